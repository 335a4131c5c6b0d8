"""Repeated runs of a comparison (``compare --seeds 0,1,2``): one entry per variant with mean and spread.

For each numeric result ``x_1 .. x_n`` of the ``n`` seeds of a variant
(held-out metrics, final loss, train seconds, and the same per decoder row),
the entry holds the mean ``m = sum(x_i) / n`` under the result's own key
(the value itself when every seed gave the same), so every reader of a
single-seed result reads the mean, and under ``spread``
the sample standard deviation ``sqrt(sum((x_i - m)**2) / (n - 1))`` (0 for
one seed), the minimum and the maximum. A metric that is infinite for some
seed (held-out cross-entropy of a sparse model) has mean ``inf`` and standard
deviation ``None``. The per-seed results are kept whole under ``runs``.
"""

from __future__ import annotations

import math
from typing import Any

NOT_AVERAGED = ("seed",)
PER_RUN = ("texts", "decoders", "run", "seed", "folder", "resumed_from", "per_class", "confusion_matrix",
           "learned_alpha_start", "learned_alpha_end", "attention_zero_heads", "curve",
           "temperatures", "calibration")  # in runs only


def spread(values: list[float]) -> tuple[float, dict[str, float | None]]:
    """``(mean, {"std", "min", "max"})`` of the values of one metric over seeds."""
    n = len(values)
    mean = math.fsum(values) / n if all(math.isfinite(v) for v in values) else sum(values) / n
    std = None
    if all(math.isfinite(v) for v in values):
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, {"std": std, "min": min(values), "max": max(values)}


def numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first row's non-numeric fields, and mean + ``spread`` of every field numeric in all rows."""
    out = {k: v for k, v in rows[0].items() if not numeric(v) or k in NOT_AVERAGED}
    out["spread"] = {}
    for key, value in rows[0].items():
        if key in NOT_AVERAGED or not numeric(value) or not all(numeric(r.get(key)) for r in rows):
            continue
        out[key], out["spread"][key] = spread([float(r[key]) for r in rows])
        if all(r[key] == value for r in rows):
            out[key] = value  # the same for every seed (block counts, steps): kept as it is
    return out


def by_variant(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The runs grouped by ``variant``, variants in the order first seen, runs in their order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(run["variant"], []).append(run)
    return groups


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per variant (in the order first seen) from the per-seed results of every run.

    Each entry: ``variant``, ``attn``, ``loss``, ``seeds``, the mean of each numeric result, ``spread``
    (``{key: {"std", "min", "max"}}``), ``decoders`` summarised row by row the same way, and ``runs``
    (the per-seed results as they were written).
    """
    out = []
    for rows in by_variant(runs).values():
        entry = {k: v for k, v in summarise(rows).items() if k not in PER_RUN}
        entry["seeds"] = [r.get("seed") for r in rows]
        if all(r.get("decoders") for r in rows):
            entry["decoders"] = [summarise([r["decoders"][i] for r in rows])
                                 for i in range(len(rows[0]["decoders"]))]
        entry["runs"] = rows
        out.append(entry)
    return out
