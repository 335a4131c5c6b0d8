"""One DDP training step of a tiny Llama with entmax15 attention and loss; run by torchrun in test_ddp.py."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hf_sparsemax as hs

from families import tiny_model


def step(model, ids):
    """Loss and one SGD step (lr 0.1) on ``ids``; returns the loss and the flattened parameters after the step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return loss.detach(), torch.cat([p.detach().flatten() for p in model.parameters()])


def data():
    return torch.randint(3, 128, (4, 12), generator=torch.Generator().manual_seed(0))


def model():
    return hs.patch_model(tiny_model("llama"), attn="entmax15", loss="entmax15")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(model())
    loss, params = step(ddp, data().chunk(world)[rank])
    dist.all_reduce(loss)
    if rank == 0:
        with open(sys.argv[1], "w") as handle:
            json.dump({"loss": loss.item() / world, "params": params.tolist()}, handle)
    dist.barrier()  # both ranks past rank 0's write: a rank tearing gloo down while its peer still works can abort
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown: under load a gloo thread still alive there aborted a rank
    # ("terminate called without an active exception") after its result was written and checked
