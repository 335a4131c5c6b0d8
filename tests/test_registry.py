"""The registry of mappings: every entry exercised at every swap point it claims, refused at the others."""

import copy
import dataclasses
import pickle
import re

import pytest
import torch
import transformers
from torch import nn

import hf_sparsemax as hs
from hf_sparsemax.metrics import sparse_text as metrics
from hf_sparsemax.attention.interface import ATTENTION_MAPPINGS, ATTENTION_OPTIONS, OPTIONS_ATTR, AttentionOptions
from hf_sparsemax.attention.interface import sparse_attention_forward
from hf_sparsemax.decoding.generation import processor_for
from hf_sparsemax.losses.names import LOSS_OPTIONS, loss_mapping, make_loss
from hf_sparsemax.mappings import registry
from hf_sparsemax.settings import SparseSettings

CASES = [(name, point) for name in registry.REGISTRY for point in registry.SWAP_POINTS]


def tiny_lm(vocab=24):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0)).eval()


def tiny_classifier():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=24, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        num_labels=4)).eval()


def exercise_attention(entry):
    g = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(2, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(2, 1, 5, 5, dtype=torch.float64)
    mask[0, ..., 3:] = torch.finfo(torch.float64).min
    module = nn.Module()
    setattr(module, OPTIONS_ATTR, AttentionOptions.from_settings(entry.name, {}))
    out, weights = sparse_attention_forward(module, query, key, value, mask, scaling=0.5, mapping=entry.name,
                                            output_attentions=True)
    expected = entry.function(query @ key.transpose(-1, -2) * 0.5 + mask, dim=-1)
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(out, (expected @ value).transpose(1, 2))
    default, _ = sparse_attention_forward(module, query, key, value, mask, scaling=0.5, mapping=entry.name)
    torch.testing.assert_close(default, out)  # the default (memory-bounded) path computes the same output
    model = tiny_lm()
    ids = torch.randint(1, 24, (2, 6), generator=g)
    hs.patch_model(model, attn=entry.name)
    assert model.config._attn_implementation == entry.name
    attentions = model(input_ids=ids, output_attentions=True).attentions
    assert all(torch.isfinite(a).all() for a in attentions)
    torch.testing.assert_close(attentions[0].sum(-1), torch.ones(2, 2, 6))
    hs.unpatch_model(model)


def exercise_loss(entry):
    g = torch.Generator().manual_seed(2)
    if entry.head == "cosine":
        model, labels = tiny_classifier(), torch.tensor([0, 3, -100])
        ids = torch.randint(1, 24, (3, 6), generator=g)
        hs.patch_model(model, loss=entry.name)
        out = model(input_ids=ids, labels=labels)
        expected = entry.loss(out.logits, labels)
    else:
        model, ids = tiny_lm(), torch.randint(1, 24, (3, 6), generator=g)
        hs.patch_model(model, loss=entry.name)
        out = model(input_ids=ids, labels=ids)
        expected = entry.loss(out.logits[:, :-1], ids[:, 1:])
    torch.testing.assert_close(out.loss, expected)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    logits = torch.randn(4, 6, generator=g, dtype=torch.float64).tanh()
    target = torch.tensor([0, 5, -100, 2])
    torch.testing.assert_close(make_loss(entry.name)(logits, target), entry.loss(logits, target))
    hs.unpatch_model(model)


def exercise_fused(entry):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(10, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(30, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 30, (10,), generator=g)
    labels[2] = -100
    fused = hs.fused_head_loss(hidden, weight, labels, entry.name)
    torch.testing.assert_close(fused, make_loss(entry.name)(hidden @ weight.T, labels))


def exercise_processor(entry):
    scores = torch.randn(3, 12, generator=torch.Generator().manual_seed(4))
    processor = processor_for(entry.name, {})
    log_p = processor(torch.zeros(3, 1, dtype=torch.long), scores)
    torch.testing.assert_close(torch.softmax(log_p, -1), loss_mapping(entry.name)(scores), rtol=0, atol=1e-6)


EXERCISES = {"attention": exercise_attention, "loss": exercise_loss, "fused": exercise_fused,
             "processor": exercise_processor}


@pytest.mark.parametrize("name,point", CASES)
def test_every_entry_works_at_each_swap_point_it_claims_and_is_refused_at_the_others(name, point):
    entry = registry.REGISTRY[name]
    if point in entry.swap_points:
        EXERCISES[point](entry)
        return
    reason = entry.refusals[point]  # an unsupported point must come with a reason a user can act on
    attempts = {
        "attention": lambda: SparseSettings(attn=name),
        "fused": lambda: SparseSettings(loss=name, loss_options={"fused": True}),
        "processor": lambda: hs.MappingLogitsProcessor(name),
        "loss": lambda: make_loss(name),
    }
    with pytest.raises(ValueError) as error:
        attempts[point]()
    assert str(error.value) == reason


def test_the_swap_points_read_the_registry():
    assert ATTENTION_MAPPINGS == registry.names("attention")
    assert set(LOSS_OPTIONS) == set(registry.names("loss")) == set(registry.REGISTRY) - {"budget_bisect"}
    assert {"sparsemax", "entmax15", "entmax_bisect", "sparse_softmax", "taylor_softmax",
            "normmax_bisect"} <= set(ATTENTION_MAPPINGS)
    assert not {"perturb_max", "am_softmax", "budget_bisect"} & set(ATTENTION_MAPPINGS)
    scales = ("temperature", "learn_temperature", "length_scale")
    assert ATTENTION_OPTIONS["normmax_bisect"] == ("alpha", "learn_alpha", "chunk_size", "kernel", *scales)
    assert ATTENTION_OPTIONS["entmax_bisect"] == ("alpha", "learn_alpha", "chunk_size", "kernel", *scales)
    assert ATTENTION_OPTIONS["taylor_softmax"] == ("order", "chunk_size", "kernel", *scales)
    for name in registry.names("loss"):
        settings = SparseSettings(loss=name)
        assert SparseSettings.from_dict(settings.to_dict()) == settings
    assert set(registry.names("fused")) == {"sparsemax", "entmax15", "entmax_bisect", "sparse_softmax"}


def test_cli_lists_the_registered_losses(capsys):
    import hf_sparsemax_cli as cli

    with pytest.raises(SystemExit):
        cli.main(["decoding-report", "--help"])
    message = " ".join(capsys.readouterr().out.split())
    assert all(name in message for name in registry.names("processor"))


@pytest.mark.parametrize("name", list(registry.REGISTRY))
def test_options_are_validated_dataclasses(name):
    entry = registry.REGISTRY[name]
    options = entry.options()
    assert dataclasses.is_dataclass(options)
    assert copy.deepcopy(options) == options and pickle.loads(pickle.dumps(options)) == options
    refusal = "are not options of loss" if entry.loss else re.escape(entry.refusals["loss"])
    with pytest.raises(ValueError, match=refusal):
        SparseSettings(loss=name, loss_options={"no_such_option": 1})
    with pytest.raises(ValueError):
        registry.get("no_such_mapping")


BAD_OPTIONS = [("entmax_bisect", {"alpha": 1.0}), ("sparse_softmax", {"top_k": 0}), ("sparse_softmax", {"top_p": 2}),
               ("normmax_bisect", {"alpha": 0.5}), ("normmax_bisect", {"alpha": "2"}),
               ("taylor_softmax", {"order": 3}), ("perturb_max", {"noise": "cauchy"}), ("perturb_max", {"points": 0}),
               ("am_softmax", {"margin": -1}), ("am_softmax", {"scale": "big"})]


@pytest.mark.parametrize("name,options", BAD_OPTIONS)
def test_bad_option_values_are_one_sentence_value_errors(name, options):
    attempts = [lambda: SparseSettings(loss=name, loss_options=options), lambda: make_loss(name, **options),
                lambda: registry.REGISTRY[name].options(**options)]
    for attempt in attempts if registry.REGISTRY[name].loss else attempts[2:]:
        with pytest.raises(ValueError) as error:
            attempt()
        assert "\n" not in str(error.value) and list(options)[0] in str(error.value)


@pytest.mark.parametrize("name", [name for name, entry in registry.REGISTRY.items() if entry.simplex])
def test_functions_that_take_a_mapping_take_its_name(name):
    entry = registry.REGISTRY[name]
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(5)).tanh()
    target = torch.tensor([0, 6, 3, -100, 1])
    by_name = hs.mapping_loss(x, target, name)
    torch.testing.assert_close(by_name, hs.mapping_loss(x, target, lambda v: entry.function(v)))
    preprocess, _ = metrics.trainer_metrics(name, vocab_size=7, causal=False)
    reference, _ = metrics.trainer_metrics(entry.function, vocab_size=7, causal=False)
    torch.testing.assert_close(preprocess(x, target), reference(x, target))
    with pytest.raises(ValueError):
        hs.mapping_loss(x, target, lambda v: v, alpha=1.2)  # options belong to a mapping given by name


def test_mapping_loss_takes_options_of_a_named_mapping():
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(6))
    target = torch.tensor([0, 1, 2, 3])
    torch.testing.assert_close(hs.mapping_loss(x, target, "entmax_bisect", alpha=1.3),
                               hs.mapping_loss(x, target, lambda v: hs.entmax_bisect(v, 1.3)))
    with pytest.raises(ValueError):
        hs.mapping_loss(x, target, "sparsemax", alpha=1.3)


