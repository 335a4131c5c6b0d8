"""Recipes and the train / evaluate / generate / compare commands, on tiny random models and real fortunes text."""

import json
import math
import os
import string

import numpy as np
import pytest
import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast, Trainer)

import hf_sparsemax_cli as console
from hf_sparsemax.app import cli, report, runner
from hf_sparsemax.app.recipes import RECIPE_DIR, RecipeError, load_recipe

CHARS = ["<pad>", "</s>", "<s>", "[CLS]", "[SEP]", *string.printable]


def char_tokenizer(**special):
    raw = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARS)}, unk_token="?"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                   **special)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer Llama with a character tokenizer (real fortunes text tokenizes into it)."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(CHARS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_bert")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(CHARS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=128, pad_token_id=0)
    BertForSequenceClassification(config).bert.save_pretrained(folder)
    char_tokenizer(cls_token="[CLS]", sep_token="[SEP]").save_pretrained(folder)
    return str(folder)


def write_recipe(tmp_path, model, **changes):
    """A small causal-LM recipe on real fortunes text; ``changes`` replace top-level sections."""
    recipe = {
        "name": "tiny",
        "model": model,
        "data": {"source": "fortunes", "categories": ["murphy"], "block_size": 32, "train_size": 16,
                 "eval_size": 4},
        "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "training": {"max_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 1e-2, "save_steps": 2,
                     "disable_tqdm": True},
        "eval": {"batch_size": 4, "max_new_tokens": 6, "prompts": ["Murphy", "If"], "heatmap_text": "Anything goes"},
        "variants": {
            "softmax_ce": {},
            "entmax15": {"attn": "entmax15", "loss": "entmax15"},
            "top3": {"attn": "sparse_softmax", "attn_options": {"top_k": 2}, "loss": "sparse_softmax",
                     "loss_options": {"top_k": 3}},
        },
    }
    recipe.update(changes)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def run(*argv):
    return console.main([str(a) for a in argv])


def refuse(name):
    raise ValueError(f"not strict JSON: bare {name}")


def strict_json(path):
    """A JSON file read by a strict parser: bare Infinity / NaN (Python's extension, which jq refuses) fail."""
    return json.loads(path.read_text(), parse_constant=refuse)


def test_json_files_are_strict_and_read_back_as_written(tmp_path):
    data = {"ce": math.inf, "low": -math.inf, "nan": math.nan, "rows": [{"x": 1.5, "y": [math.inf]}], "n": 3,
            "text": "inf"}
    runner.write_json(tmp_path / "r.json", data)
    assert strict_json(tmp_path / "r.json") == {"ce": "Infinity", "low": "-Infinity", "nan": "NaN",
                                                "rows": [{"x": 1.5, "y": ["Infinity"]}], "n": 3, "text": "inf"}
    back = runner.read_json(tmp_path / "r.json")
    assert back["ce"] == math.inf and back["low"] == -math.inf and math.isnan(back["nan"])
    assert back["rows"] == [{"x": 1.5, "y": [math.inf]}] and back["text"] == "inf" and back["n"] == 3
    with pytest.raises(ValueError):
        json.loads('{"a": Infinity}', parse_constant=refuse)  # the parser refuses what json.dump wrote before


