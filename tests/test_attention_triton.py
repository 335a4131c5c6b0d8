"""The Triton attention kernels (hf_sparsemax.attention.gpu.triton_attention) against the float64 materialised formula.

Without a GPU they run under Triton's interpreter (``TRITON_INTERPRET=1``, set here before the kernels are first
imported): small shapes, tiles of ``INTERPRET_BLOCK`` keys so that every call spans several tiles. With CUDA the
same tests run the compiled kernels. Oracle: ``p = mapping(q k^T * scaling + mask)`` in float64 with the library's
mappings (``entmax`` package for the per-head alpha gradient), ``out = p v``, gradients by autograd.
"""

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels module decorates its kernels

import pytest  # noqa: E402

triton = pytest.importorskip("triton")
if not CUDA and tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
    # An error, not a skip: a CI that resolved an older triton would otherwise never run the prefill kernels.
    raise RuntimeError(f"triton {triton.__version__}: Triton's interpreter before 3.9 cannot loop to a bound computed "
                       "from program_id (NumPy 2), and the test extra asks for triton>=3.9; install it")

import hf_sparsemax as hs  # noqa: E402
from hf_sparsemax.attention.gpu import triton_attention as ta  # noqa: E402
from hf_sparsemax.attention.gpu import triton_decode as td  # noqa: E402
from hf_sparsemax.attention.gpu.triton_attention import not_supported_reasons, triton_attention  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


def oracle(query, key, value, mask, *, causal, alpha, scaling):
    """float64 output of the materialised formula (differentiable in every input, alpha included)."""
    query, key, value = (t.double() for t in (query, key, value))
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) * scaling
    n_q, n_kv = scores.shape[-2:]
    excluded = torch.zeros_like(scores, dtype=torch.bool)
    if mask is not None:
        mask = mask[..., :n_kv]
        if mask.dtype == torch.bool:
            excluded = excluded | ~mask
        else:
            excluded = excluded | (mask <= torch.finfo(mask.dtype).min)
            scores = scores + mask.double().masked_fill(excluded, 0)
    elif causal:
        excluded = excluded | torch.ones(n_q, n_kv, dtype=torch.bool, device=scores.device).triu(1)
    scores = scores.masked_fill(excluded, float("-inf"))
    if isinstance(alpha, torch.Tensor):
        p = hs.entmax_bisect(scores, alpha=alpha.double().view(1, -1, 1, 1), dim=-1)
    elif alpha == 2:
        p = hs.sparsemax(scores, dim=-1)
    elif alpha == 1.5:
        p = hs.entmax15(scores, dim=-1)
    else:
        p = hs.entmax_bisect(scores, alpha=alpha, dim=-1)
    return p @ value, p


def operands(batch=1, heads=4, kv_heads=2, n_q=40, n_kv=40, dim=16, seed=0, dtype=torch.float32, spread=2.0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, n_q, dim, generator=generator) * spread
    key = torch.randn(batch, kv_heads, n_kv, dim, generator=generator)
    value = torch.randn(batch, kv_heads, n_kv, dim, generator=generator)
    return [t.to(DEVICE, dtype) for t in (query, key, value)]


