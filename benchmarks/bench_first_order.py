"""First-order speed, this checkout against an earlier one: forward + backward of the mappings and losses.

Made for changes to the autograd Functions (e.g. making them twice
differentiable) that must not slow the ordinary first-order path. Both
versions run in one process, interleaved round by round; the ratio
``after / before`` is what to read on a noisy machine.

    git archive main hf_sparsemax | tar -x -C /tmp/before      # the earlier version, as a folder
    python benchmarks/bench_first_order.py --before /tmp/before [--rows 512 --cols 16384 --repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

import hf_sparsemax as after
from common import interleaved_medians


def load_before(folder: str):
    """The ``hf_sparsemax`` package under ``folder``, imported as ``hf_sparsemax_before``."""
    init = os.path.join(folder, "hf_sparsemax", "__init__.py")
    spec = importlib.util.spec_from_file_location("hf_sparsemax_before", init,
                                                  submodule_search_locations=[os.path.dirname(init)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_sparsemax_before"] = module
    spec.loader.exec_module(module)
    return module


def contenders(hs, target):
    return {
        "sparsemax": hs.sparsemax,
        "entmax15": hs.entmax15,
        "entmax_bisect(1.3)": lambda x: hs.entmax_bisect(x, 1.3),
        "entmax_bisect(tensor alpha)": lambda x: hs.entmax_bisect(x, torch.full((x.shape[0], 1), 1.3)),
        "sparse_softmax(top_k=64)": lambda x: hs.sparse_softmax(x, top_k=64),
        "taylor_softmax(2)": hs.taylor_softmax,
        "sparsemax_loss": lambda x: hs.sparsemax_loss(x, target),
        "entmax15_loss": lambda x: hs.entmax15_loss(x, target),
        "entmax_bisect_loss(1.3)": lambda x: hs.entmax_bisect_loss(x, target, 1.3),
        "entmax_bisect_loss(tensor alpha)": lambda x: hs.entmax_bisect_loss(x, target, torch.tensor(1.3)),
        "sparse_softmax_loss(top_k=10)": lambda x: hs.sparse_softmax_loss(x, target, top_k=10),
        "taylor_softmax_loss": lambda x: hs.taylor_softmax_loss(x, target),
        "mapping_loss(entmax15)": lambda x: hs.mapping_loss(x, target, "entmax15"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="folder holding the earlier hf_sparsemax package")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--cols", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    before = load_before(args.before)
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.cols) * 2
    target = torch.randint(0, args.cols, (args.rows,))

    def step(fn):
        def once():
            inp = x.detach().requires_grad_()
            out = fn(inp)
            out.backward(torch.ones_like(out))

        return once

    fns = {}
    for (name, old), new in zip(contenders(before, target).items(), contenders(after, target).values()):
        fns[(name, "before")], fns[(name, "after")] = step(old), step(new)
    times = interleaved_medians(fns, args.repeats)
    print(f"forward + backward, [{args.rows}, {args.cols}] float32, median of {args.repeats} interleaved rounds\n")
    print("| function | before ms | after ms | after / before |")
    print("|---|---:|---:|---:|")
    for name in contenders(after, target):
        old, new = times[(name, "before")], times[(name, "after")]
        print(f"| {name} | {old:.1f} | {new:.1f} | {new / old:.2f} |")


if __name__ == "__main__":
    main()
