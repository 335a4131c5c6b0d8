"""Passes over the keys of the Triton forward's threshold search, counted in torch on real-text scores (no GPU).

The same per-row arithmetic as :func:`hf_sparsemax.attention.gpu._triton_kernels.attention_forward`, in float32 on the
materialised causal scores of the captured SmolLM2 queries / keys (``benchmarks/capture_qk.py``; a prefix of a
causal model's q / k is what the shorter text gives), one head at a time, blocks of ``--block`` query rows and
key tiles of ``--block`` keys (the GPU's 64 x 64):

- "before": the kernels until this change: Newton from ``tau = -1``, every pass over every tile a block sees;
- "after": the histogram start (``HIST_BINS`` bins of ``z = (alpha - 1)(x - m)``, counted in the max pass; the root
  of the binned lower bound ``L(t) <= f(t)``), then the certified passes (Halley's steps for alphas other than 2
  and 1.5; their certifying pass adds ``P V``, saving the output pass, once the last steps are below ``SPECULATE``),
  each threshold pass and the output pass over the tiles with a score above the current threshold only.

A block of rows takes as many threshold passes as its slowest row (the kernel loops until every row is certified).
Printed per alpha and length: threshold passes a block (mean, max); passes over K a forward (max pass + threshold
passes + output pass, unless the certifying pass added ``P V``); tile visits a forward, in units of one full pass
(what the passes cost: before, every pass is full; after, the max pass is full and the others visit live tiles);
the rows certified by the first threshold pass; the share of visible 64 x 64 tiles with no nonzero weight (skipped
by the output pass), and of those with no score above the start (skipped by the first threshold pass).

    PYTHONPATH=. python benchmarks/count_passes.py --tokens 1024 2048 4096
    PYTHONPATH=. python benchmarks/count_passes.py --kernel-check 128   # the kernel (interpreter) agrees, row by row

``--kernel-check N`` runs the Triton forward under ``TRITON_INTERPRET=1`` on the first ``N`` tokens with at most
``k`` threshold passes (``MAX_PASSES``; a row not certified by then comes out NaN) for k = 1, 2, ..., and prints
the share of rows certified by pass k beside this simulation's.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--kernel-check" in sys.argv:  # before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

import torch

from hf_sparsemax.attention.gpu.triton_attention import HIST_BINS, HIST_ITER, MAX_PASSES, SPECULATE, TOLERANCE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAPTURE = os.path.join(ROOT, ".bench_data", "smollm2_qkv.pt")


def newton_passes(z: torch.Tensor, tau: torch.Tensor, alpha: float, halley: bool):
    """``(passes, tau, taus)`` per row of the kernel's certified Newton (``halley``: Halley's steps for alphas other
    than 2 and 1.5, as the kernel now; without, the kernel before) from ``tau`` on ``z [rows, n]`` (float32, -inf
    where masked); ``taus``: each row's threshold at each pass (frozen once certified)."""
    am1, beta = alpha - 1.0, 1.0 / (alpha - 1.0)
    done = torch.zeros_like(tau, dtype=torch.bool)
    passes = torch.zeros_like(tau, dtype=torch.int32)
    previous = torch.full_like(tau, -1.0)
    upper = torch.zeros_like(tau)  # a threshold above the root (g < 0 there): 0, then every t found above
    taus = []
    for _ in range(MAX_PASSES):
        taus.append(tau)
        u = z - tau[:, None]
        inside = u > 0
        u = torch.where(inside, u, 0.0)
        count = inside.float().sum(1)
        total = (u ** beta).sum(1)
        slope = torch.where(inside, u ** (beta - 1), 0.0).sum(1)
        lowest = torch.where(inside, u, float("inf")).amin(1)
        norm = torch.where(total > 0, total.clamp_min(1e-30) ** am1, 1.0)
        step = (norm - 1) * (total / norm) / torch.where(slope > 0, slope, 1.0)
        if halley and alpha not in (2.0, 1.5):
            curve = torch.where(inside, u ** (beta - 2), 0.0).sum(1)
            g, d1 = norm - 1, -norm / total * slope
            d2 = (am1 - 1) * norm / total ** 2 * beta * slope ** 2 + norm / total * (beta - 1) * curve
            denominator = 1 - g * d2 / (2 * d1 * d1)
            taken = torch.where(denominator >= 0.5, step / denominator, step)
            upper = torch.where(g < 0, torch.minimum(upper, tau), upper)
            step = torch.where(tau + taken < upper, taken, (upper - tau) / 2)
        settled = step.abs() <= TOLERANCE
        if alpha == 2.0:
            settled = settled | (count == previous) | ((lowest > step) & (step >= 0) & (count > 0))
        elif alpha == 1.5:
            disc = slope * slope - count * (total - 1)
            denominator = slope + disc.clamp_min(0).sqrt()
            delta = (total - 1) / torch.where(denominator > 0, denominator, 1.0)
            exact = (disc >= 0) & (delta <= lowest) & (delta >= 0) & (count > 0)
            step = torch.where(exact, delta, step)
            settled = settled | exact
        passes = passes + (~done).int()
        tau = torch.where(done, tau, tau + step)
        done = done | settled
        previous = count
        if done.all():
            break
    return passes, tau, taus


