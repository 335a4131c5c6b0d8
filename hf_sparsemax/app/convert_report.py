"""The conversion part of a comparison's report (``recipes/convert.yaml``): curves, temperatures, alphas, targets.

Written when the runs carry curves (``eval.curve_every``, :mod:`.curves`). The figure ``curves.png`` shows,
per variant (mean over its seeds at each measured step), the held-out loss and the share of exact attention
zeros (every layer and head) over the steps. The targets are checked when the variants they name
exist, each mean over the seeds:

- ``entmax15_converted``: held-out cross-entropy within :data:`CE_MARGIN` of ``softmax_ce``'s, with at least
  :data:`MIN_ZEROS` of the attention weights exactly 0 on held-out text;
- step 0 after calibration (``entmax15_converted``'s first curve point) within :data:`STEP0_MARGIN` of the
  unpatched model's (``softmax_ce``'s first point; the plain swap ``entmax15_swap``'s shown beside);
- ``learned_alpha_converted``: within :data:`CE_MARGIN` of ``softmax_ce``, its trained alphas spread over at
  least :data:`MIN_ALPHA_SPREAD` (max - min over every layer and head, per seed).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .seeds import by_variant

CE_MARGIN = 0.02
STEP0_MARGIN = 0.05
MIN_ZEROS = 0.60
MIN_ALPHA_SPREAD = 0.2


def mean_curve(runs: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and the mean over ``runs`` of ``key`` at the steps every run measured."""
    steps = sorted(set.intersection(*({p["step"] for p in r["curve"]} for r in runs)))
    values = [float(np.mean([next(p[key] for p in r["curve"] if p["step"] == s) for r in runs])) for s in steps]
    return steps, values


