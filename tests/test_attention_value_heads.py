"""Value heads of another size than the query / key heads (DeepSeek's MLA: 192 / 128; here scaled down to 24 / 16).

Every path against the dense float64 reference ``mapping(q k^T * scaling + mask) @ v`` (the library's mappings on
the whole score matrix, their eager solvers): the torch blocks (outputs and the gradients of queries, keys, values
and a learned alpha, several blocks or one, grouped and full heads, causal and padded masks), float64 gradcheck,
the mappings without a threshold form (query chunks), the fused CPU kernel (a no-grad prefill's blocks and decoding
steps), the Triton kernels under the interpreter (head sizes they take: 32 / 16 and 16 / 32; 24 goes to the torch
path with a reason; their decoding kernel takes 24 / 16), decoding against a cache, and a tiny
``DeepseekV3ForCausalLM`` patched with entmax15 (forward, backward, generate). Page skipping and the int8 key
certificate: tests/test_attention_skipping.py, tests/test_attention_keycodes.py.
"""

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels module decorates its kernels

import pytest  # noqa: E402
from torch.autograd import gradcheck, gradgradcheck  # noqa: E402

import hf_sparsemax as hs  # noqa: E402
from hf_sparsemax.attention.blocked import blocks as attention_blocks  # noqa: E402
from hf_sparsemax.attention.blocked import decode  # noqa: E402
from hf_sparsemax.attention import routing
from hf_sparsemax.attention import interface  # noqa: E402
from hf_sparsemax.attention.interface import (ALPHA_ATTR, OPTIONS_ATTR, AttentionOptions,  # noqa: E402
                                              LearnedAlpha, sparse_attention_forward)
from hf_sparsemax.attention.gpu.triton_attention import not_supported_reasons  # noqa: E402
from hf_sparsemax.mappings import compiled  # noqa: E402
from test_attention_blocks import Float64Alpha  # noqa: E402

B, L, D, DV = 2, 11, 24, 16
HEADS = {"gqa": (4, 2), "mha": (4, 4)}  # (query heads, key / value heads)
SETUPS = {  # name -> (attention, attn_options)
    "sparsemax": ("sparsemax", {}),
    "entmax15": ("entmax15", {}),
    "bisect13": ("entmax_bisect", {"alpha": 1.3}),
    "learned": ("entmax_bisect", {"alpha": 1.3, "learn_alpha": True}),
}
SCALING = D**-0.5


def module_for(setup: str, heads: int, dtype=torch.float64, kernel: str = "torch", causal: bool = False):
    attn, options = SETUPS[setup]
    module = torch.nn.Module().train()
    module.is_causal = causal
    setattr(module, OPTIONS_ATTR, AttentionOptions.from_settings(attn, {**options, "kernel": kernel}))
    if options.get("learn_alpha"):
        kind = Float64Alpha if dtype == torch.float64 else LearnedAlpha
        module.add_module(ALPHA_ATTR, kind(heads, options["alpha"]).to(dtype))
        with torch.no_grad():  # a different alpha in every head, 1.15 to 1.75
            module.hf_sparsemax_alpha.pre_alpha.copy_(torch.linspace(-1.7, 1.1, heads, dtype=dtype))
    return module, attn


def padded_mask(length: int, dtype, batch: int = B) -> torch.Tensor:
    """Causal, and the second sequence left-padded by 3: its first 3 rows see no key (their output: zeros)."""
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    hidden = future.expand(batch, 1, length, length).clone()
    hidden[1, ..., :3] = True
    return torch.zeros(batch, 1, length, length, dtype=dtype).masked_fill(hidden, torch.finfo(dtype).min)


def causal_mask(length: int, dtype) -> torch.Tensor:
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    return torch.zeros(1, 1, length, length, dtype=dtype).masked_fill(future, torch.finfo(dtype).min)


