"""The evaluation at length (hf_sparsemax/app/long_context.py) and recipes/convert_long.yaml on a tiny model."""

import json

import pytest
import torch
from test_recipes import char_tokenizer, run, tiny_llama  # noqa: F401 (a fixture)
from transformers import LlamaConfig, LlamaForCausalLM

from hf_sparsemax.app import long_context as lc
from hf_sparsemax.app import long_report, report
from hf_sparsemax.app.recipes import RecipeError, load_recipe


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=105, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def test_cross_entropy_by_position_is_the_models_own_loss(model):
    """Every bucket's mean is the per-token loss of the model's own forward over those positions."""
    torch.manual_seed(1)
    ids = torch.randint(0, 105, (200,))
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].double()
    reference = torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")
    got = lc.cross_entropy_by_length(model, [ids, ids], buckets=((0, 50), (50, 150), (150, 400)))
    assert list(got) == ["0-50", "50-150", "150-400"]
    assert got["0-50"] == pytest.approx(float(reference[:49].mean()), rel=1e-5)  # positions 1..49 (0 has no loss)
    assert got["50-150"] == pytest.approx(float(reference[49:149].mean()), rel=1e-5)
    assert got["150-400"] == pytest.approx(float(reference[149:].mean()), rel=1e-5)


def test_the_parent_at_length_is_the_unpatched_models_cross_entropy_by_position(model):
    """parent_at_length: the same buckets as cross_entropy_by_length of the model as loaded, on the same documents;
    an empty document list is refused."""
    torch.manual_seed(3)
    documents = [torch.randint(0, 105, (200,)), torch.randint(0, 105, (200,))]
    spec = lc.LongSpec(length=200, documents=2)
    got = lc.parent_at_length(model, documents, spec)
    assert got["cross_entropy_by_length"] == lc.cross_entropy_by_length(model, documents)
    assert set(got["cross_entropy_by_length"]) == {"0-512"} and got["seconds"] >= 0
    with pytest.raises(ValueError, match="at least one document"):
        lc.parent_at_length(model, [], spec)


@pytest.mark.parametrize("attn", ["softmax", "entmax15"])
def test_the_zeros_are_counted_in_the_documents_own_pass(model, attn):
    """forward_document with zeros_length: the losses of one plain forward over the whole document, and the zero
    share that curves.measure counts on its first tokens alone."""
    import copy

    import hf_sparsemax as hs
    from hf_sparsemax.app.curves import measure

    patched = copy.deepcopy(model)
    if attn != "softmax":  # sharper scores than the random model's: some exact zeros
        hs.patch_model(patched, attn=attn, attn_options={"temperature": [[0.02] * 4] * 2})
    torch.manual_seed(2)
    ids = torch.randint(0, 105, (200,))
    losses, zeros = lc.forward_document(patched, ids, zeros_length=64)
    torch.testing.assert_close(losses, lc.token_losses(patched, ids), rtol=1e-5, atol=1e-6)
    head = ids[:64]
    want = measure(patched, [{"input_ids": head, "attention_mask": torch.ones_like(head), "labels": head}], 1, 1)
    assert zeros == pytest.approx(want["attention_zero_share"], abs=1e-12)
    assert (zeros > 0.2) == (attn == "entmax15") and lc.forward_document(patched, ids)[1] is None


@pytest.mark.parametrize("ids", [torch.tensor([], dtype=torch.long), torch.tensor([3])])
def test_an_empty_document_is_refused(model, ids):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        lc.cross_entropy_by_length(model, [ids])


def test_a_context_past_the_positions_needs_a_rope_factor(model):
    ids = torch.randint(0, 105, (300,))
    with pytest.raises(ValueError, match="longer than the model's 256 positions: set eval.long_context.rope_factor"):
        lc.cross_entropy_by_length(model, [ids])
    with pytest.raises(ValueError, match="times the rope factor 1.1"):
        lc.rope_for(model, 300, 1.1)
    assert lc.rope_for(model, 256, None) is None and lc.rope_for(model, 300, 2.0) == 2.0
    assert set(lc.cross_entropy_by_length(model, [ids], rope_factor=2.0)) == {"0-512"}


