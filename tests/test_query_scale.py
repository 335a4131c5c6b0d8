"""Per-head temperatures, ASEntmax's length scale and calibration (hf_sparsemax.attention.query_scale, .calibration).

Oracles: the plain patched model (temperature 1, identity length scale: bit for bit), queries scaled by hand
(``q / T``, ``q * (delta + beta * log(pos + 2) ** gamma)`` in float64), transformers' own eager softmax attention
for the calibration's errors, central differences in float64 for the gradients; every kernel path against the
others.
"""

import math

import pytest
import torch
import transformers

import hf_sparsemax as hs
from families import batch, tiny_model
from hf_sparsemax.attention.blocked import decode
from hf_sparsemax.attention.cpu import fused as fused_kernel
from hf_sparsemax.attention.interface import OPTIONS_ATTR, AttentionOptions, sparse_attention_forward
from hf_sparsemax.integrations import reload
from hf_sparsemax.attention.query_scale import LENGTH_SCALE_ATTR, TEMPERATURE_ATTR, HeadTemperature, LengthScale

TEMPS = [[0.5, 2.0, 1.25, 3.0], [4.0, 0.75, 1.0, 2.5]]  # tiny llama: 2 layers of 4 query heads


def sharp_llama(seed: int = 0):
    """The tiny llama with queries and keys 4x larger: scores of a few units, as a trained model's (the random
    model's are near 0, where every mapping is close to uniform)."""
    model = tiny_model("llama", seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    return model


def perturb(model, seed: int = 3):
    """Move every learned query scale off its start (beta too, so that gamma has a gradient)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in hs.query_scale_parameters(model):
            p.add_(torch.randn(p.shape, generator=g).to(p) * 0.2)


@pytest.mark.parametrize("options", [{"temperature": True}, {"length_scale": True},
                                     {"learn_temperature": True, "length_scale": True}])
def test_start_values_give_the_plain_patched_model_bit_for_bit(options):
    data = batch("llama", length=12)
    scaled = hs.patch_model(sharp_llama(), attn="entmax15", attn_options=options)
    plain = hs.patch_model(sharp_llama(), attn="entmax15")
    assert torch.equal(scaled(**data).logits, plain(**data).logits)


def attention_module(options):
    module = torch.nn.Module().eval()
    module.is_causal = True
    setattr(module, OPTIONS_ATTR, AttentionOptions.from_settings("entmax15", options))
    return module


def test_a_set_temperature_and_length_scale_are_queries_scaled_by_hand():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8, generator=g) * 2, torch.randn(2, 2, 6, 8, generator=g) * 2, torch.randn(2, 2, 6, 8)
    plain = attention_module({})
    heated = attention_module({"temperature": [TEMPS[0]]})
    heated.add_module(TEMPERATURE_ATTR, HeadTemperature(TEMPS[0]))
    by_hand = q * (1 / torch.tensor(TEMPS[0])).view(1, 4, 1, 1)
    assert torch.equal(sparse_attention_forward(heated, q, k, v, None, mapping="entmax15")[0],
                       sparse_attention_forward(plain, by_hand, k, v, None, mapping="entmax15")[0])
    length = LengthScale(4)
    with torch.no_grad():
        length.delta.copy_(torch.tensor([1.0, 0.5, 2.0, 1.5]))
        length.beta.copy_(torch.tensor([0.0, 0.3, -0.2, 0.1]))
        length.gamma.copy_(torch.tensor([1.0, 2.0, 0.5, 1.5]))
    heated.add_module(LENGTH_SCALE_ATTR, length)
    positions = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 0, 1, 2, 3]])  # left padding: transformers' ids
    scale = (length.delta.double().view(1, 4, 1, 1) + length.beta.double().view(1, 4, 1, 1)
             * torch.log(positions.double() + 2)[:, None, :, None] ** length.gamma.double().view(1, 4, 1, 1))
    by_hand = (q.double() * scale / torch.tensor(TEMPS[0], dtype=torch.float64).view(1, 4, 1, 1)).float()
    out = sparse_attention_forward(heated, q, k, v, None, mapping="entmax15", position_ids=positions)[0]
    torch.testing.assert_close(out, sparse_attention_forward(plain, by_hand, k, v, None, mapping="entmax15")[0],
                               rtol=1e-5, atol=1e-6)


def test_bad_temperatures_are_refused():
    for bad in ([[1.0, 0.0, 1.0, 1.0], [1.0] * 4], [[1.0, -2.0, 1.0, 1.0], [1.0] * 4], [[float("nan")] * 4] * 2,
                [[1.0] * 4], [[1.0] * 3, [1.0] * 4], [1.0, 1.0], "hot", [[True] * 4] * 2, [[]]):
        model = tiny_model("llama")
        with pytest.raises(ValueError, match="temperature"):
            hs.patch_model(model, attn="entmax15", attn_options={"temperature": bad})
        assert "hf_sparsemax" not in model.config.to_dict()  # refused before any change
    for name in ("learn_temperature", "length_scale"):
        with pytest.raises(ValueError, match=name):
            hs.patch_model(tiny_model("llama"), attn="entmax15", attn_options={name: 1})
    with pytest.raises(ValueError, match="calibrate"):
        hs.patch_model(tiny_model("llama"), attn="entmax15", attn_options={"calibrate": []})
    with pytest.raises(ValueError, match="temperature"):
        hs.calibrate_attention(hs.patch_model(tiny_model("llama"), attn="entmax15"), [batch("llama")])
    with pytest.raises(ValueError, match="rounds"):
        hs.calibrate_attention(tiny_model("llama"), [batch("llama")], rounds=-1)


def attention_outputs(model, data):
    """``[layer] -> [B, q, H * D]``: what each attention layer hands its output projection."""
    seen = []
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
             for layer in model.model.layers]
    with torch.no_grad():
        model(**data)
    for hook in hooks:
        hook.remove()
    return seen


def relative_error(out, reference, rows):
    return float(((out - reference).double().square().sum(-1) * rows).sum()
                 / (reference.double().square().sum(-1) * rows).sum())


def test_calibration_lowers_the_output_error_measured_against_eager_softmax():
    data = [batch("llama", length=16, seed=s) for s in (1, 2)]
    softmax = sharp_llama()  # transformers' own eager softmax attention: the independent reference
    model = hs.patch_model(sharp_llama(), attn="entmax15", attn_options={"temperature": True})
    rows = data[0]["attention_mask"].double()
    before = relative_error(attention_outputs(model, data[0])[0], attention_outputs(softmax, data[0])[0], rows)
    report = hs.calibrate_attention(model, data)
    after = relative_error(attention_outputs(model, data[0])[0], attention_outputs(softmax, data[0])[0], rows)
    assert after < 0.5 * before  # layer 0 sees the same inputs in both models: the error the fit lowered
    first = report["layers"][0]
    for layer in report["layers"]:
        assert layer["error_after"] < layer["error_before"]
    assert report["error_after"] < report["error_before"]
    # the report's own error of layer 0 (both batches) against the one measured here (the first batch)
    second = relative_error(attention_outputs(model, data[1])[0], attention_outputs(softmax, data[1])[0],
                            data[1]["attention_mask"].double())
    assert min(after, second) <= first["error_after"] * (1 + 1e-6) + 1e-12 <= max(after, second) * (1 + 1e-5) + 1e-12
    temps = model.config.hf_sparsemax["attn_options"]["temperature"]
    assert temps == [layer["temperatures"] for layer in report["layers"]]
    assert [m.hf_sparsemax_temperature.current() for m in hs.patch.base_model(model).model.layers
            for m in [m.self_attn]] == temps
    assert any(abs(t - 1) > 0.05 for layer in temps for t in layer)


def test_the_fit_reads_some_rows_each_with_its_own_keys_mask_and_position():
    """A record cut to a few query rows gives, row for row, the sparse outputs of the whole record (left padding,
    the causal mask made explicit, a length scale reading each row's position)."""
    from hf_sparsemax.swaps.calibration import record_layers

    model = hs.patch_model(sharp_llama(), attn="entmax15", attn_options={"temperature": TEMPS, "length_scale": True})
    perturb(model)
    modules = [layer.self_attn for layer in model.model.layers]
    padded = batch("llama", length=16)
    data = [padded, {"input_ids": padded["input_ids"]}]  # a padding mask; none (the causal mask left to attention)
    whole = record_layers(model, modules, data, rows_per_batch=10 ** 6)
    some = record_layers(model, modules, data, rows_per_batch=6)
    assert whole[modules[0]][1].mask is None and some[modules[0]][1].mask is not None
    pairs = [(module, full, cut) for module in modules for full, cut in zip(whole[module], some[module])]
    for module, full, cut in pairs:
        assert cut.query.shape[-2] == 3 and full.query.shape[-2] == 16
        index = torch.tensor([0, 8, 15])  # evenly spaced from the last row
        with torch.no_grad():
            out_full = sparse_attention_forward(module, full.query, full.key, full.value, full.mask, mapping="entmax15",
                                                **full.kwargs)[0]
            out_cut = sparse_attention_forward(module, cut.query, cut.key, cut.value, cut.mask, mapping="entmax15",
                                               **cut.kwargs)[0]
        torch.testing.assert_close(out_cut, out_full[:, index], rtol=1e-6, atol=1e-7)
        assert torch.equal(cut.reference, full.reference[:, index]) and torch.equal(cut.rows, full.rows[:, index])


def test_calibrate_is_an_attention_option_and_not_kept_in_the_config():
    data = [batch("llama", length=12)]
    by_option = hs.patch_model(sharp_llama(), attn="entmax15", attn_options={"calibrate": data})
    by_call = hs.patch_model(sharp_llama(), attn="entmax15", attn_options={"temperature": True})
    hs.calibrate_attention(by_call, data)
    saved = by_option.config.hf_sparsemax["attn_options"]
    assert "calibrate" not in saved and saved["temperature"] == by_call.config.hf_sparsemax["attn_options"]["temperature"]
    assert torch.equal(by_option(**data[0]).logits, by_call(**data[0]).logits)


@pytest.mark.parametrize("options", [{"calibrate": True}, {"learn_temperature": True, "length_scale": True,
                                                           "calibrate": True}])
def test_save_and_reload_keep_temperatures_and_scales_bit_for_bit(tmp_path, options):
    data = batch("llama", length=12)
    model = hs.patch_model(sharp_llama(), attn="entmax15", attn_options=dict(options, calibrate=[data]))
    perturb(model)
    expected = model(**data).logits
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded(**data).logits, expected)
    assert torch.equal(hs.patch_model(loaded)(**data).logits, expected)  # re-applied from the config: kept
    reload.remove_load_hook()  # loaded plain, then patched from the folder's config and weights
    try:
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    finally:
        reload.install_load_hook(hs.patch_model)
    assert torch.equal(hs.patch_model(plain)(**data).logits, expected)
    if options.get("learn_temperature"):
        names = {n.rsplit(".", 1)[-1] for n, _ in hs.query_scale_parameters(loaded)}
        assert names == {"log_temperature", "delta", "beta", "gamma"}


class Attention(torch.nn.Module):
    """An attention module of its own (causal, entmax15) with a learned temperature and length scale."""

    is_causal = True

    def __init__(self):
        super().__init__()
        setattr(self, OPTIONS_ATTR, AttentionOptions.from_settings("entmax15", {"learn_temperature": True,
                                                                               "length_scale": True}))
        self.add_module(TEMPERATURE_ATTR, HeadTemperature(TEMPS[0], learn=True))
        self.add_module(LENGTH_SCALE_ATTR, LengthScale(4))

    def forward(self, q, k, v, **kwargs):
        return sparse_attention_forward(self, q, k, v, None, mapping="entmax15", **kwargs)[0]


def test_learned_temperatures_and_length_scales_get_their_gradients():
    """In a model: every learned scale gets a gradient; in one attention call, in float64, autograd's gradients
    equal central differences (``gradcheck``; the model's RMS norms compute in float32 whatever its dtype)."""
    data = batch("llama", length=10)
    model = hs.patch_model(sharp_llama(), attn="entmax15", attn_options={"learn_temperature": True,
                                                                         "length_scale": True}).train()
    perturb(model)
    model(**data, labels=data["input_ids"]).loss.backward()
    named = dict(hs.query_scale_parameters(model))
    assert len(named) == 8 and all(bool(p.grad.abs().gt(0).all()) for p in named.values())
    attention = Attention().double()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 7, 8, generator=g, dtype=torch.float64) * 2 for h in (4, 2, 2))
    start = {name: p.detach().clone() for name, p in attention.named_parameters()}
    start[f"{LENGTH_SCALE_ATTR}.beta"] += torch.tensor([0.3, -0.2, 0.1, 0.4], dtype=torch.float64)
    names = list(start)
    positions = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 5, 6]])
    weights = torch.randn(2, 7, 4, 8, generator=g, dtype=torch.float64)

    def attend(*values):  # one number: one backward for autograd's row of the Jacobian
        params = dict(zip(names, values))
        out = torch.func.functional_call(attention, params, (q, k, v), {"position_ids": positions})
        return (out * weights).sum()

    inputs = tuple(start[n].requires_grad_() for n in names)
    assert torch.autograd.gradcheck(attend, inputs, eps=1e-6, atol=1e-6)


