"""The fused kernel's prefill blocks (:func:`hf_sparsemax.attention.cpu.fused.block_rows`) for every alpha in (1, 2]:
a fixed alpha (entmax_bisect) and a learned alpha per head, solved by Newton's method on each row's candidates.

Checked against the materialised mapping in float64 (``V = I``: the output rows are the weights, with the same
exact zeros), against the general path (the compiled candidates path the kernel replaces), across alphas from 1.1
to 2, different alphas per head (each row must be solved with its own head's alpha), ties, masks (rows that see
nothing included), and a learned-alpha model's no-grad prefill.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import hf_sparsemax as hs
from hf_sparsemax.attention.blocked import blocks as attention_blocks
from hf_sparsemax.attention.cpu import fused as kernel
from hf_sparsemax.attention.interface import OPTIONS_ATTR, AttentionOptions, sparse_attention_forward
from test_attention_blocks import H, H_KV, module_for, small_blocks
from test_attention_kernel_safety import python_tau

SCALING = 0.4
MIN = torch.finfo(torch.float32).min


def served_blocks(monkeypatch, fused: bool = True) -> list:
    """What the kernel returned to each prefill block (its output, or None), or with ``fused`` False the kernel
    turned off for blocks (the general path: the compiled candidates solve)."""
    served, original = [], attention_blocks.block_rows
    monkeypatch.setattr(attention_blocks, "block_rows",
                        lambda *a: served.append(original(*a) if fused else None) or served[-1])
    return served


def float64_weights(scores: torch.Tensor, alpha) -> torch.Tensor:
    """The materialised mapping in float64 on float32 ``scores [..., n]`` (``alpha`` broadcastable to them); rows
    that see no key get 0, as the attention gives them."""
    seen = scores > MIN
    rows = scores.double().masked_fill(~seen, torch.finfo(torch.float64).min)
    if not isinstance(alpha, torch.Tensor) and alpha == 2.0:
        p = hs.sparsemax(rows)
    else:
        p = hs.entmax_bisect(rows, alpha.double() if isinstance(alpha, torch.Tensor) else alpha)
    return p.masked_fill(~seen.any(-1, keepdim=True), 0.0)


def assert_same_weights(got: torch.Tensor, reference: torch.Tensor, msg: str = "") -> None:
    """The weights to float32 rounding; the support may differ only where a weight is 0 to rounding (a key at
    tau)."""
    torch.testing.assert_close(got.double(), reference, rtol=2e-5, atol=2e-6, msg=msg)
    differ = (got == 0) != (reference == 0)
    assert (got[differ].abs() < 1e-6).all() and (reference[differ].abs() < 1e-6).all(), msg


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 2), kv_heads=st.integers(1, 3), groups=st.integers(1, 3),
       rows=st.integers(1, 5), keys=st.integers(1, 60), ties=st.booleans(), seen=st.floats(0.2, 1.0),
       sort_below=st.sampled_from([0, 128]),
       alphas=st.lists(st.sampled_from([1.1, 1.2, 1.3, 1.5, 1.7, 1.9, 2.0]), min_size=9, max_size=9))
def test_block_rows_solve_each_row_with_its_head_s_alpha(seed, batch, kv_heads, groups, rows, keys, ties, seen,
                                                         sort_below, alphas):
    """Scores ``[B, Hkv, G rows, n]`` laid out as :func:`.blocks.block_scores` does (the group's heads one after
    the other), one alpha per query head (1.5 and 2 among them: those heads' rows take the closed forms), masked
    keys (rows that see nothing), ties (integer scores): each row's weights are its head's mapping's."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, kv_heads, groups, rows, keys, generator=g) * 3
    if ties:
        scores = scores.round()
    scores = scores.masked_fill(torch.rand(scores.shape, generator=g) >= seen, MIN)
    alpha = torch.tensor(alphas[: kv_heads * groups]).view(1, kv_heads, groups, 1, 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel, "SORT_BELOW", sort_below)
        out = kernel.block_rows(scores.view(batch, kv_heads, groups * rows, keys).contiguous(),
                                torch.eye(keys).expand(batch, kv_heads, keys, keys), slice(0, keys), alpha)
    assert out is not None
    assert_same_weights(out.view(scores.shape), float64_weights(scores, alpha))


@pytest.mark.parametrize("alpha", [1.1, 1.25, 1.6, 1.9])
def test_block_rows_of_one_alpha_on_real_sized_rows(alpha):
    """Long rows whose candidates are hundreds (alpha near 1: every key within ``1 / (alpha - 1)`` of the
    maximum), flat rows and a dominant key: Newton's method, dropping the candidates below its bracket, gives the
    exact weights, the thresholds the library's Python solver's (float64, to 1e-14)."""
    g = torch.Generator().manual_seed(3)
    n = 700
    scores = torch.cat([torch.randn(5, n, generator=g) * 2, torch.zeros(1, n), torch.randn(1, n, generator=g) * 0.01,
                        torch.cat([torch.full((1, 1), 40.0), torch.randn(1, n - 1, generator=g)], -1)])
    taus = torch.empty(scores.shape[0], dtype=torch.float64)
    out = kernel.block_rows(scores.view(1, 1, -1, n), torch.eye(n).view(1, 1, n, n), slice(0, n), alpha, taus=taus)
    reference = float64_weights(scores, alpha)
    assert_same_weights(out.view(scores.shape), reference)
    torch.testing.assert_close(taus, python_tau(scores, alpha), rtol=0, atol=1e-14)


@pytest.mark.parametrize("alpha", [1.125, 1.3, 1.75, "learned"])
def test_a_prefill_by_the_kernel_equals_the_general_path(alpha, monkeypatch):
    """Random values, a causal prefill of 40 queries in blocks of 8: the kernel's output equals the compiled
    candidates path's (the general path it replaces) to float32 rounding."""
    small_blocks(monkeypatch, 8 * 4 * 40)
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, H, 40, 8, generator=g), torch.randn(1, H_KV, 40, 8, generator=g) * 2, torch.randn(
        1, H_KV, 40, 8, generator=g)
    found = []
    for fused in (True, False):
        with monkeypatch.context() as patch:
            served = served_blocks(patch, fused)
            module, attn = module_for("learned" if alpha == "learned" else "bisect13")
            if alpha != "learned":
                setattr(module, OPTIONS_ATTR, AttentionOptions.from_settings(attn, {"alpha": alpha}))
            module.eval()
            module.is_causal = True
            with torch.no_grad():
                found.append(sparse_attention_forward(module, q, k, v, None, scaling=SCALING, mapping=attn)[0])
            assert len(served) == 5 and all((s is not None) == fused for s in served)
    torch.testing.assert_close(found[0], found[1], rtol=1e-5, atol=1e-6)


