"""`compare --seeds`: every variant once per seed, mean and spread in report.md and results.json."""

import json
import math
import os
import statistics

import pytest
import yaml

from hf_sparsemax.app import seeds
from hf_sparsemax.app.recipes import RecipeError, load_recipe
from test_recipes import run, tiny_bert, tiny_llama, write_recipe  # noqa: F401  (fixtures)


def test_spread_is_mean_sample_std_min_max():
    mean, spread = seeds.spread([1.0, 2.0, 6.0])
    assert mean == 3.0 and spread == {"std": pytest.approx(math.sqrt(7.0)), "min": 1.0, "max": 6.0}
    assert seeds.spread([4.0]) == (4.0, {"std": 0.0, "min": 4.0, "max": 4.0})
    mean, spread = seeds.spread([1.0, math.inf])  # a sparse model's held-out cross-entropy
    assert mean == math.inf and spread["std"] is None and spread["max"] == math.inf


def test_aggregate_groups_runs_by_variant_in_order():
    runs = [{"variant": "b", "attn": "softmax", "loss": "x", "seed": s, "run": f"b-seed{s}", "final_loss": 1.0 + s,
             "texts": ["t"], "flag": True, "decoders": [{"decoder": "matched", "support_size": 10 + s}]}
            for s in (0, 1)]
    runs.insert(1, {"variant": "a", "attn": "entmax15", "loss": "y", "seed": 0, "run": "a-seed0",
                    "final_loss": 5.0, "decoders": [{"decoder": "matched", "support_size": 3}]})
    b, a = seeds.aggregate(runs)  # in the order first seen
    assert (b["variant"], a["variant"]) == ("b", "a")
    assert b["seeds"] == [0, 1] and b["final_loss"] == 1.5 and b["spread"]["final_loss"]["min"] == 1.0
    assert b["spread"]["final_loss"]["std"] == pytest.approx(statistics.stdev([1.0, 2.0]))
    assert b["decoders"] == [{"decoder": "matched", "support_size": 10.5,
                              "spread": {"support_size": {"std": pytest.approx(math.sqrt(0.5)), "min": 10.0,
                                                          "max": 11.0}}}]
    assert b["runs"] == [runs[0], runs[2]] and "texts" not in b and b["flag"] is True and "seed" not in b
    assert b["decoders"][0]["decoder"] == "matched"
    assert a["seeds"] == [0] and a["spread"]["final_loss"]["std"] == 0.0


def test_seeds_field_and_option_are_checked_before_anything_loads(tmp_path, capsys):
    recipe = load_recipe("default", ["seeds=[0, 1, 2]"])
    assert recipe.seeds == [0, 1, 2] and load_recipe("default").seeds is None
    runs = recipe.runs()
    assert len(runs) == 3 * len(recipe.all_variants())
    assert [name for name, _ in runs[:3]] == [f"softmax_ce-seed{s}" for s in (0, 1, 2)]
    assert [recipe.training_args(v)["seed"] for _, v in runs[:3]] == [0, 1, 2]
    assert [name for name, _ in load_recipe("default").runs()] == [v.name for v in recipe.all_variants()]
    for bad in ("seeds=[]", "seeds=[1, 1]", "seeds=[-1]", "seeds=[1.5]", "seeds=[true]", "seeds=zero"):
        with pytest.raises(RecipeError, match="seeds"):
            load_recipe("default", [bad])
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:  # argparse's own usage error, one line
        run("compare", "default", "--seeds", "0,x", "--output", tmp_path / "never")
    assert done.value.code == 2 and "--seeds" in capsys.readouterr().err.strip()
    for bad in ("1,1", "0,-2"):
        assert run("compare", "default", "--seeds", bad, "--output", tmp_path / "never") == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hf-sparsemax: error:") and "\n" not in err and "seeds" in err
    assert not os.path.exists(tmp_path / "never")