def test_the_extended_rope_interpolates_positions_and_is_given_back(model):
    """Linear rope x2: position 2p under the extension is position p without it; the module comes back."""
    rotary = model.model.rotary_emb
    x = torch.zeros(1, 1, 8)
    with lc.extended_rope(model, 2.0):
        assert model.model.rotary_emb is not rotary
        cos_ext, _ = model.model.rotary_emb(x, torch.tensor([[0, 2, 10]]))
    assert model.model.rotary_emb is rotary
    cos, _ = rotary(x, torch.tensor([[0, 1, 5]]))
    torch.testing.assert_close(cos_ext, cos)


def test_the_passkey_prompt_has_the_context_and_the_needle_at_its_depth():
    tokenizer = char_tokenizer()
    for depth in (0.0, 0.5, 1.0):
        prompt, answer = lc.passkey_prompt(tokenizer, 600, depth, 12345)
        text = "".join(tokenizer.convert_ids_to_tokens(prompt))
        assert len(prompt) == 600 and "".join(tokenizer.convert_ids_to_tokens(answer)) == " 12345"
        assert text.startswith(lc.INTRO) and text.endswith(lc.QUESTION)
        needle = lc.NEEDLE.format(key=12345)
        room = 600 - len(lc.INTRO) - len(needle) - len(lc.QUESTION)  # filler characters (= tokens here)
        cut = text.index(needle) - len(lc.INTRO)
        assert abs(cut - depth * room) <= len(lc.FILLER) / 2 and cut % len(lc.FILLER) == 0
    with pytest.raises(ValueError, match="no room for filler"):
        lc.passkey_prompt(tokenizer, 150, 0.5, 12345)


def test_the_cache_goes_by_the_keyword_the_model_takes_and_warns_nothing(model):
    """transformers 5.24 renames a forward's ``past_key_values`` to ``cache`` (the old name warns, and goes in
    5.40); a model whose forward knows only ``past_key_values`` (transformers before 5.24) gets that."""
    import inspect
    import warnings

    from hf_sparsemax._model import cache_keyword

    takes = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    assert cache_keyword(model) == takes

    class Older(LlamaForCausalLM):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return super().forward(input_ids=input_ids, **{takes: past_key_values}, **kwargs)

    assert cache_keyword(Older(model.config)) == "past_key_values"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        lc.forward_document(model, torch.arange(1, 60), zeros_length=20)
        lc.greedy(model, list(range(1, 40)), steps=3)
        lc.SharedPrefix(model).grown_to(list(range(1, 30)))


@pytest.mark.parametrize("attn", ["softmax", "entmax15"])
def test_the_shared_prefix_gives_each_prompt_its_own_prefill(model, attn):
    """Cells taken by increasing prefix, each from a copy of the shared cache: the answer logits of the whole
    prompt prefilled at once, and the shared cache never holds a cell's own tokens."""
    import copy

    import hf_sparsemax as hs

    patched = copy.deepcopy(model)
    if attn != "softmax":
        hs.patch_model(patched, attn=attn)
    tokenizer = char_tokenizer()
    cells = sorted((lc.passkey_parts(tokenizer, 400, depth, key) for depth, key in ((0.7, 12345), (0.2, 67890),
                                                                                     (0.7, 13579))),
                   key=lambda c: len(c[0]))
    shared = lc.SharedPrefix(patched)
    with torch.no_grad():
        for prefix, rest, _ in cells:
            cache = shared.grown_to(prefix)
            assert cache.get_seq_length() == len(prefix) == len(shared.ids)
            got = patched(input_ids=torch.tensor([rest]), past_key_values=cache, use_cache=True).logits[0, -1]
            want = patched(input_ids=torch.tensor([prefix + rest])).logits[0, -1]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert shared.cache.get_seq_length() == len(prefix)
    with pytest.raises(ValueError, match="increasing order"):
        shared.grown_to(cells[0][0][:-1])


