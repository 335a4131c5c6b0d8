"""Sparse attention through transformers' attention interface, swept over tiny random models of 25 families."""

import pytest
import torch
import transformers
from transformers import AttentionInterface, GPTJConfig, GPTJForCausalLM, FalconConfig, FalconForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_sparsemax as hs
from hf_sparsemax.attention import interface as attention
from hf_sparsemax.attention.interface import ATTENTION_MAPPINGS, mask_function as attention_mask, sparse_attention_forward

from families import FAMILIES, NEWLY_ROUTED, batch, tiny_model

SPARSE = [("sparsemax", {}), ("entmax15", {}), ("entmax_bisect", {"alpha": 1.3}), ("sparse_softmax", {"top_k": 2}),
          ("entmax_bisect", {"alpha": 1.5, "learn_alpha": True})]
CAUSAL = [f for f, (_, _, kind) in FAMILIES.items() if kind == "causal"]
HARD_CODED = ("bloom", "deberta-v2", "xlnet", "longformer")  # softmax written into the modeling file
ATTENTION_OUTPUTS = ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions")


def real_logits(family, output, inputs):
    """Logits at the positions that are real tokens (padded query positions follow no convention)."""
    if FAMILIES[family][2] == "seq2seq":
        return output.logits
    return output.logits[inputs["attention_mask"].bool()]


def attention_maps(output):
    return [a for name in ATTENTION_OUTPUTS for a in (getattr(output, name, None) or ())]


def test_names_are_registered_with_their_mask_function():
    for name in ATTENTION_MAPPINGS:
        assert name in AttentionInterface._global_mapping
        assert name in ALL_MASK_ATTENTION_FUNCTIONS  # without it the model gets no causal / padding mask


def test_family_sweep_covers_at_least_20_families():
    assert len(FAMILIES) >= 20
    supported = hs.supported_families()
    assert all(family in supported for family in FAMILIES), sorted(set(FAMILIES) - set(supported))
    for hard_coded in HARD_CODED:
        assert hard_coded not in supported
    for family in NEWLY_ROUTED:  # on the interface in this release: swept; otherwise refused (below)
        assert (family in FAMILIES) == (family in supported)