def operands(heads, kv_heads, length=L, dim=D, value_dim=DV, dtype=torch.float64, seed=0, queries=None):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, heads, queries or length, dim), (B, kv_heads, length, dim), (B, kv_heads, length, value_dim)]
    return [(torch.randn(s, generator=g, dtype=torch.float64) * 1.5).to(dtype).requires_grad_() for s in shapes]


def dense(module, setup, q, k, v, mask, scaling=SCALING):
    """``[B, q, H, Dv]``: ``mapping(q k^T * scaling + mask) @ v`` on the whole score matrix in float64, by the
    library's mappings on their eager solvers (not the kernels under test)."""
    attn, options = SETUPS[setup]
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scaling
    if mask is not None:
        scores = scores + mask.double().masked_fill(mask <= torch.finfo(mask.dtype).min, torch.finfo(torch.float64).min)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(compiled.ENVIRONMENT, "0")
        if options.get("learn_alpha"):
            p = hs.entmax_bisect(scores, module.hf_sparsemax_alpha().double())
        elif "alpha" in options:
            p = hs.entmax_bisect(scores, options["alpha"])
        else:
            p = getattr(hs, attn)(scores)
    return (p @ v).transpose(1, 2)


def leaves(module, q, k, v):
    learned = getattr(module, ALPHA_ATTR, None)
    return [q, k, v] + ([learned.pre_alpha] if learned is not None else [])


# --- the torch blocks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("blocks", ["one", "several"])
@pytest.mark.parametrize("mask_kind", ["is_causal", "padded"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("setup", list(SETUPS))
def test_the_torch_blocks_give_the_dense_outputs_and_gradients(setup, heads, mask_kind, blocks, monkeypatch):
    """Values of another head size than the queries' (``backward_blocks`` reshaped ``dO`` to the query's): outputs
    and the gradients of q, k, v and a learned alpha equal the dense reference in float64 (one block, or blocks of
    2 queries with every block gathering its live keys)."""
    if blocks == "several":
        monkeypatch.setattr(attention_blocks, "ATTENTION_BUDGET", 2 * HEADS[heads][0] * B * L)
        monkeypatch.setattr(attention_blocks, "MIN_BLOCK_QUERIES", 1)
        monkeypatch.setattr(attention_blocks, "GATHER_BELOW", 1.0)
        monkeypatch.setattr(attention_blocks, "GATHER_WEIGHTS_BELOW", 1.0)
    module, attn = module_for(setup, HEADS[heads][0], causal=mask_kind == "is_causal")
    q, k, v = operands(*HEADS[heads])
    mask = None if mask_kind == "is_causal" else padded_mask(L, torch.float64)
    out, weights = sparse_attention_forward(module, q, k, v, mask, mapping=attn)
    assert weights is None and out.shape == (B, L, HEADS[heads][0], DV)  # the threshold path, Dv columns
    reference = dense(module, setup, q, k, v, causal_mask(L, torch.float64) if mask is None else mask)
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-12)
    assert ((out == 0) == (reference == 0)).all()
    if mask is not None:
        assert (out[1, :3] == 0).all()  # rows that see no key: zeros
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    inputs = leaves(module, q, k, v)
    got = torch.autograd.grad((out * grad).sum(), inputs)
    expected = torch.autograd.grad((reference * grad).sum(), inputs)
    for name, a, b in zip(["q", "k", "v", "alpha"], got, expected):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"d{name}")


@pytest.mark.parametrize("setup", ["entmax15", "learned"])
def test_gradcheck_with_other_value_heads(setup, monkeypatch):
    """float64 gradcheck (a padded mask) and gradgradcheck (a causal mask: the double backward's differentiable
    path) of the blocked path, one query a block, query / key heads of 6 and value heads of 4."""
    monkeypatch.setattr(attention_blocks, "ATTENTION_BUDGET", 4 * B)
    monkeypatch.setattr(attention_blocks, "MIN_BLOCK_QUERIES", 1)
    module, attn = module_for(setup, 4)
    q, k, v = operands(4, 2, length=5, dim=6, value_dim=4)
    inputs = tuple(leaves(module, q, k, v))
    for mask, order in ((padded_mask(5, torch.float64), gradcheck), (causal_mask(5, torch.float64), gradgradcheck)):

        def fn(q, k, v, *alpha):
            return sparse_attention_forward(module, q, k, v, mask, mapping=attn)[0]

        assert fn(*inputs).shape == (B, 5, 4, 4)
        assert order(fn, inputs, atol=1e-5, fast_mode=True)


