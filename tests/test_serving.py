"""The serving step without an engine: per-request choices and the batched logits step on fake batches.

The vLLM plugin (hf_sparsemax.integrations.vllm.plugin) adapts exactly this code; the tests that run it inside
vLLM live in tests_vllm/ (their own virtualenv, .ci/vllm).
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

import hf_sparsemax as hs
from hf_sparsemax.losses.names import loss_mapping
from hf_sparsemax.mappings import registry
from hf_sparsemax.decoding.engine import BatchDecoding, Choice, decoding_losses, folder_choice, request_choice

VOCAB = 50


def config(**settings):
    cfg = LlamaConfig(vocab_size=VOCAB)
    if settings:
        cfg.hf_sparsemax = hs.settings.SparseSettings(**settings).to_dict()
    return cfg


def test_the_folder_choice_is_its_trained_loss_with_or_without_sparse_attention():
    assert folder_choice(config()) is None
    assert folder_choice(config(loss="cross_entropy")) is None
    assert folder_choice(config(loss="sparse_softmax", loss_options={"top_k": 5, "fused": True})) == Choice(
        "sparse_softmax", (("top_k", 5),))
    assert folder_choice(config(attn="entmax15", loss="sparsemax")) == Choice("sparsemax")  # the attention is served
    assert folder_choice(config(attn="entmax15")) is None


def test_request_choices():
    folder = Choice.make("entmax_bisect", {"alpha": 1.3})
    assert request_choice(folder, None) is folder and request_choice(folder, {"other": 1}) is folder
    assert request_choice(folder, {"hf_sparsemax": "off"}) is None
    assert request_choice(folder, {"hf_sparsemax_alpha": 1.7}) == Choice("entmax_bisect", (("alpha", 1.7),))
    assert request_choice(folder, {"hf_sparsemax": "sparse_softmax", "hf_sparsemax_top_k": 3}) == Choice(
        "sparse_softmax", (("top_k", 3),))
    assert request_choice(None, {"hf_sparsemax": "sparsemax"}) == Choice("sparsemax")
    assert request_choice(Choice.make("perturb_max"), {"hf_sparsemax": "perturb_max"}) == Choice("perturb_max")
    for bad, message in [
        ({"hf_sparsemax": "softmax"}, "not a loss to sample from"),
        ({"hf_sparsemax": "am_softmax"}, "not a loss to sample from"),
        ({"hf_sparsemax": "sparsemax", "hf_sparsemax_alpha": 1.5}, "are not sampling options of 'sparsemax'"),
        ({"hf_sparsemax_alpha": 0.5}, "alpha"),
        ({"hf_sparsemax": "off", "hf_sparsemax_top_k": 3}, "give one or the other"),
        ({"hf_sparsemax": "perturb_max"}, "at most 4096 classes"),
    ]:
        with pytest.raises(ValueError, match=message):
            request_choice(folder, bad)
    with pytest.raises(ValueError, match="has no hf_sparsemax loss"):
        request_choice(None, {"hf_sparsemax_top_k": 3})
    with pytest.raises(ValueError, match="at most 4096 classes"):
        request_choice(None, {"hf_sparsemax": "perturb_max"})


def test_a_refusal_names_only_the_options_a_request_can_set():
    """The 400 for an option the loss does not take lists the mapping's options, never ``fused`` (a training
    option); a request's ``fused`` is refused, a folder's is dropped."""
    entmax15 = folder_choice(config(loss="entmax15", loss_options={"fused": True}))
    assert entmax15 == Choice("entmax15")
    cases = [(entmax15, {"hf_sparsemax_alpha": 1.3}, "['alpha'] are not sampling options of 'entmax15'; it takes none"),
             (None, {"hf_sparsemax": "sparse_softmax", "hf_sparsemax_alpha": 1.3},
              "['alpha'] are not sampling options of 'sparse_softmax'; it takes ['top_k', 'top_p']"),
             (entmax15, {"hf_sparsemax_fused": True},
              "['fused'] are not sampling options of 'entmax15'; it takes none"),
             (None, {"hf_sparsemax": "entmax_bisect", "hf_sparsemax_top_k": 3},
              "['top_k'] are not sampling options of 'entmax_bisect'; it takes ['alpha']")]
    for folder, extra, message in cases:
        with pytest.raises(ValueError) as refused:
            request_choice(folder, extra)
        assert str(refused.value) == message


def logits(rows, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(rows, VOCAB) * torch.linspace(0.5, 4, rows)[:, None]
    x[0, :10] = float("-inf")  # tokens the engine masked (allowed ids, bad words)
    return x


CHOICES = [Choice.make("sparse_softmax", {"top_k": 7}), Choice.make("sparse_softmax", {"top_p": 0.8}),
           Choice.make("sparsemax"), Choice.make("entmax15"), Choice.make("entmax_bisect", {"alpha": 1.2}),
           Choice.make("taylor_softmax", {"order": 4}), Choice.make("perturb_max", {"points": 64})]


def test_a_mixed_batch_maps_each_row_with_its_own_choice_and_temperature():
    choices = [CHOICES[i % len(CHOICES)] for i in range(10)] + [None]
    temperatures = [0.5, 1.0, 2.0, 0.0, 1.3, 0.7, 1.0, 1.1, 0.9, 3.0, 1.0]
    batch = BatchDecoding()
    for slot, (choice, t) in enumerate(zip(choices, temperatures)):
        batch.set(slot, choice, t)
    x = logits(len(choices))
    scaled = x / torch.tensor([t if t > 0 else 1.0 for t in temperatures])[:, None]
    # the engine divided by T before the step (vLLM V1, argmax-invariant processors)
    got = batch.apply(scaled.clone(), scaled=True)
    # the engine divides by T after the step (vLLM V2, V1's other processors): the compensated form
    compensated = batch.apply(x.clone())
    divided = compensated / torch.tensor([t if t > 0 else 1.0 for t in temperatures])[:, None]
    for row, choice in enumerate(choices):
        if choice is None:  # a request that opted out: untouched
            assert torch.equal(got[row], scaled[row]) and torch.equal(compensated[row], x[row])
            continue
        p = choice.mapping()(scaled[row])
        for out in (got[row], divided[row]):
            torch.testing.assert_close(out.softmax(-1), p, rtol=0, atol=1e-6)
            assert torch.equal(out == float("-inf"), p == 0)


def test_slots_follow_the_engine_batch():
    batch = BatchDecoding()
    a, b = Choice.make("sparsemax"), Choice.make("sparse_softmax", {"top_k": 3})
    batch.set(0, a)
    batch.set(1, b)
    batch.set(2, None)
    x = logits(3)
    expect = {choice: choice.mapping()(x).log() for choice in (a, b)}
    batch.swap(0, 1)
    out = batch.apply(x.clone(), scaled=True)
    assert torch.equal(out[0], expect[b][0]) and torch.equal(out[1], expect[a][1]) and torch.equal(out[2], x[2])
    batch.move(1, 2)
    batch.clear(0)
    out = batch.apply(x.clone(), scaled=True)
    assert torch.equal(out[:2], x[:2]) and torch.equal(out[2], expect[a][2])
    # rows in another order than the slots (Model Runner V2): slot_of_row maps them
    batch.set(0, b, 0.5)
    rows = x[[2, 0]].clone()
    out = batch.apply(rows, slot_of_row=np.array([2, 0]))
    torch.testing.assert_close(out[0], a.mapping()(x[2]).log(), rtol=0, atol=1e-6)
    torch.testing.assert_close((out[1] / 0.5).softmax(-1), b.mapping()(x[0] / 0.5), rtol=0, atol=1e-6)


def test_an_instance_maps_only_the_choices_it_handles():
    taylor, entmax = Choice.make("taylor_softmax"), Choice.make("entmax15")
    keeping = BatchDecoding(handles=lambda choice: choice.keeps_argmax)
    moving = BatchDecoding(handles=lambda choice: not choice.keeps_argmax)
    for batch in (keeping, moving):
        batch.set(0, taylor)
        batch.set(1, entmax)
    assert set(keeping.slots) == {1} and set(moving.slots) == {0}


def test_which_mappings_keep_the_argmax():
    assert {name for name in decoding_losses() if not registry.REGISTRY[name].keeps_argmax} == {"taylor_softmax"}
    x = torch.tensor([2.0, 0.0, -5.0])  # 1 + t + t^2/2: the most negative logit gets the largest probability
    assert loss_mapping("taylor_softmax")(x).argmax() == 2


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10**6), st.floats(0.1, 20))
def test_the_mappings_that_say_so_keep_the_argmax(seed, scale):
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    for choice in CHOICES:
        if choice.keeps_argmax:
            assert torch.equal(choice.mapping()(x).argmax(-1), x.argmax(-1)), choice


def test_requests_the_engine_samples_itself_are_left_to_it():
    """A top-k / top-p folder's generation_config.json gives the engine the trained top_k / top_p: no double cut."""
    from hf_sparsemax.decoding.engine import engine_samples

    both = Choice.make("sparse_softmax", {"top_k": 5, "top_p": 0.9})
    assert engine_samples(both, 5, 0.9) and not engine_samples(both, 0, 1.0) and not engine_samples(both, 5, 0.8)
    assert engine_samples(Choice.make("sparse_softmax", {"top_p": 0.9}), 0, 0.9)
    assert engine_samples(Choice.make("sparse_softmax", {"top_p": 0.9}), -1, 0.9)
    assert not engine_samples(Choice.make("sparsemax"), 0, 1.0) and not engine_samples(None, 0, 1.0)