@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_through_the_registered_path_equals_eager(family):
    """sparse_softmax without top_k is softmax: the registered path must reproduce eager attention exactly.

    This checks masks (causal, padding, sliding windows), scaling, GQA and each
    family's extras (Gemma-2 softcapping, T5 position bias, GPT-OSS sinks).
    """
    model = tiny_model(family)
    inputs = batch(family)
    with torch.no_grad():
        reference = real_logits(family, model(**inputs), inputs)
        hs.patch_model(model, attn="sparse_softmax")
        assert model.config._attn_implementation == "sparse_softmax"
        patched = real_logits(family, model(**inputs), inputs)
    torch.testing.assert_close(patched, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_sparse_attention_rows_lie_on_the_simplex_with_exact_zeros(family):
    model = tiny_model(family)
    inputs = batch(family)
    causal = FAMILIES[family][2] == "causal"
    for name, options in SPARSE:
        hs.patch_model(model, attn=name, attn_options=options)
        model.zero_grad()
        output = model(**inputs, output_attentions=True)
        maps = attention_maps(output)
        assert maps and all(torch.isfinite(a).all() and (a >= 0).all() for a in maps)
        for a in maps:
            sums = a.sum(-1)
            if family == "gpt_oss":  # the sink column takes part of the mass
                assert (sums <= 1 + 1e-6).all()
            else:
                live = sums > 0
                torch.testing.assert_close(sums[live], torch.ones_like(sums[live]), rtol=0, atol=1e-6)
            if causal:  # fully padded query rows (left padding) give zeros, not NaN
                assert (a[1, :, :3] == 0).all()
                assert (a[0].triu(1) == 0).all()  # and the causal mask holds
        assert sum(int((a == 0).sum()) for a in maps) > 0
        real_logits(family, output, inputs).float().square().mean().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        if options.get("learn_alpha"):
            alphas = [m.hf_sparsemax_alpha for m in model.modules() if "hf_sparsemax_alpha" in m._modules]
            assert alphas and all(a.pre_alpha.grad is not None and a.pre_alpha.grad.abs().sum() > 0 for a in alphas)


@pytest.mark.parametrize("family", FAMILIES)
def test_masks_left_to_the_attention_equal_the_eager_masks(family, monkeypatch):
    """Without padding transformers builds no plain causal mask for these attentions (sdpa's rule): the attention
    masks each block's future itself. Outputs and gradients must be those of transformers' eager masks."""
    inputs = dict(batch(family), attention_mask=torch.ones(2, 10, dtype=torch.long))
    returned = []

    def recorded(*args, **kwargs):
        returned.append(attention_mask(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(attention, "mask_function", recorded)
    for name, options in SPARSE:
        results = []
        for mask_function in (attention.mask_function, eager_mask):
            monkeypatch.setitem(AttentionMaskInterface._global_mapping, name, mask_function)
            model = tiny_model(family)
            hs.patch_model(model, attn=name, attn_options=options)
            output = model(**inputs)
            output.logits.square().mean().backward()
            results.append((output.logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        (logits, grads), (eager_logits, eager_grads) = results
        torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-6, msg=name)
        assert grads.keys() == eager_grads.keys()
        for parameter in grads:
            torch.testing.assert_close(grads[parameter], eager_grads[parameter], rtol=1e-4, atol=1e-6, msg=parameter)
    # (mistral: every layer's window < 10 tokens; falcon builds its mask always, allow_is_causal_skip=False, to add
    # ALiBi to it where its config asks)
    if FAMILIES[family][2] == "causal" and family not in ("mistral", "falcon"):
        assert any(mask is None for mask in returned)  # the causal mask was left to the attention


@pytest.mark.parametrize("family", CAUSAL + ["bart", "t5"])
def test_kv_cache_decoding_equals_the_full_forward(family):
    model = tiny_model(family)
    inputs = batch(family)
    seq2seq = FAMILIES[family][2] == "seq2seq"
    for name, options in SPARSE[:4]:
        hs.patch_model(model, attn=name, attn_options=options)
        with torch.no_grad():
            full = model(**inputs).logits[:, -1]
            if seq2seq:
                decoder_ids = inputs["decoder_input_ids"]
                first = model(**dict(inputs, decoder_input_ids=decoder_ids[:, :-1]), use_cache=True)
                step = model(**dict(inputs, decoder_input_ids=decoder_ids[:, -1:]),
                             past_key_values=first.past_key_values).logits[:, -1]
            else:
                ids, mask = inputs["input_ids"], inputs["attention_mask"]
                first = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
                step = model(input_ids=ids[:, -1:], attention_mask=mask,
                             past_key_values=first.past_key_values).logits[:, -1]
        torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


def test_generate_with_and_without_cache_agree():
    model = tiny_model("llama")
    inputs = batch("llama")
    hs.patch_model(model, attn="entmax15")
    with torch.no_grad():
        cached = model.generate(**inputs, max_new_tokens=8, do_sample=False, use_cache=True)
        uncached = model.generate(**inputs, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_padding_tokens_do_not_leak_into_real_positions():
    """Changing the ids under the padding mask changes nothing: the mask function is in place."""
    model = tiny_model("llama")
    hs.patch_model(model, attn="sparsemax")
    inputs = batch("llama")
    changed = dict(inputs, input_ids=inputs["input_ids"].clone())
    changed["input_ids"][1, :3] = 5
    with torch.no_grad():
        a, b = model(**inputs).logits[1, 3:], model(**changed).logits[1, 3:]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "t5", "gpt_oss", "gemma2"])
def test_chunked_queries_equal_the_materialised_path(family):
    """chunk_size recomputes each block of queries in backward: same output and gradients, bias and sinks included."""
    inputs = batch(family, length=11)
    results = []
    for chunk in (None, 3):
        model = tiny_model(family)
        options = {"alpha": 1.4, "learn_alpha": True} | ({"chunk_size": chunk} if chunk else {})
        hs.patch_model(model, attn="entmax_bisect", attn_options=options)
        output = model(**inputs)
        real_logits(family, output, inputs).square().mean().backward()
        results.append((output.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                 if p.grad is not None}))
    (out_a, grad_a), (out_b, grad_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-6)
    assert grad_a.keys() == grad_b.keys() and any("hf_sparsemax_alpha" in n for n in grad_a)
    for name in grad_a:
        torch.testing.assert_close(grad_b[name], grad_a[name], rtol=1e-4, atol=1e-6, msg=name)


def test_attention_dropout_in_training():
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal = False  # no mask, not causal: every key is seen (sdpa's rule)
    q, k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 4)
    module.train()
    torch.manual_seed(1)
    out, weights = sparse_attention_forward(module, q, k, v, None, scaling=0.5, dropout=0.5, mapping="sparsemax")
    torch.manual_seed(1)
    expected = torch.nn.functional.dropout(hs.sparsemax(q @ k.transpose(-1, -2) * 0.5), 0.5) @ v
    torch.testing.assert_close(out, expected.transpose(1, 2))
    module.eval()
    out, _ = sparse_attention_forward(module, q, k, v, None, scaling=0.5, dropout=0.5, mapping="sparsemax")
    torch.testing.assert_close(out, (weights @ v).transpose(1, 2))


def test_grouped_query_heads_and_boolean_masks():
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    keep = torch.tensor([True, True, False, True, False]).expand(1, 1, 3, 5)
    out, weights = sparse_attention_forward(torch.nn.Module().eval(), q, k, v, keep, mapping="entmax15",
                                            output_attentions=True)
    expanded_k, expanded_v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ expanded_k.transpose(-1, -2) / 8**0.5).masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(weights, hs.entmax15(scores))
    torch.testing.assert_close(out, (weights @ expanded_v).transpose(1, 2))
    assert (weights[..., [2, 4]] == 0).all()
    blocked, none = sparse_attention_forward(torch.nn.Module().eval(), q, k, v, keep, mapping="entmax15")
    assert none is None  # the memory-bounded path holds no weights to return
    torch.testing.assert_close(blocked, out)