def same_json(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


TEXTS = ["NaN", "Infinity", "-Infinity", "\u0000", "\u0000NaN", "nan", "inf", ""]


def test_texts_that_spell_a_non_finite_number_come_back_as_texts(tmp_path):
    """A prompt, a sample or a label that reads "NaN" / "Infinity" / "-Infinity" (or begins with the mark that
    tells texts apart) is a text after a write and a read, and twice so (a results file merged and written again,
    as ``generate`` and ``compare --resume`` do); a non-finite number is a float (:func:`same_json` tells them
    apart: Python's JSON writes a float NaN bare and a text quoted)."""
    data = {"samples": [{"prompt": text, "text": text} for text in TEXTS], "labels": TEXTS,
            "numbers": [math.inf, -math.inf, math.nan, 1.5], "NaN": "NaN", "nested": [[math.nan, "NaN"]]}
    runner.write_json(tmp_path / "results.json", data)
    strict_json(tmp_path / "results.json")  # still strict JSON
    assert same_json(runner.read_json(tmp_path / "results.json"), data)
    from hf_sparsemax.app.commands import update_results

    update_results(str(tmp_path), {"more": ["Infinity", math.inf]})
    update_results(str(tmp_path), {"again": "-Infinity"})
    back = runner.read_json(tmp_path / "results.json")
    assert same_json(back, {**data, "more": ["Infinity", math.inf], "again": "-Infinity"})


def test_results_files_written_before_texts_were_marked_read_back_as_written(tmp_path):
    """Files of earlier versions held non-finite numbers as the bare strings and no marked texts: read as before."""
    (tmp_path / "old.json").write_text('{"ce": "Infinity", "low": "-Infinity", "nan": "NaN", "text": "a prompt"}')
    back = runner.read_json(tmp_path / "old.json")
    assert back["ce"] == math.inf and back["low"] == -math.inf and math.isnan(back["nan"])
    assert back["text"] == "a prompt"


def test_shipped_recipes_are_valid():
    for name in ("default", "classify"):
        recipe = load_recipe(os.path.join(RECIPE_DIR, name + ".yaml"))
        assert len(recipe.all_variants()) == {"default": 5, "classify": 4}[name]  # classify: + am_softmax
    default = load_recipe("default", ["training.max_steps=7", "variants.entmax15_loss.loss_options={}"])
    assert default.training["max_steps"] == 7 and default.training["report_to"] == "none"
    # each variant changes one thing against softmax_ce: the attention or the loss
    assert [v.describe() for v in default.all_variants()] == [
        "attn=softmax loss=cross_entropy", "attn=softmax loss=sparse_softmax(top_k=10)",
        "attn=softmax loss=entmax15", "attn=entmax15 loss=cross_entropy",
        "attn=entmax_bisect(alpha=1.05, learn_alpha=True) loss=cross_entropy"]


def test_overrides_reach_their_field_and_unknown_fields_are_refused():
    recipe = load_recipe("default", ["data.block_size=16", "lora.r=2", "variants.top3={loss: sparsemax}",
                                     "eval.prompts=[hi]"])
    assert recipe.data.block_size == 16 and recipe.lora["r"] == 2 and recipe.eval.prompts == ["hi"]
    assert recipe.variant("top3").loss == "sparsemax" and recipe.variant("top3").attn == "softmax"
    for bad in ("training.max_stepz=3", "data.blocksize=3", "lora.rank=3", "modle=x", "variants.x.los=y",
                "variants.entmax15_attn.attn=entmax17", "variants.entmax15_loss.loss_options.top_k=3",
                "data.block_size=0", "variants.entmax15_attn.alpha_learning_rate=0.1",
                "variants.learned_alpha_attn.alpha_learning_rate=-1",
                "variants.learned_alpha_attn.alpha_learning_rate=fast"):
        with pytest.raises(RecipeError):
            load_recipe("default", [bad])


def test_train_evaluate_generate(tiny_llama, tmp_path, capsys):
    recipe, out = write_recipe(tmp_path, tiny_llama), tmp_path / "runs"
    assert run("train", recipe, "--variant", "entmax15", "--output", out) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("hf-sparsemax: trained 'entmax15' (3 steps") and "epsilon-perplexity" in summary
    folder = out / "entmax15"
    assert sorted(os.listdir(out)) == ["entmax15"]  # no .partial left, checkpoints removed
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(folder / "model"))
    results = json.loads((folder / "results.json").read_text())
    assert results["steps"] == 3 and results["tokens"] == 4 * 31 and results["sample_zero_prob_share"] == 0
    assert 0 <= results["zero_prob_share"] <= 1 and results["epsilon_perplexity"] > 1

    assert run("evaluate", recipe, "--variant", "entmax15", "--output", out) == 0
    printed = capsys.readouterr().out
    evaluated = json.loads(printed[printed.index("{\n"):printed.rindex("}") + 1])
    assert evaluated["epsilon_perplexity"] == pytest.approx(results["epsilon_perplexity"], rel=1e-5)
    assert evaluated["support_size"] == pytest.approx(results["support_size"], rel=1e-5)
    assert [d["decoder"] for d in evaluated["decoders"]] == [d["decoder"] for d in results["decoders"]]
    assert evaluated["decoders"][1]["outside_support_mass"] == pytest.approx(
        results["decoders"][1]["outside_support_mass"], rel=1e-5)

    assert run("generate", recipe, "--variant", "entmax15", "--output", out, "--set", "eval.prompts=[Hello]") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("Hello") and "zero-probability tokens drawn: 0.000" in lines[-1]


