"""Held-out cross-entropy at step 0 of the offline SmolLM2-135M-Instruct: unpatched, plain swap, calibrated.

The data are the default recipe's (the FreeBSD fortunes, held-out entries split by a hash of their text, packed
in blocks); the calibration batches are the first training blocks (never the held-out ones). Cross-entropy is the
mean over every held-out token, in nats.

    python benchmarks/bench_calibration.py                          # entmax15, 2 batches of 4 x 128 tokens
    python benchmarks/bench_calibration.py --attn sparsemax --batches 4 --block-size 64
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import hf_sparsemax as hs
from hf_sparsemax.app.recipe_data import causal_lm_datasets
from hf_sparsemax.app.recipes import load_recipe
from hf_sparsemax.app.runner import load_base_model, load_tokenizer


def held_out_cross_entropy(model, blocks, batch_size: int = 8) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(blocks), batch_size):
            ids = torch.stack([blocks[i]["input_ids"] for i in range(start, min(start + batch_size, len(blocks)))])
            logits = model(input_ids=ids).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
            total, count = total + float(loss), count + ids[:, 1:].numel()
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attn", default="entmax15")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batches", type=int, default=2, help="calibration batches")
    parser.add_argument("--batch-size", type=int, default=4, help="blocks per calibration batch")
    parser.add_argument("--eval-size", type=int, default=32, help="held-out blocks")
    args = parser.parse_args()
    torch.manual_seed(0)
    recipe = load_recipe("default", [f"data.block_size={args.block_size}", f"data.eval_size={args.eval_size}",
                                     f"data.train_size={args.batches * args.batch_size}"])
    tokenizer = load_tokenizer(recipe)
    train, held = causal_lm_datasets(recipe.data, tokenizer)
    batches = [{"input_ids": torch.stack([train[i]["input_ids"] for i in range(b * args.batch_size,
                                                                               (b + 1) * args.batch_size)])}
               for b in range(args.batches)]
    model = load_base_model(recipe).eval()
    results = {"unpatched": held_out_cross_entropy(model, held)}
    hs.patch_model(model, attn=args.attn)
    results["plain_swap"] = held_out_cross_entropy(model, held)
    hs.patch_model(model, attn=args.attn, attn_options={"temperature": True})
    start, cpu = time.perf_counter(), time.process_time()
    report = hs.calibrate_attention(model, batches)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    results["calibrated"] = held_out_cross_entropy(model, held)
    temps = [t for layer in report["layers"] for t in layer["temperatures"]]
    print(json.dumps({
        "attn": args.attn, "block_size": args.block_size, "held_out_blocks": len(held),
        "calibration_tokens": args.batches * args.batch_size * args.block_size, "calibration_seconds": round(seconds, 2),
        "calibration_cpu_seconds": round(cpu, 2), "threads": torch.get_num_threads(),
        "cross_entropy": {k: round(v, 4) for k, v in results.items()},
        "relative_to_unpatched": {k: round(v / results["unpatched"] - 1, 4) for k, v in results.items()},
        "output_error": {"before": round(report["error_before"], 4), "after": round(report["error_after"], 4)},
        "temperatures": {"min": round(min(temps), 3), "median": round(sorted(temps)[len(temps) // 2], 3),
                         "max": round(max(temps), 3)},
    }, indent=1))


if __name__ == "__main__":
    main()
