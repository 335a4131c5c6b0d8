"""Per-call speed of the mappings and the top_p loss, as ratios to torch.softmax / cross-entropy (issue 12's shapes).

Every contender runs in one process, interleaved round by round, so ratios hold
on a noisy shared machine even when absolute times drift. ``--compiled`` adds
each mapping compiled with inductor, as a ratio to compiled softmax.

    python benchmarks/bench_speed.py                              # every table, eager
    python benchmarks/bench_speed.py --tables mappings --shapes attention512 --compiled
    python benchmarks/bench_speed.py --tables top_p --real        # adds SmolLM2 logits on fortunes text
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import hf_sparsemax as hs
from common import interleaved_medians, mapping_call

SHAPES = {"attention512": (2, 9, 512, 512), "attention256": (2, 9, 256, 256), "attention2048": (1, 9, 2048, 2048),
          "vocab": (2048, 49152)}


def mappings(shape):
    heads = shape[1] if len(shape) == 4 else 1
    alpha = torch.linspace(1.2, 1.8, heads).view((1, heads, 1, 1) if len(shape) == 4 else (1, 1))  # per head
    return {
        "softmax": lambda x: torch.softmax(x, -1),
        "sparsemax": hs.sparsemax,
        "entmax15": hs.entmax15,
        "entmax_bisect(1.3)": lambda x: hs.entmax_bisect(x, 1.3),
        "learned per-head alpha": lambda x: hs.entmax_bisect(x, alpha),
        "sparse_softmax(top_k=32)": lambda x: hs.sparse_softmax(x, top_k=32),
    }


def package():
    import entmax

    return {"sparsemax": lambda x: entmax.sparsemax(x, -1), "entmax15": lambda x: entmax.entmax15(x, -1),
            "entmax_bisect(1.3)": lambda x: entmax.entmax_bisect(x, 1.3, -1),
            "learned per-head alpha": lambda x: entmax.entmax_bisect(x, torch.full(x.shape[:-1] + (1,), 1.5), -1)}


def mapping_table(shapes, repeats, with_package, compiled):
    print("| shape | pass | mapping | ms | x softmax | entmax pkg x softmax | compiled x compiled softmax |")
    print("|---|---|---|---:|---:|---:|---:|")
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        ours = mappings(shape)
        pkg = package() if with_package else {}
        for backward in (False, True):
            fns = {name: mapping_call(fn, x, backward) for name, fn in ours.items()}
            fns.update({f"pkg {name}": mapping_call(fn, x, backward) for name, fn in pkg.items()})
            if compiled:
                fns.update({f"compiled {name}": mapping_call(torch.compile(fn, dynamic=False), x, backward)
                            for name, fn in ours.items()})
            ms = interleaved_medians(fns, repeats)
            for name in ours:
                pkg_cell = f"{ms[f'pkg {name}'] / ms['softmax']:.1f}" if f"pkg {name}" in ms else ""
                comp_cell = f"{ms[f'compiled {name}'] / ms['compiled softmax']:.2f}" if compiled else ""
                print(f"| {shape_name} {list(shape)} | {'fwd+bwd' if backward else 'fwd'} | {name} | "
                      f"{ms[name]:.1f} | {ms[name] / ms['softmax']:.2f} | {pkg_cell} | {comp_cell} |", flush=True)


def real_logits(tokens: int) -> torch.Tensor:
    """SmolLM2-135M's logits on FreeBSD fortunes text (offline assets)."""
    from hf_sparsemax.app import assets

    model, tokenizer = assets.load_smollm2()
    text = "\n%\n".join(assets.fortunes())
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    with torch.no_grad():
        return torch.cat([model(input_ids=chunk).logits[0] for chunk in ids.split(512, dim=1)]).float()


def top_p_table(tokens, vocab, repeats, real):
    print("\n| logits | pass | loss | ms | x cross-entropy | mean nucleus size |")
    print("|---|---|---|---:|---:|---:|")
    inputs = {"flat random": torch.randn(tokens, vocab, generator=torch.Generator().manual_seed(0))}
    if real:
        inputs["SmolLM2 on fortunes"] = real_logits(tokens)
    losses = {"cross_entropy": F.cross_entropy, "sparse_softmax_loss(top_p=0.9)":
              lambda x, t: hs.sparse_softmax_loss(x, t, top_p=0.9)}
    for label, x in inputs.items():
        t = torch.randint(0, x.shape[-1], (x.shape[0],), generator=torch.Generator().manual_seed(1))
        size = (hs.sparse_softmax(x, top_p=0.9) > 0).sum(-1).float().mean()
        for backward in (False, True):
            fns = {name: mapping_call(lambda inp, fn=fn: fn(inp, t), x, backward) for name, fn in losses.items()}
            ms = interleaved_medians(fns, repeats)
            for name in losses:
                print(f"| {label} {list(x.shape)} | {'fwd+bwd' if backward else 'fwd'} | {name} | {ms[name]:.1f} | "
                      f"{ms[name] / ms['cross_entropy']:.2f} | {size:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", nargs="+", choices=["mappings", "top_p"], default=["mappings", "top_p"])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-package", action="store_true", help="skip the entmax package")
    parser.add_argument("--compiled", action="store_true", help="add inductor-compiled mappings")
    parser.add_argument("--real", action="store_true", help="top_p table on SmolLM2 logits too")
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU, median of {args.repeats} "
          "interleaved rounds\n")
    if "mappings" in args.tables:
        mapping_table(args.shapes, args.repeats, not args.no_package, args.compiled)
    if "top_p" in args.tables:
        top_p_table(args.tokens, 49152, args.repeats, args.real)


if __name__ == "__main__":
    main()