def test_a_top_k_top_p_folder_tells_engines_its_sampling(tmp_path):
    import json

    from transformers import GenerationConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    before = model.generation_config.to_dict()
    hs.patch_model(model, loss="sparse_softmax", loss_options={"top_p": 0.8})
    model.save_pretrained(tmp_path)  # a valid generation config (do_sample=True with top_k / top_p)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert (saved["top_k"], saved["top_p"], saved["do_sample"]) == (0, 0.8, True)  # 0: transformers' 50 is off
    # plain transformers' warpers from that file sample the trained distribution
    config = GenerationConfig.from_pretrained(tmp_path)
    warpers = model._get_logits_processor(config, input_ids_seq_length=1, encoder_input_ids=torch.zeros(3, 1).long(),
                                          prefix_allowed_tokens_fn=None, logits_processor=[])
    x = logits(3)[1:]
    torch.testing.assert_close(warpers(None, x.clone()).softmax(-1), hs.sparse_softmax(x, top_p=0.8), rtol=0, atol=1e-6)
    hs.patch_model(model, loss="sparsemax")  # another loss: the fields are given back
    after = model.generation_config.to_dict()
    assert [after.get(k) for k in ("top_k", "top_p", "do_sample")] == [before.get(k) for k in ("top_k", "top_p",
                                                                                                "do_sample")]