def test_decoding_with_a_cache_scales_each_query_at_its_own_position():
    model = hs.patch_model(sharp_llama(), attn="entmax15", attn_options={"temperature": TEMPS, "length_scale": True})
    perturb(model)
    data = batch("llama", length=8)
    with torch.no_grad():
        out = model.generate(**data, max_new_tokens=4, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        mask = torch.cat([data["attention_mask"], torch.ones(2, 4, dtype=torch.long)], dim=1)
        full = model(input_ids=out.sequences, attention_mask=mask,
                     position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, full[:, 7 + step], rtol=1e-4, atol=1e-4)


def test_the_fused_kernel_and_the_general_path_apply_the_scales(monkeypatch):
    """Decoding steps and a short no-grad prefill through the fused CPU kernel equal the general path."""
    served = []
    original = decode.fused_decode
    monkeypatch.setattr(decode, "fused_decode", lambda *a: served.append(original(*a)) or served[-1])
    model = hs.patch_model(sharp_llama(), attn="entmax15", attn_options={"temperature": TEMPS, "length_scale": True})
    perturb(model)
    data = batch("llama", length=6)
    outputs = {}
    for path in ("fused", "general"):
        if path == "general":
            monkeypatch.setenv(fused_kernel.ENVIRONMENT, "0")
        with torch.no_grad():
            outputs[path] = model.generate(**data, max_new_tokens=3, do_sample=False, output_logits=True,
                                           return_dict_in_generate=True)
        if path == "fused":
            assert any(result is not None for result in served)
    assert torch.equal(outputs["fused"].sequences, outputs["general"].sequences)
    for fused, general in zip(outputs["fused"].logits, outputs["general"].logits):
        torch.testing.assert_close(fused, general, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the materialised path (weights asked for) too
        positions = (data["attention_mask"].cumsum(-1) - 1).clamp_min(0)  # as generate computes them
        weights = model(**data, position_ids=positions, output_attentions=True).logits
        torch.testing.assert_close(weights[:, -1], outputs["general"].logits[0], rtol=1e-5, atol=1e-5)


def test_unpatch_and_repatch_drop_the_scales():
    model = hs.patch_model(sharp_llama(), attn="entmax15", attn_options={"learn_temperature": True,
                                                                         "length_scale": True})
    assert len(hs.query_scale_parameters(model)) == 8
    hs.patch_model(model, attn="sparsemax")
    assert hs.query_scale_parameters(model) == []
    hs.patch_model(model, attn="entmax15", attn_options={"temperature": TEMPS})
    assert model.model.layers[1].self_attn.hf_sparsemax_temperature.current() == TEMPS[1]
    hs.unpatch_model(model)
    assert not any(TEMPERATURE_ATTR in m._modules or LENGTH_SCALE_ATTR in m._modules for m in model.modules())


def test_peft_keeps_learned_temperatures_and_length_scales_with_its_adapter(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    data = batch("llama", length=12)
    options = {"learn_temperature": True, "length_scale": True}
    base = hs.patch_model(sharp_llama(), attn="entmax15", attn_options=options)
    base.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    hs.patch_model(peft_model, attn="entmax15", attn_options=dict(options, calibrate=[data]))
    perturb(peft_model)
    trained = dict(hs.query_scale_parameters(peft_model))
    assert len(trained) == 8 and all("modules_to_save" in name for name in trained)
    with torch.no_grad():  # the same path (no autograd) in both
        expected = peft_model.eval()(**data).logits
        peft_model.save_pretrained(tmp_path / "adapter")
        loaded = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                           tmp_path / "adapter").eval()
        assert torch.equal(loaded(**data).logits, expected)
        assert torch.equal(hs.patch_model(loaded)(**data).logits, expected)
    hs.unpatch_model(peft_model)
    assert not set(peft_model.peft_config["default"].modules_to_save or []) & {TEMPERATURE_ATTR, LENGTH_SCALE_ATTR}