def test_compare_writes_a_complete_report(tiny_llama, tmp_path, capsys):
    recipe, out = write_recipe(tmp_path, tiny_llama), tmp_path / "report"
    assert run("compare", recipe, "--output", out, "--set", "training.max_steps=2") == 0
    printed = capsys.readouterr()
    lines = printed.out.strip().splitlines()
    summary = lines[-1]
    assert summary.startswith("hf-sparsemax: compared 3 variants") and summary.endswith("report.md")
    # one line per variant as it starts, saying what it changes; no Trainer log dicts; the verdict at the end
    assert [line for line in lines if line.startswith("hf-sparsemax: [")] == [
        "hf-sparsemax: [1/3] entmax15: attention -> entmax15, loss -> entmax15",
        "hf-sparsemax: [2/3] softmax_ce: the recipe's own settings (softmax attention, cross_entropy loss)",
        "hf-sparsemax: [3/3] top3: attention -> sparse_softmax(top_k=2), loss -> sparse_softmax(top_k=3)"]
    assert "{'loss'" not in printed.out + printed.err and lines[-3].startswith("- Time: training CPU time")
    files = set(os.listdir(out))
    assert {"report.md", "loss_curves.png", "attention_heatmap.png", "samples.txt", "results.json",
            "softmax_ce", "entmax15", "top3"} <= files
    assert not os.path.exists(str(out) + ".partial")
    text = (out / "report.md").read_text()
    table = [line for line in text.split("\n\n") if line.startswith("| variant | attention")][0].splitlines()
    assert len(table) == 2 + 3 and "eps-perplexity" in table[0]
    results = {r["variant"]: r for r in strict_json(out / "results.json")}
    assert results["softmax_ce"]["zero_prob_share"] == 0 and results["softmax_ce"]["cross_entropy"] < 10
    assert results["top3"]["cross_entropy"] == "Infinity"  # a held-out token at p = 0: strict JSON's string for it
    for name in ("recipe.json", "top3/results.json", "top3/log_history.json", "top3/variant.json"):
        strict_json(out / name)
    assert results["top3"]["support_size"] == 3 and results["top3"]["sample_zero_prob_share"] == 0
    assert results["top3"]["attention_zero_share"] > 0 and results["softmax_ce"]["attention_zero_share"] == 0
    # every layer and head on held-out blocks, apart from the heatmap's one head on one sentence
    assert results["top3"]["heldout_attention_zero_share"] > 0 == results["softmax_ce"]["heldout_attention_zero_share"]
    assert all(r["train_cpu_seconds"] > 0 and len(r["train_load"]) == 2 for r in results.values())
    assert text.startswith("# hf-sparsemax compare: recipe `tiny`\n\n## Verdict\n\n- **Time**: training CPU time")
    assert "attention zeros (held-out, all heads) | heatmap head zeros | train CPU s |" in table[0]
    assert "=== top3" in (out / "samples.txt").read_text()
    assert all(r["eval_examples"] == 4 for r in results.values())

    # the decoder table: every variant under each distribution a user could sample it from
    decoders = {name: {row["decoder"]: row for row in r["decoders"]} for name, r in results.items()}
    assert list(decoders["softmax_ce"]) == ["matched", "top-k=10", "top-p=0.9", "top-k=50 (transformers default)"]
    assert list(decoders["top3"]) == list(decoders["entmax15"]) == ["matched", "plain generate (softmax, top-k=50)"]
    for name, rows in decoders.items():
        matched = rows["matched"]
        assert matched["outside_support_mass"] == 0 and matched["tokens"] == results[name]["tokens"]
        for key in ("epsilon_perplexity", "sparsemax_score", "jensen_shannon", "zero_prob_share", "support_size"):
            assert matched[key] == pytest.approx(results[name][key], rel=1e-4, abs=1e-6), (name, key)
    assert all(row["outside_support_mass"] == 0 for row in decoders["softmax_ce"].values())
    assert decoders["softmax_ce"]["top-k=10"]["support_size"] == 10
    assert decoders["softmax_ce"]["top-k=50 (transformers default)"]["support_size"] == 50
    assert decoders["softmax_ce"]["top-k=10"]["zero_prob_share"] > 0 == decoders["softmax_ce"]["matched"][
        "zero_prob_share"]
    for name in ("top3", "entmax15"):
        plain = decoders[name]["plain generate (softmax, top-k=50)"]
        assert plain["support_size"] == 50 and 0 <= plain["outside_support_mass"] < 1
    # top-50 keeps 47 tokens the top-3 loss rules out (the tiny entmax15 keeps ~97 of 105: top-50 stays inside)
    assert decoders["top3"]["plain generate (softmax, top-k=50)"]["outside_support_mass"] > 0.5
    rows = [line for line in text.split("\n\n") if line.startswith("| variant | decoder")][0].splitlines()
    assert len(rows) == 2 + 4 + 2 + 2 and "mass outside trained support" in rows[0]
    assert sum(row.startswith("| softmax_ce | top-p=0.9 |") for row in rows) == 1


