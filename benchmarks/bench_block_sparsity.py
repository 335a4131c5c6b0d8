"""Block skipping on real text: how much of a sparse attention is exactly zero, and what skipping it saves.

Block skipping (AdaSplash; issue 25, item 3) leaves out the ``P V`` product and the backward over keys whose
weights are all exactly zero. This counts them in the attention of the offline SmolLM2-135M (pretrained weights,
patched with each sparse attention) on the offline fortunes corpus, at three granularities:

- ``per-head 64 x 64``: a GPU kernel's tile (one head, 64 queries, 64 keys), what AdaSplash skips;
- ``CPU block x 64``: one query block of the memory-bounded CPU path (every head of ``block_queries(...)`` queries,
  as ``hf_sparsemax.attention.blocked.blocks`` runs them) against 64 keys;
- ``keys no query of a CPU block weighs``: single keys of such a block, what ``attention_blocks`` skips.

Keys and tiles wholly in the masked future are left out of the counts (every path skips those already); ``zeros`` is the
share of exactly-zero weights among the visible ones.

With ``--time``, one training step of the same model (forward, loss, backward) at ``--seq`` tokens, each
sparse attention with block skipping (the default) and without (``GATHER_BELOW = 0``), against sdpa in the same
run, rounds interleaved:

    python benchmarks/bench_block_sparsity.py --seq 1024
    python benchmarks/bench_block_sparsity.py --seq 2048 --time --repeats 2
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from common import interleaved_medians

import hf_sparsemax as hs
from hf_sparsemax.attention.blocked import blocks as attention_blocks
from hf_sparsemax.app.assets import fortunes, load_smollm2
from hf_sparsemax.attention.blocked.blocks import block_queries

TILE = 64
ATTENTIONS = {"sparsemax": ("sparsemax", {}), "entmax15": ("entmax15", {}),
              "entmax_bisect(1.3)": ("entmax_bisect", {"alpha": 1.3})}
LEARNED = {"learned alpha (from 1.3)": ("entmax_bisect", {"alpha": 1.3, "learn_alpha": True})}


def tile_counts(weights: torch.Tensor, rows_per_block: int) -> tuple[int, ...]:
    """``(zero, visible)`` weights, ``(zero, visible)`` per-head tiles, ``(zero, visible)`` CPU-block tiles and
    ``(zero, visible)`` CPU-block keys (what the blocked path skips: keys no query of the block weighs)."""
    _, heads, q, k = weights.shape
    causal = torch.ones(q, k, dtype=torch.bool).tril()
    zero_w = int(((weights == 0) & causal).sum())
    visible_w = int(causal.sum()) * heads
    pad_q, pad_k = -q % TILE, -k % TILE
    live = torch.nn.functional.pad(weights[0] != 0, (0, pad_k, 0, pad_q))
    seen = torch.nn.functional.pad(causal, (0, pad_k, 0, pad_q))
    head_tiles = live.unflatten(2, (-1, TILE)).unflatten(1, (-1, TILE)).any(-1).any(2)  # [H, q/T, k/T]
    seen_tiles = seen.unflatten(1, (-1, TILE)).unflatten(0, (-1, TILE)).any(-1).any(1)  # [q/T, k/T]
    head = (int((~head_tiles & seen_tiles).sum()), int(seen_tiles.sum()) * heads)
    blocks_live, blocks_seen, keys_dead, keys_seen = [], [], 0, 0
    for start in range(0, q, rows_per_block):
        rows = slice(start, min(start + rows_per_block, q))
        live_keys = (weights[0, :, rows] != 0).any(1).any(0)
        seen_keys = causal[rows].any(0)
        keys_dead, keys_seen = keys_dead + int((~live_keys & seen_keys).sum()), keys_seen + int(seen_keys.sum())
        blocks_live.append(torch.nn.functional.pad(live_keys, (0, pad_k)).unflatten(0, (-1, TILE)).any(-1))
        blocks_seen.append(torch.nn.functional.pad(seen_keys, (0, pad_k)).unflatten(0, (-1, TILE)).any(-1))
    block_live, block_seen = torch.stack(blocks_live), torch.stack(blocks_seen)
    cpu = (int((~block_live & block_seen).sum()), int(block_seen.sum()))
    return zero_w, visible_w, *head, *cpu, keys_dead, keys_seen


def training_step(model, ids, attention: tuple[str, dict] | None, skipping: bool = True) -> Callable[[], None]:
    """One step (forward, language-model loss, backward) of ``model`` patched with ``attention`` (None: as loaded,
    sdpa), with or without block skipping."""

    def step():
        patched = model if attention is None else hs.patch_model(model, attn=attention[0], attn_options=attention[1])
        gather = attention_blocks.GATHER_BELOW
        attention_blocks.GATHER_BELOW = gather if skipping else 0.0
        try:
            patched(ids, labels=ids).loss.backward()
        finally:
            attention_blocks.GATHER_BELOW = gather
            model.zero_grad(set_to_none=True)
            if attention is not None:
                hs.unpatch_model(patched)

    return step


def time_steps(model, ids, repeats: int) -> None:
    """The ``--time`` table: step times with and without block skipping, as ratios to sdpa's."""
    steps = {"sdpa": training_step(model, ids, None)}
    for name, attention in (ATTENTIONS | LEARNED).items():
        steps[name] = training_step(model, ids, attention)
        steps[f"{name} without skipping"] = training_step(model, ids, attention, skipping=False)
    found = interleaved_medians(steps, repeats)
    sdpa = found["sdpa"]
    print(f"training step (median of {repeats}), sdpa {sdpa / 1e3:.2f} s\n")
    print("| attention | step | x sdpa | without skipping | x sdpa | skipping's speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in ATTENTIONS | LEARNED:
        on, off = found[name], found[f"{name} without skipping"]
        print(f"| {name} | {on / 1e3:.2f} s | {on / sdpa:.2f} | {off / 1e3:.2f} s | {off / sdpa:.2f} | "
              f"{off / on:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--time", action="store_true", help="time training steps with and without block skipping")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds (--time)")
    args = parser.parse_args()
    model, tokenizer = load_smollm2(dtype=torch.float32)
    text = "\n\n".join(fortunes())
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.seq]
    heads = model.config.num_attention_heads
    rows = block_queries(1, heads, args.seq, args.seq)
    print(f"SmolLM2-135M (pretrained), {ids.shape[1]} tokens of the fortunes corpus, {model.config.num_hidden_layers} "
          f"layers x {heads} heads; CPU query block: {rows} queries x all heads\n")
    if args.time:
        time_steps(model.train(), ids, args.repeats)
        return
    print("| attention | zero weights | all-zero per-head 64x64 tiles | all-zero CPU-block x 64 tiles | "
          "keys no query of a CPU block weighs (skipped) |")
    print("|---|---:|---:|---:|---:|")
    for name, (attn, options) in ATTENTIONS.items():
        patched = hs.patch_model(model, attn=attn, attn_options=options)
        with torch.no_grad():
            found = patched(ids, output_attentions=True).attentions
        totals = [sum(c) for c in zip(*(tile_counts(w, rows) for w in found))]
        del found
        hs.unpatch_model(patched)
        print(f"| {name} | {totals[0] / totals[1]:.1%} | {totals[2] / totals[3]:.1%} | {totals[4] / totals[5]:.1%} | "
              f"{totals[6] / totals[7]:.1%} |", flush=True)


if __name__ == "__main__":
    main()
