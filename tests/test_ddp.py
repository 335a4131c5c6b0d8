"""2-process DDP on CPU (gloo): each rank imports the plugin; the step equals one process on the whole batch."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from ddp_worker import data, model, step

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_ddp_gives_the_single_process_step(tmp_path):
    out = tmp_path / "ddp.json"
    here = os.path.dirname(__file__)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), os.path.join(here, "ddp_worker.py"), str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ddp = json.loads(out.read_text())
    loss, params = step(model(), data())
    assert abs(ddp["loss"] - loss.item()) < 1e-5
    torch.testing.assert_close(torch.tensor(ddp["params"]), params, rtol=1e-5, atol=1e-6)
