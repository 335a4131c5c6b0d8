"""Inference against sdpa: prefill and per-token greedy decoding with transformers' KV cache (issue 37).

The pretrained SmolLM2-135M-Instruct (the offline asset, float32 unless ``--dtype bfloat16``) on fortunes text,
patched with each sparse attention, against sdpa (the model as loaded). Each contender runs in its own fresh
process (one model, the same prompt); the contenders run back to back, ``--rounds`` times interleaved, and each
number is the median over rounds. Per context (``--contexts``) and batch (``--batches``; batches > 1 are
left-padded, row ``i`` shorter by ``i * 8`` tokens):

- prefill: one forward over the prompt under ``torch.no_grad()`` with a fresh cache (median of
  ``--prefills`` calls after a warm-up forward at 256 tokens and two decoding steps): a ``DynamicCache``, or with
  ``--cache static`` a ``StaticCache`` of the prompt's length plus ``--tokens`` (every step then attends over the
  whole static length, its unfilled slots masked, as ``generate(cache_implementation="static")`` does);
- decode: from that cache, ``--tokens`` greedy steps of one token each (the model's forward with the cache, as
  ``generate`` calls it); the median step.

Targets (issue 37; ratios to sdpa, met / MISSED printed beside each):
prefill <= 1.15x for sparsemax and entmax15, <= 1.5x for entmax_bisect(1.3) and a learned alpha (from 1.3);
decode <= 1.05x / <= 1.2x. Where an attention skips KV pages (``pages skipped``: exact KV skipping of
:mod:`hf_sparsemax.attention.blocked.pages`, from ``MIN_KEYS`` cached keys; ``HF_SPARSEMAX_KV_SKIP=0`` turns it off), the
share of the pages of its decoding steps whose keys and values it never read; ``keys certified``: the share of
the cached keys the fused kernel's int8 key certificate (:mod:`hf_sparsemax.attention.blocked.keycodes`) never read. From
8192 tokens the decode targets are issue 47's: <= 0.6x sdpa for sparsemax, <= 0.7x for entmax15.

    PYTHONPATH=. python benchmarks/bench_inference.py                       # 512 and 2048 tokens, batch 1
    PYTHONPATH=. python benchmarks/bench_inference.py --contexts 8192 --rounds 1 --prefills 1
    PYTHONPATH=. python benchmarks/bench_inference.py --batches 8 --contexts 512
    PYTHONPATH=. python benchmarks/bench_inference.py --threads 1 --clock cpu   # on a shared, loaded machine
    PYTHONPATH=. python benchmarks/bench_inference.py --cache static            # transformers' StaticCache
    PYTHONPATH=. python benchmarks/bench_inference.py --device cuda --dtype bfloat16 --contexts 2048 8192
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

CONTENDERS = {  # name -> (attention, attn_options, prefill target, decode target): ratios to sdpa
    "sdpa": ("sdpa", None, None, None),
    "sparsemax": ("sparsemax", {}, 1.15, 1.05),
    "entmax15": ("entmax15", {}, 1.15, 1.05),
    "entmax_bisect(1.3)": ("entmax_bisect", {"alpha": 1.3}, 1.5, 1.2),
    "learned alpha (1.3)": ("entmax_bisect", {"alpha": 1.3, "learn_alpha": True}, 1.5, 1.2),
}
LONG_DECODE = {"sparsemax": 0.6, "entmax15": 0.7}  # issue 47: decode targets from LONG_CONTEXT tokens
LONG_CONTEXT = 8192
WARMUP_TOKENS = 256  # large enough for the compiled row kernels (blocks of 9 x 256 x 256 scores)
PAD_STEP = 8  # row i of a padded batch is shorter by i * PAD_STEP tokens


def prompt(tokenizer, context: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[batch, context]`` of fortunes text, left-padded rows for batch > 1."""
    from hf_sparsemax.app.assets import fortunes

    ids = tokenizer("\n\n".join(fortunes()), return_tensors="pt").input_ids[0]
    if ids.numel() < context + batch:
        raise ValueError(f"the fortunes text has {ids.numel()} tokens, fewer than --contexts {context} needs")
    rows, masks = [], []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for i in range(batch):
        length = context - i * PAD_STEP
        if length < 1:
            raise ValueError(f"batch {batch} at context {context}: row {i} would have no tokens")
        start = i * 997 % (ids.numel() - context)  # a different passage per row
        rows.append(torch.cat([torch.full((context - length,), pad), ids[start : start + length]]))
        masks.append(torch.cat([torch.zeros(context - length, dtype=torch.long), torch.ones(length, dtype=torch.long)]))
    return torch.stack(rows), torch.stack(masks)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows (as ``generate`` computes them): 0 at each row's first real token."""
    return (mask.cumsum(-1) - 1).clamp_min(0)


