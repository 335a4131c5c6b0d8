"""Sampling speed of SmolLM2-135M-Instruct (offline GGUF) with each matched processor vs plain top-k sampling.

Tokens per second (median of interleaved rounds, one process), and the ratio
to transformers' own top-k sampling.

    python benchmarks/bench_decoding.py --new-tokens 64 --batch 4
"""

from __future__ import annotations

import argparse

import torch
from transformers import LogitsProcessorList

import hf_sparsemax as hs
from hf_sparsemax.app import assets
from common import interleaved_medians

CONTENDERS = {
    "plain top_k=50 sampling": None,
    "SparseSoftmax(top_k=50)": hs.SparseSoftmaxLogitsProcessor(top_k=50),
    "SparseSoftmax(top_p=0.9)": hs.SparseSoftmaxLogitsProcessor(top_p=0.9),
    "Sparsemax": hs.SparsemaxLogitsProcessor(),
    "Entmax(1.5)": hs.EntmaxLogitsProcessor(),
    "Entmax(1.3)": hs.EntmaxLogitsProcessor(alpha=1.3),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = assets.load_smollm2()
    model.eval()
    prompt = tokenizer(["The secret of a happy life is"] * args.batch, return_tensors="pt")

    def run(processor):
        def once():
            torch.manual_seed(0)
            extra = {"top_k": 50} if processor is None else {"top_k": 0, "logits_processor": LogitsProcessorList([processor])}
            with torch.no_grad():
                model.generate(**prompt, do_sample=True, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                               pad_token_id=tokenizer.eos_token_id, **extra)

        return once

    ms = interleaved_medians({name: run(p) for name, p in CONTENDERS.items()}, args.repeats)
    tokens = args.new_tokens * args.batch
    base = tokens / ms["plain top_k=50 sampling"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch} x {args.new_tokens} "
          f"new tokens, CPU, median of {args.repeats}\n")
    print("| decoding | tokens/s | x plain top-k |\n|---|---:|---:|")
    for name, value in ms.items():
        rate = tokens / value * 1e3
        print(f"| {name} | {rate:.1f} | {rate / (base * 1e3):.2f} |")


if __name__ == "__main__":
    main()