def masks(kind: str, batch: int, heads: int, n_q: int, n_kv: int):
    """Masks as transformers builds them: bool (True: seen) or additive (0 / finfo.min), [B | 1, 1, q, kv]."""
    i, j = torch.arange(n_q)[:, None] + (n_kv - n_q), torch.arange(n_kv)[None, :]
    causal = j <= i
    if kind == "left_padding_bool":  # batch row b has its first 3 + 5 b keys padded
        return torch.stack([causal & (j >= 3 + 5 * b) for b in range(batch)]).unsqueeze(1)
    if kind == "right_padding_additive":
        seen = (causal & (j < n_kv - 6)).expand(batch, 1, n_q, n_kv)
        return torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)
    if kind == "sliding_window_additive":
        seen = causal & (j > i - 13)
        return torch.zeros(1, 1, n_q, n_kv).masked_fill(~seen, torch.finfo(torch.float32).min)
    if kind == "packed_bool":  # three sequences packed in one row: block-diagonal causal
        starts = torch.tensor([0, 11, 29])
        doc_i, doc_j = (torch.bucketize(x, starts, right=True) for x in (i, j))
        return (causal & (doc_i == doc_j)).view(1, 1, n_q, n_kv)
    if kind == "fully_masked_rows":  # some query rows see no key: weights 0, output 0, never NaN
        seen = causal.clone()
        seen[5:9] = False
        seen[n_q - 1] = False
        return torch.where(seen, 0.0, float("-inf")).view(1, 1, n_q, n_kv).expand(batch, heads, n_q, n_kv)
    if kind == "per_head_bool":
        generator = torch.Generator().manual_seed(3)
        return (torch.rand(batch, heads, n_q, n_kv, generator=generator) < 0.7) & causal
    raise ValueError(kind)


def check(query, key, value, mask, *, causal, alpha, scaling=0.3, atol=2e-5, grad=True):
    """Output and gradients (query, key, value, a tensor alpha) of the kernels against the oracle."""
    inputs = [t.clone().requires_grad_(grad) for t in (query, key, value)]
    alpha_in = alpha.clone().requires_grad_(grad) if isinstance(alpha, torch.Tensor) else alpha
    out = triton_attention(*inputs, mask, causal=causal, alpha=alpha_in, scaling=scaling)
    ref_inputs = [t.detach().double().requires_grad_(grad) for t in (query, key, value)]
    ref_alpha = alpha.detach().double().requires_grad_(grad) if isinstance(alpha, torch.Tensor) else alpha
    ref, weights = oracle(*ref_inputs, mask, causal=causal, alpha=ref_alpha, scaling=scaling)
    assert out.shape == ref.shape and out.dtype == query.dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=atol)
    if not grad:
        return out, weights
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)
    out.backward(grad_out.to(out.dtype))
    ref.backward(grad_out.double())
    for mine, theirs in zip(inputs, ref_inputs):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, atol=10 * atol, rtol=10 * atol)
    if isinstance(alpha, torch.Tensor):
        torch.testing.assert_close(alpha_in.grad.double(), ref_alpha.grad, atol=10 * atol, rtol=10 * atol)
    return out, weights


@pytest.mark.parametrize("kind,alpha", [
    ("causal", 2.0), ("causal", 1.5), ("causal", 1.3), ("full", 1.5), ("left_padding_bool", 2.0),
    ("right_padding_additive", 1.3), ("sliding_window_additive", 1.5), ("packed_bool", 2.0),
    ("fully_masked_rows", 1.5), ("per_head_bool", 1.7),
])
def test_matches_the_formula_with_every_mask(kind, alpha):
    """Outputs and dQ, dK, dV equal the float64 formula for every mask family, grouped heads (4 query heads on
    2 key/value heads), several tiles a row."""
    batch = 2 if kind in ("left_padding_bool", "right_padding_additive", "per_head_bool") else 1
    query, key, value = operands(batch=batch, seed=len(kind) + int(alpha * 10))
    mask = None if kind in ("causal", "full") else masks(kind, batch, 4, 40, 40).to(DEVICE)
    out, weights = check(query, key, value, mask, causal=kind == "causal", alpha=alpha)
    dead = weights.sum(-1) == 0
    if kind == "fully_masked_rows":
        assert dead.any() and (out[dead] == 0).all()


