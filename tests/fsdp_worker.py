"""One FSDP2 (``fully_shard``) training step of a tiny patched Llama on CPU (gloo); run by test_fsdp.py.

The model has 1.3-entmax attention with a learned alpha per head (an ``nn.Parameter`` inside each attention
module, so FSDP shards it with its decoder layer) and the top-10 sparse-softmax loss.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import hf_sparsemax as hs

from families import tiny_model


def model():
    return hs.patch_model(tiny_model("llama"), attn="entmax_bisect", attn_options={"alpha": 1.3, "learn_alpha": True},
                          loss="sparse_softmax", loss_options={"top_k": 10})


def data():
    return torch.randint(3, 128, (4, 12), generator=torch.Generator().manual_seed(0))


def step(model, ids):
    """Loss and one SGD step (lr 0.5) on ``ids``; returns the loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return loss.detach()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = model()
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    local = {name: list(p.to_local().shape) for name, p in sharded.named_parameters() if "alpha" in name}
    loss = step(sharded, data().chunk(world)[rank])
    dist.all_reduce(loss)
    params = {name: p.full_tensor().tolist() for name, p in sharded.named_parameters()}  # collective: every rank
    if rank == 0:
        with open(sys.argv[1], "w") as handle:
            json.dump({"loss": loss.item() / world, "params": params, "local_alpha_shapes": local,
                       "kind": type(sharded).__name__}, handle)
    dist.barrier()  # both ranks past rank 0's write: a rank tearing gloo down while its peer still works can abort
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown: under load a gloo thread still alive there aborted a rank
    # ("terminate called without an active exception") after its result was written and checked