def histogram_start(x: torch.Tensor, m: torch.Tensor, alpha: float) -> torch.Tensor:
    """The kernel's start: the root of the binned lower bound of ``f`` (bins on the score grid of width
    ``w / (alpha - 1)``, anchored at the grid point above the row max, the max itself counted exactly)."""
    am1, beta = alpha - 1.0, 1.0 / (alpha - 1.0)
    width = 1.0 / (HIST_BINS - 1)
    grid = width / am1
    c = torch.ceil(x / grid)  # -inf where masked
    g = c.amax(1)
    b = g[:, None] - c
    counts = torch.stack([(b == i).float().sum(1) for i in range(HIST_BINS)], 1)
    offset = am1 * (g * grid - m)
    edges = offset[:, None] - (torch.arange(HIST_BINS, dtype=x.dtype) + 1)[None, :] * width
    counts[:, 0] -= 1  # the max, at z = 0 exactly
    tau = torch.full_like(m, -1.0)
    for _ in range(HIST_ITER):
        u = (edges - tau[:, None]).clamp_min(0)
        total = (counts * u ** beta).sum(1) + (-tau) ** beta
        slope = (counts * torch.where(u > 0, u ** (beta - 1), 0.0)).sum(1) + (-tau) ** (beta - 1)
        norm = total ** am1  # Newton on the lower bound's norm - 1 (convex, decreasing): stays below its root
        tau = tau + (norm - 1) * (total / norm) / slope
    return tau