@pytest.mark.parametrize("mapping", ["normmax_bisect", "sparse_softmax", "taylor_softmax"])
def test_the_other_mappings_take_another_value_head_size(mapping):
    """The mappings without a threshold form take the general path (query chunks recomputed in backward): with
    chunks of 3 queries, outputs and gradients equal their mapping on the whole score matrix, then ``@ v``."""
    from hf_sparsemax.mappings import registry

    module = torch.nn.Module().train()
    module.is_causal = False
    setattr(module, OPTIONS_ATTR, AttentionOptions.from_settings(mapping, {"chunk_size": 3}))
    q, k, v = operands(4, 2)
    mask = padded_mask(L, torch.float64)
    out, _ = sparse_attention_forward(module, q, k, v, mask, mapping=mapping)
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * SCALING + mask
    reference = (registry.REGISTRY[mapping].function(scores, dim=-1) @ v.repeat_interleave(2, 1)).transpose(1, 2)
    assert out.shape == (B, L, 4, DV)
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out.square().sum(), [q, k, v]),
                    torch.autograd.grad(reference.square().sum(), [q, k, v])):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


# --- the fused CPU kernel ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("setup", list(SETUPS))
def test_the_fused_kernel_serves_a_prefill_and_decoding_steps(setup, heads, monkeypatch):
    """float32 without autograd: a prefill's blocks (``block_rows``) and decoding steps of 1 and 3 rows
    (``fused.decode``) are served by the C kernel with Dv != D, and equal the dense float64 reference."""
    monkeypatch.setattr(attention_blocks, "ATTENTION_BUDGET", 3 * HEADS[heads][0] * B * L)
    monkeypatch.setattr(attention_blocks, "MIN_BLOCK_QUERIES", 1)
    blocks_served, steps_served = [], []
    rows, fused_decode = attention_blocks.block_rows, decode.fused_decode
    monkeypatch.setattr(attention_blocks, "block_rows", lambda *a: blocks_served.append(rows(*a)) or blocks_served[-1])
    monkeypatch.setattr(decode, "fused_decode", lambda *a: steps_served.append(fused_decode(*a)) or steps_served[-1])
    module, attn = module_for(setup, HEADS[heads][0], dtype=torch.float32)
    module.eval()
    q, k, v = (t.detach() for t in operands(*HEADS[heads], dtype=torch.float32))
    mask = padded_mask(L, torch.float32)
    with torch.no_grad():
        out, _ = sparse_attention_forward(module, q, k, v, mask, mapping=attn)
        steps = [sparse_attention_forward(module, q[..., -n:, :], k, v, mask[..., -n:, :], mapping=attn)[0]
                 for n in (1, 3)]
    assert len(blocks_served) > 1 and all(found is not None for found in blocks_served)
    assert len(steps_served) == 2 and all(found is not None for found in steps_served)
    reference = dense(module, setup, q, k, v, mask)
    torch.testing.assert_close(out.double(), reference, rtol=2e-5, atol=2e-6)
    for n, step in zip((1, 3), steps):
        assert step.shape == (B, n, HEADS[heads][0], DV)
        torch.testing.assert_close(step.double(), reference[:, -n:], rtol=2e-5, atol=2e-6)


# --- the Triton kernels (under the interpreter without a GPU) -----------------------------------------------------


