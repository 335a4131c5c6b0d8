"""Half precision (bfloat16, float16) on the memory-bounded threshold path: computed in float32, output rounded.

A half model's attention takes the same path as float32's (query blocks, the compiled threshold kernels, one
threshold a row kept for backward, the decoding path), its scores, threshold, weights and ``P V`` computed in
float32 from the half operands, as sdpa accumulates. So its output and gradients are the float32 computation on
the half-rounded inputs, rounded once to the model's dtype: checked here against the materialised formula in
float32 on those inputs, to half tolerance, with the same exact zeros, across mask families (padding, a query
that sees nothing), grouped heads and a learned alpha.
"""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_sparsemax as hs
from hf_sparsemax.attention.blocked import blocks as attention_blocks
from hf_sparsemax.attention import interface
from hf_sparsemax.attention.interface import sparse_attention_forward
from test_attention_blocks import B, H, H_KV, L, SETUPS, inputs, masks, materialised, module_for, small_blocks
from test_attention_inference import compiled_decoding, decode_inputs, decode_masks, decoding_calls  # noqa: F401 (fixtures)

HALF = [torch.bfloat16, torch.float16]
TOLERANCE = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def half_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """An additive float32 mask as a half model's: masked entries at ``finfo(dtype).min``."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(mask == torch.finfo(torch.float32).min,
                                                             torch.finfo(dtype).min)


@pytest.fixture
def materialised_calls(monkeypatch):
    """Calls that left the threshold path for the materialised one (``attend``), recorded."""
    seen = []
    original = interface.attend
    monkeypatch.setattr(interface, "attend", lambda *a, **kw: seen.append(1) or original(*a, **kw))
    return seen


@pytest.mark.parametrize("kernels", ["eager", "compiled"])
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("dtype", HALF)
def test_half_output_and_gradients_are_the_float32_computation_rounded(dtype, setup, kernels, request, monkeypatch,
                                                                        materialised_calls):
    if kernels == "compiled":
        request.getfixturevalue("compiled_kernels")
    small_blocks(monkeypatch, 100)  # several query blocks
    for name, mask in masks().items():
        module, attn = module_for(setup)
        module.is_causal = name == "is_causal"
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in inputs())
        grad = torch.randn(B, L, H, 8, generator=torch.Generator().manual_seed(2)).to(dtype)
        alpha = [module.hf_sparsemax_alpha.pre_alpha] if SETUPS[setup][1].get("learn_alpha") else []
        out, weights = sparse_attention_forward(module, q, k, v, half_mask(mask, dtype), scaling=0.4, mapping=attn)
        assert weights is None and not materialised_calls and out.dtype == dtype, name
        got = torch.autograd.grad((out.float() * grad.float()).sum(), [q, k, v, *alpha])
        exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
        reference = materialised(module, setup, *exact, masks()["causal"] if module.is_causal else mask, 0.4)
        expected = torch.autograd.grad((reference * grad.float()).sum(), [*exact, *alpha])
        torch.testing.assert_close(out, reference.to(dtype), **TOLERANCE[dtype], msg=name)
        for a, b, leaf in zip(got, expected, ["q", "k", "v", "alpha"]):
            assert a.dtype == (dtype if leaf != "alpha" else torch.float32)
            torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2, msg=f"{name}: d{leaf}")
        if name == "causal+padding":
            assert (out[1, :3] == 0).all()  # queries that see nothing: zeros, never NaN
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("dtype", HALF)
def test_half_weights_are_zero_exactly_where_float32_s_are(dtype, setup, monkeypatch):
    """With ``V`` the identity the output is the weights themselves: in half precision, zero exactly where the
    float32 computation's are, rounded (these rows have no near-ties: the support is the same; float16 rounds
    weights below its smallest subnormal, 6e-8, to 0, as it would any float32 result)."""
    small_blocks(monkeypatch, 200)
    n = 16
    g = torch.Generator().manual_seed(11)
    q, k = torch.randn(B, H, n, n, generator=g).mul(2).to(dtype), torch.randn(B, H_KV, n, n, generator=g).to(dtype)
    v = torch.eye(n, dtype=dtype).expand(B, H_KV, n, n)
    for name, mask in masks(n).items():
        if name == "per head":
            continue  # masks() builds it for L queries
        module, attn = module_for(setup)
        module.is_causal = name == "is_causal"
        with torch.no_grad():
            out, _ = sparse_attention_forward(module, q, k, v, half_mask(mask, dtype), scaling=0.5, mapping=attn)
            reference = materialised(module, setup, q.float(), k.float(), v.float(),
                                     masks(n)["causal"] if module.is_causal else mask, 0.5)
        assert ((out == 0) == (reference.to(dtype) == 0)).all(), name  # float16 underflows a few tiny weights
        assert (reference > 0).float().mean() < 0.6, name  # sparse: the test has zeros to compare
        torch.testing.assert_close(out, reference.to(dtype), **TOLERANCE[dtype], msg=name)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("setup", list(SETUPS))
def test_half_decoding_steps_are_the_float32_computation_rounded(setup, dtype, compiled_decoding, decoding_calls):
    q, k, v = (t.to(dtype) for t in decode_inputs(2))
    for name, mask in decode_masks(2).items():
        module, attn = module_for(setup)
        module.eval()
        decoding_calls.clear()
        with torch.no_grad():
            out, _ = sparse_attention_forward(module, q, k, v, half_mask(mask, dtype), scaling=0.4, mapping=attn)
        reference = materialised(module, setup, q.float(), k.float(), v.float(), mask, 0.4)
        assert decoding_calls == [1] and out.dtype == dtype, name
        torch.testing.assert_close(out, reference.to(dtype), **TOLERANCE[dtype], msg=name)
        if name == "a query that sees nothing":
            assert (out[2, 0] == 0).all()


class Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """The storage and element count of each tensor cast to another dtype while active."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.sizes.append((args[0].data_ptr(), args[0].numel()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("setup", ["sparsemax", "learned"])
def test_a_half_decoding_step_casts_only_the_value_rows_it_weighs(setup, dtype, decoding_calls):
    """The cache stays half: no float32 copy of the whole value cache per step, only of the rows with weight
    (sharp scores: a few keys a head), and the output is still the float32 computation rounded."""
    q, k, v = (t.to(dtype) for t in decode_inputs(1))
    mask = decode_masks(1)["left padding"]
    module, attn = module_for(setup)
    module.eval()
    with torch.no_grad(), Casts() as casts:
        out, _ = sparse_attention_forward(module, q, k, v, half_mask(mask, dtype), scaling=3.0, mapping=attn)
    reference = materialised(module, setup, q.float(), k.float(), v.float(), mask, 3.0)
    assert decoding_calls == [1] and casts.sizes and (v.data_ptr(), v.numel()) not in casts.sizes
    torch.testing.assert_close(out, reference.to(dtype), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", HALF)
def test_a_half_no_grad_prefill_equals_the_recorded_forward(dtype, monkeypatch):
    small_blocks(monkeypatch, 100)
    module, attn = module_for("entmax15")
    module.is_causal = True
    q, k, v = (t.detach().to(dtype) for t in inputs(length=30))
    recorded, _ = sparse_attention_forward(module, q.requires_grad_(), k, v, None, scaling=0.4, mapping=attn)
    with torch.no_grad():
        plain, _ = sparse_attention_forward(module, q, k, v, None, scaling=0.4, mapping=attn)
    torch.testing.assert_close(plain, recorded.detach(), rtol=0, atol=0)


def test_the_backward_of_a_half_call_keeps_the_half_inputs_not_float32_copies(monkeypatch):
    small_blocks(monkeypatch, 100)
    module, attn = module_for("sparsemax")
    q, k, v = (t.detach().to(torch.bfloat16).requires_grad_() for t in inputs())
    out, _ = sparse_attention_forward(module, q, k, v, None, scaling=0.4, mapping=attn)
    from test_attention_blocks import threshold_node

    node = threshold_node(out)
    assert all(t is None or t.dtype != torch.float32 for t in node.saved_tensors[:4])
    assert all(tau is None or tau.dtype == torch.float32 for tau in node.states)  # the threshold in float32


@pytest.mark.parametrize("dtype", HALF)
def test_a_half_model_generates_on_the_threshold_path(dtype, materialised_calls, monkeypatch):
    """A tiny Llama in half precision (grouped heads, a left-padded batch): prefill and a cached step take the
    threshold or decoding path (never the materialised one), and its logits follow the float32 model's."""
    blocked = []
    for name in ("threshold_attention", "decode_attention"):
        original = getattr(interface, name)
        monkeypatch.setattr(interface, name, lambda *a, _f=original, **kw: blocked.append(1) or _f(*a, **kw))
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = hs.patch_model(LlamaForCausalLM(config).eval(), attn="sparsemax")
    reference = hs.patch_model(LlamaForCausalLM(config).eval(), attn="sparsemax")
    reference.load_state_dict(model.state_dict())
    model.to(dtype)
    reference.load_state_dict({n: t.to(dtype).float() for n, t in model.state_dict().items()})
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=config))
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        step = model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], -1),
                     past_key_values=out.past_key_values)
        served = len(blocked)
        full = reference(input_ids=ids, attention_mask=mask).logits
    assert not materialised_calls and served == 2 * config.num_hidden_layers
    assert out.logits.dtype == step.logits.dtype == dtype
    real = mask.bool()
    torch.testing.assert_close(out.logits.float()[real], full[real], rtol=0.05, atol=0.05)
