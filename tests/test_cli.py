"""The hf-sparsemax command: decoding-report, and one-line errors with exit code 2."""

import json
import pathlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from tokenizers import Tokenizer, models, pre_tokenizers

import hf_sparsemax_cli as cli


def tiny_folder(tmp_path):
    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<s>", *"abcdefghijklmnopqrstuvwxyz"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return str(tmp_path)


def test_decoding_report_command(tmp_path, capsys):
    folder = tiny_folder(tmp_path)
    code = cli.main(["decoding-report", "--model", folder, "--loss", "sparse_softmax", "--loss-option", "top_k=4",
                     "--prompt", "hello", "--max-new-tokens", "6"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["zero_prob_share"] == 0 and report["mean_support_size"] == 4 and report["matched"]
    code = cli.main(["decoding-report", "--model", folder, "--loss", "sparse_softmax", "--loss-option", "top_k=2",
                     "--decode-option", "top_k=20", "--prompt", "hello", "--max-new-tokens", "12"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and not report["matched"] and report["zero_prob_share"] > 0


def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys):
    folder = tiny_folder(tmp_path)
    capsys.readouterr()
    assert cli.main(["decoding-report", "--model", folder, "--loss", "focal", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-sparsemax: error:") and "\n" not in err
    assert cli.main(["decoding-report", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2


def test_recipe_commands_document_overrides_and_refuse_unknown_options(capsys):
    for command in ("train", "evaluate", "generate", "compare"):
        with pytest.raises(SystemExit) as done:
            cli.main([command, "--help"])
        assert done.value.code == 0 and "--set PATH=VALUE" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        cli.main(["compare", "default", "--epochs", "3"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-sparsemax: error: unrecognized arguments: --epochs 3") and "\n" not in err


PLAIN_INSTALL = """
import sys
for name in {missing!r}:  # what `pip install hf-sparsemax` (no extras) lacks: find_spec gives None, import fails
    sys.modules[name] = None
from hf_sparsemax_cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize(
    "missing, argv, names, extra",
    [
        (["datasets", "peft", "matplotlib", "gguf"], ["compare", "classify"], "datasets, matplotlib", "recipes"),
        (["datasets", "peft", "matplotlib", "gguf"], ["train", "default"], "datasets", "recipes"),
        (["matplotlib"], ["compare", "default"], "matplotlib", "recipes"),  # e.g. only the `metrics` extra
        (["peft"], ["train", "default"], "peft", "recipes"),  # the default recipe trains LoRA adapters
        (["gguf"], ["evaluate", "default"], "gguf", "recipes"),  # the offline SmolLM2 is a GGUF file
        (["gguf"], ["decoding-report", "--prompt", "x"], "gguf", "offline"),
    ],
    ids=["plain-compare", "plain-train", "no-matplotlib", "no-peft", "no-gguf", "decoding-report-no-gguf"],
)
def test_missing_optional_packages_stop_at_once_naming_the_extra(tmp_path, missing, argv, names, extra):
    """Each command path checks its optional packages before loading a model or writing anything: one line,
    exit code 2, the install command, nothing left in the working folder."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", PLAIN_INSTALL.format(missing=missing, argv=argv)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    err = done.stderr.strip()
    assert "\n" not in err and err.startswith("hf-sparsemax: error:"), err
    assert f"needs {names}, not installed" in err and f'pip install "hf-sparsemax[{extra}]"' in err, err
    assert list(tmp_path.iterdir()) == []
    if argv == ["compare", "classify"]:  # docs/recipes.md shows this refusal as the command prints it
        page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "recipes.md").read_text()
        assert page.split("$ hf-sparsemax compare classify\n", 1)[1].splitlines()[0] == err


ENTRY_POINT = """
import importlib, sys, tomllib
with open({pyproject!r}, "rb") as handle:
    module, function = tomllib.load(handle)["project"]["scripts"]["hf-sparsemax"].split(":")
try:
    getattr(importlib.import_module(module), function)({argv!r})
except SystemExit as done:
    heavy = sorted(n for n in ("torch", "transformers", "datasets", "numpy", "hf_sparsemax") if n in sys.modules)
    print("exit", done.code, "imported", heavy, file=sys.stderr)
    print("cpu", time.process_time(), file=sys.stderr)
"""
HELP_CPU_SECONDS = 0.3  # the whole process: interpreter start, parser, help (about 0.05 s on the 2-core machine)


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["compare", "--help"], 0), (["compare"], 2),
                                        (["compare", "default", "--epochs", "3"], 2), (["train", "x", "--seeds"], 2),
                                        (["bench", "--help"], 0), (["bench", "attention", "--help"], 0),
                                        (["bench", "losses", "--vocab", "many"], 2), (["bench"], 2)])
def test_help_and_argument_errors_import_no_heavy_package(argv, code):
    """The console script (pyproject's entry point) answers --help and usage errors before importing torch,
    transformers or hf_sparsemax (5-8 s of imports), so they come at once: in well under 0.3 s of CPU time for
    the whole process (CPU time, not wall time: a loaded machine delays a process without making it slower)."""
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", "import time\n" + ENTRY_POINT.format(
        pyproject=str(root / "pyproject.toml"), argv=argv)], capture_output=True, text=True, timeout=120)
    *_, said, cpu = done.stderr.strip().splitlines()
    assert said == f"exit {code} imported []", done.stderr[-2000:]
    assert float(cpu.split()[1]) < HELP_CPU_SECONDS, cpu


def test_bench_help_lists_its_subcommands(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "{attention,generation,serving,losses}" in text
    assert all(f"\n    {name} " in text for name in ("attention", "generation", "serving", "losses"))


def test_help_names_every_shipped_recipe(capsys):
    """The console finds the shipped recipes without importing the package (which never imports the console):
    both find the same folder and names."""
    from hf_sparsemax.app.recipes import RECIPE_DIR, shipped_recipes

    names = shipped_recipes()
    assert {"default", "classify", "convert", "convert_long"} <= set(names)
    assert cli.shipped_recipes() == names and cli.shipped_recipes(RECIPE_DIR) == names
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"shipped with the package: {', '.join(names)})" in text
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    assert f"shipped recipe ({', '.join(names)})" in " ".join(capsys.readouterr().out.split())


def test_an_unknown_field_names_the_nearest_and_lists_the_valid_ones(capsys):
    assert cli.main(["train", "default", "--set", "training.max_stepz=5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown field(s) ['max_stepz'] in training (did you mean 'max_steps'?)" in err
    assert "valid are " in err and ", max_steps, " in err and ", learning_rate, " in err
    assert cli.main(["train", "default", "--set", "data.blok_size=5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "(did you mean 'block_size'?)" in err and "valid are balance, block_size, categories," in err
