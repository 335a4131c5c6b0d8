"""FSDP2 over 2 CPU processes (gloo), started by `accelerate launch`: the step equals one process on the batch.

Sparse attention with a learned alpha per head and a sparse loss. FSDP shards each decoder layer's parameters,
the learned alphas included (each rank holds 2 of the 4 heads' alphas), gathers them for the forward pass and
reduce-scatters their gradients; after one SGD step every parameter, alphas included, equals the single-process
step on the whole batch.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from fsdp_worker import data, model, step
from test_ddp import free_port

@pytest.mark.slow
def test_two_process_fsdp2_gives_the_single_process_step(tmp_path):
    out = tmp_path / "fsdp.json"
    here = os.path.dirname(__file__)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
               os.path.join(here, "fsdp_worker.py"), str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    fsdp = json.loads(out.read_text())
    assert fsdp["kind"].startswith("FSDP")  # fully_shard swapped in its FSDP class: the model is really sharded
    alphas = [name for name in fsdp["local_alpha_shapes"] if name.endswith("pre_alpha")]
    assert len(alphas) == 2 and all(fsdp["local_alpha_shapes"][name] == [2] for name in alphas)  # 4 heads / 2 ranks

    single, start = model(), model()
    loss = step(single, data())
    assert abs(fsdp["loss"] - loss.item()) < 1e-5
    params = dict(single.named_parameters())
    assert sorted(fsdp["params"]) == sorted(params)
    for name, p in params.items():
        torch.testing.assert_close(torch.tensor(fsdp["params"][name]), p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    moved = [(params[n] - dict(start.named_parameters())[n]).abs().max().item() for n in alphas]
    assert min(moved) > 0  # the alphas trained (so "equal" is not "both unchanged")


def test_fsdp_on_cpu_through_trainer_is_refused_not_silently_ddp(tmp_path, monkeypatch, capsys):
    """accelerate 1.15 enables FSDP only on GPU-like devices: on CPU, Trainer would train plain DDP instead."""
    from test_recipes import run, write_recipe

    recipe = write_recipe(tmp_path, str(tmp_path / "never_loaded"))
    assert run("train", recipe, "--output", tmp_path / "a", "--set", "training.fsdp=full_shard auto_wrap") == 2
    assert "FSDP was asked for" in capsys.readouterr().err
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --use_fsdp` sets
    assert run("compare", recipe, "--output", tmp_path / "b") == 2
    assert "plain DDP" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