def test_the_passkey_cells_are_the_whole_prompts(monkeypatch):
    """passkey (cells reordered by prefix, each from the shared cache): the prompts the loops draw, each decoded
    to the tokens a fresh prefill of the whole prompt gives, and the accuracy of those tokens."""
    import random

    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=105, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512)).eval()
    spec = lc.LongSpec(contexts=[700, 340, 400], depths=[0.8, 0.1], trials=2, rope_factor=2.0, decode_context=400,
                       decode_steps=2, seed=3)  # 700: rope x2, a second shared prefix
    seen, original = {}, lc.greedy
    monkeypatch.setattr(lc, "greedy", lambda m, prompt, *a, **k: seen.setdefault(tuple(prompt), original(m, prompt, *a, **k)))
    got = lc.passkey(model, tokenizer, spec)
    rng, want = random.Random(3), {}
    with torch.no_grad():
        for context in spec.contexts:
            for depth in spec.depths:
                right = 0
                for _ in range(spec.trials):
                    prompt, answer = lc.passkey_prompt(tokenizer, context, depth, rng.randrange(10000, 100000))
                    with lc.extended_rope(model, lc.rope_for(model, context, spec.rope_factor)):
                        tokens, _ = original(model, prompt, len(answer))
                    assert seen.pop(tuple(prompt))[0] == tokens
                    right += tokens == answer
                want.setdefault(str(context), {})[f"{depth:g}"] = right / spec.trials
    assert not seen and got["passkey_accuracy"] == want and got["decode"]["context"] == 400


