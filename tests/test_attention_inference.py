"""Attention without autograd: the decoding path (a few query rows against a cache) and the no-grad prefill.

The decoding path (:mod:`hf_sparsemax.attention.blocked.decode`) is checked against the materialised formula on the
library's eager solvers, across the threshold mappings (a learned per-head alpha included), grouped-query heads,
one and several query rows, and the masks a decoding step meets (none, left padding, a sliding window, per
head, a query that sees nothing); rows the compiled passes do not certify send the call to the general path.
A no-grad forward (prefill) gives the same output as the forward autograd records.
"""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_sparsemax as hs
from hf_sparsemax.attention.blocked import blocks as attention_blocks
from hf_sparsemax.attention.blocked import decode
from hf_sparsemax.attention import interface
from hf_sparsemax.attention.interface import sparse_attention_forward
from hf_sparsemax.mappings import compiled
from test_attention_blocks import SETUPS, gather_always, materialised, module_for, small_blocks

MIN = torch.finfo(torch.float32).min
B, H, H_KV, KV, D = 3, 4, 2, 40, 8


@pytest.fixture
def compiled_decoding(compiled_kernels, monkeypatch):
    """``compiled_kernels``, and the general decoding path (the fused kernel off: it has its own tests,
    tests/test_attention_fused.py) with its compiled kernel at any size."""
    monkeypatch.setattr(decode, "MIN_SCORES", 0)
    monkeypatch.setattr(decode, "fused_decode", lambda problem, alpha: None)
    return compiled_kernels


@pytest.fixture
def decoding_calls(monkeypatch):
    """The calls the decoding path served, recorded."""
    served = []
    original = interface.decode_attention
    monkeypatch.setattr(interface, "decode_attention", lambda *a, **kw: served.append(1) or original(*a, **kw))
    return served


def decode_masks(rows: int) -> dict[str, torch.Tensor | None]:
    """Masks of ``rows`` query rows at the end of ``KV`` keys, as transformers passes them while decoding."""
    seen = torch.ones(B, 1, rows, KV, dtype=torch.bool)
    padded = seen.clone()
    padded[1, ..., :5], padded[2, ..., :11] = False, False  # left padding
    window = seen.clone()
    window[..., : KV - 16] = False
    nothing = padded.clone()
    nothing[2, ..., 0, :] = False  # a query that sees no key: zeros, no NaN
    per_head = torch.rand(B, H, rows, KV, generator=torch.Generator().manual_seed(3)) > 0.3
    per_head[..., -1] = True
    additive = lambda keep: torch.zeros(keep.shape).masked_fill(~keep, MIN)  # noqa: E731
    return {"none": None, "left padding": additive(padded), "sliding window": additive(window),
            "per head": additive(per_head), "a query that sees nothing": additive(nothing)}


def decode_inputs(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, rows, D, generator=g) * 1.5, torch.randn(B, H_KV, KV, D, generator=g) * 1.5,
            torch.randn(B, H_KV, KV, D, generator=g))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_decoding_path_equals_the_materialised_formula(setup, rows, compiled_decoding, decoding_calls):
    calls = compiled_decoding
    q, k, v = decode_inputs(rows)
    for name, mask in decode_masks(rows).items():
        module, attn = module_for(setup)
        module.eval()
        calls.clear(), decoding_calls.clear()
        with torch.no_grad():
            out, weights = sparse_attention_forward(module, q, k, v, mask, scaling=0.4, mapping=attn)
        reference = materialised(module, setup, q, k, v, mask, 0.4)
        assert weights is None and decoding_calls == [1] and calls == ["solve_and_map"], name  # one compiled call
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=2e-6, msg=name)
        if name == "a query that sees nothing":
            assert (out[2, 0] == 0).all()


def test_rows_the_passes_do_not_certify_get_the_eager_exact_threshold(compiled_decoding, decoding_calls, monkeypatch):
    """Rows without a certificate (made so here: all but the first, their threshold moved) are solved again by the
    mapping's eager exact solver: the exact answer."""
    from hf_sparsemax.mappings._sync_free import newton_certified

    def uncertain(rows, alpha, masked, steps=None):
        found = newton_certified(rows, alpha, masked, steps)
        return found._replace(tau=found.tau + 0.25, done=found.done & (torch.arange(rows.shape[0]) == 0)[:, None])

    monkeypatch.setattr(compiled, "newton_certified", uncertain)
    for setup in SETUPS:
        module, attn = module_for(setup)
        q, k, v = decode_inputs(1)
        mask = decode_masks(1)["left padding"]
        with torch.no_grad():
            out, _ = sparse_attention_forward(module, q, k, v, mask, scaling=0.4, mapping=attn)
        reference = materialised(module, setup, q, k, v, mask, 0.4)
        torch.testing.assert_close(out[1:], reference[1:], rtol=1e-5, atol=2e-6, msg=setup)
    assert len(decoding_calls) == len(SETUPS) and compiled_decoding == ["solve_and_map"] * len(SETUPS)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_decoding_path_in_float64_equals_the_materialised_formula(setup, decoding_calls):
    """Float64 (the eager exact solvers): the same support, the output to rounding."""
    q, k, v = (t.double() for t in decode_inputs(2, seed=7))
    module, attn = module_for(setup, torch.float64)
    for name, mask in decode_masks(2).items():
        mask = None if mask is None else mask.double().masked_fill(mask == MIN, torch.finfo(torch.float64).min)
        with torch.no_grad():
            out, _ = sparse_attention_forward(module, q, k, v, mask, scaling=0.4, mapping=attn)
        reference = materialised(module, setup, q, k, v, mask, 0.4)
        torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12, msg=name)
    assert len(decoding_calls) == len(decode_masks(2))


