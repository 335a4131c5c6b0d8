"""CLI faults: one run per output folder (an OS lock), settings refused before the model loads, nothing written."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from transformers import TrainingArguments

from hf_sparsemax.app import runner
from hf_sparsemax.app.recipes import RecipeError, load_recipe, recipe_from_dict
from hf_sparsemax.app.run_lock import lock_path, output_lock

from test_recipes import run, tiny_llama, write_recipe  # noqa: F401  (tiny_llama is a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def files_under(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a tokenizer or model is loaded."""

    def loaded(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded")

    for name in ("local_model", "load_tokenizer", "load_base_model", "load_trained"):
        monkeypatch.setattr(runner, name, loaded)


def test_a_variants_own_training_numbers_are_coerced(tmp_path):
    recipe = recipe_from_dict({"training": {"weight_decay": "1e-2"},
                               "variants": {"a": {"training": {"learning_rate": "5e-4", "max_steps": "3"}}}})
    args = recipe.training_args(recipe.variant("a"))
    assert args["learning_rate"] == 5e-4 and args["max_steps"] == 3 and args["weight_decay"] == 0.01
    TrainingArguments(output_dir=str(tmp_path), **args)  # no string reaches TrainingArguments
    recipe = load_recipe("default", ["variants.entmax15.training={learning_rate: 5e-4}"])  # YAML: a string
    assert recipe.training_args(recipe.variant("entmax15"))["learning_rate"] == 5e-4
    with pytest.raises(RecipeError, match="variants.entmax15.training.learning_rate"):
        load_recipe("default", ["variants.entmax15.training={learning_rate: fast}"])


BAD = {
    "batch_size_0": ["--set", "training.per_device_train_batch_size=0"],
    "learning_rate_negative": ["--set", "training.learning_rate=-1"],
    "variant_learning_rate_negative": ["--set", "variants.entmax15.training={learning_rate: -1}"],
    "accumulation_0": ["--set", "training.gradient_accumulation_steps=0"],
    "beta_1": ["--set", "training.adam_beta2=1"],
    "logging_steps_0": ["--set", "training.logging_steps=0"],
    "mapping_option": ["--set", "variants.entmax15.loss_options={alpha: 3}"],
    "train_size_0": ["--set", "data.train_size=0"],
    "fortune_category": ["--set", "data.categories=[poems]"],
    "missing_data_file": ["--set", "data.source=/nonexistent/data.txt"],
    "output_is_a_file": ["--output", "{tmp}/file"],
}


@pytest.mark.parametrize("command", ["train", "compare"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_settings_are_refused_before_loading_and_write_nothing(tiny_llama, tmp_path, capsys,  # noqa: F811
                                                                  no_loading, command, case):
    recipe = write_recipe(tmp_path, tiny_llama)
    (tmp_path / "file").write_text("not a folder")
    before = files_under(tmp_path)
    extra = [a.replace("{tmp}", str(tmp_path)) for a in BAD[case]]
    args = [command, recipe, "--output", tmp_path / "out", *extra]
    capsys.readouterr()
    assert run(*args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-sparsemax: error:") and "\n" not in err, err
    assert files_under(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["file", "tiny.yaml"]


def test_a_run_failing_after_the_model_loaded_leaves_no_partial_folder(tiny_llama, tmp_path, capsys):  # noqa: F811
    recipe = write_recipe(tmp_path, tiny_llama)
    out = tmp_path / "runs" / "out"
    assert run("train", recipe, "--output", out, "--variant", "entmax15", "--set", "lora.target_modules=[nope]") == 2
    assert "nope" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["tiny.yaml"]  # no out.partial, no lock file, no runs/ folder


def test_the_lock_names_its_holder_and_is_released():
    folder = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"hf_sparsemax_lock_test_{os.getpid()}", "out")
    with output_lock(folder, "train tiny"):
        with pytest.raises(RecipeError, match=f"pid {os.getpid()} \\(hf-sparsemax train tiny, since"):
            with output_lock(folder, "train other"):
                pass
        assert json.loads(open(lock_path(folder)).read())["pid"] == os.getpid()
    assert not os.path.exists(os.path.dirname(folder))  # lock file and the folder made for it are gone
    with output_lock(folder, "again"):  # free again
        pass


@pytest.mark.slow
def test_a_busy_folder_is_refused_at_once_and_a_killed_run_never_blocks(tiny_llama, tmp_path, capsys,  # noqa: F811
                                                                        monkeypatch):
    recipe = write_recipe(tmp_path, tiny_llama)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen([sys.executable, "-m", "hf_sparsemax_cli", "train", recipe, "--variant", "top3",
                                  "--output", str(out), "--set", "training.max_steps=100000"],
                                 env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and first.poll() is None:  # wait until the first run holds the lock
            try:
                if json.loads(open(lock_path(str(out))).read())["pid"] == first.pid:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-2000:]

        with monkeypatch.context() as patched:  # the second run is refused before it loads anything
            patched.setattr(runner, "load_tokenizer", lambda *a, **k: pytest.fail("loaded"))
            capsys.readouterr()
            started = time.perf_counter()
            assert run("compare", recipe, "--output", out) == 2
            assert time.perf_counter() - started < 30
        err = capsys.readouterr().err.strip()
        assert f"in use by another run, pid {first.pid} (hf-sparsemax train tiny --variant top3" in err, err
        assert "\n" not in err
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert os.path.exists(lock_path(str(out)))  # a stale file is left, but no lock: it blocks nothing
    assert run("train", recipe, "--variant", "top3", "--output", out, "--set", "training.max_steps=1") == 0
    assert not os.path.exists(lock_path(str(out))) and sorted(os.listdir(out)) == ["top3"]
    capsys.readouterr()
    assert run("train", recipe, "--variant", "top3", "--output", out, "--set", "training.max_steps=1") == 0
    printed = capsys.readouterr().out
    assert f"{out / 'top3'} holds a finished result; this run replaces it" in printed
    assert f"replaced the earlier result in {out / 'top3'}" in printed


def test_train_summary_when_no_loss_was_logged(tiny_llama, tmp_path, capsys):
    """max_steps below logging_steps: training logs no loss; the summary says so instead of crashing."""
    recipe = write_recipe(tmp_path, tiny_llama)
    assert run("train", recipe, "--variant", "top3", "--output", tmp_path / "out",
               "--set", "training.max_steps=2", "--set", "training.logging_steps=10") == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert "final loss none logged" in summary and "trained 'top3' (2 steps" in summary