def curve_runs(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per variant, its runs that carry a curve (``results``: every run, each seed)."""
    return {name: [r for r in rows if r.get("curve")] for name, rows in by_variant(results).items()
            if any(r.get("curve") for r in rows)}


def plot_curves(results: list[dict[str, Any]], path: str) -> bool:
    """``curves.png``: held-out loss and exact attention zeros over the steps; False (no file) without curves."""
    groups = curve_runs(results)
    if not groups:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, runs in groups.items():
        label = f"{name} ({len(runs)} seed{'s' * (len(runs) > 1)})"
        axes[0].plot(*mean_curve(runs, "eval_loss"), marker="o", label=label)
        axes[1].plot(*mean_curve(runs, "attention_zero_share"), marker="o", label=label)
    axes[0].set_ylabel("held-out loss (curve blocks)")
    axes[1].set_ylabel("attention weights exactly 0")
    axes[1].set_ylim(-0.02, 1.02)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def mean_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
    return float(np.mean(values)) if len(values) == len(runs) and values else None


def alpha_spread(run: dict[str, Any]) -> float | None:
    end = run.get("learned_alpha_end")
    return float(np.max(end) - np.min(end)) if end else None


def span_of(nested) -> str:
    values = np.asarray([v for layer in nested for v in layer], dtype=np.float64)
    return f"{values.min():.3g}-{values.max():.3g} (median {np.median(values):.3g})"


def summary(groups: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per variant: mean and std of held-out CE, mean step-0 loss and held-out zeros, alpha spread."""
    out = {}
    for name, runs in groups.items():
        ce = [r.get("cross_entropy") for r in runs]
        spreads = [alpha_spread(r) for r in runs]
        out[name] = {"seeds": len(runs), "ce": float(np.mean(ce)),
                     "ce_std": float(np.std(ce, ddof=1)) if len(ce) > 1 else 0.0,
                     "step0": mean_of(runs, "step0_loss"), "zeros": mean_of(runs, "heldout_attention_zero_share"),
                     "alpha_spread": float(np.mean(spreads)) if all(s is not None for s in spreads) else None}
    return out


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def targets(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Report lines for each target whose variants ran (module docstring)."""
    lines, soft = [], rows.get("softmax_ce")
    if soft is None:
        return lines
    conv, swap, learned = rows.get("entmax15_converted"), rows.get("entmax15_swap"), rows.get("learned_alpha_converted")
    if conv is not None:
        gap = conv["ce"] / soft["ce"] - 1
        ok = gap <= CE_MARGIN and (conv["zeros"] or 0) >= MIN_ZEROS
        lines.append(f"- converted entmax15 within {CE_MARGIN:.0%} of softmax_ce with >= {MIN_ZEROS:.0%} exact zeros: "
                     f"**{verdict(ok)}**: held-out CE {conv['ce']:.3f} ± {conv['ce_std']:.3f} vs {soft['ce']:.3f} "
                     f"± {soft['ce_std']:.3f} ({gap:+.1%}), {conv['zeros']:.0%} exact zeros.")
        if conv["step0"] is not None and soft["step0"] is not None:
            gap0 = conv["step0"] / soft["step0"] - 1
            plain = (f"; the plain swap at step 0: {swap['step0']:.3f} ({swap['step0'] / soft['step0'] - 1:+.1%})"
                     if swap is not None and swap["step0"] is not None else "")
            lines.append(f"- step 0 after calibration within {STEP0_MARGIN:.0%} of the unpatched model: "
                         f"**{verdict(gap0 <= STEP0_MARGIN)}**: {conv['step0']:.3f} vs {soft['step0']:.3f} "
                         f"({gap0:+.1%}){plain}.")
    if learned is not None and learned["alpha_spread"] is not None:
        gap = learned["ce"] / soft["ce"] - 1
        ok = gap <= CE_MARGIN and learned["alpha_spread"] >= MIN_ALPHA_SPREAD
        lines.append(f"- converted learned alpha within {CE_MARGIN:.0%} of softmax_ce, alphas spread >= "
                     f"{MIN_ALPHA_SPREAD}: **{verdict(ok)}**: held-out CE {learned['ce']:.3f} ± {learned['ce_std']:.3f} "
                     f"({gap:+.1%}), alphas spread over {learned['alpha_spread']:.3f}.")
    return lines


def conversion_section(results: list[dict[str, Any]]) -> list[str]:
    """report.md lines: the conversion table (means over seeds), the targets, temperatures and alphas."""
    groups = curve_runs(results)
    if not groups:
        return []
    rows = summary(groups)
    lines = ["## Conversion", "",
             "Step-0 and curve losses are measured on the first held-out blocks (`eval.curve_blocks`), before "
             "training: the patched (and calibrated) model as it starts; held-out CE on every held-out block at the "
             "end; exact zeros: share of the attention weights of every layer and head that are exactly 0 on the "
             "curve blocks at the end (cells the causal mask allows). Mean over the seeds.", "",
             "| variant | seeds | step-0 loss | held-out CE | vs softmax_ce | exact zeros | alpha spread |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    soft = rows.get("softmax_ce")
    for name, row in rows.items():
        versus = f"{row['ce'] / soft['ce'] - 1:+.1%}" if soft is not None else ""
        step0 = "" if row["step0"] is None else f"{row['step0']:.3f}"
        zeros = "" if row["zeros"] is None else f"{row['zeros']:.0%}"
        spread = "" if row["alpha_spread"] is None else f"{row['alpha_spread']:.3f}"
        lines.append(f"| {name} | {row['seeds']} | {step0} | {row['ce']:.3f} ± {row['ce_std']:.3f} | {versus} | "
                     f"{zeros} | {spread} |")
    lines += ["", "Targets:", "", *(targets(rows) or ["- (the variants the targets name did not run)"]), ""]
    for name, runs in groups.items():
        first = runs[0]
        if first.get("temperatures"):
            calibration = first.get("calibration", {})
            lines.append(f"- `{first.get('run', name)}`: per-head temperatures {span_of(first['temperatures'])}; "
                         f"relative attention-output error against softmax {calibration.get('error_before', math.nan):.3f}"
                         f" before calibration, {calibration.get('error_after', math.nan):.3f} after "
                         f"({calibration.get('batches', '?')} training batches).")
        if first.get("learned_alpha_end"):
            lines.append(f"- `{first.get('run', name)}`: learned alphas at the end {span_of(first['learned_alpha_end'])}.")
    return lines + ["", "Per-head temperatures and alphas: `results.json` (`runs[*].temperatures`, "
                    "`runs[*].learned_alpha_end`); curves: `curves.png` and `runs[*].curve`.", ""]
