"""Your own data in a recipe: held-out files / splits used as given, null sizes, natural label distribution,
unseen held-out labels refused, per-class classification metrics and the confusion-matrix plot."""

import json
import os
from collections import Counter

import pytest
import torch
import yaml
from test_recipes import char_tokenizer, run, tiny_bert  # noqa: F401  (tiny_bert is a fixture)

from hf_sparsemax.metrics import sparse_text as metrics
from hf_sparsemax.app import runner
from hf_sparsemax.app.recipe_data import causal_lm_datasets, classification_datasets, held_out
from hf_sparsemax.app.recipes import DataSpec, RecipeError

WORDS = "apple river stone cloud lemon tiger piano violet mirror candle harbor meadow".split()


def sentence(i: int, label: str) -> str:
    return f"{label} {WORDS[i % len(WORDS)]} {WORDS[(3 * i + 1) % len(WORDS)]} number {i}"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps({"text": t, "label": l}) + "\n" for t, l in rows))
    return str(path)


def labelled(counts: dict[str, int], start: int = 0, train_side: bool | None = None):
    """``counts[label]`` entries per label; ``train_side``: only texts the hash split keeps for training."""
    rows, i = [], start
    for label, count in counts.items():
        made = 0
        while made < count:
            text = sentence(i, label)
            i += 1
            if train_side is None or held_out(text, 0.1) != train_side:
                rows.append((text, label))
                made += 1
    return rows