@pytest.mark.parametrize("sizes, heads", [((32, 16), "gqa"), ((16, 32), "gqa"), ((32, 16), "mha")])
@pytest.mark.parametrize("mask_kind", ["is_causal", "padded"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_the_triton_kernels_take_another_value_head_size(setup, mask_kind, sizes, heads, monkeypatch):
    """kernel="triton": outputs and gradients (q, k, v, a learned alpha) of the Triton kernels with query / key
    heads of 32 and value heads of 16 (and the other way round) equal the dense reference to float32 rounding."""
    pytest.importorskip("triton")
    dim, value_dim = sizes
    served = []
    original = routing.triton_route
    monkeypatch.setattr(interface, "triton_route", lambda *a, **k: served.append(original(*a, **k)) or served[-1])
    module, attn = module_for(setup, 4, dtype=torch.float32, kernel="triton", causal=mask_kind == "is_causal")
    q, k, v = operands(*HEADS[heads], length=20, dim=dim, value_dim=value_dim, dtype=torch.float32)
    mask = None if mask_kind == "is_causal" else padded_mask(20, torch.float32)
    out, _ = sparse_attention_forward(module, q, k, v, mask, scaling=0.3, mapping=attn)
    assert served and served[-1] is not None and out.shape == (B, 20, 4, value_dim)
    reference = dense(module, setup, q, k, v, causal_mask(20, torch.float32) if mask is None else mask, scaling=0.3)
    torch.testing.assert_close(out.double(), reference, rtol=1e-4, atol=2e-5)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    inputs = leaves(module, q, k, v)
    got = torch.autograd.grad((out * grad).sum(), inputs)
    expected = torch.autograd.grad((reference * grad.double()).sum(), inputs)
    for name, a, b in zip(["q", "k", "v", "alpha"], got, expected):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-3, atol=2e-4, msg=f"d{name}")


def test_head_sizes_the_triton_kernels_do_not_take_go_to_the_torch_path_with_a_reason():
    """Query / key heads of 24 (DeepSeek's 192 is no power of 2 either): "triton" refuses in one ValueError naming
    the head size, "auto" leaves the call to the torch path; the decoding kernel takes any head sizes."""
    q, k, v = operands(4, 2, dtype=torch.float32)
    reasons = not_supported_reasons(q, k, v)
    assert reasons == [f"query / key head size {D} (the kernels take one of (16, 32, 64, 128); the torch path any)"]
    with torch.no_grad():  # a decoding call (the decoding kernel has no backward)
        assert not_supported_reasons(q, k, v, decoding=True) == []
    assert "value head size 24" in "; ".join(not_supported_reasons(k, k, k))
    assert "differ" in "; ".join(not_supported_reasons(q, v, v, decoding=True))
    module, attn = module_for("entmax15", 4, dtype=torch.float32, kernel="triton")
    with pytest.raises(ValueError, match=f"query / key head size {D}"):
        sparse_attention_forward(module, q, k, v, padded_mask(L, torch.float32), mapping=attn)
    auto = routing.triton_route(module, q, k, v, None, kernel="auto", mapping=attn, scaling=SCALING, dropout=0.0,
                                softcap=None, position_bias=None, sinks=None, causal=True, weights=False, options=None,
                                learned=None)
    assert auto is None  # the caller takes the torch path


@pytest.mark.parametrize("setup", ["sparsemax", "learned"])
def test_triton_decoding_steps_take_any_head_sizes(setup):
    """A decoding step (3 rows, no gradient) with query / key heads of 24 and value heads of 16 under
    kernel="triton": the decoding kernel serves it and equals the dense reference."""
    pytest.importorskip("triton")
    module, attn = module_for(setup, 4, dtype=torch.float32, kernel="triton")
    module.eval()
    q, k, v = (t.detach() for t in operands(4, 2, length=40, queries=3, dtype=torch.float32))
    i, j = torch.arange(3)[:, None] + 37, torch.arange(40)[None, :]
    mask = torch.zeros(B, 1, 3, 40).masked_fill(j > i, torch.finfo(torch.float32).min)
    mask[1, ..., :5] = torch.finfo(torch.float32).min  # left padding
    with torch.no_grad():
        out, _ = sparse_attention_forward(module, q, k, v, mask, mapping=attn)
    torch.testing.assert_close(out.double(), dense(module, setup, q, k, v, mask), rtol=1e-4, atol=2e-5)


# --- a tiny DeepSeek-V3 ---------------------------------------------------------------------------------------


def tiny_deepseek(dtype=torch.float64, nope: int = 16, rope: int = 8, value: int = 16):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=value, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, experts_implementation="eager")  # eager experts: grouped_mm takes no float64
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config).to(dtype)


