"""The fused head loss on every model family: equal to the unfused loss (value and gradients) or refused.

Families whose causal-LM head scales or caps its logits (Granite, Cohere,
Falcon-H1, Gemma 2/3) are built with non-trivial values of those settings, so
a fused path that ignored them would differ.
"""

import pytest
import torch
import transformers

import hf_sparsemax as hs
from hf_sparsemax.losses.fused_heads import HEAD_TRANSFORMS

from families import DECODER, FAMILIES, NEWLY_ROUTED

EXTRA = {  # causal-LM families with head transforms that the attention sweep does not build
    "cohere": ("CohereForCausalLM", dict(DECODER, logit_scale=0.3), "causal"),
    "cohere2": ("Cohere2ForCausalLM", dict(DECODER, logit_scale=0.3, sliding_window=4), "causal"),
    "falcon_h1": ("FalconH1ForCausalLM", dict(DECODER, lm_head_multiplier=0.7, mamba_d_ssm=32, mamba_n_heads=4,
                                              mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8,
                                              mamba_d_conv=2), "causal"),
    "granitemoe": ("GraniteMoeForCausalLM", dict(DECODER, num_local_experts=4, num_experts_per_tok=2,
                                                 logits_scaling=3.0), "causal"),
}
HEAD_SETTINGS = {  # non-default head transforms for sweep families (their tiny configs keep the defaults)
    "granite": {"logits_scaling": 3.0},
    "gemma2": {"final_logit_softcapping": 2.0},
    "gemma3_text": {"final_logit_softcapping": 2.0},
}
ALL = {**NEWLY_ROUTED, **FAMILIES, **EXTRA}  # the fused head needs no attention interface: GPT-J on any release
LOSSES = [("sparsemax", {}), ("sparse_softmax", {"top_k": 5})]


def build(family, **changes):
    class_name, kwargs, _ = ALL[family]
    model_class = getattr(transformers, class_name)
    config = model_class.config_class(**{**kwargs, **HEAD_SETTINGS.get(family, {}), **changes})
    torch.manual_seed(0)
    return model_class._from_config(config, attn_implementation="eager").train()


def inputs(family, length=10):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, length), generator=generator)
    labels = ids.clone()
    labels[0, :3] = -100
    batch = {"input_ids": ids, "labels": labels}
    if ALL[family][2] == "seq2seq":
        batch["decoder_input_ids"] = torch.randint(3, 128, (2, 6), generator=generator)
        batch["labels"] = batch["decoder_input_ids"].clone()
    return batch


def loss_and_grads(model, batch):
    model.zero_grad()
    torch.manual_seed(2)  # the same dropout / router noise on both paths
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("family", sorted(ALL))
@pytest.mark.parametrize("loss,options", LOSSES, ids=[name for name, _ in LOSSES])
def test_fused_equals_unfused_or_is_refused(family, loss, options):
    model = build(family)
    batch = inputs(family)
    if family not in HEAD_TRANSFORMS:
        with pytest.raises(ValueError, match="fused|compute_loss_func"):
            hs.patch_model(model, loss=loss, loss_options={**options, "fused": True})
        assert not hasattr(model.config, "hf_sparsemax") and "forward" not in vars(model)  # nothing half-patched
        return
    hs.patch_model(model, loss=loss, loss_options=options)
    plain, plain_grads = loss_and_grads(model, batch)
    hs.patch_model(model, loss=loss, loss_options={**options, "fused": True})
    fused, fused_grads = loss_and_grads(model, batch)
    assert fused.logits is None and plain.logits is not None
    assert torch.allclose(fused.loss, plain.loss, rtol=1e-5, atol=0), (fused.loss.item(), plain.loss.item())
    head = next(n for n, p in model.named_parameters() if p is model.get_output_embeddings().weight)
    assert set(fused_grads) == set(plain_grads) and head in fused_grads
    scale = max(grad.abs().max() for grad in plain_grads.values())
    for name, grad in plain_grads.items():  # (some gradients are zero up to rounding, e.g. OPT's key bias)
        assert (fused_grads[name] - grad).abs().max() <= 1e-4 * grad.abs().max() + 1e-6 * scale, name


def test_every_table_entry_is_tested_and_every_sweep_decoder_is_fusable():
    assert set(HEAD_TRANSFORMS) <= set(ALL)
    causal = {f for f, (_, _, kind) in FAMILIES.items() if kind == "causal"}
    assert causal - set(HEAD_TRANSFORMS) == {"gpt2"}  # GPT2LMHeadModel has no loss_type: patch_model refuses it
    assert {"granite", "cohere", "falcon_h1", "gemma2"} <= set(HEAD_TRANSFORMS)