def test_eval_source_is_used_as_given_and_null_sizes_take_every_entry(tmp_path):
    tokenizer = char_tokenizer()
    train = [f"Paragraph {i}: {WORDS[i % 12]} and {WORDS[(i + 5) % 12]}." for i in range(30)]
    held = [f"Held {i} {WORDS[i % 12]}" for i in range(9)]
    (tmp_path / "train.txt").write_text("\n\n".join(train))
    spec = DataSpec(source=str(tmp_path / "train.txt"), eval_source=write_jsonl(tmp_path / "held.jsonl",
                    [(t, "") for t in held]), block_size=8, train_size=None, eval_size=None)
    train_set, eval_set = causal_lm_datasets(spec, tokenizer)

    def ids(texts):
        return [i for t in texts for i in tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]]

    every = ids(train)
    assert len(train_set) == len(every) // 8  # no entry held out by the hash: all 30 train (shuffled)
    used = Counter(torch.cat([train_set[i]["input_ids"] for i in range(len(train_set))]).tolist())
    assert not used - Counter(every) and sum((Counter(every) - used).values()) < 8  # all but the last partial block
    expected = torch.tensor(ids(held)[:len(ids(held)) // 8 * 8]).view(-1, 8)  # file order, every full block
    assert torch.equal(torch.stack([eval_set[i]["input_ids"] for i in range(len(eval_set))]), expected)
    assert torch.equal(eval_set[0]["labels"], eval_set[0]["input_ids"])
    two = causal_lm_datasets(DataSpec(source=spec.source, eval_source=spec.eval_source, block_size=8, train_size=3,
                                      eval_size=2), tokenizer)
    assert len(two[0]) == 3 and torch.equal(torch.stack([two[1][i]["input_ids"] for i in range(2)]), expected[:2])


def test_eval_split_of_a_dataset_folder_is_used_verbatim(tmp_path):
    folder = tmp_path / "mydata"
    folder.mkdir()
    train = labelled({"a": 6, "b": 5, "c": 2})
    test = [(sentence(100 + i, label), label) for i, label in enumerate("cabbacb")]
    write_jsonl(folder / "train.jsonl", train)
    write_jsonl(folder / "test.jsonl", test)
    spec = DataSpec(source=str(folder), eval_split="test", balance=False, train_size=None, eval_size=None,
                    max_length=64)
    train_set, eval_set, names = classification_datasets(spec, char_tokenizer())
    assert names == ["a", "b", "c"] and len(train_set) == len(train)  # every entry, none held out by hash
    assert [names[int(eval_set[i]["labels"])] for i in range(len(eval_set))] == list("cabbacb")  # file order
    tokenizer = char_tokenizer()
    assert eval_set[0]["input_ids"].tolist() == tokenizer(test[0][0], truncation=True, max_length=64).input_ids
    assert sorted(names[int(train_set[i]["labels"])] for i in range(len(train_set))) == sorted(l for _, l in train)


def test_balance_false_keeps_the_natural_distribution_and_a_rare_class(tmp_path):
    rows = labelled({"big": 30, "mid": 12, "rare": 3}, train_side=True) + labelled({"big": 4, "mid": 2},
                                                                                   start=500, train_side=False)
    source = write_jsonl(tmp_path / "all.jsonl", rows)
    with pytest.raises(RecipeError, match=r"label 'rare' has 3 train examples, fewer than data.train_size=10: "
                                          r"lower it, or set data.balance=false"):
        classification_datasets(DataSpec(source=source, train_size=10, eval_size=1), char_tokenizer())
    train_set, eval_set, names = classification_datasets(
        DataSpec(source=source, balance=False, train_size=None, eval_size=None), char_tokenizer())
    counts = Counter(names[int(train_set[i]["labels"])] for i in range(len(train_set)))
    assert counts == {"big": 30, "mid": 12, "rare": 3} and len(eval_set) == 6
    train_set, _, _ = classification_datasets(DataSpec(source=source, balance=False, train_size=20, eval_size=None),
                                              char_tokenizer())
    assert len(train_set) == 20  # 20 in all, drawn from the shuffled entries
    with pytest.raises(RecipeError, match=r"the train data holds 45 entries, fewer than data.train_size=46"):
        classification_datasets(DataSpec(source=source, balance=False, train_size=46), char_tokenizer())


def own_data_recipe(tmp_path, model, data, **changes):
    recipe = {
        "name": "own", "task": "sequence_classification", "model": model,
        "data": {"max_length": 48, **data},
        "training": {"max_steps": 2, "per_device_train_batch_size": 8, "learning_rate": 1e-3, "disable_tqdm": True},
        "eval": {"batch_size": 16},
        "variants": {"ce": {}, "sparsemax": {"loss": "sparsemax"}},
        **changes,
    }
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_own_classification_data_reports_per_class_scores_and_a_confusion_plot(tiny_bert, tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", labelled({"big": 20, "mid": 8, "rare": 3}))
    held_rows = labelled({"big": 5, "mid": 3, "rare": 1}, start=900)
    held = write_jsonl(tmp_path / "held.jsonl", held_rows)
    path = own_data_recipe(tmp_path, tiny_bert, {"source": train, "eval_source": held, "balance": False,
                                                  "train_size": None, "eval_size": None})
    out = tmp_path / "out"
    assert run("compare", path, "--output", out) == 0
    results = json.loads((out / "results.json").read_text())
    for r in results:
        assert r["eval_examples"] == len(held_rows) == r["tokens"]
        assert r["class_names"] == ["big", "mid", "rare"] and set(r["per_class"]) == {"big", "mid", "rare"}
        matrix = torch.tensor(r["confusion_matrix"])
        assert matrix.sum() == len(held_rows) and matrix.sum(1).tolist() == [5, 3, 1]
        assert r["accuracy"] == pytest.approx(float(matrix.trace()) / len(held_rows))
        for c, name in enumerate(r["class_names"]):
            scores, tp = r["per_class"][name], float(matrix[c, c])
            assert scores["support"] == int(matrix[c].sum())
            assert scores["recall"] == pytest.approx(tp / float(matrix[c].sum()))
            assert scores["precision"] == pytest.approx(tp / float(matrix[:, c].sum()) if matrix[:, c].sum() else 0)
            assert scores["f1"] == pytest.approx(2 * tp / float(matrix[c].sum() + matrix[:, c].sum()))
        assert r["macro_f1"] == pytest.approx(sum(s["f1"] for s in r["per_class"].values()) / 3)
    assert (out / "confusion_matrix.png").stat().st_size > 1000
    assert "confusion_matrix.png" in (out / "report.md").read_text()

    capsys.readouterr()
    assert run("evaluate", path, "--output", out, "--variant", "sparsemax") == 0
    evaluated = json.loads((out / "sparsemax" / "results.json").read_text())
    assert evaluated["eval_examples"] == len(held_rows) and evaluated["per_class"]["rare"]["support"] == 1


def test_macro_f1_averages_the_classes_present():
    predicted, labels = torch.tensor([0, 0, 1, 1]).numpy(), torch.tensor([0, 1, 1, 1]).numpy()
    # class 0: tp 1, fp 1, fn 0 -> F1 2/3; class 1: tp 2, fp 0, fn 1 -> F1 4/5; class 2: absent, not averaged
    assert runner.macro_f1(predicted, labels, 3) == pytest.approx((2 / 3 + 4 / 5) / 2)
    table = runner.per_class(predicted, labels, ["x", "y", "z"])["per_class"]
    assert table["x"] == {"precision": 0.5, "recall": 1.0, "f1": pytest.approx(2 / 3), "support": 1}
    assert table["z"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 0}


def test_outside_support_mass():
    trained = torch.tensor([[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    decoded = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.7, 0.3, 0.0, 0.0]])
    assert metrics.outside_support_mass(decoded, trained).tolist() == pytest.approx([0.3, 0.3])
    assert metrics.outside_support_mass(trained, trained).tolist() == [0.0, 0.0]


def test_a_label_only_in_the_held_out_data_exits_2_naming_it(tiny_bert, tmp_path, capsys, monkeypatch):
    train = write_jsonl(tmp_path / "train.jsonl", labelled({"a": 6, "b": 6}))
    held = write_jsonl(tmp_path / "held.jsonl", labelled({"a": 2, "ghost": 1, "b": 1, "phantom": 1}, start=50))
    path = own_data_recipe(tmp_path, tiny_bert, {"source": train, "eval_source": held, "balance": False,
                                                  "train_size": None, "eval_size": None})

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(runner, "load_base_model", no_model)
    capsys.readouterr()
    assert run("compare", path, "--output", tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-sparsemax: error: label(s) ['ghost', 'phantom'] occur only in the held-out data")
    assert "\n" not in err and not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("case", ["split_of_files", "missing_eval_file", "both", "balance", "size", "eval_name"])
def test_bad_own_data_fields_are_refused_before_anything_loads(tiny_bert, tmp_path, capsys, monkeypatch, case):
    train = write_jsonl(tmp_path / "train.jsonl", labelled({"a": 6, "b": 6}))
    data = {"source": train, "split_of_files": {"eval_split": "test"},
            "missing_eval_file": {"eval_source": str(tmp_path / "nope.jsonl")},
            "both": {"eval_source": train, "eval_split": "test"}, "balance": {"balance": "no"},
            "size": {"train_size": 0}, "eval_name": {"eval_source": "some/dataset"}}[case]
    path = own_data_recipe(tmp_path, tiny_bert, {"source": train, **data})

    def nothing(*args, **kwargs):
        raise AssertionError("nothing may load")

    monkeypatch.setattr(runner, "load_tokenizer", nothing)
    capsys.readouterr()
    assert run("train", path, "--output", tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-sparsemax: error:") and "\n" not in err and "data." in err, err
    assert not (tmp_path / "out").exists()