def test_resume_continues_from_the_last_checkpoint(tiny_llama, tmp_path, monkeypatch):
    recipe = write_recipe(tmp_path, tiny_llama)
    steps = ["--set", "training.max_steps=6", "--variant", "top3"]
    assert run("train", recipe, "--output", tmp_path / "whole", *steps) == 0
    whole = json.loads((tmp_path / "whole" / "top3" / "log_history.json").read_text())

    original = Trainer.training_step

    def interrupted(self, *args, **kwargs):
        if self.state.global_step == 5:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "training_step", interrupted)
    assert run("train", recipe, "--output", tmp_path / "cut", *steps) == 130  # Ctrl-C: one line, exit 130
    assert not (tmp_path / "cut" / "top3").exists()  # nothing published
    assert os.listdir(tmp_path / "cut" / "top3.partial" / "checkpoints") == ["checkpoint-4"]
    monkeypatch.setattr(Trainer, "training_step", original)
    assert run("train", recipe, "--output", tmp_path / "cut", "--resume", *steps) == 0
    resumed = json.loads((tmp_path / "cut" / "top3" / "log_history.json").read_text())
    def steps_and_losses(history):
        logged = [e for e in history if "loss" in e]
        return [e["step"] for e in logged], [e["loss"] for e in logged]

    resumed_steps, resumed_losses = steps_and_losses(resumed)
    whole_steps, whole_losses = steps_and_losses(whole)
    assert resumed_steps == whole_steps == [1, 2, 3, 4, 5, 6]
    assert resumed_losses[-2:] == pytest.approx(whole_losses[-2:], rel=1e-5)
    assert json.loads((tmp_path / "cut" / "top3" / "results.json").read_text())["resumed_from"] == "checkpoint-4"