def tile_live(z: torch.Tensor, tau: torch.Tensor, block: int) -> torch.Tensor:
    """``[query blocks, key tiles]``: some row of the block has a score with ``z > tau`` in the tile."""
    n = z.shape[0]
    return (z > tau[:, None]).view(n // block, block, n // block, block).any(3).any(1)


def output_saved(passes: torch.Tensor, taus: list, tau: torch.Tensor, alpha: float, block: int) -> torch.Tensor:
    """Per block: whether the kernel's certifying pass adds ``P V`` (other alphas: at the first pass ``k`` after
    which every pending row's last step is at most ``SPECULATE``, if it certifies every pending row)."""
    saved = torch.zeros(passes.numel() // block, dtype=torch.bool)
    if alpha in (2.0, 1.5):
        return saved
    taus = taus + [tau]
    for b in range(saved.numel()):
        rows = slice(block * b, block * (b + 1))
        for k in range(1, int(passes[rows].max())):
            pending = passes[rows] > k
            if (taus[k][rows] - taus[k - 1][rows]).abs()[pending].max() <= SPECULATE:
                if (passes[rows][pending] == k + 1).all():
                    saved[b] = True
                    break
    return saved


def count(query, key, alpha: float, block: int, scaling: float) -> dict:
    """Threshold passes a block before / after, tile visits a forward (in full passes) before / after, the rows
    certified by the first threshold pass, the dead tiles at the end and at the start."""
    heads, n, _ = query.shape
    groups = heads // key.shape[0]
    seen = torch.ones(n // block, n // block, dtype=torch.bool).tril()
    stats = dict(before=[], after=[], saved=[], visits_after=0.0, certified=0.0, dead=0, dead_start=0)
    for h in range(heads):
        x = (query[h].float() @ key[h // groups].float().T) * scaling
        x = x.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        m = x.amax(1)
        z = (alpha - 1) * (x - m[:, None])
        before, _, _ = newton_passes(z, torch.full_like(m, -1.0), alpha, halley=False)
        start = histogram_start(x, m, alpha)
        after, tau, taus = newton_passes(z, start, alpha, halley=True)
        block_before, block_after = before.view(-1, block).amax(1), after.view(-1, block).amax(1)
        saved = output_saved(after, taus, tau, alpha, block)
        stats["before"].append(block_before)
        stats["after"].append(block_after)
        stats["saved"].append(saved)
        stats["certified"] += (after == 1).float().sum().item()
        # tiles a block visits after: pass 1 all it sees, each threshold pass and the output pass its live tiles
        visits = seen.sum(1).float() + tile_live(z, tau, block).logical_and(seen).sum(1) * ~saved
        for k, t in enumerate(taus):
            visits += tile_live(z, t, block).logical_and(seen).sum(1) * (block_after > k)
        stats["visits_after"] += visits.sum().item()
        stats["dead"] += (seen & ~tile_live(z, tau, block)).sum().item()
        stats["dead_start"] += (seen & ~tile_live(z, start, block)).sum().item()
    visible = heads * seen.sum().item()
    before, after = torch.cat(stats["before"]).float(), torch.cat(stats["after"]).float()
    saved = torch.cat(stats["saved"]).float()
    # before: every pass visits every tile it sees: (2 + threshold passes) full passes, weighted by tiles seen
    weights = seen.sum(1).float().repeat(heads)
    return dict(before_mean=before.mean().item(), before_max=int(before.max()), after_mean=after.mean().item(),
                after_max=int(after.max()), k_after=(2 + after - saved).mean().item(),
                visits_before=((2 + before) * weights).sum().item() / visible,
                visits_after=stats["visits_after"] / visible, certified=stats["certified"] / (heads * n),
                dead=stats["dead"] / visible, dead_start=stats["dead_start"] / visible)


def kernel_check(query, key, tokens: int, scaling: float, alphas) -> None:
    """Rows certified by threshold pass k: the kernel (rows finite with ``MAX_PASSES = k``) against the torch
    simulation, on the first ``tokens`` tokens of every head."""
    from hf_sparsemax.attention.gpu import triton_attention as ta

    q, k = query[:, :tokens].float(), key[:, :tokens].float()
    groups = q.shape[0] // k.shape[0]
    block = ta.INTERPRET_BLOCK
    print(f"| alpha | threshold passes k | rows certified by pass k: kernel | simulation | passes over K a block "
          f"({block} x {block} tiles), kernel's count: mean / max | tile visits a forward in full passes: kernel |")
    print("|---:|---:|---:|---:|---|---:|")
    for alpha in alphas:
        passes = []
        for h in range(q.shape[0]):
            x = (q[h] @ k[h // groups].T) * scaling
            x = x.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), float("-inf"))
            m = x.amax(1)
            passes.append(newton_passes((alpha - 1) * (x - m[:, None]), histogram_start(x, m, alpha), alpha, True)[0])
        passes = torch.cat(passes)
        original = ta.MAX_PASSES
        seen = torch.ones(tokens // block, tokens // block).tril().sum(1)  # tiles a block sees (causal)
        try:
            for limit in range(1, int(passes.max()) + 1):
                ta.MAX_PASSES = limit
                alphas = torch.full((q.shape[0],), alpha)
                out, _, _, work = ta._forward(q[None], k[None], k[None], alphas, None, 0.0, True, scaling)
                finite = torch.isfinite(out).all(-1).float().mean().item()
                counted = ""
                if limit == int(passes.max()):  # every row certified: the kernel's own counters
                    done = work[0, ..., 0].float()
                    counted = (f"{done.mean():.2f} / {int(done.max())} | "
                               f"{work[0, ..., 1].sum() / (seen.sum() * q.shape[0]):.2f}")
                print(f"| {alpha} | {limit} | {100 * finite:.1f}% | {100 * (passes <= limit).float().mean():.1f}% | "
                      f"{counted or ' |'} |", flush=True)
        finally:
            ta.MAX_PASSES = original


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--alphas", type=float, nargs="+", default=[2.0, 1.5, 1.3])
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--kernel-check", type=int, default=0, metavar="N")
    args = parser.parse_args()
    capture = torch.load(CAPTURE)
    query, key = capture["query"][0], capture["key"][0]
    if args.kernel_check:
        return kernel_check(query, key, args.kernel_check, capture["scaling"], args.alphas)
    print("| tokens | alpha | threshold passes a block, before: mean / max | after: mean / max | passes over K a "
          "forward, before -> after (mean) | tile visits a forward in full passes, before -> after | rows certified "
          "by the first threshold pass | dead tiles at the end | dead at the start |")
    print("|---:|---:|---|---|---|---|---:|---:|---:|")
    for tokens in args.tokens:
        for alpha in args.alphas:
            r = count(query[:, :tokens], key[:, :tokens], alpha, args.block, capture["scaling"])
            print(f"| {tokens} | {alpha} | {r['before_mean']:.2f} / {r['before_max']} | {r['after_mean']:.2f} / "
                  f"{r['after_max']} | {2 + r['before_mean']:.2f} -> {r['k_after']:.2f} | "
                  f"{r['visits_before']:.2f} -> {r['visits_after']:.2f} | {100 * r['certified']:.1f}% | "
                  f"{100 * r['dead']:.1f}% | {100 * r['dead_start']:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