def test_arguments_that_change_the_math_are_refused():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="'block_indices'"):  # MiniMax-M3's block selection: not reproduced
        sparse_attention_forward(torch.nn.Module(), q, q, q, None, mapping="sparsemax", block_indices=torch.zeros(3))
    with pytest.raises(ValueError, match="head_mask"):
        sparse_attention_forward(torch.nn.Module(), q, q, q, None, mapping="sparsemax", head_mask=torch.ones(2))
    out, _ = sparse_attention_forward(torch.nn.Module(), q, q, q, None, mapping="sparsemax", is_causal=True,
                                      sliding_window=None, output_attentions=False)
    assert out.shape == (1, 3, 2, 4)


def test_from_pretrained_and_set_attn_implementation(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="entmax15").eval()
    assert loaded.config._attn_implementation == "entmax15"
    inputs = batch("llama")
    output = loaded(**inputs, output_attentions=True)
    assert (output.attentions[0][0].triu(1) == 0).all() and (output.attentions[0] == 0).float().mean() > 0.5
    loaded.set_attn_implementation("sparsemax")
    reference = hs.patch_model(tiny_model("llama"), attn="sparsemax")
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, reference(**inputs).logits)


@pytest.mark.parametrize("attn, options", [("entmax_bisect", {"alpha": 1.3}), ("sparse_softmax", {"top_k": 3}),
                                           ("entmax_bisect", {"alpha": 1.6, "learn_alpha": True})])
def test_settings_and_learned_alpha_survive_save_pretrained(tmp_path, attn, options):
    model = hs.patch_model(tiny_model("llama"), attn=attn, attn_options=options, loss="entmax15")
    if options.get("learn_alpha"):
        with torch.no_grad():
            for module in model.modules():
                if "hf_sparsemax_alpha" in module._modules:
                    module.hf_sparsemax_alpha.pre_alpha.uniform_(-2, 2)
    inputs = batch("llama")
    with torch.no_grad():
        before = real_logits("llama", model(**inputs), inputs)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.hf_sparsemax["attn"] == attn and loaded.config.hf_sparsemax["attn_options"] == options
    hs.patch_model(loaded)
    assert loaded.config._attn_implementation == attn
    with torch.no_grad():
        after = real_logits("llama", loaded(**inputs), inputs)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)


