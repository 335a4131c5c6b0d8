"""The fused kernel (hf_sparsemax/attention/cpu/fused.c): decoding in one pass over the cache, and a prefill's blocks;
exact thresholds.

Checked against the materialised mapping in float64 on the same inputs, with the value rows the identity so that
the output rows are the attention weights themselves: the same exact zeros, the weights to float32 rounding;
across the threshold mappings (a learned alpha per head included), one and three query rows per head, grouped
heads, every mask a decoding step meets, float32 and bfloat16 caches, strided caches (a static cache's filled
part), NaN and +inf scores, closed forms and Newton's method; a prefill's blocks; and what it leaves to the
general path (float16, a key layout it does not read), the build cache, and a machine without a compiler.
"""

import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_sparsemax as hs
from hf_sparsemax.attention.blocked import blocks as attention_blocks
from hf_sparsemax.attention.blocked import decode
from hf_sparsemax.attention.cpu import fused as kernel
from hf_sparsemax.attention.cpu import kernel_build
from hf_sparsemax.attention.blocked.blocks import grouped
from hf_sparsemax.attention.interface import sparse_attention_forward
from test_attention_blocks import L, SETUPS, masks, module_for, small_blocks
from test_attention_inference import B, H, H_KV, KV, decode_masks

SCALING = 0.4


@pytest.fixture
def served(monkeypatch):
    """What the fused kernel returned to each decoding call: its output, or None where it left the call."""
    outcomes = []
    original = decode.fused_decode
    monkeypatch.setattr(decode, "fused_decode", lambda *a: outcomes.append(original(*a)) or outcomes[-1])
    return outcomes


def weights_inputs(rows: int, seed: int = 0, dtype=torch.float32):
    """Queries and keys, and ``V = I`` (``D = KV``): each output row is that row's attention weights."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, rows, KV, generator=g) * 0.6).to(dtype)
    k = (torch.randn(B, H_KV, KV, KV, generator=g) * 0.6).to(dtype)
    v = torch.eye(KV).expand(B, H_KV, KV, KV).to(dtype).contiguous()
    return q, k, v


def reference_weights(module, setup, q, k, mask):
    """``[B, q, H, KV]`` weights of the materialised mapping in float64 (the eager exact solvers)."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(H // H_KV, 1)
    scores = q @ k.transpose(-1, -2) * SCALING + (0 if mask is None else mask.double().masked_fill(
        mask == torch.finfo(torch.float32).min, torch.finfo(torch.float64).min))
    attn, options = SETUPS[setup]
    if options.get("learn_alpha"):
        p = hs.entmax_bisect(scores, module.hf_sparsemax_alpha().double())
    else:
        p = hs.entmax_bisect(scores, options["alpha"]) if "alpha" in options else getattr(hs, attn)(scores)
    return p.transpose(1, 2)


def decode_call(module, attn, q, k, v, mask):
    with torch.no_grad():
        return sparse_attention_forward(module, q, k, v, mask, scaling=SCALING, mapping=attn)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_the_kernel_gives_the_exact_weights(setup, rows, dtype, served):
    q, k, v = weights_inputs(rows, dtype=dtype)
    for name, mask in decode_masks(rows).items():
        module, attn = module_for(setup)
        module.eval()
        out = decode_call(module, attn, q, k, v, mask)
        reference = reference_weights(module, setup, q, k, mask)
        assert served[-1] is not None, name
        assert out.dtype == dtype and ((out == 0) == (reference == 0)).all(), name  # the same exact zeros
        torch.testing.assert_close(out.double(), reference, rtol=2e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-6 if dtype == torch.float32 else 4e-3, msg=name)
        if name == "a query that sees nothing":
            assert (out[2, 0] == 0).all()


