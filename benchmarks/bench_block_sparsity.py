"""How much of a sparse attention a block-skipping kernel could skip: the share of all-zero tiles.

Block skipping (AdaSplash; issue 25, item 3) pays off when a whole tile of weights is exactly zero: the tile's
``P V`` product and its backward can then be left out. This counts those tiles in the attention of the offline
SmolLM2-135M (pretrained weights, patched with each sparse attention) on the offline fortunes corpus, at two tile
granularities:

- ``per-head 64 x 64``: a GPU kernel's tile (one head, 64 queries, 64 keys), what AdaSplash skips;
- ``CPU block x 64``: one query block of the memory-bounded CPU path (every head of ``block_queries(...)`` queries,
  as ``hf_sparsemax.attention_blocks`` runs them) against 64 keys.

Tiles wholly in the masked future are left out of both counts (every path skips those already); ``zeros`` is the
share of exactly-zero weights among the visible ones.

    python benchmarks/bench_block_sparsity.py --seq 1024
"""

from __future__ import annotations

import argparse

import torch

import hf_sparsemax as hs
from hf_sparsemax.app.assets import fortunes, load_smollm2
from hf_sparsemax.attention_blocks import block_queries

TILE = 64
ATTENTIONS = {"sparsemax": ("sparsemax", {}), "entmax15": ("entmax15", {}),
              "entmax_bisect(1.3)": ("entmax_bisect", {"alpha": 1.3})}


def tile_counts(weights: torch.Tensor, rows_per_block: int) -> tuple[int, int, int, int, int, int]:
    """``(zero, visible)`` weights, ``(zero, visible)`` per-head tiles and ``(zero, visible)`` CPU-block tiles."""
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
    blocks_live, blocks_seen = [], []
    for start in range(0, q, rows_per_block):
        rows = slice(start, min(start + rows_per_block, q))
        blocks_live.append(torch.nn.functional.pad(weights[0, :, rows] != 0, (0, pad_k)).unflatten(2, (-1, TILE))
                           .any(-1).any(1).any(0))
        blocks_seen.append(torch.nn.functional.pad(causal[rows], (0, pad_k)).unflatten(1, (-1, TILE)).any(-1).any(0))
    block_live, block_seen = torch.stack(blocks_live), torch.stack(blocks_seen)
    cpu = (int((~block_live & block_seen).sum()), int(block_seen.sum()))
    return zero_w, visible_w, *head, *cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    model, tokenizer = load_smollm2(dtype=torch.float32)
    text = "\n\n".join(fortunes())
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.seq]
    heads = model.config.num_attention_heads
    rows = block_queries(1, heads, args.seq, args.seq)
    print(f"SmolLM2-135M (pretrained), {ids.shape[1]} tokens of the fortunes corpus, {model.config.num_hidden_layers} "
          f"layers x {heads} heads; CPU query block: {rows} queries x all heads\n")
    print("| attention | zero weights | all-zero per-head 64x64 tiles | all-zero CPU-block x 64 tiles |")
    print("|---|---:|---:|---:|")
    for name, (attn, options) in ATTENTIONS.items():
        patched = hs.patch_model(model, attn=attn, attn_options=options)
        with torch.no_grad():
            found = patched(ids, output_attentions=True).attentions
        totals = [sum(c) for c in zip(*(tile_counts(w, rows) for w in found))]
        del found
        hs.unpatch_model(patched)
        print(f"| {name} | {totals[0] / totals[1]:.1%} | {totals[2] / totals[3]:.1%} | {totals[4] / totals[5]:.1%} |",
              flush=True)


if __name__ == "__main__":
    main()