def test_learned_alpha_stays_in_its_range_and_trains():
    model = hs.patch_model(tiny_model("qwen2"), attn="entmax_bisect", attn_options={"alpha": 1.5, "learn_alpha": True})
    alphas = [m.hf_sparsemax_alpha for m in model.modules() if "hf_sparsemax_alpha" in m._modules]
    assert len(alphas) == 2 and all(a.pre_alpha.shape == (4,) for a in alphas)  # one per layer and head
    torch.testing.assert_close(alphas[0]().flatten(), torch.full((4,), 1.5))
    optimizer = torch.optim.SGD(model.parameters(), lr=50.0)
    inputs = batch("qwen2")
    for _ in range(3):
        optimizer.zero_grad()
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        optimizer.step()
    values = torch.cat([a().flatten() for a in alphas])
    assert (values > 1).all() and (values < 2).all() and not torch.allclose(values, torch.full_like(values, 1.5))



def test_learned_alphas_take_their_own_learning_rate_in_trainer(tmp_path):
    """The README's parameter group: the alphas found by name, trained by Trainer at their own rate."""
    from transformers import Trainer, TrainingArguments

    model = hs.patch_model(tiny_model("llama"), attn="entmax_bisect", attn_options={"alpha": 1.05, "learn_alpha": True})
    alphas = [p for n, p in model.named_parameters() if n.endswith("hf_sparsemax_alpha.pre_alpha")]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("hf_sparsemax_alpha.pre_alpha")]
    assert len(alphas) == 2 and len(alphas) + len(rest) == len([p for p in model.parameters() if p.requires_grad])
    optimizer = torch.optim.AdamW([{"params": rest}, {"params": alphas, "lr": 1e-2, "weight_decay": 0.0}], lr=5e-5)
    start = [a.detach().clone() for a in alphas]
    inputs = batch("llama")
    data = [{"input_ids": ids, "labels": ids} for ids in inputs["input_ids"]]
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=2,
                             max_steps=3, save_strategy="no", disable_tqdm=True, lr_scheduler_type="constant")
    Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None)).train()
    moved = torch.cat([(a.detach() - s).abs() for a, s in zip(alphas, start)])
    assert (moved > 5e-3).all() and (moved < 4e-2).all()  # Adam: about lr = 1e-2 a step, 3 steps


def test_unpatch_restores_the_original_attention():
    model = tiny_model("llama", attn_implementation="sdpa")
    inputs = batch("llama")
    with torch.no_grad():
        reference = real_logits("llama", model(**inputs), inputs)
    hs.patch_model(model, attn="entmax_bisect", attn_options={"learn_alpha": True})
    hs.patch_model(model, attn="softmax")
    assert model.config._attn_implementation == "sdpa" and not any("alpha" in n for n, _ in model.named_parameters())
    hs.patch_model(model, attn="sparsemax")
    hs.unpatch_model(model)
    assert model.config._attn_implementation == "sdpa" and not hasattr(model.config, "hf_sparsemax")
    with torch.no_grad():
        torch.testing.assert_close(real_logits("llama", model(**inputs), inputs), reference)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attn": "flash_sparsemax"},
        {"attn": "entmax_bisect", "attn_options": {"alpha": 1.0}},
        {"attn": "entmax_bisect", "attn_options": {"alpha": 2.5}},
        {"attn": "entmax_bisect", "attn_options": {"alpha": 2.0, "learn_alpha": True}},
        {"attn": "entmax_bisect", "attn_options": {"learn_alpha": "yes"}},
        {"attn": "sparse_softmax", "attn_options": {"top_k": 0}},
        {"attn": "sparse_softmax", "attn_options": {"top_k": -3}},
        {"attn": "sparsemax", "attn_options": {"alpha": 1.5}},
        {"attn": "entmax15", "attn_options": {"chunk_size": 0}},
        {"attn": "softmax", "attn_options": {"top_k": 3}},
    ],
)
def test_bad_attention_settings_raise_and_leave_the_model_untouched(kwargs):
    model = hs.patch_model(tiny_model("llama"), attn="entmax15")
    before = dict(model.config.hf_sparsemax)
    with pytest.raises(ValueError):
        hs.patch_model(model, **kwargs)
    assert model.config.hf_sparsemax == before and model.config._attn_implementation == "entmax15"


