"""The swap points of patch_model: one protocol (plan / apply / remove), plans before changes, exact round trips."""

import inspect

import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

import hf_sparsemax as hs
from hf_sparsemax import swaps
from hf_sparsemax.integrations import trainer as trainer_guard
from hf_sparsemax.integrations import trl as trl_support
from hf_sparsemax.attention.interface import ALPHA_ATTR
from hf_sparsemax.settings import SparseSettings
from hf_sparsemax.patch import SWAPS
from hf_sparsemax.swaps import PatchRequest, Swap

VOCAB = 64


def llama(head=LlamaForCausalLM, vocab=VOCAB, seed=0, **overrides):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         **overrides)
    return head(config).eval()


def llama_classifier():
    return llama(LlamaForSequenceClassification, num_labels=3)


def bert_classifier():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config).eval()


def inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, 8), generator=g)
    if model.loss_type == "ForSequenceClassification":
        return {"input_ids": ids, "labels": torch.tensor([0, 2, 1])}
    labels = ids.clone()
    labels[0, :3] = -100
    return {"input_ids": ids, "labels": labels}


def outputs(model):
    """Loss and logits in eval and in training mode (no dropout in these configs), and a greedy generation."""
    results = []
    for training in (False, True):
        model.train(training)
        with torch.no_grad():
            out = model(**inputs(model))
        results += [out.loss, out.logits]
    model.eval()
    if model.loss_type == "ForCausalLM":
        results.append(model.generate(inputs(model)["input_ids"][:1, :4], max_new_tokens=3, do_sample=False,
                                      pad_token_id=0))
    return results


def same_outputs(a, b):
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                                    for x, y in zip(a, b))


def describe(value):
    """A comparable stand-in for an instance attribute: a function by its name, a plain value as is."""
    function = getattr(value, "__func__", value)
    if callable(function) and hasattr(function, "__qualname__"):
        return "function", function.__module__, function.__qualname__
    if value is None or isinstance(value, (str, int, float, bool, list, tuple)):
        return value
    return type(value).__name__


def fingerprint(model):
    """Everything a swap could change: weights (values and objects), config, instance attributes, hooks, tags."""
    generation = getattr(model, "generation_config", None)
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "params": [(name, id(p)) for name, p in model.named_parameters()],
        "config": model.config.to_dict(),
        "attn": model.config._attn_implementation,
        "modules": {name: ({k: describe(v) for k, v in vars(m).items() if not isinstance(v, dict)}, sorted(m._modules),
                           len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()},
        "generation": None if generation is None else (generation.to_dict(), sorted(vars(generation))),
        "tags": model.model_tags,
    }


def same_fingerprint(a, b):
    if a.keys() != b.keys() or a["state"].keys() != b["state"].keys():
        return False
    tensors = all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
    rest = {k: v for k, v in a.items() if k != "state"} == {k: v for k, v in b.items() if k != "state"}
    return tensors and rest


# one case per swap point: a model, settings that ask for that swap, and what shows that it is installed
CASES = {
    "attention": (llama, dict(attn="entmax_bisect", attn_options={"alpha": 1.3, "learn_alpha": True}),
                  lambda m: m.config._attn_implementation == "entmax_bisect"),
    "fused_forward": (llama, dict(loss="sparsemax", loss_options={"fused": True}),
                      lambda m: "forward" in vars(m)),
    "cosine_head": (llama_classifier, dict(loss="am_softmax"),
                    lambda m: bool((m(**inputs(m)).logits.abs() <= 1 + 1e-6).all())),
    "loss": (llama, dict(loss="entmax15"),
             lambda m: m.loss_function.__name__ == "causal_lm_loss"),
    "matched_generate": (llama, dict(loss="sparse_softmax", loss_options={"top_k": 5}),
                         lambda m: "generate" in vars(m)),
    "trainer_guard": (llama, dict(attn="sparsemax", loss="entmax15"),
                      lambda m: trainer_guard.HOOK_ATTR in vars(m) and trainer_guard.ROLLOUT_HOOK_ATTR in vars(m)),
    "token_outputs": (llama, dict(loss="sparsemax"), lambda m: trl_support.HOOK_ATTR in vars(m)),
    "model_card": (llama, dict(loss="sparsemax"), lambda m: "save_pretrained" in vars(m)),
}
BY_NAME = {swap.name: swap for swap in SWAPS}
PEFT_ONLY = {"adapter_alpha"}  # acts on a peft model's adapter config: test_a_peft_model_with_learned_alphas_round_trips