@pytest.mark.parametrize("kwargs,says", [
    (dict(loss="sparse_softmax", loss_options={"top_k": 5}), "carries `top_k` / `top_p`"),
    (dict(loss="entmax15"), "sample softmax, not the `entmax15` distribution"),
    (dict(attn="sparsemax", loss="sparsemax"), "computes this model's sparsemax attention over vLLM's paged KV"),
])
def test_a_saved_folder_has_a_model_card_saying_how_to_serve_it(tmp_path, kwargs, says):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    hs.patch_model(model, **kwargs).save_pretrained(tmp_path / "a")
    card = (tmp_path / "a" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\ntags:\n- hf_sparsemax\n") and says in card
    own = tmp_path / "b" / "README.md"
    own.parent.mkdir()
    own.write_text("my own card\n")
    model.save_pretrained(own.parent)
    assert own.read_text() == "my own card\n"  # a card of the user's stays
    hs.unpatch_model(model).save_pretrained(tmp_path / "c")
    assert not (tmp_path / "c" / "README.md").exists()


def test_hf_sparsemax_serve_prepares_a_trained_variant_for_vllm_on_loopback(tmp_path, capsys):
    """`hf-sparsemax serve --dry-run`: the LoRA variant merged into a folder vLLM loads, and the command."""
    from test_recipes import CHARS, char_tokenizer, run, write_recipe
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path / "tiny"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(CHARS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                                 bos_token_id=2)).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    recipe = write_recipe(tmp_path, str(folder), variants={"topk": {"loss": "sparse_softmax",
                                                                    "loss_options": {"top_k": 5}},
                                                           "attention": {"attn": "entmax15"}},
                          training={"max_steps": 1, "per_device_train_batch_size": 4, "disable_tqdm": True})
    out = tmp_path / "runs"
    assert run("train", recipe, "--variant", "topk", "--output", out) == 0
    capsys.readouterr()
    assert run("serve", recipe, "--variant", "topk", "--output", out, "--dry-run", "--", "--max-model-len", "64") == 0
    command = capsys.readouterr().out.strip().splitlines()[-1].split()
    served = out / "topk" / "serve"
    assert command[1:] == ["-m", "vllm.entrypoints.openai.api_server", "--model", str(served), "--host", "127.0.0.1",
                           "--port", "8000", "--max-model-len", "64"]
    model = AutoModelForCausalLM.from_pretrained(served)  # merged, patched as trained
    assert model.config.hf_sparsemax["loss_options"] == {"top_k": 5} and "lora" not in str(type(model)).lower()
    assert (served / "README.md").exists() and (served / "tokenizer.json").exists()
    assert run("serve", recipe, "--variant", "topk", "--output", out, "--dry-run", "--", "--host", "0.0.0.0") == 2
    assert run("train", recipe, "--variant", "attention", "--output", out) == 0
    capsys.readouterr()
    assert run("serve", recipe, "--variant", "attention", "--output", out, "--dry-run") == 0  # sparse attention too
    served = capsys.readouterr().out.strip().splitlines()[-1].split()[4]
    assert AutoModelForCausalLM.from_pretrained(served).config.hf_sparsemax["attn"] == "entmax15"


@pytest.mark.parametrize("choice", CHOICES + [Choice.make("sparse_softmax", {"top_k": 7, "top_p": 0.5})], ids=str)
def test_the_support_path_gives_the_mapping_s_log_probabilities(choice):
    x = logits(6, seed=3)
    x[2, 5:9] = x[2, 4]  # ties at the top
    expected = choice.mapping()(x).log()
    got = choice.log_mapping()(x.clone())
    assert torch.equal(got == float("-inf"), expected == float("-inf"))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