REFUSED = {  # families that hard-code softmax in their modeling file (GPT-J: up to transformers 5.23, Falcon: 5.24)
    "falcon": lambda: FalconForCausalLM(FalconConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                     vocab_size=64)),
    "gptj": lambda: GPTJForCausalLM(GPTJConfig(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=32,
                                               rotary_dim=4)),
}
@pytest.mark.parametrize("family", [f for f in REFUSED if f not in hs.supported_families()])
def test_families_that_hard_code_softmax_are_refused(family):
    model = REFUSED[family]()
    implementation = model.config._attn_implementation
    with pytest.raises(ValueError, match="supported_families"):
        hs.patch_model(model, attn="sparsemax", loss="sparsemax")
    assert model.config._attn_implementation == implementation and not hasattr(model.config, "hf_sparsemax")


class NamedRequest(torch.nn.Module):
    """An attention module that takes ``output_attentions`` by name and does not pass it on to its attention
    function (Falcon's from transformers 5.25; its decoder layers collect the weights it returns)."""

    def forward(self, query, key, value, output_attentions=False):
        return sparse_attention_forward(self, query, key, value, None, scaling=0.5, mapping="entmax15")


def test_weights_come_back_to_a_module_given_output_attentions_by_name():
    from hf_sparsemax.attention.blocked import pages

    module = NamedRequest()
    pages.install(module)  # patch_model's pre-hook on every attention module
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 6, 8, generator=generator) for _ in range(3))
    out, weights = module(query, key, value, output_attentions=True)
    assert weights is not None and weights.shape == (1, 2, 6, 6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 2, 6))
    expected = torch.matmul(weights, value).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert module(query, key, value)[1] is None  # not asked for: none (the next call forgets the last one's request)
    pages.uninstall(module)
    assert module(query, key, value, output_attentions=True)[1] is None


def test_peft_lora_and_gradient_checkpointing():
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama")
    model.train()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable  # 5.19: the old name
    enable()
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    hs.patch_model(peft_model, attn="entmax_bisect", attn_options={"learn_alpha": True})
    inputs = batch("llama")
    peft_model(**inputs, labels=inputs["input_ids"]).loss.backward()
    trained = [n for n, p in peft_model.named_parameters() if p.grad is not None]
    assert any("lora_" in n for n in trained) and any("hf_sparsemax_alpha" in n for n in trained)
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    hs.unpatch_model(peft_model)
    assert model.config._attn_implementation == "eager"


def test_torch_compile():
    model = hs.patch_model(tiny_model("llama"), attn="entmax15")
    inputs = batch("llama")
    with torch.no_grad():
        expected = model(**inputs).logits
        compiled = torch.compile(model, backend="aot_eager")
        torch.testing.assert_close(compiled(**inputs).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models(dtype):
    """Half-precision scores are mapped in float32; masks at finfo(dtype).min still give exact zeros."""
    model = hs.patch_model(tiny_model("llama").to(dtype), attn="entmax15")
    inputs = batch("llama")
    with torch.no_grad():
        output = model(**inputs, output_attentions=True)
        reference = hs.patch_model(tiny_model("llama"), attn="entmax15")(**inputs).logits
    maps = output.attentions
    assert all(a.dtype == dtype and torch.isfinite(a).all() for a in maps)
    assert all((a[1, :, :3] == 0).all() and (a[0].triu(1) == 0).all() for a in maps)
    live = [a.float().sum(-1)[a.float().sum(-1) > 0] for a in maps]
    assert all(torch.allclose(s, torch.ones_like(s), atol=1e-2) for s in live)
    mask = inputs["attention_mask"].bool()
    torch.testing.assert_close(output.logits.float()[mask], reference[mask], rtol=0.05, atol=0.05)


def test_an_attention_forward_is_found_under_several_decorators():
    """transformers 5.25 wraps attention forwards in ``deprecate_kwarg``, whose ``__wrapped__`` is a wrapper
    again: the check that a module calls the attention interface reads the innermost function."""
    import functools

    def wrapper(function):
        @functools.wraps(function)
        def wrapped(*args, **kwargs):
            return function(*args, **kwargs)
        return wrapped

    class Routed(torch.nn.Module):
        @wrapper
        @wrapper
        def forward(self, x):
            return ALL_ATTENTION_FUNCTIONS["sdpa"](self, x, x, x, None)

    class Plain(torch.nn.Module):
        @wrapper
        @wrapper
        def forward(self, x):
            return torch.softmax(x, -1)

    assert attention.routes_attention(Routed) and not attention.routes_attention(Plain)