def test_the_decoding_path_is_not_taken_where_it_does_not_apply(decoding_calls):
    calls = decoding_calls
    module, attn = module_for("sparsemax")
    q, k, v = decode_inputs(3)
    out, _ = sparse_attention_forward(module, q.requires_grad_(), k, v, None, scaling=0.4, mapping=attn)
    assert not calls and out.requires_grad  # a gradient is wanted: the blocked path's Function
    module.is_causal = True
    with torch.no_grad():  # several rows, no mask, a causal module: the causal mask is the attention's to apply
        sparse_attention_forward(module, q, k[:, :, :3], v[:, :, :3], None, scaling=0.4, mapping=attn)
        q_long = torch.randn(B, H, decode.MAX_QUERIES + 1, D)
        sparse_attention_forward(module, q_long, k, v, None, scaling=0.4, mapping=attn)
    assert not calls
    module.is_causal = False
    with torch.no_grad():
        sparse_attention_forward(module, q, k, v, None, scaling=0.4, mapping=attn)
    assert calls == [1]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("gather", ["where it pays", "always"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_no_grad_prefill_equals_the_recorded_forward(setup, gather, fused, monkeypatch):
    """Without autograd the blocked forward keeps nothing for a backward and gives the same output, bit for bit;
    where the fused kernel solves the blocks (``fused``), to float32 rounding."""
    small_blocks(monkeypatch, 100)
    if gather == "always":
        gather_always(monkeypatch)
    served, original = [], attention_blocks.block_rows

    def block_rows(*args):  # the fused kernel's block path, on or off, its calls recorded
        served.append(1)
        return original(*args) if fused else None

    monkeypatch.setattr(attention_blocks, "block_rows", block_rows)
    module, attn = module_for(setup)
    module.is_causal = True
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, H, 30, D, generator=g), torch.randn(2, H_KV, 30, D, generator=g), torch.randn(
        2, H_KV, 30, D, generator=g)
    recorded, _ = sparse_attention_forward(module, q.requires_grad_(), k, v, None, scaling=0.4, mapping=attn)
    assert recorded.requires_grad
    assert not served  # the recorded forward (training) never takes the fused kernel
    with torch.no_grad():
        plain, _ = sparse_attention_forward(module, q, k, v, None, scaling=0.4, mapping=attn)
    assert served
    exact = not fused
    torch.testing.assert_close(plain, recorded.detach(), rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)


def test_a_no_grad_forward_packs_no_live_keys(monkeypatch):
    packed = []
    original = attention_blocks.pack_bits
    monkeypatch.setattr(attention_blocks, "pack_bits", lambda flags: packed.append(1) or original(flags))
    gather_always(monkeypatch)
    module, attn = module_for("sparsemax")
    module.is_causal = True
    q, k, v = torch.randn(1, H, 30, D), torch.randn(1, H_KV, 30, D), torch.randn(1, H_KV, 30, D)
    with torch.no_grad():
        sparse_attention_forward(module, q, k, v, None, scaling=0.4, mapping=attn)
    assert not packed
    sparse_attention_forward(module, q.requires_grad_(), k, v, None, scaling=0.4, mapping=attn)
    assert packed


@pytest.mark.parametrize("setup", ["entmax15", "learned"])
def test_cached_greedy_decoding_equals_the_uncached_forward(setup, compiled_decoding, decoding_calls):
    """A tiny Llama (grouped heads), a left-padded batch: each cached step's logits equal a full forward's."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    attn, options = SETUPS[setup]
    hs.patch_model(model, attn=attn, attn_options=options)
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        cache = DynamicCache(config=config)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        for _ in range(3):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            ids, mask = torch.cat([ids, nxt], -1), torch.cat([mask, torch.ones_like(nxt)], -1)
            positions = (mask.cumsum(-1) - 1).clamp_min(0)
            decoding_calls.clear()
            out = model(input_ids=nxt, attention_mask=mask, position_ids=positions[:, -1:], past_key_values=cache)
            assert len(decoding_calls) == config.num_hidden_layers
            full = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
            torch.testing.assert_close(out.logits[:, -1], full, rtol=1e-4, atol=1e-5)