def new_cache(model, kind: str, length: int):
    """A fresh cache for ``length`` tokens: transformers' ``DynamicCache`` or ``StaticCache``."""
    from transformers import DynamicCache, StaticCache

    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=length)
    return DynamicCache(config=model.config)


def measure(name: str, contexts: list[int], batches: list[int], prefills: int, tokens: int, dtype: str,
            clock, device: str = "cpu", cache_kind: str = "dynamic") -> dict:
    """The child process: prefill and decode milliseconds for each (context, batch) of one contender."""
    import hf_sparsemax as hs
    from hf_sparsemax.app.assets import load_smollm2
    from hf_sparsemax.attention.blocked import keycodes, pages

    attention, options = CONTENDERS[name][:2]
    model, tokenizer = load_smollm2(dtype=getattr(torch, dtype))
    model.to(device).eval()
    if attention != "sdpa":
        hs.patch_model(model, attn=attention, attn_options=options)
    found = {}
    with torch.no_grad():
        for batch in batches:  # compiles the kernels (prefill blocks, decoding steps) before anything is timed
            warm_ids, warm_mask = (t.to(device) for t in prompt(tokenizer, WARMUP_TOKENS, batch))
            full = bool(warm_mask.all())
            out = model(input_ids=warm_ids, attention_mask=None if full else warm_mask, position_ids=positions(warm_mask),
                        past_key_values=new_cache(model, cache_kind, WARMUP_TOKENS + 2))
            for _ in range(2):
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                warm_mask = torch.cat([warm_mask, torch.ones_like(nxt)], dim=-1)
                out = model(input_ids=nxt, attention_mask=None if full else warm_mask,
                            position_ids=positions(warm_mask)[:, -1:], past_key_values=out.past_key_values)
        for context in contexts:
            for batch in batches:
                ids, mask = (t.to(device) for t in prompt(tokenizer, context, batch))
                full = bool(mask.all())
                times = []
                for _ in range(prefills):
                    cache = new_cache(model, cache_kind, context + tokens)
                    start = clock()
                    out = model(input_ids=ids, attention_mask=None if full else mask, position_ids=positions(mask),
                                past_key_values=cache, use_cache=True, logits_to_keep=1)
                    times.append(clock() - start)
                steps, cache = [], out.past_key_values
                pages.reset_counts()
                keycodes.reset_counts()
                for _ in range(tokens):
                    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                    mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
                    start = clock()
                    out = model(input_ids=nxt, attention_mask=None if full else mask, position_ids=positions(mask)[:, -1:],
                                past_key_values=cache, use_cache=True)
                    steps.append(clock() - start)
                found[f"{context}x{batch}"] = {"prefill": statistics.median(times) * 1e3,
                                               "decode": statistics.median(steps) * 1e3,
                                               "pages": pages.skipped_share() if pages.COUNTS["calls"] else None,
                                               "certified": keycodes.certified_share()
                                               if keycodes.COUNTS["calls"] else None}
    return found


def synchronised(clock):
    """``clock`` read after the GPU has finished the work queued so far (CUDA runs asynchronously)."""
    def read() -> float:
        torch.cuda.synchronize()
        return clock()
    return read


