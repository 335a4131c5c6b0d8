"""The memory-bounded default attention path (query blocks, a saved threshold per row, weights recomputed).

Checked against the materialised formula ``mapping(q k^T * scaling + mask) v`` with the library's own
mappings (themselves checked against closed forms and the ``entmax`` package elsewhere): outputs and the
gradients of queries, keys, values and learned alphas, across block sizes, grouped heads and mask families,
in float64 to first and second order, and the memory bound by what autograd keeps for backward.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.autograd import gradcheck, gradgradcheck

import hf_sparsemax as hs
from hf_sparsemax.attention.blocked import blocks as attention_blocks
from hf_sparsemax.mappings import compiled
from hf_sparsemax.attention.interface import ALPHA_ATTR, OPTIONS_ATTR, AttentionOptions, LearnedAlpha, sparse_attention_forward

MIN = torch.finfo(torch.float32).min
B, H, H_KV, L, D = 2, 4, 2, 13, 8
SETUPS = {  # name -> (attention, attn_options)
    "sparsemax": ("sparsemax", {}),
    "entmax15": ("entmax15", {}),
    "bisect13": ("entmax_bisect", {"alpha": 1.3}),
    "learned": ("entmax_bisect", {"alpha": 1.4, "learn_alpha": True}),
    "hybrid": ("entmax_bisect", {"alpha": 1.5, "learn_alpha": True}),  # heads 0 and 3 kept wide at alpha 1.2
}
HYBRID_ALPHAS = (1.2, 1.5, 1.5, 1.2)  # transfer_attention's dense_heads: a mixed model, every path exact on it


def masks(length: int = L) -> dict[str, torch.Tensor | None]:
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)
    window = causal | torch.ones(length, length, dtype=torch.bool).tril(-4)
    padded = torch.zeros(B, 1, length, length).masked_fill(causal, MIN)
    padded[1, ..., :3] = MIN  # left padding: the first rows of the second sequence see nothing
    return {
        "none": None,
        "is_causal": None,  # no mask, a causal module: the plain causal mask left to the attention, as sdpa
        "causal": torch.zeros(1, 1, length, length).masked_fill(causal, MIN),
        "causal+padding": padded,
        "sliding window": torch.zeros(1, 1, length, length).masked_fill(window, MIN),
        "per head": torch.zeros(B, H, length, length).masked_fill(torch.rand(B, H, length, length) < 0.3, MIN),
    }


class Float64Alpha(LearnedAlpha):
    """A learned alpha computed in float64 (``LearnedAlpha`` rounds to float32, too coarse for gradcheck)."""

    def forward(self) -> torch.Tensor:
        return (1 + torch.sigmoid(self.pre_alpha)).view(1, -1, 1, 1)


def module_for(setup: str, dtype=torch.float32) -> tuple[torch.nn.Module, str]:
    attn, options = SETUPS[setup]
    module = torch.nn.Module().train()
    module.is_causal = False  # a mask of masks() says what each query sees ("is_causal" sets it True)
    setattr(module, OPTIONS_ATTR, AttentionOptions.from_settings(attn, options))
    if options.get("learn_alpha"):
        kind = Float64Alpha if dtype == torch.float64 else LearnedAlpha
        module.add_module(ALPHA_ATTR, kind(H, options["alpha"]).to(dtype))
        with torch.no_grad():
            if setup == "hybrid":
                alphas = torch.tensor(HYBRID_ALPHAS, dtype=torch.float64)
                module.hf_sparsemax_alpha.pre_alpha.copy_(((alphas - 1) / (2 - alphas)).log())
            else:
                module.hf_sparsemax_alpha.pre_alpha.uniform_(-1, 1, generator=torch.Generator().manual_seed(1))
    return module, attn


def materialised(module, setup, q, k, v, mask, scaling):
    """The reference: the library's mappings on the whole score matrix, on their eager solvers (not the compiled
    kernels under test)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(compiled.ENVIRONMENT, "0")
        return materialised_eagerly(module, setup, q, k, v, mask, scaling)


def materialised_eagerly(module, setup, q, k, v, mask, scaling):
    attn, options = SETUPS[setup]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scaling + (0 if mask is None else mask)
    if options.get("learn_alpha"):
        p = hs.entmax_bisect(scores, module.hf_sparsemax_alpha())
    else:
        p = hs.entmax_bisect(scores, options["alpha"]) if "alpha" in options else getattr(hs, attn)(scores)
    return (p @ v).transpose(1, 2)


