"""The sparse-attention targets, each printed with its measured ratio and met / MISSED.

1. Training step (forward + backward) of a 4-layer SmolLM2-135M-shaped Llama (random weights, batch 1, float32),
   each sparse attention on its default path, against sdpa (transformers' default) at each sequence length:
   time <= 1.3x sdpa for sparsemax and entmax15, <= 2x for entmax_bisect(1.3) and a learned per-head alpha
   (from 1.3); peak memory <= 1.0x sdpa's. Times: medians of interleaved rounds, every contender in one fresh
   process per length (one model each, the same inputs). Memory: the resident memory one step adds over the
   loaded model, every contender in its own fresh process.
2. One call of the mapping on attention scores, forward + backward, against ``torch.softmax`` on the same
   scores (interleaved, one process, at least 5 rounds, each sample the mean of several calls at 512 tokens):
   ``[2, 9, 512, 512]`` and ``[1, 9, 2048, 2048]`` causal scores,
   <= 2 / 2.5 / 4 / 4x for sparsemax / entmax15 / entmax_bisect(1.3) / learned alpha.

    python benchmarks/bench_attention_targets.py                                  # everything (long)
    python benchmarks/bench_attention_targets.py --seqs 512 2048 --repeats 2 --calls
    python benchmarks/bench_attention_targets.py --seqs 8192 --memory-only       # memory of the longest
    python benchmarks/bench_attention_targets.py --seqs 4096 --repeats 1 --time-only   # step time only
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing

import torch

import hf_sparsemax as hs
from bench_step import patched, step
from common import interleaved_medians, mapping_call, peak_memory_mb

SPARSE = {  # name -> (attention, attn_options, time target as a multiple of sdpa)
    "sparsemax": ("sparsemax", {}, 1.3),
    "entmax15": ("entmax15", {}, 1.3),
    "entmax_bisect(1.3)": ("entmax_bisect", {"alpha": 1.3}, 2.0),
    "learned alpha (from 1.3)": ("entmax_bisect", {"alpha": 1.3, "learn_alpha": True}, 2.0),
}
CONTENDERS = {"sdpa": ("sdpa", None), **{name: spec[:2] for name, spec in SPARSE.items()}}
CALL_TARGETS = {"sparsemax": 2.0, "entmax15": 2.5, "entmax_bisect(1.3)": 4.0, "learned alpha (from 1.3)": 4.0}
CALL_SHAPES = [(2, 9, 512, 512), (1, 9, 2048, 2048)]
CALL_ENTRIES = 40_000_000  # entries of scores a timed sample of the per-call table covers (several short calls)
CALL_ROUNDS = 5  # at least this many interleaved rounds in the per-call table
LAYERS = 4


def verdict(ratio: float, target: float) -> str:
    return "met" if ratio <= target else "MISSED"


def step_times(seq: int, repeats: int) -> dict[str, float]:
    """Median step milliseconds of every contender at one length (run in a fresh process)."""
    ids = torch.randint(0, 49152, (1, seq), generator=torch.Generator().manual_seed(seq))
    steps = {name: step(patched(LAYERS, *spec), ids) for name, spec in CONTENDERS.items()}
    return interleaved_medians(steps, repeats)


def _in_child(fn, args, queue):
    queue.put(fn(*args))


def fresh(fn, *args):
    """``fn(*args)`` in a fresh spawned process (its memory and caches start empty)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_in_child, args=(fn, args, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def memory_setup(attn: str, options: dict | None, seq: int) -> dict:
    """For :func:`common.peak_memory_mb`: the model and inputs held, the step to measure (after one warm-up step,
    which loads the compiled threshold kernels, and with its gradients freed)."""
    model = patched(LAYERS, attn, options)
    ids = torch.randint(0, 49152, (1, seq), generator=torch.Generator().manual_seed(seq))
    step(model, ids)()
    model.zero_grad(set_to_none=True)
    gc.collect()
    return {"step": step(model, ids)}


def causal_scores(shape) -> torch.Tensor:
    scores = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 2
    return scores.masked_fill(torch.ones(shape[-2:], dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)


def call_table(repeats: int) -> None:
    repeats = max(repeats, CALL_ROUNDS)
    print("\n| shape | mapping (fwd + bwd) | ms | x torch.softmax | target | |\n|---|---|---:|---:|---:|---|")
    for shape in CALL_SHAPES:
        x = causal_scores(shape)
        alpha = torch.full((1, shape[1], 1, 1), 1.3, requires_grad=True)
        fns = {
            "torch.softmax": lambda s: torch.softmax(s, -1),
            "sparsemax": hs.sparsemax,
            "entmax15": hs.entmax15,
            "entmax_bisect(1.3)": lambda s: hs.entmax_bisect(s, 1.3),
            "learned alpha (from 1.3)": lambda s: hs.entmax_bisect(s, alpha),
        }
        calls = max(1, CALL_ENTRIES // x.numel())  # 8 calls a sample at [2, 9, 512, 512], 1 at 2048 tokens
        ms = interleaved_medians({name: mapping_call(fn, x, True) for name, fn in fns.items()}, repeats, calls)
        for name, target in CALL_TARGETS.items():
            ratio = ms[name] / ms["torch.softmax"]
            print(f"| {list(shape)} | {name} | {ms[name]:.0f} | {ratio:.2f} | {target:g} | {verdict(ratio, target)} |",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--memory-only", action="store_true", help="skip the step times (long sequences)")
    parser.add_argument("--time-only", action="store_true", help="skip the peak memory (measured apart)")
    parser.add_argument("--calls", action="store_true", help="also the per-call table")
    parser.add_argument("--calls-only", action="store_true", help="only the per-call table")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, float32; {LAYERS}-layer SmolLM2-shaped "
          f"Llama, batch 1; medians of {args.repeats} interleaved rounds")
    if not args.calls_only:
        print("\n| seq | attention | step ms | x sdpa | target | | peak MiB | x sdpa | target | |")
        print("|---:|---|---:|---:|---:|---|---:|---:|---:|---|")
        for seq in args.seqs:
            ms = None if args.memory_only else fresh(step_times, seq, args.repeats)
            mib = None if args.time_only else {name: peak_memory_mb(memory_setup, (*spec, seq), "step")
                                               for name, spec in CONTENDERS.items()}
            for name in CONTENDERS:
                cells = ["", "", "", ""]
                if ms is not None:
                    cells = [f"{ms[name]:.0f}", f"{ms[name] / ms['sdpa']:.2f}", "", ""]
                    if name in SPARSE:
                        target = SPARSE[name][2]
                        cells[2:] = [f"{target:g}", verdict(ms[name] / ms["sdpa"], target)]
                memory = ["", "", "", ""]
                if mib is not None:
                    memory[:2] = [f"{mib[name]:.0f}", f"{mib[name] / mib['sdpa']:.3f}"]
                if name in SPARSE and mib is not None:
                    memory[2:] = ["1", verdict(mib[name] / mib["sdpa"], 1.0)]
                print(f"| {seq} | {name} | " + " | ".join(cells + memory) + " |", flush=True)
    if args.calls or args.calls_only:
        call_table(args.repeats)


if __name__ == "__main__":
    main()