def load() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


def target(name: str, index: int, context: int) -> float | None:
    """The contender's target for the step (index 2: prefill, 3: decode), issue 47's decode targets from
    ``LONG_CONTEXT`` tokens."""
    if index == 3 and context >= LONG_CONTEXT and name in LONG_DECODE:
        return LONG_DECODE[name]
    return CONTENDERS[name][index]


def verdict(ratio: float, target: float | None) -> str:
    return "" if target is None else " met" if ratio <= target else " MISSED"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every contender, back to back")
    parser.add_argument("--prefills", type=int, default=2, help="timed prefills per context (median)")
    parser.add_argument("--tokens", type=int, default=16, help="decode steps per context (median)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads in each child")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="wall: elapsed time; cpu: the process's CPU time (with --threads 1, what a shared, "
                             "loaded machine still measures fairly: time spent waiting for a core is not counted)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (on cuda the wall clock, synchronised)")
    parser.add_argument("--cache", default="dynamic", choices=["dynamic", "static"],
                        help="transformers' KV cache: DynamicCache, or StaticCache of the prompt plus --tokens")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        torch.set_num_threads(args.threads)
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        if args.device.startswith("cuda"):
            clock = synchronised(time.perf_counter)
        print(json.dumps(measure(args.child, args.contexts, args.batches, args.prefills, args.tokens, args.dtype,
                                 clock, args.device, args.cache)))
        return
    if "sdpa" not in args.contenders:
        args.contenders = ["sdpa", *args.contenders]
    samples: dict[str, list[dict]] = {name: [] for name in args.contenders}
    loads = [load()]
    for _ in range(args.rounds):
        for name in args.contenders:
            command = [sys.executable, __file__, "--child", name, "--contexts", *map(str, args.contexts),
                       "--batches", *map(str, args.batches), "--prefills", str(args.prefills),
                       "--tokens", str(args.tokens), "--dtype", args.dtype, "--threads", str(args.threads),
                       "--clock", args.clock, "--device", args.device, "--cache", args.cache]
            done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
            if done.returncode:
                raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
            samples[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            loads.append(load())
    where = (torch.cuda.get_device_name() if args.device.startswith("cuda")
             else f"{args.threads} threads, {args.clock} clock")
    print(f"SmolLM2-135M-Instruct ({args.dtype}, {args.cache} cache), fortunes text, {where}; medians of "
          f"{args.rounds} rounds ({args.prefills} prefills, {args.tokens} decode steps each); load average "
          f"{loads[0]} at start, {loads[-1]} at end\n")
    print("| context | batch | step | sdpa | " + " | ".join(n for n in args.contenders if n != "sdpa") + " |")
    print("|---:|---:|---|---:|" + "---:|" * (len(args.contenders) - 1))
    for context in args.contexts:
        for batch in args.batches:
            key = f"{context}x{batch}"
            for step, index in (("prefill", 2), ("decode / token", 3)):
                field = step.split()[0]
                median = {n: statistics.median(s[key][field] for s in samples[n]) for n in args.contenders}
                base = median["sdpa"]
                cells = [f"{median[n] / base:.2f}x{verdict(median[n] / base, target(n, index, context))}"
                         for n in args.contenders if n != "sdpa"]
                shown = f"{base / 1e3:.2f} s" if base >= 1e3 else f"{base:.1f} ms"
                print(f"| {context} | {batch} | {step} | {shown} | " + " | ".join(cells) + " |")
            shares = [[s[key].get("pages") for s in samples[n]] for n in args.contenders if n != "sdpa"]
            cells = ["" if None in share else f"{statistics.median(share):.0%}" for share in shares]
            print(f"| {context} | {batch} | pages skipped | | " + " | ".join(cells) + " |")
            shares = [[s[key].get("certified") for s in samples[n]] for n in args.contenders if n != "sdpa"]
            cells = ["" if None in share else f"{statistics.median(share):.1%}" for share in shares]
            print(f"| {context} | {batch} | keys certified | | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