def test_the_head_transform_matters_on_these_tiny_models():
    """Ignoring the scale or cap gives another loss: the equality tests above would catch a fused path that does."""
    for family in ("granite", "cohere", "falcon_h1", "gemma2", "granitemoe"):
        model = build(family)
        hs.patch_model(model, loss="sparsemax")
        batch = inputs(family)
        with torch.no_grad():
            torch.manual_seed(2)
            out = model(**batch, output_hidden_states=True)
            raw = model.get_output_embeddings()(out.hidden_states[-1])
        assert not torch.allclose(raw, out.logits, rtol=1e-3), family


def test_settings_read_at_call_time_and_bad_values_refused():
    model = build("granite")
    batch = inputs("granite")
    hs.patch_model(model, loss="entmax15", loss_options={"fused": True})
    model.config.logits_scaling = 5.0  # changed after patching: the fused loss follows
    fused = model(**batch).loss
    hs.patch_model(model, loss="entmax15")
    assert torch.allclose(fused, model(**batch).loss, rtol=1e-5)
    for value in (0.0, -1.0, float("nan")):
        model.config.logits_scaling = value
        with pytest.raises(ValueError, match="logits_scaling"):
            hs.patch_model(model, loss="entmax15", loss_options={"fused": True})
    model = build("cohere")
    model.logit_scale = torch.nn.Parameter(torch.tensor(0.3))  # a learned scale: its gradient is not fused
    with pytest.raises(ValueError, match="logit_scale"):
        hs.patch_model(model, loss="entmax15", loss_options={"fused": True})


def test_router_aux_loss_is_refused_not_dropped():
    with pytest.raises(ValueError, match="output_router_logits"):
        hs.patch_model(build("mixtral", output_router_logits=True), loss="sparsemax", loss_options={"fused": True})
    model = hs.patch_model(build("qwen3_moe"), loss="sparsemax", loss_options={"fused": True})
    batch = inputs("qwen3_moe")
    assert model(**batch).logits is None
    with pytest.raises(ValueError, match="output_router_logits"):
        model(**batch, output_router_logits=True)


def test_own_forward_or_unknown_family_is_refused():
    class CustomForCausalLM(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
            logits = self.lm_head(self.model(input_ids=input_ids, **kwargs).last_hidden_state) * 2
            loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
            return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)

    model = CustomForCausalLM(build("llama").config).train()
    with pytest.raises(ValueError, match="own forward"):
        hs.patch_model(model, loss="sparsemax", loss_options={"fused": True})
    assert not hasattr(model.config, "hf_sparsemax")

    class SubclassForCausalLM(transformers.LlamaForCausalLM):  # the same forward: accepted
        pass

    hs.patch_model(SubclassForCausalLM(build("llama").config).train(), loss="sparsemax", loss_options={"fused": True})


# ---------------------------------------------------------------- the kernel itself

def test_logit_scale_equals_scaled_logits_in_float64():
    g = torch.Generator().manual_seed(0)
    h, w, b = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((20, 8), (50, 8), (50,)))
    t = torch.randint(0, 50, (20,), generator=g)
    for softcap in (None, 1.5):
        tensors = [x.clone().requires_grad_() for x in (h, w, b)]
        fused = hs.fused_head_loss(*tensors[:2], t, "entmax15", bias=tensors[2], softcap=softcap, logit_scale=0.37,
                                   chunk_size=7)
        fused_grads = torch.autograd.grad(fused, tensors)
        tensors = [x.clone().requires_grad_() for x in (h, w, b)]
        z = 0.37 * (tensors[0] @ tensors[1].T + tensors[2])
        z = z if softcap is None else softcap * torch.tanh(z / softcap)
        plain = hs.entmax15_loss(z, t)
        plain_grads = torch.autograd.grad(plain, tensors)
        assert relative_error(fused, plain) <= 1e-12
        assert all(relative_error(a, c) <= 1e-10 for a, c in zip(fused_grads, plain_grads))
    for bad in (0.0, -2.0, float("inf"), True):
        with pytest.raises(ValueError, match="logit_scale"):
            hs.fused_head_loss(h, w, t, "sparsemax", logit_scale=bad)


def test_bias_gradient_keeps_the_bias_dtype_precision():
    """bf16 weight, float32 bias (autocast): the bias gradient is the float32 sum, not rounded to bf16."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 16, generator=g)
    w = torch.randn(40, 16, generator=g).bfloat16().requires_grad_()
    b = torch.randn(40, generator=g).requires_grad_()
    t = torch.randint(0, 40, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = hs.fused_head_loss(h, w, t, "sparsemax", bias=b, reduction="sum")
    loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.addmm(b, h, w.T)  # the forward's logits, exactly
    p = hs.sparsemax(logits.detach().float())
    expected = (p - torch.nn.functional.one_hot(t, 40)).sum(0)
    assert b.grad.dtype == torch.float32 and w.grad.dtype == torch.bfloat16
    assert relative_error(b.grad, expected) <= 1e-6
