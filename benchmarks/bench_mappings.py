"""Side-by-side speed of the probability mappings: softmax vs hf_sparsemax vs the `entmax` package.

Every contender runs in the same process, interleaved round by round, so the
ratios to softmax hold on a noisy shared machine even when absolute times
drift. Prints a Markdown table of median milliseconds and ratios.

    python benchmarks/bench_mappings.py                 # both shapes, forward and forward+backward
    python benchmarks/bench_mappings.py --repeats 3 --shapes attention
"""

from __future__ import annotations

import argparse
import torch

import hf_sparsemax as hs
from common import interleaved_medians, mapping_call

SHAPES = {"vocab": (2048, 49152), "attention": (2, 9, 512, 512)}


def contenders(with_package: bool):
    rows = [
        ("softmax", lambda x: torch.softmax(x, -1), None),
        ("sparsemax", hs.sparsemax, "sparsemax"),
        ("entmax15", hs.entmax15, "entmax15"),
        ("entmax_bisect(1.5)", lambda x: hs.entmax_bisect(x, 1.5), "entmax_bisect"),
        ("normmax_bisect(2)", lambda x: hs.normmax_bisect(x, 2.0), "normmax_bisect"),
        ("budget_bisect(2)", lambda x: hs.budget_bisect(x, 2.0), "budget_bisect"),
        ("sparse_softmax(top_k=64)", lambda x: hs.sparse_softmax(x, top_k=64), None),
        ("taylor_softmax(2)", hs.taylor_softmax, None),
    ]
    package = {}
    if with_package:
        import entmax

        package = {
            "sparsemax": lambda x: entmax.sparsemax(x, -1),
            "entmax15": lambda x: entmax.entmax15(x, -1),
            "entmax_bisect": lambda x: entmax.entmax_bisect(x, 1.5, -1),
            "normmax_bisect": lambda x: entmax.normmax_bisect(x, 2.0, -1),
            "budget_bisect": lambda x: entmax.budget_bisect(x, 2.0, -1),
        }
    return rows, package


def run(shape, repeats: int, with_package: bool, backward: bool):
    torch.manual_seed(0)
    x = torch.randn(shape)
    rows, package = contenders(with_package)
    fns = {name: fn for name, fn, _ in rows}
    fns.update({f"entmax pkg {name}": fn for name, fn in package.items()})

    return interleaved_medians({name: mapping_call(fn, x, backward) for name, fn in fns.items()}, repeats), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--no-package", action="store_true", help="skip the entmax package")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU, median of {args.repeats}\n")
    print("| shape | pass | mapping | hf_sparsemax ms | x softmax | entmax pkg ms | x softmax | pkg / ours |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for shape_name in args.shapes:
        for backward in (False, True):
            ms, rows = run(SHAPES[shape_name], args.repeats, not args.no_package, backward)
            base = ms["softmax"]
            for name, _, pkg in rows:
                pkg_ms = ms.get(f"entmax pkg {pkg}") if pkg else None
                cells = [f"{ms[name]:.1f}", f"{ms[name] / base:.2f}"]
                cells += [f"{pkg_ms:.1f}", f"{pkg_ms / base:.1f}", f"{pkg_ms / ms[name]:.1f}"] if pkg_ms else ["", "", ""]
                label = f"{shape_name} {list(SHAPES[shape_name])}"
                print(f"| {label} | {'fwd+bwd' if backward else 'fwd'} | {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