def test_the_kernel_equals_the_general_path_on_a_real_output(monkeypatch):
    """With random values (not the identity): the kernel and the general path (compiled kernel) agree."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, H, 1, 16, generator=g), torch.randn(2, H_KV, 300, 16, generator=g) * 2,
               torch.randn(2, H_KV, 300, 16, generator=g))
    for setup in SETUPS:
        module, attn = module_for(setup)
        module.eval()
        by_kernel = decode_call(module, attn, q, k, v, None)
        with monkeypatch.context() as patch:
            patch.setattr(decode, "fused_decode", lambda problem, alpha: None)
            general = decode_call(module, attn, q, k, v, None)
        torch.testing.assert_close(by_kernel, general, rtol=1e-5, atol=1e-5, msg=setup)  # scores up to ~20: ulp 2e-6


@pytest.mark.parametrize("through_kernel", [True, False])
def test_value_heads_may_have_another_size_than_query_heads(through_kernel, monkeypatch):
    """``V``'s head size need not be ``Q``'s and ``K``'s (an MLA attention): the kernel and the general path."""
    q, k, v = weights_inputs(1)  # D = KV = 40 for q and k; v is the identity of size KV
    v = torch.cat([v, v[..., :7]], dim=-1)  # 47 channels: the weights, then again the first 7
    if not through_kernel:
        monkeypatch.setattr(decode, "fused_decode", lambda problem, alpha: None)
    module, attn = module_for("bisect13")
    module.eval()
    out = decode_call(module, attn, q, k, v, None)
    reference = reference_weights(module, "bisect13", q, k, None)
    assert out.shape == (B, 1, H, KV + 7)
    torch.testing.assert_close(out.double(), torch.cat([reference, reference[..., :7]], dim=-1), rtol=2e-5, atol=1e-6)