class MergingTokenizer:
    """Characters, except that "s" and a following space are one token: the answer's space merges with the
    question's last letter."""

    def __init__(self):
        self.chars = char_tokenizer()

    def __call__(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            if text[i:i + 2] == "s ":
                ids.append(999)
                i += 2
            else:
                ids.append(self.chars.convert_tokens_to_ids(text[i]))
                i += 1
        return type("Encoded", (), {"input_ids": ids})()

    def decode(self, ids):
        return "".join("s " if i == 999 else self.chars.convert_ids_to_tokens(i) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [self.decode([i]) for i in ids]


def test_a_tokenizer_that_splits_the_passkey_otherwise_is_refused():
    with pytest.raises(ValueError, match="splits the pass key 12345 differently"):
        lc.passkey_prompt(MergingTokenizer(), 600, 0.5, 12345)


def test_bad_long_context_settings_are_refused():
    with pytest.raises(RecipeError, match="unknown field"):
        lc.long_spec({"trails": 3})
    with pytest.raises(RecipeError, match="depths must be a list of shares"):
        lc.long_spec({"depths": [1.5]})
    with pytest.raises(RecipeError, match="rope_factor must be a number > 1"):
        lc.long_spec({"rope_factor": 1})
    with pytest.raises(RecipeError, match="trials must be a positive integer"):
        lc.long_spec({"trials": 0})
    spec = load_recipe("convert_long").eval.long_context  # cells of 5 trials at 3 depths, 8192 decoded
    assert spec.contexts == [4096, 8192] and len(spec.depths) == 3 and spec.trials == 5 and spec.decode_context == 8192


def run_of(name, ce, passkey, never=0.995):
    return {"variant": name, "seed": 0, "cross_entropy_by_length": ce, "passkey_accuracy": passkey,
            "attention_zero_share_at_length": 0.8, "keys_never_read": never,
            "decode": {"tokens_per_s": 2.0, "sdpa_tokens_per_s": 1.0, "ratio_to_sdpa": 2.0},
            "long_context": {**lc.LongSpec().__dict__, "contexts": [2048, 16384], "depths": [0.5], "trials": 2}}


def test_the_targets_at_length_say_met_or_missed_with_their_numbers():
    runs = [run_of("softmax_ce", {"0-512": 2.0, "512-2048": 2.0}, {"2048": {"0.5": 1.0}, "16384": {"0.5": 0.0}},
                   None),
            run_of("entmax15_converted", {"0-512": 2.02, "512-2048": 2.1},
                   {"2048": {"0.5": 0.5}, "16384": {"0.5": 0.5}}),
            run_of("entmax15_converted_length", {"0-512": 2.0, "512-2048": 2.0},
                   {"2048": {"0.5": 1.0}, "16384": {"0.5": 0.5}}, 0.5)]
    text = "\n".join(long_report.section(runs))
    assert "in every bucket: **MISSED**: 0-512: 2.020 vs 2.000 (+1.0%), 512-2048: 2.100 vs 2.000 (+5.0%)" in text
    assert "**MISSED**: mean 50% vs 100%, worst cell -50% (2 trial(s) a cell)" in text
    assert "at least as good as softmax_ce on the passkey: **met**: 50% vs 0%" in text
    assert "`entmax15_converted` decoding at 8192 tokens with >= 95% keys never read: **met**: 99.50%" in text
    assert "`entmax15_converted_length` decoding at 8192 tokens with >= 95% keys never read: **MISSED**: 50.00%" in text
    assert "| entmax15_converted | 1 | 2.020 (+1.0%) | 2.100 (+5.0%) | 80% | 99.50% |" in text
    assert "`entmax15_converted` with >= 90% of its attention weights exactly 0: **MISSED**: 80.0%" in text


def test_a_transferred_variant_gets_the_targets_and_its_layers_residuals_in_the_report():
    transferred = run_of("entmax_transferred", {"0-512": 2.01, "512-2048": 2.03},
                         {"2048": {"0.5": 1.0}, "16384": {"0.5": 0.0}})
    transferred.update(attention_zero_share_at_length=0.93, transfer={
        "error_before": 0.5, "error_calibrated": 0.06, "error_after": 0.01, "dense_heads": [[3, 1], [7, 0]],
        "layers": [[0.4, 0.05, 0.008], [0.6, 0.07, 0.012]], "blocks": 2, "block_size": 2048, "seconds": 9.0})
    soft = run_of("softmax_ce", {"0-512": 2.0, "512-2048": 2.0}, {"2048": {"0.5": 1.0}, "16384": {"0.5": 0.0}}, None)
    text = "\n".join(long_report.section([soft, transferred]))
    assert ("`entmax_transferred` within 2% of softmax_ce's held-out CE in every bucket: **met**: "
            "0-512: 2.010 vs 2.000 (+0.5%), 512-2048: 2.030 vs 2.000 (+1.5%)") in text
    assert "`entmax_transferred` with >= 90% of its attention weights exactly 0: **met**: 93.0%" in text
    assert "| entmax_transferred | 0 | 2 x 2048 | 0.5000 | 0.0600 | 0.0100 | 0.0120 (layer 1) | 3.1, 7.0 |" in text
    assert "Attention transfer" not in "\n".join(long_report.section([soft]))


def test_the_parent_is_the_first_row_and_a_converted_variant_never_far_above_it():
    """The untrained parent's cross-entropy: the table's first row (its gap to softmax_ce beside it), and the target
    "never more than 0.5% above the parent in any bucket" per converted variant, met or MISSED with each gap."""
    soft = run_of("softmax_ce", {"0-512": 2.0, "512-2048": 2.0}, {"2048": {"0.5": 1.0}, "16384": {"0.5": 0.0}}, None)
    converted = run_of("entmax_transferred", {"0-512": 2.02, "512-2048": 1.99},
                       {"2048": {"0.5": 1.0}, "16384": {"0.5": 0.0}})
    parent = {"cross_entropy_by_length": {"512-2048": 2.05, "0-512": 2.0}, "seconds": 1.0}  # as read back: text order
    text = "\n".join(long_report.section([soft, converted], parent))
    lines = text.splitlines()
    first = lines.index("| variant | seeds | CE 0-512 | CE 512-2048 | exact zeros | keys never read |") + 2
    assert lines[first] == "| parent, before any training | | 2.000 (+0.0%) | 2.050 (+2.5%) | | |"
    assert lines[first + 1].startswith("| softmax_ce | 1 | 2.000 | 2.000 |")
    assert ("`entmax_transferred` never more than 0.5% above the untrained parent's held-out CE in any bucket: "
            "**MISSED**: 0-512: +1.0%, 512-2048: -2.9%.") in text
    converted["cross_entropy_by_length"]["0-512"] = 2.008
    assert "any bucket: **met**: 0-512: +0.4%, 512-2048: -2.9%." in "\n".join(long_report.section([converted], parent))
    assert "untrained parent" not in "\n".join(long_report.section([soft, converted]))
    other = {"cross_entropy_by_length": {"0-512": 2.0}}  # other buckets than the runs': no row, no target
    assert "parent" not in "\n".join(long_report.section([soft, converted], other))


@pytest.mark.slow
def test_the_convert_long_recipe_runs_on_a_tiny_model(tiny_llama, tmp_path, monkeypatch):  # noqa: F811
    """recipes/convert_long.yaml shrunk to the tiny Llama (2048 positions): every variant, the long keys in each
    run's results.json (the zeros at length beside the heatmap head's, not over them), a context past the
    positions (rope x2), the certificate at 1100 keys, report and heatmap."""
    out = tmp_path / "convert_long"
    shrink = [f"model={tiny_llama}", "training.max_steps=2", "data.block_size=64", "data.train_size=2",
              "data.eval_size=1", "eval.max_new_tokens=2", "eval.heatmap_layer=0", "eval.prompts=[The]",
              "eval.long_context={documents: 1, length: 700, contexts: [600, 2200], depths: [0.5], trials: 1, "
              "rope_factor: 2.0, zeros_length: 64, decode_context: 2200, decode_steps: 2}",
              "variants.entmax_transferred.transfer={blocks: 1, block_size: 128, steps: 2, rows_per_batch: 16, "
              "dense_heads: 1}"]  # a reduced transfer, one head kept wide: a hybrid model served at length
    heatmap = []  # the heatmap head's share of zeros, as the comparison computes it
    monkeypatch.setattr(report, "zero_share", lambda weights, share=report.zero_share: heatmap.append(share(weights))
                        or heatmap[-1])

    def forward_document(*args, forward=lc.forward_document, **kwargs):  # zeros at length unlike the heatmap's
        losses, zeros = forward(*args, **kwargs)
        return losses, None if zeros is None else 0.125

    monkeypatch.setattr(lc, "forward_document", forward_document)
    assert run("compare", "convert_long", "--output", out, *(a for s in shrink for a in ("--set", s))) == 0
    names = ["softmax_ce", "entmax15_converted", "entmax_transferred"]
    per_head = sum(len(layer) for name in names for layer in json.loads(  # a learned alpha's heads, each counted
        (out / f"{name}-seed0" / "results.json").read_text()).get("attention_zero_heads") or [])
    assert len(heatmap) == 2 * len(names) + per_head  # each run's (and its heads'), then the report's figure titles
    for name, zeros in zip(names, heatmap):
        result = json.loads((out / f"{name}-seed0" / "results.json").read_text())
        assert result["attention_zero_share"] == zeros and result["attention_zero_share_at_length"] == 0.125
        assert set(result["cross_entropy_by_length"]) == {"0-512", "512-2048"}
        assert set(result["passkey_accuracy"]) == {"600", "2200"}
        assert all(v in (0.0, 1.0) for row in result["passkey_accuracy"].values() for v in row.values())
        assert result["decode"]["context"] == 2200 and result["decode"]["tokens_per_s"] > 0
        parts = result["part_seconds"]  # where the time went: [wall, cpu] seconds of each part
        assert {"prepare", "train", "evaluate", "decoders_and_samples", "heatmap", "long_context"} <= set(parts)
        assert ("calibrate" in parts) == (name.startswith("entmax15_converted"))
        assert ("transfer" in parts) == ("transfer" in result) == (name == "entmax_transferred")
        if name == "entmax_transferred":
            transfer = result["transfer"]
            assert len(transfer["dense_heads"]) == 1 and transfer["block_size"] == 128
            assert transfer["error_after"] <= transfer["error_calibrated"] <= transfer["error_before"]
            assert result["distill"]["logit_weight"] == 1.0
        assert all(len(pair) == 2 and min(pair) >= 0 for pair in parts.values())
        seconds = result["long_context"]["passkey_seconds"]
        assert set(seconds) == {"600", "2200"} and all(set(p) == {"prefix", "prompt"} for p in seconds.values())
        assert 0 < result["decode"]["seconds"] <= seconds["2200"]["prompt"][0] + 0.1
        if name == "softmax_ce":
            assert result["keys_never_read"] is None
        else:
            assert 0 <= result["keys_never_read"] <= 1 and result["keys_never_read_by_context"]["600"] is None
    text = (out / "report.md").read_text()
    assert "## At length" in text and "Passkey accuracy at 2200 tokens, rope x2.0" in text
    assert "(passkey_heatmap.png)" in text and (out / "passkey_heatmap.png").is_file()
    assert "Attention transfer" in text and "| entmax_transferred | 0 | 1 x 128 |" in text
    parent = json.loads((out / "parent_at_length.json").read_text())  # measured once, before any variant
    assert set(parent["cross_entropy_by_length"]) == {"0-512", "512-2048"}
    assert "| parent, before any training | |" in text and "above the untrained parent's held-out CE" in text


def test_the_length_scale_trains_at_its_own_learning_rate(model, tmp_path):
    """scale_learning_rate: the length scale's delta, beta, gamma in one optimizer group at that rate, without
    weight decay, and nowhere else; a variant without a learned query scale is refused."""
    import copy

    from transformers import Trainer, TrainingArguments

    import hf_sparsemax as hs
    from hf_sparsemax.app import runner

    patched = copy.deepcopy(model)
    hs.patch_model(patched, attn="entmax15", attn_options={"length_scale": True})
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-3, weight_decay=0.1, use_cpu=True,
                             report_to="none")
    trainer = runner.own_rate_trainer(Trainer, {"query_scale": 0.05})(model=patched, args=args)
    groups = trainer.create_optimizer().param_groups
    scales = {id(p) for _, p in hs.query_scale_parameters(patched)}
    assert len(scales) == 3 * 2  # delta, beta, gamma of 2 layers
    own = [g for g in groups if g.get("hf_sparsemax_group") == "query_scale"]
    assert len(own) == 1 and {id(p) for p in own[0]["params"]} == scales
    assert own[0]["lr"] == 0.05 and own[0]["weight_decay"] == 0.0
    assert not any(id(p) in scales for g in groups if g is not own[0] for p in g["params"])
    with pytest.raises(RecipeError, match="scale_learning_rate is the learning rate of learned query scales"):
        load_recipe("convert_long", ["variants.entmax15_converted.scale_learning_rate=0.05"])
    length = ["variants.entmax15_converted.attn_options={temperature: true, length_scale: true}",
              "variants.entmax15_converted.scale_learning_rate=5e-2"]
    assert load_recipe("convert_long", length).variant("entmax15_converted").scale_learning_rate == 0.05
