"""Passes over the keys of the Triton forward's threshold search, counted in torch on real-text scores (no GPU).

The same per-row arithmetic as :func:`hf_sparsemax.attention._triton_kernels.attention_forward`, in float32 on the
materialised causal scores of the captured SmolLM2 queries / keys (``benchmarks/capture_qk.py``; a prefix of a
causal model's q / k is what the shorter text gives), one head at a time, blocks of ``--block`` query rows and
key tiles of ``--block`` keys (the GPU's 64 x 64):

- "before": Newton from ``tau = -1`` (the kernels until this change);
- "after": the histogram start (``HIST_BINS`` bins of ``z = (alpha - 1)(x - m)`` over the top ``1 + w``, counted in
  the max pass; the root of the binned lower bound ``L(t) <= f(t)`` as the start), then the same Newton passes.

A block of rows takes as many threshold passes as its slowest row (the kernel loops until every row is certified).
Printed per alpha and length: threshold passes per block (mean, max), passes over K per forward (max pass + threshold
passes + output pass), the share of rows certified by the first threshold pass, and the share of visible 64 x 64
tiles with no nonzero weight (skipped by the output pass), and of those dead already at the start.

    PYTHONPATH=. python benchmarks/count_passes.py --tokens 1024 2048 4096
"""

from __future__ import annotations

import argparse
import os

import torch

from hf_sparsemax.attention.triton_attention import HIST_BINS, MAX_PASSES, TOLERANCE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAPTURE = os.path.join(ROOT, ".bench_data", "smollm2_qkv.pt")


def newton_passes(z: torch.Tensor, tau: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(passes, tau)`` per row of the kernel's certified Newton from ``tau`` on ``z [rows, n]`` (float32, -inf
    where masked)."""
    am1, beta = alpha - 1.0, 1.0 / (alpha - 1.0)
    done = torch.zeros_like(tau, dtype=torch.bool)
    passes = torch.zeros_like(tau, dtype=torch.int32)
    previous = torch.full_like(tau, -1.0)
    upper = torch.zeros_like(tau)  # a threshold above the root (g < 0 there): 0, then every t found above
    for _ in range(MAX_PASSES):
        u = z - tau[:, None]
        inside = u > 0
        u = torch.where(inside, u, 0.0)
        count = inside.float().sum(1)
        total = (u ** beta).sum(1)
        slope = torch.where(inside, u ** (beta - 1), 0.0).sum(1)
        lowest = torch.where(inside, u, float("inf")).amin(1)
        norm = torch.where(total > 0, total.clamp_min(1e-30) ** am1, 1.0)
        step = (norm - 1) * (total / norm) / torch.where(slope > 0, slope, 1.0)
        if HALLEY and alpha not in (2.0, 1.5):
            curve = torch.where(inside, u ** (beta - 2), 0.0).sum(1)
            g, d1 = norm - 1, -(total / norm) ** (1 - am1) * 0 - norm / total * slope
            d2 = (am1 - 1) * norm / total ** 2 * beta * slope ** 2 + norm / total * (beta - 1) * curve
            denominator = 1 - g * d2 / (2 * d1 * d1)
            halley = torch.where(denominator >= 0.5, step / denominator, step)
            upper = torch.where(g < 0, torch.minimum(upper, tau), upper)
            step = torch.where(tau + halley < upper, halley, (upper - tau) / 2)
        settled = step.abs() <= TOLERANCE
        if alpha == 2.0:
            settled = settled | ((step >= 0) & ((count == previous) | ((lowest > step) & (count > 0))))
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
    return passes, tau


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


HIST_ITER = 12
HALLEY = True


def count(query, key, alpha: float, block: int, scaling: float) -> dict:
    heads, n, _ = query.shape
    groups = heads // key.shape[0]
    out = {name: [] for name in ("before", "after")}
    certified_first, dead, dead_start, visible = 0.0, 0, 0, 0
    rows_total = 0
    for h in range(heads):
        x = (query[h].float() @ key[h // groups].float().T) * scaling
        x = x.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        m = x.amax(1)
        z = (alpha - 1) * (x - m[:, None])
        before, _ = newton_passes(z, torch.full_like(m, -1.0), alpha)
        start = histogram_start(x, m, alpha)
        after, tau = newton_passes(z, start, alpha)
        certified_first += (after == 1).float().sum().item()
        rows_total += n
        for name, passes in (("before", before), ("after", after)):
            out[name].append(passes.view(-1, block).amax(1))
        live = (z > tau[:, None]).view(n // block, block, n // block, block).any(3).any(1)
        live_start = (z > start[:, None]).view(n // block, block, n // block, block).any(3).any(1)
        seen = torch.ones(n // block, n // block, dtype=torch.bool).tril()
        visible += seen.sum().item()
        dead += (seen & ~live).sum().item()
        dead_start += (seen & ~live_start).sum().item()
    result = {name: torch.cat(v).float() for name, v in out.items()}
    return dict(before_mean=result["before"].mean().item(), before_max=int(result["before"].max()),
                after_mean=result["after"].mean().item(), after_max=int(result["after"].max()),
                certified_first=certified_first / rows_total, dead=dead / visible, dead_start=dead_start / visible)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--alphas", type=float, nargs="+", default=[2.0, 1.5, 1.3])
    parser.add_argument("--block", type=int, default=64)
    args = parser.parse_args()
    capture = torch.load(CAPTURE)
    query, key = capture["query"][0], capture["key"][0]
    print("| tokens | alpha | threshold passes a block, before: mean / max | after: mean / max | passes over K a "
          "forward, before -> after (mean) | rows certified by the first threshold pass | dead tiles (output pass) "
          "| dead at the start |")
    print("|---:|---:|---|---|---|---:|---:|---:|")
    for tokens in args.tokens:
        for alpha in args.alphas:
            r = count(query[:, :tokens], key[:, :tokens], alpha, args.block, capture["scaling"])
            print(f"| {tokens} | {alpha} | {r['before_mean']:.2f} / {r['before_max']} | {r['after_mean']:.2f} / "
                  f"{r['after_max']} | {2 + r['before_mean']:.2f} -> {2 + r['after_mean']:.2f} | "
                  f"{100 * r['certified_first']:.1f}% | {100 * r['dead']:.1f}% | {100 * r['dead_start']:.1f}% |",
                  flush=True)


if __name__ == "__main__":
    main()
