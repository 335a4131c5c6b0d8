"""Losses on [tokens, vocab] float32 logits: hf_sparsemax vs dense cross-entropy vs the `entmax` package.

Median milliseconds of forward and forward+backward (interleaved rounds, one
process) and the peak memory each adds (a fresh forked process each), as
ratios to `torch.nn.functional.cross_entropy`.

    python benchmarks/bench_losses.py                    # 4096 x 49152
    python benchmarks/bench_losses.py --tokens 512 --vocab 50257 --repeats 3
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import hf_sparsemax as hs
from common import interleaved_medians, peak_memory_mb


def contenders(with_package: bool):
    ours = {
        "cross_entropy (torch)": lambda x, t: F.cross_entropy(x, t),
        "sparse_softmax_loss(top_k=10)": lambda x, t: hs.sparse_softmax_loss(x, t, top_k=10),
        "sparse_softmax_loss(top_k=64)": lambda x, t: hs.sparse_softmax_loss(x, t, top_k=64),
        "sparse_softmax_loss(top_p=0.9)": lambda x, t: hs.sparse_softmax_loss(x, t, top_p=0.9),
        "sparsemax_loss": hs.sparsemax_loss,
        "entmax15_loss": hs.entmax15_loss,
        "entmax_bisect_loss(1.5)": lambda x, t: hs.entmax_bisect_loss(x, t, 1.5),
    }
    if with_package:
        import entmax

        ours.update({
            "entmax pkg sparsemax_loss": entmax.SparsemaxLoss(),
            "entmax pkg entmax15_loss": entmax.Entmax15Loss(),
            "entmax pkg entmax_bisect_loss(1.5)": entmax.EntmaxBisectLoss(1.5),
        })
    return ours


def setup(tokens, vocab, with_package, backward):
    torch.manual_seed(0)
    x = torch.randn(tokens, vocab)
    t = torch.randint(0, vocab, (tokens,))

    def call(fn):
        def once():
            inp = x.detach().requires_grad_() if backward else x
            loss = fn(inp, t)
            if backward:
                loss.backward()

        return once

    return {name: call(fn) for name, fn in contenders(with_package).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-package", action="store_true", help="skip the entmax package")
    args = parser.parse_args()
    with_package = not args.no_package
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, logits [{args.tokens}, {args.vocab}] "
          f"float32, CPU, median of {args.repeats}\n")
    print("| pass | loss | ms | x cross-entropy | peak MiB | x cross-entropy |")
    print("|---|---|---:|---:|---:|---:|")
    for backward in (False, True):
        config = (args.tokens, args.vocab, with_package, backward)
        ms = interleaved_medians(setup(*config), args.repeats)
        memory = {name: peak_memory_mb(setup, config, name) for name in ms}
        base, base_mem = ms["cross_entropy (torch)"], max(memory["cross_entropy (torch)"], 1.0)
        for name in ms:
            print(f"| {'fwd+bwd' if backward else 'fwd'} | {name} | {ms[name]:.1f} | {ms[name] / base:.2f} | "
                  f"{memory[name]:.0f} | {memory[name] / base_mem:.2f} |", flush=True)


if __name__ == "__main__":
    main()