def test_a_learned_alpha_model_s_no_grad_prefill_through_the_kernel_equals_the_torch_path(monkeypatch):
    """A tiny Llama (grouped heads, a learned alpha per layer and head, all different), a left-padded batch of 24
    tokens (a prefill, not a decoding step): logits with the kernel's blocks equal those without."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    hs.patch_model(model, attn="entmax_bisect", attn_options={"alpha": 1.3, "learn_alpha": True})
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.hf_sparsemax_alpha.pre_alpha.copy_(torch.linspace(-2.0, 1.5, 4) + 0.3 * i)
    ids = torch.randint(1, 64, (2, 24), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    logits = []
    for fused in (True, False):
        with monkeypatch.context() as patch, torch.no_grad():
            served = served_blocks(patch, fused)
            logits.append(model(input_ids=ids, attention_mask=mask).logits)
            assert served and all((s is not None) == fused for s in served)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_what_block_rows_leaves_or_refuses():
    """An alpha beyond (1, 2] is left to the general path (None: its ``h`` is not convex there); an alpha tensor
    that is not one per query head is a model's bug (ValueError)."""
    scores, value = torch.randn(1, 2, 6, 5), torch.randn(1, 2, 5, 3)
    assert kernel.block_rows(scores, value, slice(0, 5), 2.5) is None
    assert kernel.block_rows(scores, value, slice(0, 5), torch.tensor([1.3, 2.5]).view(1, 2, 1, 1, 1)) is None
    assert kernel.block_rows(scores, value, slice(0, 5), torch.full((1, 2, 3, 1, 1), 1.3)) is not None
    with pytest.raises(ValueError, match="alpha has shape"):
        kernel.block_rows(scores, value, slice(0, 5), torch.full((1, 4, 1, 1), 1.3))
    with pytest.raises(ValueError, match="not 4 query heads' rows"):
        kernel.block_rows(scores, value, slice(0, 5), torch.full((1, 2, 4, 1, 1), 1.3))