def test_compare_with_seeds_reports_mean_and_spread(tiny_llama, tmp_path, capsys):
    recipe = write_recipe(tmp_path, tiny_llama)
    keep = ["--set", "training.max_steps=2", "--set", "variants={softmax_ce: {}, top3: {loss: sparse_softmax, "
            "loss_options: {top_k: 3}}}"]
    assert run("compare", recipe, "--output", tmp_path / "one", *keep) == 0
    assert run("compare", recipe, "--output", tmp_path / "three", "--seeds", "0,1,2", *keep) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("hf-sparsemax: compared 2 variants x 3 seeds")
    out = tmp_path / "three"
    assert {f"{v}-seed{s}" for v in ("softmax_ce", "top3") for s in (0, 1, 2)} <= set(os.listdir(out))
    results = {r["variant"]: r for r in json.loads((out / "results.json").read_text())}
    single = {r["variant"]: r for r in json.loads((tmp_path / "one" / "results.json").read_text())}
    for name, entry in results.items():
        assert entry["seeds"] == [0, 1, 2] and [r["seed"] for r in entry["runs"]] == [0, 1, 2]
        assert [r["run"] for r in entry["runs"]] == [f"{name}-seed{s}" for s in (0, 1, 2)]
        for key in ("final_loss", "epsilon_perplexity", "sparsemax_score", "support_size"):
            values = [r[key] for r in entry["runs"]]
            assert entry[key] == pytest.approx(statistics.fmean(values), rel=1e-12)
            assert entry["spread"][key]["std"] == pytest.approx(statistics.stdev(values), rel=1e-9, abs=1e-12)
            assert (entry["spread"][key]["min"], entry["spread"][key]["max"]) == (min(values), max(values))
        # seed 0 is the single-seed run (training.seed defaults to 0); other seeds train differently
        assert entry["runs"][0]["final_loss"] == pytest.approx(single[name]["final_loss"], rel=1e-5)
        assert entry["runs"][0]["epsilon_perplexity"] == pytest.approx(single[name]["epsilon_perplexity"], rel=1e-5)
        assert len({round(r["final_loss"], 6) for r in entry["runs"]}) == 3
        matched = entry["decoders"][0]
        assert matched["decoder"] == "matched" and matched["outside_support_mass"] == 0
        assert matched["epsilon_perplexity"] == pytest.approx(entry["epsilon_perplexity"], rel=1e-4)
    assert results["top3"]["support_size"] == 3 and results["top3"]["spread"]["support_size"]["std"] == 0
    assert results["top3"]["eval_examples"] == 4 and isinstance(results["top3"]["eval_examples"], int)
    assert all(isinstance(r["attention_zero_share"], float) for e in results.values() for r in e["runs"])
    assert results["top3"]["attention_zero_share"] == pytest.approx(
        statistics.fmean(r["attention_zero_share"] for r in results["top3"]["runs"]))
    text = (out / "report.md").read_text()
    assert "mean ± sample standard deviation over the seeds" in text
    table = [b for b in text.split("\n\n") if b.startswith("| variant | attention")][0].splitlines()
    assert len(table) == 2 + 2 and all("±" in line for line in table[2:])
    row = table[2].split(" | ")
    assert row[0] == "| softmax_ce" and row[4] == f"{results['softmax_ce']['cross_entropy']:.3f} ± " \
        f"{results['softmax_ce']['spread']['cross_entropy']['std']:.3f}"
    assert "| top3 | plain generate (softmax, top-k=50) |" in text
    assert (out / "samples.txt").read_text().count("=== top3-seed") == 3


def test_classification_with_seeds(tiny_bert, tmp_path, capsys):
    recipe = {
        "name": "cls", "task": "sequence_classification", "model": tiny_bert,
        "data": {"source": "fortunes", "categories": ["limerick", "murphy", "zippy"], "train_size": 8,
                 "eval_size": 4, "max_length": 64},
        "training": {"max_steps": 2, "per_device_train_batch_size": 8, "learning_rate": 1e-3, "disable_tqdm": True},
        "variants": {"ce": {}, "sparsemax": {"loss": "sparsemax"}}, "seeds": [3, 4],
    }
    path = tmp_path / "cls.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert run("compare", path, "--output", tmp_path / "out") == 0
    assert "compared 2 variants x 2 seeds" in capsys.readouterr().out.strip().splitlines()[-1]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(r["variant"], r["seeds"]) for r in results] == [("ce", [3, 4]), ("sparsemax", [3, 4])]
    for r in results:
        assert r["accuracy"] == pytest.approx(statistics.fmean(run["accuracy"] for run in r["runs"]))
        assert "per_class" not in r and all("per_class" in run for run in r["runs"])  # per seed only
    assert {"confusion_matrix.png", "ce-seed3", "sparsemax-seed4"} <= set(os.listdir(tmp_path / "out"))