def test_classification_recipe_reports_accuracy_and_macro_f1(tiny_bert, tmp_path, capsys):
    recipe = {
        "name": "cls", "task": "sequence_classification", "model": tiny_bert,
        "data": {"source": "fortunes", "categories": ["limerick", "murphy", "zippy"], "train_size": 8,
                 "eval_size": 4, "max_length": 64},
        "training": {"max_steps": 2, "per_device_train_batch_size": 8, "learning_rate": 1e-3, "disable_tqdm": True},
        "variants": {"ce": {}, "sparsemax": {"loss": "sparsemax"}},
    }
    path = tmp_path / "cls.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert run("compare", path, "--output", tmp_path / "out") == 0
    assert "best macro-f1" in capsys.readouterr().out.strip().splitlines()[-1]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["variant"] for r in results] == ["ce", "sparsemax"]
    for r in results:
        assert 0 <= r["accuracy"] <= 1 and 0 <= r["macro_f1"] <= 1 and r["tokens"] == 12
    assert "macro-F1" in (tmp_path / "out" / "report.md").read_text()


def gguf_of(path, architecture):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("case", ["yaml", "field", "override", "model", "data", "gguf", "variant", "option"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tiny_llama, tmp_path, capsys, case):
    recipe = write_recipe(tmp_path, tiny_llama)
    args = ["train", recipe, "--output", tmp_path / "out"]
    if case == "yaml":
        (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
        args[1] = tmp_path / "bad.yaml"
    elif case == "field":
        args[1] = write_recipe(tmp_path, tiny_llama, trainer={"max_steps": 2})
    elif case == "override":
        args += ["--set", "training.max_step=2"]
    elif case == "model":
        args += ["--set", f"model={tmp_path / 'no_such_model'}"]
    elif case == "data":
        args += ["--set", f"data.source={tmp_path / 'missing.txt'}"]
    elif case == "gguf":
        args += ["--set", f"model={gguf_of(tmp_path / 'bert.gguf', 'bert')}"]
    elif case == "variant":
        args += ["--variant", "nope"]
    else:
        args += ["--set", "variants.entmax15.attn_options={top_k: 3}"]
    capsys.readouterr()
    assert run(*args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-sparsemax: error:") and "\n" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_two_processes_give_the_losses_of_one(tiny_llama, tmp_path):
    """``accelerate launch --num_processes 2`` on CPU (gloo), half the batch per process: the same run."""
    import subprocess
    import sys

    recipe = write_recipe(tmp_path, tiny_llama)
    common = ["train", recipe, "--variant", "top3", "--set", "training.max_steps=4"]
    assert run(*common, "--output", tmp_path / "one", "--set", "training.per_device_train_batch_size=4") == 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hf_sparsemax_cli"]
    done = subprocess.run([*launch, *map(str, common), "--output", str(tmp_path / "two"),
                           "--set", "training.per_device_train_batch_size=2"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("hf-sparsemax: trained 'top3'") == 1  # one summary line, from the main process

    def losses(folder):
        history = json.loads((tmp_path / folder / "top3" / "log_history.json").read_text())
        return [e["loss"] for e in history if "loss" in e]

    assert len(losses("two")) == 4
    assert losses("two") == pytest.approx(losses("one"), rel=1e-4)


@pytest.mark.slow
def test_default_recipe_on_the_real_smollm2(tmp_path, capsys):
    """The README's main job, shrunk to 2 steps of 8 short blocks per variant."""
    out = tmp_path / "default"
    shrink = ["training.max_steps=2", "data.block_size=32", "data.train_size=16", "data.eval_size=4",
              "eval.max_new_tokens=8", "training.disable_tqdm=true"]
    assert run("compare", "default", "--output", out, *(a for s in shrink for a in ("--set", s))) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert "best epsilon-perplexity" in printed[-1] and printed[-2].startswith("- Memory: peak resident memory")
    results = {r["variant"]: r for r in strict_json(out / "results.json")}
    verdict = (out / "report.md").read_text().split("## Verdict\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split("**")[1] for line in verdict] == [
        "Which loss keeps quality, at which sparsity", "Which attention", "Time", "Memory"]
    eps = results["entmax15_attn"]["epsilon_perplexity"]
    assert f"`entmax15_attn` attends with {results['entmax15_attn']['heldout_attention_zero_share']:.0%}" in verdict[1]
    assert f"epsilon-perplexity {eps:.2f}" in verdict[1] and "`learned_alpha_attn`" in verdict[1]
    assert results["entmax15_attn"]["heldout_attention_zero_share"] > 0.2
    assert list(results) == ["softmax_ce", "sparse_softmax_top10", "entmax15_loss", "entmax15_attn",
                             "learned_alpha_attn"]
    assert 0 < results["softmax_ce"]["cross_entropy"] < 10 and results["softmax_ce"]["zero_prob_share"] == 0
    assert results["sparse_softmax_top10"]["support_size"] == 10
    assert results["entmax15_attn"]["attention_zero_share"] > 0.2 and results["softmax_ce"]["attention_zero_share"] == 0
    for name in ("entmax15_attn", "learned_alpha_attn"):  # sparse attention, dense (softmax) output distribution
        assert results[name]["zero_prob_share"] == 0 and 0 < results[name]["cross_entropy"] < 10
    for r in results.values():
        assert r["sample_zero_prob_share"] == 0 and r["steps"] == 2 and 1 < r["epsilon_perplexity"] < 1e6
        assert all(len(text.split()) >= 2 for text in r["texts"]), r["texts"]
    for name in results:
        assert (out / name / "model" / "adapter_model.safetensors").is_file()
    assert {"report.md", "loss_curves.png", "attention_heatmap.png", "samples.txt",
            "learned_alphas.png"} <= set(os.listdir(out))
    assert results["learned_alpha_attn"]["alpha_learning_rate"] == 0.1 and "## Learned alphas" in (
        out / "report.md").read_text()


def test_learned_alpha_variant_records_its_trained_alphas(tiny_llama, tmp_path):
    variants = "variants={alpha: {attn: entmax_bisect, attn_options: {alpha: 1.05, learn_alpha: true}}}"
    recipe, out = write_recipe(tmp_path, tiny_llama), tmp_path / "runs"
    assert run("train", recipe, "--output", out, "--set", variants, "--set", "training.learning_rate=0.5") == 0
    results = json.loads((out / "alpha" / "results.json").read_text())
    low, mean, high = (results[f"learned_alpha_{k}"] for k in ("min", "mean", "max"))
    assert 1 < low <= mean <= high < 2 and high - low > 1e-4  # one alpha per layer and head, trained apart
    assert results["zero_prob_share"] == 0  # cross-entropy: the output distribution stays softmax
    assert run("train", recipe, "--output", tmp_path / "plain", "--variant", "top3", "--set",
               "training.max_steps=1") == 0
    assert "learned_alpha_mean" not in json.loads((tmp_path / "plain" / "top3" / "results.json").read_text())


def test_the_report_shows_what_the_learned_alphas_learned(tiny_llama, tmp_path):
    """Alphas per layer and head before and after training, the share of heads past a sparse alpha, their
    attention zeros; at a fine-tuning rate the alphas stay where they started and the report says so, with
    ``alpha_learning_rate`` (their own optimizer group) they move."""
    learned = "{attn: entmax_bisect, attn_options: {alpha: 1.05, learn_alpha: true}"
    variants = f"variants={{still: {learned}}}, fast: {learned}, alpha_learning_rate: 0.5}}}}"
    recipe, out = write_recipe(tmp_path, tiny_llama), tmp_path / "report"
    assert run("compare", recipe, "--output", out, "--set", variants, "--set", "training.learning_rate=1e-4") == 0
    results = {r["variant"]: r for r in json.loads((out / "results.json").read_text())}
    for r in results.values():
        start, end = np.asarray(r["learned_alpha_start"]), np.asarray(r["learned_alpha_end"])
        assert start.shape == end.shape == np.asarray(r["attention_zero_heads"]).shape == (2, 4)  # layers, heads
        np.testing.assert_allclose(start, 1.05, rtol=1e-6)
        assert r["learned_alpha_max"] == pytest.approx(end.max())
    change = {name: np.abs(np.subtract(r["learned_alpha_end"], r["learned_alpha_start"])).max()
              for name, r in results.items()}
    assert change["still"] < 1e-3 and change["fast"] > 0.02, change
    assert results["fast"]["alpha_learning_rate"] == 0.5 and "alpha_learning_rate" not in results["still"]
    assert "learned_alphas.png" in os.listdir(out)
    text = (out / "report.md").read_text()
    lines = {name: next(line for line in text.splitlines() if line.startswith(f"- `{name}`")) for name in results}
    sparse = report.learned_alpha_summary(results["fast"])["sparse_end"]
    assert f"{sparse:.0%} at the end" in lines["fast"] and "alpha learning rate 0.5" in lines["fast"]
    assert "did not move" in text.split(lines["still"])[1].split("\n- ")[0] and "did not move" not in (
        text.split(lines["fast"])[1].split("\n- ")[0])
    assert "![learned_alphas.png](learned_alphas.png)" in text


def test_learned_alpha_summary_counts_heads_past_the_sparse_alpha():
    r = {"learned_alpha_start": [[1.05, 1.05], [1.05, 1.12]], "learned_alpha_end": [[1.2, 1.05], [1.1, 1.0]],
         "attention_zero_heads": [[0.5, 0.0], [0.3, 0.1]]}
    summary = report.learned_alpha_summary(r, threshold=1.1)
    assert summary == pytest.approx({"heads": 4, "sparse_start": 0.25, "sparse_end": 0.5, "max_change": 0.15,
                                     "mean_change": (0.15 + 0 + 0.05 - 0.12) / 4, "sparse_zeros": 0.4,
                                     "all_zeros": 0.225})
    assert report.learned_alpha_summary({**r, "attention_zero_heads": None}, 1.3)["sparse_zeros"] is None
    assert report.learned_alpha_section([{"variant": "plain"}]) == []


@pytest.mark.slow
def test_the_convert_recipe_runs_on_a_tiny_model(tiny_llama, tmp_path):
    """recipes/convert.yaml shrunk to the tiny Llama: four variants, curves, temperatures, alphas, targets."""
    out = tmp_path / "convert"
    shrink = [f"model={tiny_llama}", "seeds=[0]", "training.max_steps=2", "data.categories=[murphy]",
              "data.block_size=32", "data.train_size=16", "data.eval_size=4", "training.per_device_train_batch_size=4",
              "eval={batch_size: 4, max_new_tokens: 4, prompts: [If], heatmap_text: Anything goes, heatmap_layer: 0, "
              "curve_every: 1, curve_blocks: 2}", "variants.entmax15_converted.calibrate=1",
              "variants.learned_alpha_converted.calibrate=1"]
    assert run("compare", "convert", "--output", out, *(a for s in shrink for a in ("--set", s))) == 0
    table = json.loads((out / "results.json").read_text())
    assert [r["variant"] for r in table] == ["softmax_ce", "entmax15_swap", "entmax15_converted",
                                             "learned_alpha_converted"]
    runs = {r["variant"]: r["runs"][0] for r in table}
    for name, r in runs.items():  # today's fields, and the curves: step 0, every step
        assert {"variant", "cross_entropy", "attention_zero_share", "seed"} <= set(r) and r["seed"] == 0
        assert [p["step"] for p in r["curve"]] == [0, 1, 2] and r["step0_loss"] == r["curve"][0]["eval_loss"]
    assert runs["softmax_ce"]["heldout_attention_zero_share"] == 0  # (the tiny model's scores are too flat for zeros)
    assert all(0 <= r["heldout_attention_zero_share"] <= 1 for r in runs.values())
    assert runs["softmax_ce"]["step0_loss"] == pytest.approx(runs["entmax15_converted"]["curve"][0]["eval_loss"],
                                                            rel=0.5)
    converted = runs["entmax15_converted"]
    assert len(converted["temperatures"]) == 2 and all(len(layer) == 4 for layer in converted["temperatures"])
    assert converted["calibration"]["error_after"] <= converted["calibration"]["error_before"]
    assert converted["alpha_schedule"] == {"share": 0.3, "start": 1.01} and converted["distill"]["share"] == 0.5
    assert np.asarray(runs["learned_alpha_converted"]["learned_alpha_end"]).shape == (2, 4)
    saved = json.loads((out / "entmax15_converted-seed0" / "variant.json").read_text())["settings"]
    assert saved["attn"] == "entmax15" and saved["attn_options"]["temperature"] == converted["temperatures"]
    text = (out / "report.md").read_text()
    assert "## Conversion" in text and "step 0 after calibration" in text and "(curves.png)" in text
    assert (out / "curves.png").is_file()


def test_the_conversion_targets_say_met_or_missed_with_their_numbers():
    from hf_sparsemax.app import convert_report

    def run_of(variant, seed, ce, step0, zeros, alphas=None):
        curve = [{"step": 0, "eval_loss": step0, "attention_zero_share": 0.0},
                 {"step": 4, "eval_loss": ce, "attention_zero_share": zeros}]
        return {"variant": variant, "seed": seed, "cross_entropy": ce, "step0_loss": step0, "curve": curve,
                "heldout_attention_zero_share": zeros, **({"learned_alpha_end": alphas} if alphas else {})}

    runs = [run_of("softmax_ce", s, 4.0 + 0.01 * s, 4.2, 0.0) for s in range(2)]
    runs += [run_of("entmax15_swap", s, 4.3, 5.0, 0.8) for s in range(2)]
    runs += [run_of("entmax15_converted", s, 4.05, 4.3, 0.7) for s in range(2)]
    runs += [run_of("learned_alpha_converted", s, 4.2, 4.2, 0.1, [[1.4, 1.5], [1.5, 1.55]]) for s in range(2)]
    text = "\n".join(convert_report.conversion_section(runs))
    assert "within 2% of softmax_ce with >= 60% exact zeros: **met**: held-out CE 4.050 ± 0.000 vs 4.005 ± 0.007" in text
    assert "step 0 after calibration within 5% of the unpatched model: **met**: 4.300 vs 4.200 (+2.4%); the plain " \
           "swap at step 0: 5.000 (+19.0%)" in text
    assert "alphas spread >= 0.2: **MISSED**: held-out CE 4.200 ± 0.000 (+4.9%), alphas spread over 0.150" in text
    assert "| entmax15_converted | 2 | 4.300 | 4.050 ± 0.000 | +1.1% | 70% |  |" in text


def test_the_console_shows_a_progress_bar_with_the_loss_and_each_warning_once(tiny_llama, tmp_path, capsys):
    recipe = write_recipe(tmp_path, tiny_llama)
    assert run("train", recipe, "--variant", "top3", "--output", tmp_path / "runs",
               "--set", "training.disable_tqdm=false") == 0
    printed = capsys.readouterr()
    assert "hf-sparsemax: training top3: attention -> sparse_softmax(top_k=2), loss -> sparse_softmax(top_k=3)" in \
        printed.out
    bar = printed.err.replace("\r", "\n")
    assert "top3 training: 100%" in bar and "loss=" in bar  # tqdm, the last logged loss in the bar
    bars = [line for line in bar.splitlines() if "%|" in line]
    assert any(line.startswith("top3 evaluation: ") for line in bars)  # Trainer's evaluation bar, named too
    assert not [line for line in bars if line.lstrip()[:1].isdigit()], bars  # no bar without a name
    assert "{'loss'" not in printed.out + printed.err and "'train_runtime'" not in printed.out + printed.err


def test_each_warning_once_survives_catch_warnings():
    """A dependency's warning repeated in every variant is shown once, although catch_warnings in between clears
    the registry the filter action "once" relies on."""
    import warnings

    def warn():
        warnings.warn("deprecated thing", FutureWarning)

    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("default")
        with cli.each_warning_once():
            for _ in range(3):
                warn()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
            warnings.warn("another", FutureWarning)
        warn()  # outside the block: shown as the filters say
    assert [str(w.message) for w in log] == ["deprecated thing", "another", "deprecated thing"]