def test_a_new_mapping_is_one_registry_entry(monkeypatch):
    """A mapping added to the registry alone becomes a loss, a processor and a recipe / settings name."""

    @dataclasses.dataclass(frozen=True)
    class HalfOptions:
        pass

    def half_softmax(x, dim=-1):
        return torch.softmax(x / 2, dim)

    def half_loss(logits, target, ignore_index=-100, reduction="mean"):
        return nn.functional.cross_entropy(logits / 2, target, ignore_index=ignore_index, reduction=reduction)

    entry = registry.Mapping("half_softmax", HalfOptions, half_softmax, rows=lambda rows, masked, o: half_softmax(rows),
                             loss=half_loss, loss_rule="nll", refusals={"fused": "dense", "attention": "no"})
    monkeypatch.setitem(registry.REGISTRY, "half_softmax", entry)
    model, ids = tiny_lm(), torch.randint(1, 24, (2, 5), generator=torch.Generator().manual_seed(7))
    hs.patch_model(model, loss="half_softmax")
    out = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, half_loss(out.logits[:, :-1].reshape(-1, 24), ids[:, 1:].reshape(-1)))
    (processor,) = hs.logits_processors(model)
    scores = out.logits[:, -1]
    torch.testing.assert_close(torch.softmax(processor(ids, scores), -1), half_softmax(scores), rtol=0, atol=1e-6)
    fn = hs.compute_loss_func("half_softmax", task="token_classification")
    assert torch.isfinite(fn({"logits": out.logits}, ids))


def test_a_mapping_off_the_simplex_is_refused_where_a_distribution_is_needed():
    x, target = torch.randn(3, 5), torch.tensor([0, 1, 2])
    reason = registry.REGISTRY["budget_bisect"].refusals["processor"]
    for attempt in (lambda: hs.mapping_loss(x, target, "budget_bisect"),
                    lambda: metrics.trainer_metrics("budget_bisect", vocab_size=5, causal=False)):
        with pytest.raises(ValueError, match="no probability distribution") as error:
            attempt()
        assert reason in str(error.value)