@pytest.mark.parametrize("n_q,n_kv,causal", [(7, 40, False), (40, 23, False), (24, 40, True)])
def test_queries_and_keys_of_different_lengths(n_q, n_kv, causal):
    """q != kv (a prefill after a cache, a short block of queries), and a causal mask upper-left aligned as the
    torch path's (query i sees keys j <= i)."""
    query, key, value = operands(n_q=n_q, n_kv=n_kv, seed=n_q)
    mask = None
    if not causal:
        mask = masks("right_padding_additive", 1, 4, n_q, n_kv).to(DEVICE)
    check(query, key, value, mask, causal=causal, alpha=1.5 if causal else 2.0)


def test_learned_alpha_per_head_gradient():
    """One alpha a head (the fast sparsemax / 1.5 branches and the general one side by side), its gradient in
    closed form against the float64 formula's autograd and against the ``entmax`` package."""
    query, key, value = operands(seed=11)
    alpha = torch.tensor([1.25, 1.5, 2.0, 1.8], device=DEVICE)
    check(query, key, value, None, causal=True, alpha=alpha)
    entmax = pytest.importorskip("entmax")
    inputs = [t.clone().requires_grad_() for t in (query, key, value)]
    mine = alpha.clone().requires_grad_()
    out = triton_attention(*inputs, None, causal=False, alpha=mine, scaling=0.3)
    theirs = alpha.double().clone().requires_grad_()
    scores = query.double() @ key.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.3
    p = entmax.entmax_bisect(scores, theirs.view(1, -1, 1, 1).expand(1, 4, scores.shape[2], 1), dim=-1, n_iter=100)
    ref = p @ value.double().repeat_interleave(2, 1)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    (out * grad_out).sum().backward()
    (ref * grad_out.double()).sum().backward()
    torch.testing.assert_close(mine.grad.double(), theirs.grad, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("alpha,kind", [(2.0, "causal"), (1.5, "left_padding_bool"), (1.3, "sliding_window_additive")])
def test_the_same_exact_zeros(alpha, kind):
    """With V = identity the output is the weights: zero exactly where the formula's weights are zero (away from
    float32 rounding at the threshold), nonzero where they are."""
    n = 32
    query, key, _ = operands(n_q=n, n_kv=n, dim=n, seed=5, spread=1.0)
    value = torch.eye(n, device=DEVICE).expand(1, 2, n, n).contiguous()
    mask = None if kind == "causal" else masks(kind, 1, 4, n, n).to(DEVICE)
    out, weights = check(query, key, value, mask, causal=kind == "causal", alpha=alpha, grad=False)
    clear = weights.abs() > 1e-5
    assert (out[weights == 0] == 0).all() and (out[clear] > 0).all()
    assert 0.3 < (weights == 0).double().mean() < 0.97  # sparse, not trivially so


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_operands(dtype):
    """bfloat16 / float16 operands: float32 scores, threshold and accumulation; compared with the formula on the
    rounded operands, to the precision of the weights rounded for the products (as FlashAttention)."""
    query, key, value = operands(seed=9, dtype=dtype)
    mask = masks("left_padding_bool", 1, 4, 40, 40).to(DEVICE)
    out, _ = check(query, key, value, mask, causal=False, alpha=1.5, atol=2e-2)
    assert out.dtype == dtype


def test_not_served_calls_say_why(monkeypatch):
    query, key, value = operands(dim=16)
    reasons = not_supported_reasons(query, key, value[..., :8], alpha=1.05, softcap=30.0, weights=True,
                                    mapping="sparse_softmax")
    text = " ".join(reasons)
    for needle in ("sparse_softmax", "softcapping", "weights", "value head size 8", "alpha 1.05"):
        assert needle in text
    with pytest.raises(ValueError, match="query / key head size 8"):
        triton_attention(query[..., :8].contiguous(), key[..., :8], value[..., :8], None, alpha=1.5)
    with pytest.raises(ValueError, match="dtypes"):
        triton_attention(query.double(), key.double(), value.double(), None, alpha=1.5)
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            triton_attention(query, key, value, None, alpha=1.5)


def tiny_llama(**options):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(DEVICE)


def test_patched_llama_triton_equals_torch(monkeypatch):
    """patch_model(..., attn_options={"kernel": "triton"}) gives the torch path's logits and gradients (learned
    per-head alpha included), with left padding; a greedy continuation decodes the same tokens."""
    calls, decoded = [], []
    original, original_decode = ta.triton_attention, td.triton_decode
    monkeypatch.setattr(ta, "triton_attention", lambda q, *a, **k: calls.append(q.shape[-2]) or original(q, *a, **k))
    monkeypatch.setattr(td, "triton_decode",
                        lambda q, *a, **k: decoded.append(q.shape[-2]) or original_decode(q, *a, **k))
    models = {}
    for kernel in ("triton", "torch"):
        model = tiny_llama()
        models[kernel] = hs.patch_model(model, attn="entmax_bisect",
                                        attn_options={"alpha": 1.4, "learn_alpha": True, "kernel": kernel})
    ids = torch.randint(1, 64, (2, 20), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    logits = {}
    for kernel, model in models.items():
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        logits[kernel] = out.logits
    real = mask.bool()
    torch.testing.assert_close(logits["triton"][real], logits["torch"][real], atol=1e-4, rtol=1e-4)
    grads = {k: {n: p.grad for n, p in m.named_parameters() if p.grad is not None} for k, m in models.items()}
    assert grads["triton"].keys() == grads["torch"].keys() and any("alpha" in n for n in grads["torch"])
    for name, grad in grads["torch"].items():
        torch.testing.assert_close(grads["triton"][name], grad, atol=1e-4, rtol=1e-3, msg=name)
    with torch.no_grad():
        tokens = {k: m.generate(input_ids=ids[:, :9], attention_mask=mask[:, :9], max_new_tokens=3,
                                do_sample=False) for k, m in models.items()}
    assert torch.equal(tokens["triton"], tokens["torch"])
    assert calls == [20, 20]  # 2 layers, training: the forward / backward kernels
    assert decoded == [9, 9] + [1] * 4  # no grad, at most 16 rows: the decoding kernel (prefill, 2 steps)


def test_query_scales_reach_the_triton_kernels(monkeypatch):
    """Per-head temperatures and a length scale (learned, moved off their start) are applied before the kernels:
    the Triton path gives the torch path's logits and gradients, scales included, and decodes the same tokens."""
    calls = []
    original = ta.triton_attention
    monkeypatch.setattr(ta, "triton_attention", lambda q, *a, **k: calls.append(q.shape[-2]) or original(q, *a, **k))
    temps = [[0.5, 2.0, 1.25, 3.0], [4.0, 0.75, 1.0, 2.5]]
    models = {}
    for kernel in ("triton", "torch"):
        model = hs.patch_model(tiny_llama(), attn="entmax15", attn_options={
            "temperature": temps, "learn_temperature": True, "length_scale": True, "kernel": kernel})
        with torch.no_grad():
            g = torch.Generator().manual_seed(4)
            for _, p in hs.query_scale_parameters(model):
                p.add_(torch.randn(p.shape, generator=g).to(p) * 0.2)
        models[kernel] = model
    ids = torch.randint(1, 64, (2, 20), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits = {}
    for kernel, model in models.items():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        logits[kernel] = out.logits
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
    grads = {k: dict(hs.query_scale_parameters(m)) for k, m in models.items()}
    assert len(grads["torch"]) == 8
    for name, param in grads["torch"].items():
        torch.testing.assert_close(grads["triton"][name].grad, param.grad, atol=1e-4, rtol=1e-3, msg=name)
    with torch.no_grad():
        tokens = {k: m.generate(input_ids=ids[:, :9], max_new_tokens=3, do_sample=False) for k, m in models.items()}
    assert torch.equal(tokens["triton"], tokens["torch"])
    assert calls[:2] == [20, 20]


def test_triton_kernel_refuses_what_it_cannot_serve():
    """kernel="triton" on a call the kernels do not serve: one ValueError with the reasons, no silent fallback."""
    model = hs.patch_model(tiny_llama(), attn="sparse_softmax", attn_options={"top_k": 4, "kernel": "triton"})
    ids = torch.randint(1, 64, (1, 8)).to(DEVICE)
    with pytest.raises(ValueError, match="kernel 'triton' cannot serve.*sparse_softmax"):
        model(input_ids=ids)
    model = hs.patch_model(tiny_llama(), attn="sparsemax", attn_options={"kernel": "triton"})
    with pytest.raises(ValueError, match="weights are requested"):
        model(input_ids=ids, output_attentions=True)
    with pytest.raises(ValueError, match="kernel must be one of"):
        hs.patch_model(tiny_llama(), attn="sparsemax", attn_options={"kernel": "cuda"})


def test_auto_on_cpu_takes_the_torch_path(monkeypatch):
    """kernel="auto" (the default) runs the Triton kernels only on CUDA."""
    if CUDA:
        pytest.skip("on CUDA auto takes the kernels")
    monkeypatch.setattr(ta, "triton_attention", lambda *a, **k: pytest.fail("Triton kernels called on a CPU"))
    model = hs.patch_model(tiny_llama().cpu(), attn="sparsemax")
    out = model(input_ids=torch.randint(1, 64, (1, 8)))
    assert torch.isfinite(out.logits).all()


def test_a_row_not_settled_is_nan_never_silently_wrong(monkeypatch):
    """With too few threshold passes allowed, the rows that needed more come out NaN (output and saved threshold),
    the settled ones exact."""
    query, key, value = operands(seed=4)
    monkeypatch.setattr(ta, "MAX_PASSES", 1)
    out = triton_attention(query, key, value, None, causal=True, alpha=1.3, scaling=0.3)
    ref, _ = oracle(query, key, value, None, causal=True, alpha=1.3, scaling=0.3)
    nan = torch.isnan(out).any(-1)
    assert nan.any() and not nan.all()
    torch.testing.assert_close(out[~nan].double(), ref[~nan], atol=2e-5, rtol=2e-5)


def test_a_mask_longer_than_the_keys_and_broadcast_over_queries():
    """transformers may pass a mask wider than the keys (a static cache's slots) and a mask row shared by every
    query ([B, 1, 1, kv]): read through strides, the extra columns ignored."""
    query, key, value = operands(batch=2, n_q=5, n_kv=30, seed=8)
    wide = torch.zeros(2, 1, 1, 36)
    wide[0, ..., :4] = torch.finfo(torch.float32).min  # left padding of the first batch row
    wide[..., 30:] = torch.finfo(torch.float32).min  # unwritten slots
    check(query, key, value, wide.to(DEVICE), causal=False, alpha=1.5)


def test_decoding_calls_take_the_decoding_kernel_where_present(monkeypatch):
    """routing.decode_kernel() is the one switch for decoding calls (a few query rows, no gradient)."""
    from hf_sparsemax.attention import routing

    seen = []

    def fake_decode(query, key, value, mask, *, alpha, scaling):
        seen.append((query.shape[-2], alpha, scaling))
        return triton_attention(query, key, value, mask, alpha=alpha, scaling=scaling)

    monkeypatch.setattr(routing, "decode_kernel", lambda: fake_decode)
    model = hs.patch_model(tiny_llama(), attn="entmax15", attn_options={"kernel": "triton"})
    ids = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
    assert [q for q, _, _ in seen] == [1, 1] and seen[0][1] == 1.5  # the step after the prefill, 2 layers


def test_double_backward_goes_through_the_differentiable_formula():
    """create_graph=True: the backward of the backward is the materialised formula's (second derivatives exact)."""
    query, key, value = operands(n_q=24, n_kv=24, seed=6)
    alpha = torch.tensor([1.3, 1.5, 2.0, 1.7], device=DEVICE)
    results = []
    for dtype in (torch.float32, torch.float64):
        q, k, v, a = (t.to(dtype).clone().requires_grad_() for t in (query, key, value, alpha))
        if dtype == torch.float32:
            out = triton_attention(q, k, v, None, causal=True, alpha=a, scaling=0.3)
        else:
            out = oracle(q, k, v, None, causal=True, alpha=a, scaling=0.3)[0]
        (d_q,) = torch.autograd.grad((out * out).sum(), q, create_graph=True)
        results.append(torch.autograd.grad(d_q.square().sum(), (k, v, a)))
    for mine, theirs in zip(*results):
        torch.testing.assert_close(mine.double(), theirs, atol=1e-3, rtol=1e-3)  # float32 against float64


@pytest.mark.slow
def test_the_kernels_compile_for_an_h100():
    """The forward kernel compiles ahead of time for sm_90 with a GPU's tiles and launch options (PTX, no GPU
    needed; ``tests/triton_compile_check.py attention``, in a process without the interpreter; ``attention
    --backward`` compiles the backward kernels too)."""
    import subprocess
    import sys

    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no NVIDIA backend here")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_compile_check.py")
    done = subprocess.run([sys.executable, script, "attention"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 2


@pytest.mark.parametrize("alpha", [2.0, 1.3])
def test_a_maximum_that_rises_tile_after_tile(alpha):
    """Scores that grow along the keys: every key tile raises the row maximum, so the first pass moves each row's
    histogram down (the threshold's start) tile after tile; the output and the exact zeros still equal the
    formula's, with and without skipping the tiles that have no weight."""
    query, key, value = operands(n_q=8, n_kv=64, dim=16, seed=12)
    key = key * torch.linspace(0.2, 3.0, 64, device=DEVICE)[:, None]
    query = key[:, :, -8:].repeat_interleave(2, 1) + 0.1 * query  # rows aligned with the late, long keys
    for skip in (True, False):
        ta_skip = ta.SKIP_BYTES
        try:
            ta.SKIP_BYTES = ta_skip if skip else 0
            check(query, key, value, None, causal=False, alpha=alpha, grad=False)
        finally:
            ta.SKIP_BYTES = ta_skip


def test_skipped_tiles_have_no_weight():
    """The tiles the forward marks dead (never visited by the output pass) have no nonzero weight in the float64
    formula, and the live ones have some: the skipping is exact, on scores sparse enough to skip most tiles."""
    n, block = 64, ta.INTERPRET_BLOCK if not CUDA else ta.BLOCK_M
    query, key, value = operands(n_q=n, n_kv=n, dim=16, seed=13, spread=4.0)
    mask = masks("left_padding_bool", 1, 4, n, n).to(DEVICE)
    alphas = torch.tensor([2.0, 1.5, 1.3, 1.7], device=DEVICE)
    out, t, live, _ = ta._forward(query, key, value, alphas, *ta._mask_operand(mask, query, key), False, 0.3)
    _, weights = oracle(query, key, value, mask, causal=False, alpha=alphas, scaling=0.3)
    blocks = weights.shape[-1] // block
    nonzero = (weights > 0).view(1, 4, blocks, block, blocks, block).any(5).any(3)
    assert torch.equal(live.bool().cpu(), nonzero.cpu()) and (~nonzero).any() and nonzero.any()


def test_the_certifying_pass_adds_the_output_for_other_alphas(monkeypatch):
    """alpha 1.3: the threshold pass that certifies a block's rows also adds P V (the output pass is saved): the
    kernel's own count of passes over the keys is one less in some blocks than with that off, never more, and
    the outputs equal the formula's both ways. Every block makes one full pass, then visits only live tiles
    (sparsemax on local scores: fewer tile visits than passes x tiles seen)."""
    query, key, value = operands(n_q=64, n_kv=64, seed=14, spread=3.0)
    args = (query, key, value, torch.full((4,), 1.3, device=DEVICE), None, 0.0, True, 0.3)
    ref, _ = oracle(query, key, value, None, causal=True, alpha=1.3, scaling=0.3)
    out, _, _, work = ta._forward(*args)
    monkeypatch.setattr(ta, "SPECULATE", -1.0)
    plain, _, _, plain_work = ta._forward(*args)
    for result in (out, plain):
        torch.testing.assert_close(result.double(), ref, atol=2e-5, rtol=2e-5)
    passes, plain_passes = work[..., 0].cpu(), plain_work[..., 0].cpu()
    assert (passes <= plain_passes).all() and (passes < plain_passes).any() and (passes >= 2).all()
    sharp = key.repeat_interleave(2, 1) * 3.0  # each row's own key scores far above the others: a local support
    _, _, _, work = ta._forward(sharp, key, value, torch.full((4,), 2.0, device=DEVICE), *args[4:])
    passes, visits = work[..., 0].cpu(), work[..., 1].cpu()
    tiles = torch.arange(1, work.shape[2] + 1)  # causal: query block i sees i + 1 key tiles
    assert (visits <= passes * tiles).all() and (visits < passes * tiles).any()


def tiny_dsa(top_k: int):
    """DeepSeek-V3.2 with its lightning indexer selecting ``top_k`` keys a query (heads of 16: the kernels' size)."""
    from transformers import AutoModelForCausalLM, DeepseekV32Config

    config = DeepseekV32Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=2,
                               kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                               index_topk=top_k, index_head_dim=16, index_n_heads=2, max_position_embeddings=64,
                               initializer_range=0.2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(DEVICE)


def test_the_indexer_selection_reaches_the_triton_kernels(monkeypatch):
    """DeepSeek-V3.2's indexer (``indices``) under kernel="triton": the keys it selects are folded into the mask
    before the route (what kernel="auto" does on CUDA), so the Triton kernels give the torch path's logits and
    gradients and decode the same tokens; the torch path with every key selected differs (the selection matters)."""
    calls, decoded = [], []
    original, original_decode = ta.triton_attention, td.triton_decode
    monkeypatch.setattr(ta, "triton_attention", lambda q, *a, **k: calls.append(q.shape[-2]) or original(q, *a, **k))
    monkeypatch.setattr(td, "triton_decode",
                        lambda q, *a, **k: decoded.append(q.shape[-2]) or original_decode(q, *a, **k))
    models = {kernel: hs.patch_model(tiny_dsa(top_k=4), attn="entmax15", attn_options={"kernel": kernel})
              for kernel in ("triton", "torch")}
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    real, logits = mask.bool(), {}
    for kernel, model in models.items():
        out = model(input_ids=ids, attention_mask=mask)
        out.logits[real].square().mean().backward()
        logits[kernel] = out.logits[real]
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
    grads = {k: {n: p.grad for n, p in m.named_parameters() if p.grad is not None} for k, m in models.items()}
    assert grads["triton"].keys() == grads["torch"].keys() and grads["torch"]
    for name, grad in grads["torch"].items():
        torch.testing.assert_close(grads["triton"][name], grad, atol=1e-4, rtol=1e-3, msg=name)
    assert calls == [12, 12]  # 2 layers, training: the forward / backward kernels
    with torch.no_grad():
        tokens = {k: m.generate(input_ids=ids[:1, :9], max_new_tokens=3, do_sample=False, pad_token_id=0)
                  for k, m in models.items()}
        every_key = hs.patch_model(tiny_dsa(top_k=64), attn="entmax15", attn_options={"kernel": "torch"})
        assert not torch.allclose(every_key(input_ids=ids, attention_mask=mask).logits[real], logits["torch"],
                                  atol=1e-3)
    assert torch.equal(tokens["triton"], tokens["torch"])
    assert decoded == [9, 9] + [1] * 4  # no grad, at most 16 rows: the decoding kernel (prefill, 2 steps)