def test_every_swap_point_has_one_protocol():
    assert [swap.name for swap in SWAPS] == ["attention", "fused_forward", "cosine_head", "loss", "matched_generate",
                                            "trainer_guard", "adapter_alpha", "token_outputs", "model_card"]
    assert [swap.name for swap in SWAPS[:5]] == [swap.name for swap in swaps.SWAPS]  # the library's, then the engines'
    assert set(CASES) == set(BY_NAME) - PEFT_ONLY
    for swap in SWAPS:
        assert isinstance(swap, Swap)
        assert list(inspect.signature(swap.plan).parameters) == ["model", "request"]
        assert list(inspect.signature(swap.apply).parameters) == ["model", "plan"]
        assert list(inspect.signature(swap.remove).parameters) == ["model"]


@pytest.mark.parametrize("name", CASES)
def test_each_swap_plans_applies_and_removes(name):
    make, kwargs, installed = CASES[name]
    swap, model = BY_NAME[name], make()
    results, before = outputs(model), fingerprint(model)
    settings = SparseSettings(**kwargs)
    assert swap.plan(model, PatchRequest(SparseSettings())) is None  # the model's own: nothing to swap
    plan = swap.plan(model, PatchRequest(settings))
    assert plan is not None and type(plan)._fields  # a named result, not a positional tuple
    assert same_fingerprint(fingerprint(model), before)  # planning changes nothing
    swap.apply(model, plan)
    assert installed(model) and not same_fingerprint(fingerprint(model), before)
    swap.remove(model)
    assert same_fingerprint(fingerprint(model), before) and same_outputs(outputs(model), results)
    swap.remove(model)  # removing what is not there does nothing
    assert same_fingerprint(fingerprint(model), before)


@pytest.mark.parametrize("name", CASES)
def test_patch_then_unpatch_gives_the_original_model_back(name):
    make, kwargs, installed = CASES[name]
    model = make()
    results, before = outputs(model), fingerprint(model)
    hs.patch_model(model, **kwargs)
    assert installed(model) and not same_outputs(outputs(model), results)
    hs.unpatch_model(model)
    assert same_fingerprint(fingerprint(model), before)
    assert same_outputs(outputs(model), results)


def test_every_swap_at_once_round_trips_and_repatching_is_the_same_as_patching_once():
    model, kwargs = llama(), dict(attn="sparse_softmax", attn_options={"top_k": 3}, loss="sparse_softmax",
                                  loss_options={"top_k": 5, "fused": True})
    results, before = outputs(model), fingerprint(model)
    hs.patch_model(model, **kwargs)
    once = fingerprint(model)
    hs.patch_model(model, **kwargs)
    hs.patch_model(model)  # re-apply what the config says
    assert same_fingerprint(fingerprint(model), once)
    hs.unpatch_model(model)
    assert same_fingerprint(fingerprint(model), before) and same_outputs(outputs(model), results)


def test_the_cosine_head_of_a_model_that_hard_codes_its_loss_round_trips():
    model = bert_classifier()
    results, before = outputs(model), fingerprint(model)
    hs.patch_model(model, loss="am_softmax", loss_options={"margin": 0.2, "scale": 10.0})
    out = model(**inputs(model))
    assert torch.allclose(out.loss, hs.am_softmax_loss(out.logits, inputs(model)["labels"], 0.2, 10.0), atol=1e-6)
    hs.unpatch_model(model)
    assert same_fingerprint(fingerprint(model), before) and same_outputs(outputs(model), results)


