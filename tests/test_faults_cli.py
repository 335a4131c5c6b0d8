"""The CLI under faults: a full disk (writes failing inside Trainer's checkpointing) and SIGINT.

What the user gets: one line on stderr (exit 2 for a failed write, 130 for
Ctrl-C), the output lock released, and only what ``--resume`` can use kept
(a half-written checkpoint is removed). The lock and SIGKILL: ``test_cli_faults.py``.
"""

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli_env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


@pytest.fixture
def tiny_recipe(tmp_path):
    from test_recipes import char_tokenizer, write_recipe
    from transformers import LlamaConfig, LlamaForCausalLM

    from test_recipes import CHARS

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(CHARS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = tmp_path / "tiny_llama"
    LlamaForCausalLM(config).save_pretrained(model)
    char_tokenizer().save_pretrained(model)
    return write_recipe(tmp_path, str(model))


def folders_left(tmp_path):
    return sorted(f for f in os.listdir(tmp_path) if f not in ("tiny.yaml", "tiny_llama"))


@pytest.mark.slow
def test_a_full_disk_gives_one_line_and_leaves_nothing_behind(tiny_recipe, tmp_path):
    """Every file write beyond a few KB fails (RLIMIT_FSIZE), as on a full disk, inside Trainer's torch.save."""
    import resource

    def full_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, 6000))

    done = subprocess.run([sys.executable, "-m", "hf_sparsemax_cli", "train", tiny_recipe, "--variant", "top3",
                           "--output", str(tmp_path / "out")], env=cli_env(), preexec_fn=full_disk,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hf-sparsemax: error: writing checkpoint-2 failed, is the disk full?"), done.stderr[-3000:]
    assert "nothing was kept" in last and "Traceback" not in done.stderr
    assert folders_left(tmp_path) == []  # no out, no out.partial, no lock file


def test_a_failed_checkpoint_write_keeps_the_complete_ones_and_resume_finishes(tiny_recipe, tmp_path, capsys,
                                                                                monkeypatch):
    from test_recipes import run
    from transformers import Trainer

    original = Trainer._save_rng_state
    calls = []

    def no_space(self, output_dir):
        calls.append(output_dir)
        if len(calls) == 2:  # checkpoint-4: the model and optimizer are written, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, output_dir)

    out = tmp_path / "out"
    with monkeypatch.context() as patched:
        patched.setattr(Trainer, "_save_rng_state", no_space)
        assert run("train", tiny_recipe, "--variant", "top3", "--output", out, "--set", "training.max_steps=6") == 2
    err = capsys.readouterr().err.strip()
    assert "writing checkpoint-4 failed, is the disk full? ([Errno 28] No space left on device)" in err, err
    assert f"--resume continues from the last complete checkpoint in {out / 'top3.partial'}" in err
    assert os.listdir(out / "top3.partial" / "checkpoints") == ["checkpoint-2"]  # the half-written one is gone
    assert run("train", tiny_recipe, "--variant", "top3", "--output", out, "--set", "training.max_steps=6",
               "--resume") == 0
    assert "resumed_from" in open(out / "top3" / "results.json").read()
    assert folders_left(tmp_path) == ["out"] and os.listdir(out) == ["top3"]


def default_sigint():
    """Ctrl-C's default in the child: a shell that starts jobs in the background (CI) ignores SIGINT in them,
    and a process started with SIGINT ignored keeps ignoring it (Python then installs no handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", [False, True], ids=["before a checkpoint", "after a checkpoint"])
def test_sigint_stops_with_one_line_releases_the_lock_and_keeps_only_what_resume_can_use(tiny_recipe, tmp_path,
                                                                                         checkpoint):
    out = tmp_path / "out"
    run = subprocess.Popen([sys.executable, "-m", "hf_sparsemax_cli", "train", tiny_recipe, "--variant", "top3",
                            "--output", str(out), "--set", "training.max_steps=100000", "--set",
                            "training.save_steps=5"], env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, preexec_fn=default_sigint)
    checkpoints = out / "top3.partial" / "checkpoints"
    deadline = time.time() + 180
    while time.time() < deadline and run.poll() is None:
        if checkpoint and checkpoints.is_dir() and any((c / "trainer_state.json").is_file()
                                                       for c in checkpoints.iterdir()):
            break
        if not checkpoint and (tmp_path / "out.lock").exists():
            break
        time.sleep(0.2)
    run.send_signal(signal.SIGINT)
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "hf-sparsemax: interrupted" and "Traceback" not in stderr
    assert not (tmp_path / "out.lock").exists()
    if checkpoint:
        assert f"interrupted; --resume continues from the last checkpoint in {out / 'top3.partial'}" in stdout
        assert all((c / "trainer_state.json").is_file() for c in checkpoints.iterdir())
    else:
        assert folders_left(tmp_path) == []