def small_blocks(monkeypatch, budget: int) -> None:
    """Blocks within ``budget`` entries, down to one query (the library holds at least ``MIN_BLOCK_QUERIES``)."""
    monkeypatch.setattr(attention_blocks, "ATTENTION_BUDGET", budget)
    monkeypatch.setattr(attention_blocks, "MIN_BLOCK_QUERIES", 1)


def gather_always(monkeypatch) -> None:
    """Every block gathers its live keys, for P V and backward (by default only where few enough are live)."""
    monkeypatch.setattr(attention_blocks, "GATHER_BELOW", 1.0)
    monkeypatch.setattr(attention_blocks, "GATHER_WEIGHTS_BELOW", 1.0)


def inputs(dtype=torch.float32, length: int = L, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, length, D), (B, H_KV, length, D), (B, H_KV, length, D)]
    return [(torch.randn(s, generator=g, dtype=dtype) * 1.5).requires_grad_() for s in shapes]


@pytest.mark.parametrize("gather", ["where it pays", "always"])
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("budget", [None, 1, 100])  # one block; one query per block; a few queries per block
def test_blocked_path_equals_the_materialised_formula(setup, budget, gather, monkeypatch):
    if budget is not None:
        small_blocks(monkeypatch, budget)
    if gather == "always":
        gather_always(monkeypatch)
    for name, mask in masks().items():
        module, attn = module_for(setup)
        module.is_causal = name == "is_causal"
        q, k, v = inputs()
        grad = torch.randn(B, L, H, D, generator=torch.Generator().manual_seed(2))
        leaves = [q, k, v] + ([module.hf_sparsemax_alpha.pre_alpha] if SETUPS[setup][1].get("learn_alpha") else [])
        out, weights = sparse_attention_forward(module, q, k, v, mask, scaling=0.4, mapping=attn)
        assert weights is None  # the blocked path was taken: no weights held
        got = torch.autograd.grad((out * grad).sum(), leaves)
        reference = materialised(module, setup, q, k, v, masks()["causal"] if module.is_causal else mask, 0.4)
        expected = torch.autograd.grad((reference * grad).sum(), leaves)
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=2e-6, msg=name)
        for a, b, leaf in zip(got, expected, ["q", "k", "v", "alpha"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{name}: d{leaf}")
        if mask is not None and name == "causal+padding":
            assert (out[1, :3] == 0).all()  # fully masked queries: zeros, never NaN


def test_explicit_chunk_size_overrides_the_budget(monkeypatch):
    seen = []
    original = attention_blocks.forward_blocks
    monkeypatch.setattr(attention_blocks, "forward_blocks", lambda p, block: seen.append(block) or original(p, block))
    q, k, v = inputs()
    for chunk in (None, 5):
        module, attn = module_for("entmax15")
        if chunk:
            setattr(module, OPTIONS_ATTR, AttentionOptions.from_settings(attn, {"chunk_size": chunk}))
        sparse_attention_forward(module, q, k, v, masks()["causal"], mapping=attn)
    assert seen == [L, 5]


def test_block_sizes_hold_the_budget_and_short_inputs_stay_whole():
    assert attention_blocks.block_queries(2, 9, 512, 512, budget=1 << 24) == 512  # fits: one block, no chunking
    least = attention_blocks.MIN_BLOCK_QUERIES
    assert attention_blocks.block_queries(1, 9, 8192, 8192, budget=1 << 20) == least == 64  # 14 fit: the floor
    for batch, heads, queries, keys, budget in [(1, 9, 8192, 8192, 1 << 24), (1, 9, 2048, 2048, 1 << 24),
                                               (1, 9, 8192, 8192, 1 << 20), (1, 9, 4100, 4100, 1 << 20),
                                               (3, 2, 7, 5, 1), (1, 1, 10, 10, 35), (1, 1, 1000, 10, 35)]:
        block = attention_blocks.block_queries(batch, heads, queries, keys, budget=budget)
        largest = max(least, budget // (batch * heads * keys))  # the budget's queries, never fewer than the floor
        assert 1 <= block <= min(largest, queries)
        assert -(-queries // block) == -(-queries // largest)  # equal blocks, as few as allowed


@pytest.mark.parametrize("causal", ["causal", "is_causal"])
def test_backward_keeps_no_query_by_key_tensor(causal, monkeypatch):
    """What autograd saves for backward is the inputs and one threshold per row: nothing of size q x kv, and
    under a plain causal mask (sdpa's ``is_causal``: no mask passed) nothing of size q x kv is built at all."""
    length = 64
    small_blocks(monkeypatch, B * H * length * 8)  # blocks of 8 queries
    module, attn = module_for("learned")
    module.is_causal = causal == "is_causal"
    q, k, v = inputs(length=length)
    saved, built = [], []
    make_mask = attention_blocks.causal_mask

    def recorded(*args):
        built.append(make_mask(*args).numel())
        return make_mask(*args)

    monkeypatch.setattr(attention_blocks, "causal_mask", recorded)

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = sparse_attention_forward(module, q, k, v, masks(length)[causal], mapping=attn)
    assert saved and max(saved) < length * length * H
    assert bool(built) == module.is_causal and max(built, default=0) <= 8 * length
    out.sum().backward()
    assert q.grad is not None and module.hf_sparsemax_alpha.pre_alpha.grad.abs().sum() > 0


def threshold_node(out: torch.Tensor):
    """The :class:`ThresholdAttention` node behind ``out`` (its context holds what the backward keeps)."""
    todo, seen = [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__.startswith("ThresholdAttention"):
            return node
        todo.extend(next_node for next_node, _ in node.next_functions)
    raise AssertionError("no ThresholdAttention node")


@pytest.mark.parametrize("setup", list(SETUPS))
def test_the_backward_keeps_one_threshold_a_row_in_the_scores_dtype(setup, monkeypatch):
    """Per query row and head, one float32 number outlives the forward (4 bytes, as sdpa's log-sum-exp): the
    threshold; the row's shift (its maximum) is found again from the recomputed scores."""
    small_blocks(monkeypatch, B * H * L * 4)  # blocks of 4 queries
    module, attn = module_for(setup)
    q, k, v = inputs()
    out, _ = sparse_attention_forward(module, q, k, v, masks()["causal+padding"], scaling=0.4, mapping=attn)
    states = threshold_node(out).states
    assert len(states) == -(-L // 4)
    assert all(t.dtype == torch.float32 and t.shape[1:] == (1,) for t in states)
    assert sum(t.numel() for t in states) == B * H * L


def far_keys(length: int = 40, far=range(8, 30)):
    """Inputs where every query weighs nothing on the keys ``far`` (their scores sit far below the rest)."""
    q, k, v = [t.detach() for t in inputs(length=length)]
    q[..., 0], k[..., 0] = 4.0, 0.0
    k[..., list(far), 0] = -8.0
    return [t.requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("mask", ["none", "is_causal", "causal+padding", "per head"])
def test_keys_no_query_weighs_are_left_out_of_p_v_and_the_backward(setup, mask, monkeypatch):
    """Block skipping: a block's ``P V`` and its backward (``Q K^T`` again, ``dO V^T``, the Jacobian product, ``dQ``,
    ``dK``, ``dV``) run over the keys some of its queries weigh; the gradients equal the dense path's and the
    materialised formula's."""
    length, far = 40, range(8, 30)
    small_blocks(monkeypatch, B * H * length * 10)  # blocks of 10 queries
    widths = []
    original = compiled.weights_vjp
    monkeypatch.setattr(compiled, "weights_vjp", lambda rows, *a: widths.append(rows.shape[1]) or original(rows, *a))
    results, given_mask = {}, masks(length)[mask]
    for gather in (True, False):
        monkeypatch.setattr(attention_blocks, "GATHER_BELOW", 0.9 if gather else 0.0)
        module, attn = module_for(setup)
        module.is_causal = mask == "is_causal"
        q, k, v = far_keys(length, far)
        leaves = [q, k, v] + ([module.hf_sparsemax_alpha.pre_alpha] if SETUPS[setup][1].get("learn_alpha") else [])
        out, _ = sparse_attention_forward(module, q, k, v, given_mask, scaling=0.4, mapping=attn)
        parts = threshold_node(out).parts
        results[gather] = out, torch.autograd.grad(out.square().sum(), leaves)
        if gather:
            live = [part.keys() for part in parts if part.high > part.low]
            assert all(isinstance(keys, torch.Tensor) for keys in live[1:])  # the first block sees no far key
            assert not any(set(keys.tolist()) & set(far) for keys in live if isinstance(keys, torch.Tensor))
            assert max(widths) <= length - len(far)
            widths.clear()
            reference = materialised(module, setup, q, k, v, masks(length)["causal"] if module.is_causal
                                     else given_mask, 0.4)
            expected = torch.autograd.grad(reference.square().sum(), leaves)
            torch.testing.assert_close(out, reference, rtol=1e-5, atol=2e-6)
            for a, b in zip(results[True][1], expected):  # two float32 orders of sums: gradients reach ~150 here
                # (the far keys' scores), so their rounding reaches ~1e-7 of that (2.8e-5 seen under 1 thread)
                torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5 + 1e-6 * float(b.abs().max()))
    assert max(widths) == length  # without gathering every key is recomputed
    torch.testing.assert_close(results[True][0], results[False][0], rtol=0, atol=1e-6)
    for a, b in zip(results[True][1], results[False][1]):  # to the rounding of sums over fewer (zero) terms
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert (results[True][1][1][..., list(far), :] == 0).all()  # no weight, no gradient for those keys


@given(st.lists(st.booleans(), max_size=40))
def test_live_key_bits_round_trip(flags):
    flags = torch.tensor(flags, dtype=torch.bool)
    bits = attention_blocks.pack_bits(flags)
    assert bits.dtype == torch.uint8 and bits.numel() == -(-flags.numel() // 8)
    assert torch.equal(attention_blocks.unpack_bits(bits, flags.numel()), flags)


def test_a_nan_row_keeps_every_key_of_its_block(monkeypatch):
    """NaN weights count as live: a NaN query gives NaN outputs and gradients, never zeros from skipped keys."""
    module, attn = module_for("sparsemax")
    q, k, v = far_keys()
    with torch.no_grad():
        q[0, 0, 3, 1] = float("nan")
    out, _ = sparse_attention_forward(module, q, k, v, None, scaling=0.4, mapping=attn)
    assert threshold_node(out).parts[0].live is None
    assert torch.isnan(out[0, 3, 0]).all() and not torch.isnan(out[1]).any()


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("causal", ["causal", "is_causal"])
@pytest.mark.parametrize("setup", ["entmax15", "learned"])
def test_first_and_second_derivatives_in_float64(setup, causal, gather, monkeypatch):
    """float64 gradcheck and gradgradcheck of the blocked path (one query per block), alphas included, with and
    without gathering the live keys."""
    small_blocks(monkeypatch, 2 * H * 5)
    if gather:
        gather_always(monkeypatch)
    module, attn = module_for(setup, torch.float64)
    module.is_causal = causal == "is_causal"
    q, k, v = [t.detach().double().requires_grad_() for t in inputs(length=5)]
    mask = None if module.is_causal else masks(5)["causal"].double()
    alpha = [module.hf_sparsemax_alpha.pre_alpha] if SETUPS[setup][1].get("learn_alpha") else []

    def fn(q, k, v, *pre_alpha):
        return sparse_attention_forward(module, q, k, v, mask, mapping=attn)[0]

    assert gradcheck(fn, (q, k, v, *alpha), atol=1e-6, fast_mode=True)
    assert gradgradcheck(fn, (q, k, v, *alpha), atol=1e-5, fast_mode=True)


def test_alphas_below_the_float32_range_take_the_float64_materialised_path():
    module, attn = module_for("learned")
    with torch.no_grad():
        module.hf_sparsemax_alpha.pre_alpha.fill_(-4.0)  # alpha = 1.018: solved in float64 by the mapping
    q, k, v = inputs()
    mask = masks()["causal"]
    out, weights = sparse_attention_forward(module, q, k, v, mask, mapping=attn)
    assert weights is not None
    torch.testing.assert_close(out, materialised(module, "learned", q, k, v, mask, D**-0.5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("setup", ["sparsemax", "learned"])
def test_compiled_kernels_equal_the_materialised_formula(setup, gather, compiled_kernels, monkeypatch):
    small_blocks(monkeypatch, 100)
    if gather:
        gather_always(monkeypatch)
    calls = compiled_kernels
    module, attn = module_for(setup)
    q, k, v = inputs()
    mask = masks()["causal+padding"]
    leaves = [q, k, v] + ([module.hf_sparsemax_alpha.pre_alpha] if SETUPS[setup][1].get("learn_alpha") else [])
    out, _ = sparse_attention_forward(module, q, k, v, mask, scaling=0.4, mapping=attn)
    got = torch.autograd.grad(out.square().sum(), leaves)
    reference = materialised(module, setup, q, k, v, mask, 0.4)
    expected = torch.autograd.grad(reference.square().sum(), leaves)
    assert {"solve_and_map", "map_and_vjp"} <= set(calls) and not compiled._failed
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=2e-6)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_rows_the_fixed_passes_do_not_certify_get_the_eager_exact_threshold(compiled_kernels, monkeypatch):
    """Rows without a certificate (made so here: every second row; rare on real scores) are solved again by the
    eager exact solver, and their weights and gradients are the mapping's."""
    from hf_sparsemax.mappings._sync_free import newton_certified
    from hf_sparsemax.mappings.sparsemax import sparsemax_threshold

    def uncertain(rows, alpha, masked, steps=None):
        found = newton_certified(rows, alpha, masked, steps)
        return found._replace(tau=found.tau + 0.25, done=found.done & (torch.arange(rows.shape[0]) % 2 == 0)[:, None])

    rows = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 3
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(compiled.ENVIRONMENT, "0")
        reference = hs.sparsemax(rows)
    monkeypatch.setattr(compiled, "newton_certified", uncertain)
    eager = lambda r, masked, alpha: sparsemax_threshold(r, masked)  # noqa: E731
    p, tau = compiled.weights(rows.clone(), MIN, 2.0, eager)
    torch.testing.assert_close(p[1::2], reference[1::2], rtol=0, atol=1e-7)  # re-solved: exact
    assert not torch.allclose(p[::2], reference[::2])  # certified rows keep the (here shifted) compiled answer
    grad = torch.randn(rows.shape, generator=torch.Generator().manual_seed(1))
    p_again, d_rows, _ = compiled.weights_vjp(rows.clone(), tau, grad, MIN, 2.0, False)
    x = rows.clone().requires_grad_()
    torch.testing.assert_close(p_again, p, rtol=0, atol=1e-7)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(compiled.ENVIRONMENT, "0")
        expected = torch.autograd.grad(hs.sparsemax(x), x, grad)[0]
    torch.testing.assert_close(d_rows[1::2], expected[1::2], rtol=1e-5, atol=1e-6)


def test_a_backend_that_fails_falls_back_to_the_eager_solver_with_one_warning(compiled_kernels, monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "no_such_backend")
    monkeypatch.setattr(compiled.compiled, "cache_clear", compiled.compiled.cache_clear)
    module, attn = module_for("entmax15")
    q, k, v = inputs()
    with pytest.warns(RuntimeWarning, match="eager solver"):
        out, _ = sparse_attention_forward(module, q, k, v, masks()["causal"], scaling=0.4, mapping=attn)
    assert compiled._failed and not compiled.applies(torch.zeros(4, 4))
    torch.testing.assert_close(out, materialised(module, "entmax15", q, k, v, masks()["causal"], 0.4),
                               rtol=1e-5, atol=2e-6)


def test_an_accelerator_takes_larger_blocks_than_the_cpu():
    """On a GPU each block costs kernel launches and a wait for its live keys, so its budget is larger: SmolLM2's
    2048-token prefill (9 heads) is one block there and 32 blocks on the CPU; both stay linear past their budget."""
    assert attention_blocks.block_queries(1, 9, 2048, 2048, device=torch.device("cpu")) == 64
    assert attention_blocks.block_queries(1, 9, 2048, 2048) == 64  # no device named: the CPU's budget
    assert attention_blocks.block_queries(1, 9, 2048, 2048, device=torch.device("meta")) == 2048
    per_query = 9 * 32768
    block = attention_blocks.block_queries(1, 9, 32768, 32768, device="meta")
    assert block * per_query <= attention_blocks.DEVICE_ATTENTION_BUDGET < (block + 8) * per_query