def test_a_strided_cache_is_read_in_place(served):
    """The filled part of a longer cache (a static cache's view): not contiguous, read through its strides."""
    q, k, v = weights_inputs(1)
    bigger_k, bigger_v = torch.zeros(B, H_KV, KV + 9, KV), torch.zeros(B, H_KV, KV + 9, KV)
    bigger_k[:, :, :KV], bigger_v[:, :, :KV] = k, v
    k_view, v_view = bigger_k[:, :, :KV], bigger_v[:, :, :KV]
    assert not k_view.is_contiguous()
    module, attn = module_for("entmax15")
    module.eval()
    out = decode_call(module, attn, q, k_view, v_view, None)
    assert served[-1] is not None
    torch.testing.assert_close(out.double(), reference_weights(module, "entmax15", q, k, None), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("setup", ["sparsemax", "bisect13"])
def test_nan_and_inf_scores_give_nan_rows_as_the_general_path(setup, monkeypatch, served):
    q, k, v = weights_inputs(1)
    q[0, 1, 0, 0] = float("nan")  # a row of NaN scores (query head 1 of batch row 0)
    k[1, 0, 7], k[1, 0, 7, 0], q[1, : H // H_KV, 0, 0] = 0.0, float("inf"), 1.0  # +inf: kv head 0's queries, row 1
    module, attn = module_for(setup)
    module.eval()
    fused = decode_call(module, attn, q, k, v, None)
    assert served[-1] is not None
    with monkeypatch.context() as patch:
        patch.setattr(decode, "fused_decode", lambda problem, alpha: None)
        general = decode_call(module, attn, q, k, v, None)
    assert fused[0, 0, 1].isnan().all() and fused[1, 0, : H // H_KV].isnan().all()
    assert (fused.isnan() == general.isnan()).all()
    torch.testing.assert_close(fused.nan_to_num(), general.nan_to_num(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_rows_with_many_candidates_are_solved_by_newton_exactly(setup, monkeypatch, served):
    """Sparsemax and 1.5-entmax rows with more than ``SORT_BELOW`` candidates (flat rows) take Newton's method
    (Michelot's algorithm for sparsemax) instead of the closed form on sorted candidates: forced here on every
    row, and on flat rows (keys all alike: every key a candidate) the kernel still serves the call."""
    monkeypatch.setattr(kernel, "SORT_BELOW", 0)
    module, attn = module_for(setup)
    module.eval()
    q, k, v = weights_inputs(3)
    for name, mask in decode_masks(3).items():
        out = decode_call(module, attn, q, k, v, mask)
        assert served[-1] is not None, name
        reference = reference_weights(module, setup, q, k, mask)
        assert ((out == 0) == (reference == 0)).all(), name
        torch.testing.assert_close(out.double(), reference, rtol=2e-5, atol=1e-6, msg=name)
    flat = k[:, :, :1].expand(k.shape).contiguous() + 1e-3 * k  # every key within 1 / (alpha - 1) of the maximum
    out = decode_call(module, attn, q, flat, v, None)
    assert served[-1] is not None
    torch.testing.assert_close(out.double(), reference_weights(module, setup, q, flat, None), rtol=2e-5, atol=1e-6)


def test_what_the_kernel_does_not_read_goes_to_the_general_path(served):
    module, attn = module_for("sparsemax")
    module.eval()
    q, k, v = weights_inputs(1)
    half = decode_call(module, attn, q.half(), k.half(), v.half(), None)  # float16: the general path
    key_major = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # channels not contiguous
    strided = decode_call(module, attn, q, key_major, v, None)
    assert served == [None, None]
    reference = reference_weights(module, "sparsemax", q, k, None)
    torch.testing.assert_close(strided.double(), reference, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(half.double(), reference_weights(module, "sparsemax", q.half(), k.half(), None),
                               rtol=1e-2, atol=2e-3)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A build of the kernel in an empty cache folder (the process's loaded kernel restored after)."""
    monkeypatch.setenv("HF_SPARSEMAX_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel, "_failed", [])
    monkeypatch.setattr(kernel_build, "_said", set())
    kernel.library.cache_clear()
    yield tmp_path
    kernel.library.cache_clear()


def test_the_build_is_cached_by_source_flags_and_cpu(fresh_build):
    assert kernel.library() is not None
    built = sorted(os.listdir(fresh_build))
    assert len(built) == 1 and built[0].startswith("fused-") and built[0].endswith(".so")
    stamp = os.path.getmtime(fresh_build / built[0])
    kernel.library.cache_clear()
    assert kernel.library() is not None and sorted(os.listdir(fresh_build)) == built  # loaded, not rebuilt
    assert os.path.getmtime(fresh_build / built[0]) == stamp


def test_without_a_compiler_decoding_warns_once_and_stays_exact(fresh_build, monkeypatch, served):
    monkeypatch.setenv("CC", str(fresh_build / "no-such-compiler"))
    module, attn = module_for("sparsemax")
    module.eval()
    q, k, v = weights_inputs(1)
    with pytest.warns(RuntimeWarning, match="fused attention kernel could not be built"):
        out = decode_call(module, attn, q, k, v, None)
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        decode_call(module, attn, q, k, v, None)
    assert not [w for w in later if "fused attention kernel" in str(w.message)]  # one warning a process
    assert served == [None, None] and kernel._failed
    torch.testing.assert_close(out.double(), reference_weights(module, "sparsemax", q, k, None), rtol=2e-5, atol=1e-6)


def test_the_switch_turns_the_kernel_off(monkeypatch, served):
    monkeypatch.setenv(kernel.ENVIRONMENT, "0")
    module, attn = module_for("sparsemax")
    module.eval()
    q, k, v = weights_inputs(1)
    decode_call(module, attn, q, k, v, None)
    assert served == [None]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 3), kv_heads=st.integers(1, 3), groups=st.integers(1, 3),
       rows=st.integers(1, 4), keys=st.integers(1, 70), ties=st.booleans(), seen=st.floats(0.2, 1.0),
       alpha=st.sampled_from([2.0, 1.5, 1.3, 1.9, "learned"]), sort_below=st.sampled_from([0, 3, 128]))
def test_the_kernel_is_exact_on_any_input(seed, batch, kv_heads, groups, rows, keys, ties, seen, alpha, sort_below):
    """Any shape, grouping, mask density (rows that see nothing included) and alpha; ``ties``: integer keys and
    queries, so many scores are equal (the closed forms' sorted candidates hold equal runs); ``sort_below``: the
    closed forms on sorted candidates or Newton's method, or each for some rows."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * groups
    q, k = torch.randn(batch, heads, rows, 6, generator=g), torch.randn(batch, kv_heads, keys, 6, generator=g) * 2
    if ties:
        q, k = q.round(), k.round()
    v = torch.eye(keys).expand(batch, kv_heads, keys, keys).contiguous()
    keep = torch.rand(batch, 1, rows, keys, generator=g) < seen
    mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    learned = alpha == "learned"
    per_head = (1.15 + 0.85 * torch.rand(1, heads, 1, 1, generator=g)) if learned else None
    problem = grouped(q, k, v, mask, False, per_head if learned else alpha, SCALING, None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel, "SORT_BELOW", sort_below)
        out = kernel.decode(problem, problem.alpha)
    assert out is not None
    scores = q.double() @ k.double().repeat_interleave(groups, 1).transpose(-1, -2) * SCALING
    scores = scores.masked_fill(~keep, torch.finfo(torch.float64).min)
    reference = hs.entmax_bisect(scores, per_head.double() if learned else alpha)
    reference = reference.masked_fill(~keep.any(-1, keepdim=True), 0.0)  # a row that sees nothing: 0
    got = out.view(batch, kv_heads, groups, rows, keys).flatten(1, 2).double()
    torch.testing.assert_close(got, reference, rtol=2e-5, atol=2e-6)
    differ = (got == 0) != (reference == 0)  # the support: it may differ only where a weight is 0 to rounding (a key
    assert (got[differ].abs() < 1e-6).all() and (reference[differ].abs() < 1e-6).all()  # at tau)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_no_grad_prefill_s_blocks_by_the_kernel_give_the_exact_weights(setup, monkeypatch):
    """A prefill (no autograd, blocks of 5 queries) of every threshold mapping (a learned alpha: a different one
    per head): each block's rows solved and summed by the kernel, with ``V = I``: the weights, with the same exact
    zeros, across the mask families."""
    small_blocks(monkeypatch, 5 * 4 * L)
    served, original = [], attention_blocks.block_rows
    monkeypatch.setattr(attention_blocks, "block_rows", lambda *a: served.append(original(*a)) or served[-1])
    g = torch.Generator().manual_seed(11)
    q, k = torch.randn(2, H, L, 8, generator=g), torch.randn(2, H_KV, L, 8, generator=g) * 1.5
    v = torch.eye(L).expand(2, H_KV, L, L).contiguous()
    for name, mask in masks().items():
        module, attn = module_for(setup)
        module.eval()
        module.is_causal = name == "is_causal"
        served.clear()
        with torch.no_grad():
            out, _ = sparse_attention_forward(module, q, k, v, mask, scaling=SCALING, mapping=attn)
        assert served and all(found is not None for found in served), name
        if module.is_causal:
            mask = masks()["causal"]
        reference = reference_weights(module, setup, q, k, mask)
        assert ((out == 0) == (reference == 0)).all(), name
        torch.testing.assert_close(out.double(), reference, rtol=2e-5, atol=1e-6, msg=name)


@pytest.fixture
def without_the_floor(monkeypatch):
    """The kernel built with one level (tau's floor -1 for every row: fused.c tau_floor), Newton for every row."""
    monkeypatch.setattr(kernel, "FLOOR_LEVELS", 1)
    monkeypatch.setattr(kernel, "SORT_BELOW", 0)
    kernel.library.cache_clear()
    yield
    kernel.library.cache_clear()


@pytest.mark.parametrize("alpha", [1.5, 1.7])
def test_newtons_method_does_not_cycle_between_the_bracket_ends(alpha, without_the_floor):
    """Rows of a trained model's kind (the converted SmolLM2 at 4k-8k tokens): the top key, a few keys within 0.4 of
    it, a crowd just above -1. From tau = -1 Halley's step overshoots to just under the top; Newton's step from
    there, with only the top key left, lands on -1 exactly. A proposal was taken on the bracket's end it came from,
    so tau went -1, ~0, -1, ... to max_iter and came back -1 (weights summing to ~40: rows of 3 of the 8192
    positions' forward were such). Each row's weights are the formula's to rounding."""
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        n = int(torch.randint(100, 400, (1,), generator=g))
        near = int(torch.randint(5, 60, (1,), generator=g))
        z = torch.cat([torch.zeros(1), -0.04 - 0.35 * torch.rand(near, generator=g),
                       -1 + 0.15 * torch.rand(n - near - 1, generator=g)])
        scores = (z / (alpha - 1)).float()[None, None, None].contiguous()
        weights = kernel.block_rows(scores, torch.eye(n)[None, None], slice(0, n), alpha)[0, 0, 0].double()
        reference = hs.entmax_bisect(scores.double()[0, 0, 0], alpha=alpha, dim=-1, n_iter=200)
        torch.testing.assert_close(weights, reference, rtol=1e-5, atol=1e-6, msg=f"seed {seed}")