def test_a_peft_model_with_learned_alphas_round_trips():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(llama(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    config = model.peft_config["default"]
    saved = list(config.modules_to_save or [])
    hs.patch_model(model, attn="entmax_bisect", attn_options={"learn_alpha": True}, loss="sparsemax")
    assert ALPHA_ATTR in config.modules_to_save
    hs.unpatch_model(model)
    assert list(config.modules_to_save or []) == saved
    assert not any(ALPHA_ATTR in name for name, _ in model.named_parameters())


REFUSED = [  # (model, a patch refused by the swap point named, after the swaps before it planned)
    (llama_classifier, dict(attn="sparsemax", loss="sparsemax", loss_options={"fused": True}), "causal LM"),
    (llama, dict(attn="sparsemax", loss="am_softmax"), "cosine head"),
    (lambda: llama(vocab=5000), dict(attn="entmax15", loss="perturb_max"), "at most 4096 classes"),
    (llama, dict(attn="sparsemax", loss="sparse_softmax", loss_options={"top_k": 0}), "top_k"),
]


@pytest.mark.parametrize("make,kwargs,message", REFUSED)
@pytest.mark.parametrize("patched", [False, True], ids=["plain", "patched"])
def test_a_refused_patch_changes_nothing(make, kwargs, message, patched, monkeypatch):
    model = make()
    if patched:  # a model already patched at every point that applies to it keeps that patch, alphas included
        loss = "am_softmax" if model.loss_type == "ForSequenceClassification" else "sparse_softmax"
        hs.patch_model(model, attn="entmax_bisect", attn_options={"learn_alpha": True}, loss=loss)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01)
    results, before = outputs(model), fingerprint(model)
    calls = []
    for swap in SWAPS:
        monkeypatch.setattr(swap, "apply", lambda model, plan, name=swap.name: calls.append(("apply", name)))
        monkeypatch.setattr(swap, "remove", lambda model, name=swap.name: calls.append(("remove", name)))
    with pytest.raises(ValueError, match=message):
        hs.patch_model(model, **kwargs)
    assert calls == []
    assert same_fingerprint(fingerprint(model), before) and same_outputs(outputs(model), results)


def test_patch_applies_in_order_and_unpatch_removes_in_reverse(monkeypatch):
    model, calls = llama(), []
    for swap in SWAPS:
        apply, remove = swap.apply, swap.remove
        monkeypatch.setattr(swap, "apply", lambda m, plan, name=swap.name, f=apply: (calls.append(("apply", name)),
                                                                                     f(m, plan)))
        monkeypatch.setattr(swap, "remove", lambda m, name=swap.name, f=remove: (calls.append(("remove", name)),
                                                                                f(m)))
    hs.patch_model(model, attn="sparsemax", loss="sparsemax")
    names = [swap.name for swap in SWAPS]
    applied = [name for name in names if name not in ("fused_forward", "cosine_head", "adapter_alpha")]
    assert calls == [("remove", name) for name in reversed(names)] + [("apply", name) for name in applied]
    calls.clear()
    hs.unpatch_model(model)
    assert calls == [("remove", name) for name in reversed(names)]


def test_repatching_keeps_trained_alphas_unless_the_attention_is_asked_for_again():
    model = llama()
    hs.patch_model(model, attn="entmax_bisect", attn_options={"alpha": 1.3, "learn_alpha": True})
    alphas = [m._modules[ALPHA_ATTR] for m in model.modules() if ALPHA_ATTR in m._modules]
    with torch.no_grad():
        for alpha in alphas:
            alpha.pre_alpha.uniform_(-2, 2)
    trained = [alpha.pre_alpha.clone() for alpha in alphas]
    hs.patch_model(model, loss="sparsemax")  # attention not named: the same modules, trained values
    now = [m._modules[ALPHA_ATTR] for m in model.modules() if ALPHA_ATTR in m._modules]
    assert all(a is b for a, b in zip(now, alphas)) and len(now) == len(alphas) == 2
    assert all(torch.equal(a.pre_alpha, t) for a, t in zip(now, trained))
    hs.patch_model(model, attn="entmax_bisect", attn_options={"alpha": 1.3, "learn_alpha": True})  # asked again
    fresh = [m._modules[ALPHA_ATTR] for m in model.modules() if ALPHA_ATTR in m._modules]
    assert len(fresh) == 2 and all(a is not b for a, b in zip(fresh, alphas))
    assert all(torch.allclose(a().flatten(), torch.full((4,), 1.3)) for a in fresh)


def test_the_loss_plan_names_its_fields():
    model = llama()
    plan = swaps.LOSS.plan(model, PatchRequest(SparseSettings(loss="sparsemax")))
    assert plan.task == "causal_lm" and plan.loss_function.__name__ == "causal_lm_loss"
    attention = swaps.ATTENTION.plan(model, PatchRequest(SparseSettings(attn="entmax_bisect",
                                                                        attn_options={"learn_alpha": True})))
    assert attention.options.learn_alpha and attention.heads == [4, 4] and attention.kept == [None, None]
