"""Attention transfer (hs.transfer_attention): each layer fitted to the softmax parent's attention outputs, heads
kept wide (hybrid attention), and logit distillation (SelfDistillation's logit_weight)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import hf_sparsemax as hs
from hf_sparsemax.attention import LearnedAlpha
from hf_sparsemax.attention.interface import attention_modules
from hf_sparsemax.conversion.transfer import check_budget, choose_wide

HEADS, KV = 4, 2


def tiny_llama(seed=0, layers=2):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper scores than a random init's, so that entmax keeps few keys
        for module in attention_modules(model):
            module.q_proj.weight.mul_(4.0)
    return model


def batch(seed=1, size=2, length=48):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (size, length), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def head_inputs(model, inputs):
    """Each attention layer's output before its output projection ``[B, T, H * D]`` (o_proj's input)."""
    outs = []
    hooks = [m.o_proj.register_forward_pre_hook(lambda mod, args: outs.append(args[0].detach()))
             for m in attention_modules(model)]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return outs


def teacher_forced_errors(model, parent, inputs):
    """Per layer: ``sum ||sparse - softmax||^2 / sum ||softmax||^2`` of the heads' outputs, each layer of the sparse
    model fed the parent's hidden states (the transfer's objective, computed independently: hooks on the layers)."""
    errors = []
    for index, (student, teacher) in enumerate(zip(attention_modules(model), attention_modules(parent))):
        captured = {}

        def keep_input(mod, args, kwargs):
            captured["args"], captured["kwargs"] = args, kwargs

        hook = teacher.register_forward_pre_hook(keep_input, with_kwargs=True)
        reference = head_inputs(parent, inputs)[index]
        hook.remove()
        seen = []
        pre = student.o_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
        with torch.no_grad():
            student(*captured["args"], **captured["kwargs"])
        pre.remove()
        errors.append(float(((seen[0] - reference) ** 2).sum() / (reference ** 2).sum()))
    return errors


def test_transfer_fits_each_layer_and_reports_the_objective_it_lowers():
    parent = tiny_llama()
    model = hs.patch_model(copy.deepcopy(parent), attn="entmax_bisect",
                           attn_options={"alpha": 1.5, "learn_alpha": True, "temperature": True})
    inputs = batch()
    before = teacher_forced_errors(model, parent, inputs)
    report = hs.transfer_attention(model, [inputs], steps=30, learning_rate=0.05, rows_per_batch=10_000)
    after = teacher_forced_errors(model, parent, inputs)
    assert len(report["layers"]) == 2 and report["dense_heads"] == [] and report["block_lengths"] == [48]
    for layer, b, a in zip(report["layers"], before, after):
        assert layer["error_before"] == pytest.approx(b, rel=1e-3)  # every row read: the same objective
        assert layer["error_after"] == pytest.approx(a, rel=1e-3)
        assert layer["error_after"] <= layer["error_calibrated"] <= layer["error_before"]
    assert report["error_after"] < report["error_calibrated"]  # the alphas' gradient buys more than the grid
    alphas = [a for layer in report["layers"] for a in layer["alphas"]]
    assert len(set(alphas)) > 1 and all(1 < a < 2 for a in alphas)
    saved = model.config.hf_sparsemax["attn_options"]["temperature"]
    assert saved == [layer["temperatures"] for layer in report["layers"]]


def test_transfer_with_fixed_alpha_fits_temperatures_and_never_raises_the_error():
    parent = tiny_llama(seed=2)
    model = hs.patch_model(copy.deepcopy(parent), attn="entmax15", attn_options={"temperature": True})
    report = hs.transfer_attention(model, [batch(seed=3)], steps=10, rows_per_batch=16)
    for layer in report["layers"]:
        assert layer["error_after"] <= layer["error_calibrated"] <= layer["error_before"]
        assert layer["alphas"] is None and len(layer["temperatures"]) == HEADS


def test_wide_heads_get_the_dense_alpha_and_the_largest_error_shares():
    parent = tiny_llama(seed=4, layers=3)
    model = hs.patch_model(copy.deepcopy(parent), attn="entmax_bisect",
                           attn_options={"alpha": 1.5, "learn_alpha": True, "temperature": True})
    report = hs.transfer_attention(model, [batch(seed=5)], steps=5, dense_heads=2)
    assert len(report["dense_heads"]) == 2
    learned = [m for m in model.modules() if isinstance(m, LearnedAlpha)]
    for layer, head in report["dense_heads"]:
        assert float(learned[layer]().detach().flatten()[head]) == pytest.approx(1.2, abs=1e-6)
        assert report["layers"][layer]["alphas"][head] == pytest.approx(1.2, abs=1e-6)
    others = [a for i, l in enumerate(report["layers"]) for h, a in enumerate(l["alphas"])
              if [i, h] not in report["dense_heads"]]
    assert all(a >= 1.125 - 1e-6 for a in others)  # the default bound: the lowest alpha the float32 kernels serve


def test_wide_heads_by_group_take_whole_key_value_groups():
    shares = [torch.tensor([0.1, 0.5, 0.0, 0.05]), torch.tensor([0.35, 0.3, 0.2, 0.0])]
    assert choose_wide(shares, 2, [2, 2], by_group=False) == [(0, 1), (1, 0)]  # the two largest heads
    assert choose_wide(shares, 2, [2, 2], by_group=True) == [(1, 0), (1, 1)]  # group sums 0.65 > 0.6 > 0.2
    assert choose_wide(shares, 3, [2, 2], by_group=True) == [(1, 0), (1, 1)]  # a third head splits no group
    assert choose_wide(shares, 4, [2, 2], by_group=True) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("bad", [-1, 1.0, 1.5, 9, True, "0.1", float("nan")])
def test_a_dense_head_budget_outside_its_range_is_refused(bad):
    with pytest.raises(ValueError, match="dense_heads"):
        check_budget(bad, 8)
    assert check_budget(0.25, 8) == 2 and check_budget(3, 8) == 3 and check_budget(0, 8) == 0


def test_bad_transfer_calls_are_refused():
    parent = tiny_llama()
    with pytest.raises(ValueError, match="temperatures"):
        hs.transfer_attention(copy.deepcopy(parent), [batch()])  # not patched
    fixed = hs.patch_model(copy.deepcopy(parent), attn="entmax15", attn_options={"temperature": True})
    with pytest.raises(ValueError, match="learn_alpha"):
        hs.transfer_attention(fixed, [batch()], dense_heads=1)  # a wide head needs an alpha per head
    for kwargs, word in (({"steps": -1}, "steps"), ({"rows_per_batch": 0}, "rows_per_batch"),
                         ({"learning_rate": 0}, "learning_rate"), ({"dense_alpha": 1.0}, "dense_alpha"),
                         ({"dense_alpha": 2.0}, "dense_alpha")):
        with pytest.raises(ValueError, match=word):
            hs.transfer_attention(fixed, [batch()], **kwargs)
    with pytest.raises(ValueError, match="no batches"):
        hs.transfer_attention(fixed, [])


# -- logit distillation


def peft_model(base):
    torch.manual_seed(7)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return hs.patch_model(get_peft_model(base, config), attn="entmax15").train()


def test_the_logit_term_is_the_kl_from_the_parent_and_trains_the_adapter():
    base = tiny_llama()
    model, inputs = peft_model(copy.deepcopy(base)), batch(length=12)
    with torch.no_grad():  # an adapter that has learned something: the student's logits differ from the parent's
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    inputs["attention_mask"][1, :3] = 0  # padding counts nothing
    distill = hs.SelfDistillation(weight=0.0, logit_weight=2.0, logit_temperature=2.0)
    with distill.student(model) as outputs:
        student = model(**inputs).logits
    term = distill.term(model, inputs, outputs, student)
    with torch.no_grad():
        parent = copy.deepcopy(base)(**inputs).logits  # the untouched softmax model is the teacher
    per_token = F.kl_div(torch.log_softmax(student.double() / 2, -1), torch.log_softmax(parent.double() / 2, -1),
                         log_target=True, reduction="none").sum(-1)
    mask = inputs["attention_mask"].double()
    expected = 2.0 * 4.0 * (per_token * mask).sum() / mask.sum()
    assert term.item() == pytest.approx(expected.item(), rel=1e-4) and term.item() > 0
    term.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_" in n)


def test_the_logit_term_adds_to_the_layer_term():
    model, inputs = peft_model(tiny_llama()), batch(length=12)
    both = hs.SelfDistillation(weight=1.0, logit_weight=0.5)
    layer = hs.SelfDistillation(weight=1.0)
    logit = hs.SelfDistillation(weight=0.0, logit_weight=0.5)
    with both.student(model) as outputs:
        student = model(**inputs).logits
    total = both.term(model, inputs, outputs, student).item()
    parts = layer.term(model, inputs, outputs).item() + logit.term(model, inputs, outputs, student).item()
    assert total == pytest.approx(parts, rel=1e-5)


def test_logit_distillation_without_logits_or_weights_is_refused():
    model, inputs = peft_model(tiny_llama()), batch(length=12)
    distill = hs.SelfDistillation(logit_weight=1.0)
    with distill.student(model) as outputs:
        model(**inputs)
    with pytest.raises(ValueError, match="logits"):
        distill.term(model, inputs, outputs)  # the student's logits not passed
    for kwargs in ({"weight": 0.0}, {"weight": 0.0, "logit_weight": 0.0}):
        with pytest.raises(ValueError, match="both 0"):
            hs.SelfDistillation(**kwargs)
    for kwargs in ({"logit_weight": -1.0}, {"logit_temperature": 0.0}, {"logit_temperature": float("inf")}):
        with pytest.raises(ValueError):
            hs.SelfDistillation(**kwargs)


def test_the_alpha_schedule_refuses_alphas_fitted_per_head_instead_of_discarding_them():
    from types import SimpleNamespace

    model = hs.patch_model(tiny_llama(), attn="entmax_bisect",
                           attn_options={"alpha": 1.5, "learn_alpha": True, "temperature": True})
    callback = hs.AlphaScheduleCallback(share=0.5, start=1.01)
    callback.on_train_begin(None, SimpleNamespace(global_step=0, max_steps=4), None, model=model)  # fresh: fine
    fresh = hs.patch_model(tiny_llama(), attn="entmax_bisect",
                           attn_options={"alpha": 1.5, "learn_alpha": True, "temperature": True})
    hs.transfer_attention(fresh, [batch()], steps=0, dense_heads=1)
    with pytest.raises(ValueError, match="without the alpha schedule"):
        hs.AlphaScheduleCallback().on_train_begin(None, SimpleNamespace(global_step=0, max_steps=4), None,
                                                  model=fresh)


def test_min_alpha_bounds_the_fitted_alphas_and_at_the_target_leaves_them_there():
    parent = tiny_llama(seed=6)
    options = {"alpha": 1.5, "learn_alpha": True, "temperature": True}
    free = hs.transfer_attention(hs.patch_model(copy.deepcopy(parent), attn="entmax_bisect", attn_options=options),
                                 [batch(seed=7)], steps=20, min_alpha=None)
    bounded = hs.transfer_attention(hs.patch_model(copy.deepcopy(parent), attn="entmax_bisect",
                                                   attn_options=options), [batch(seed=7)], steps=20, min_alpha=1.4)
    at_target = hs.transfer_attention(hs.patch_model(copy.deepcopy(parent), attn="entmax_bisect",
                                                     attn_options=options), [batch(seed=7)], steps=20, min_alpha=1.5)
    alphas = lambda report: [a for layer in report["layers"] for a in layer["alphas"]]  # noqa: E731
    assert min(alphas(free)) < 1.4  # the free fit goes below the bound
    assert min(alphas(bounded)) >= 1.4 - 1e-5
    assert min(alphas(at_target)) == pytest.approx(1.5, abs=1e-5)
    assert free["error_after"] <= bounded["error_after"] + 1e-6
    with pytest.raises(ValueError, match="min_alpha"):
        hs.transfer_attention(copy.deepcopy(parent), [batch()], min_alpha=1.0)