def batch():
    """Two sequences of 9 tokens, the second left-padded by 3."""
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, :3] = 0
    return ids, attention_mask


def loss_and_grads(model, ids, attention_mask):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=attention_mask, labels=ids.masked_fill(attention_mask == 0, -100))
    out.loss.backward()
    return out.loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_a_tiny_deepseek_v3_trains_and_decodes_with_entmax15(monkeypatch):
    """Query / key heads of 24 (16 + 8 rotary), value heads of 16, float64: the patched model's loss and gradients
    equal those of the materialised formula (the same mapping on the whole score matrix), every gradient finite;
    its logits with a DynamicCache (a prefill, then a step of 1 and of 3 rows) equal the full forward's; greedy
    generation with and without a cache gives the same tokens."""
    from transformers import DynamicCache

    model = tiny_deepseek()
    hs.patch_model(model, attn="entmax15")
    ids, attention_mask = batch()
    calls = []
    for name in ("threshold_attention", "decode_attention"):  # which path each call took
        original = getattr(interface, name)
        monkeypatch.setattr(interface, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    loss, grads = loss_and_grads(model, ids, attention_mask)
    assert calls == ["threshold_attention"] * 2  # the blocked path in both layers, its backward the fixed one
    assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads.values())
    with monkeypatch.context() as patch:  # the reference: every call materialised (no threshold path)
        patch.setattr(interface, "threshold_path", lambda *a, **k: None)
        loss_ref, grads_ref = loss_and_grads(model, ids, attention_mask)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-10, atol=1e-12)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-7, atol=1e-10, msg=name)

    model.eval()
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attention_mask).logits
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :5], attention_mask=attention_mask[:, :5], cache=cache)
        one = model(input_ids=ids[:, 5:6], attention_mask=attention_mask[:, :6], cache=cache).logits
        three = model(input_ids=ids[:, 6:], attention_mask=attention_mask, cache=cache).logits
    assert calls[-4:] == ["decode_attention"] * 4  # the two steps, two layers each: the decoding path
    torch.testing.assert_close(one[:, 0], full[:, 5], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(three, full[:, 6:], rtol=1e-9, atol=1e-10)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, use_cache=True, **kwargs)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert cached.shape == (2, 15) and torch.equal(cached, uncached)


def test_a_tiny_deepseek_v3_on_the_triton_kernels_equals_the_torch_path():
    """Query / key heads of 32 (24 + 8 rotary), value heads of 16 (head sizes the Triton kernels take), float32:
    kernel="triton" (the interpreter without a GPU) gives kernel="torch"'s loss and gradients, and decodes the same
    tokens with a cache."""
    pytest.importorskip("triton")
    results = []
    for kernel in ("torch", "triton"):
        model = tiny_deepseek(torch.float32, nope=24, rope=8, value=16)
        hs.patch_model(model, attn="entmax15", attn_options={"kernel": kernel})
        ids, attention_mask = batch()
        loss, grads = loss_and_grads(model, ids, attention_mask)
        assert all(torch.isfinite(g).all() for g in grads.values())
        model.eval()
        tokens = model.generate(ids, attention_mask=attention_mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
        results.append((loss, grads, tokens))
    (loss, grads, tokens), (loss_t, grads_t, tokens_t) = results
    torch.testing.assert_close(loss_t, loss, rtol=1e-5, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads_t[name], grads[name], rtol=1e-3, atol=1e-5, msg=name)
    assert torch.equal(tokens, tokens_t)
