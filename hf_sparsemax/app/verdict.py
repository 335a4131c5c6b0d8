"""The verdict that opens report.md: one sentence per question a comparison asks, computed from its table.

The reference is the variant with softmax attention and cross-entropy (else the first). A variant that changes
only the loss answers "which loss keeps quality at which sparsity"; one that changes only the attention answers
"which attention"; every variant answers "what it costs" (training CPU time against the reference; the run's
peak memory). With seeds each number carries its sample standard deviation, and a difference counts as one
when it is wider than twice the two standard deviations combined (``2 sqrt(s1^2 + s2^2)``); with one seed
there are no error bars and the sentence says so. A number the results lack reads "not measured".
"""

from __future__ import annotations

import math
from typing import Any

NOT_MEASURED = "not measured"
QUALITY = {  # task -> (results key, name, format, higher is better)
    "causal_lm": ("epsilon_perplexity", "epsilon-perplexity", "{:.2f}", False),
    "sequence_classification": ("macro_f1", "macro-F1", "{:.3f}", True),
}
LOAD_SPREAD = 1.0  # 1-minute load averages further apart than this while training: the CPU-time ratios are warned of


def number(row: dict[str, Any], key: str) -> tuple[float, float | None] | None:
    """``(value, standard deviation or None)`` of ``row[key]``; None when the row has no number there."""
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    std = row.get("spread", {}).get(key, {}).get("std") if len(row.get("seeds") or []) > 1 else None
    return float(value), std


def shown(row: dict[str, Any], key: str, fmt: str) -> str:
    """``row[key]`` as ``"1.23"`` / ``"1.23 ± 0.04"`` / ``"inf"`` / :data:`NOT_MEASURED`."""
    got = number(row, key)
    if got is None:
        return NOT_MEASURED
    value, std = got
    text = "inf" if math.isinf(value) else fmt.format(value)
    return text + (f" ± {fmt.format(std)}" if std is not None else "")


def compared(row: dict[str, Any], ref: dict[str, Any], key: str, higher_better: bool) -> str:
    """How ``row[key]`` stands against the reference's: better, worse or within the error bars."""
    a, b = number(row, key), number(ref, key)
    if a is None or b is None:
        return NOT_MEASURED
    if math.isinf(a[0]) or math.isinf(b[0]):
        if a[0] == b[0]:
            return "no finite comparison"
        return "better" if (a[0] > b[0]) == higher_better else "worse"
    if a[1] is None or b[1] is None:
        return ("better" if (a[0] > b[0]) == higher_better else "worse") + " (one run: no error bars)"
    wide = 2 * math.hypot(a[1], b[1])
    if abs(a[0] - b[0]) <= wide:
        return "within the error bars (2 standard deviations)"
    return "better" if (a[0] > b[0]) == higher_better else "worse"


def reference(results: list[dict[str, Any]]) -> dict[str, Any]:
    for row in results:
        if row.get("attn") == "softmax" and row.get("loss") == "cross_entropy":
            return row
    return results[0]


def loss_sentence(rows, ref, task: str) -> str:
    key, name, fmt, higher = QUALITY[task]
    parts = []
    for row in rows:
        parts.append(f"`{row['variant']}` {name} {shown(row, key, fmt)} ({compared(row, ref, key, higher)}), "
                     f"held-out tokens at p = 0 {shown(row, 'zero_prob_share', '{:.3f}')}, "
                     f"mean support {shown(row, 'support_size', '{:.1f}')}")
    ranked = [row for row in rows if number(row, key) is not None]
    best = ""
    if ranked:
        top = (max if higher else min)(ranked, key=lambda r: number(r, key)[0])
        best = f" Best sparse loss by {name}: `{top['variant']}`."
    return (f"**Which loss keeps quality, at which sparsity** (against `{ref['variant']}`: {name} "
            f"{shown(ref, key, fmt)}, mean support {shown(ref, 'support_size', '{:.1f}')}): "
            + "; ".join(parts) + "." + best)


def attention_sentence(rows, ref, task: str) -> str:
    key, name, fmt, higher = QUALITY[task]
    parts = []
    for row in rows:
        ce = number(row, "cross_entropy"), number(ref, "cross_entropy")
        cost = (f"{ce[0][0] - ce[1][0]:+.3f} nats of held-out cross-entropy"
                if None not in ce and math.isfinite(ce[0][0]) and math.isfinite(ce[1][0]) else
                f"held-out cross-entropy {NOT_MEASURED}")
        zeros = shown(row, "heldout_attention_zero_share", "{:.0%}")
        parts.append(f"`{row['variant']}` attends with {zeros} exact zeros at {cost}, "
                     f"{name} {shown(row, key, fmt)} ({compared(row, ref, key, higher)})")
    return (f"**Which attention** (exact zeros: every layer and head on held-out text; against "
            f"`{ref['variant']}`: {shown(ref, 'heldout_attention_zero_share', '{:.0%}')} zeros, "
            f"{name} {shown(ref, key, fmt)}): "
            + "; ".join(parts) + ".")


def cost_sentences(results, ref, peak_rss: float | None) -> list[str]:
    base = number(ref, "train_cpu_seconds")
    parts = []
    for row in results:
        if row is ref:
            continue
        got = number(row, "train_cpu_seconds")
        parts.append(f"`{row['variant']}` " + (f"{got[0] / base[0]:.2f}x" if got and base and base[0] > 0
                                               else NOT_MEASURED))
    loads = [load for row in results for load in row.get("train_load") or []]
    load = f"; 1-minute load average {min(loads):.1f}-{max(loads):.1f} while training" if loads else ""
    if loads and max(loads) - min(loads) > LOAD_SPREAD:
        load += (" (the load changed while training: threads waiting for a core burn CPU time too, so these ratios "
                 "measure the machine as much as the variants; compare them from a run on a quiet machine)")
    time = (f"**Time**: training CPU time (process CPU seconds) against `{ref['variant']}` "
            f"({shown(ref, 'train_cpu_seconds', '{:.0f}')} s): " + (", ".join(parts) or "no other variant")
            + load + ".")
    memory = ("**Memory**: peak resident memory of the whole comparison (one process, every variant) "
              + (f"{peak_rss / 2**30:.2f} GiB" if peak_rss else NOT_MEASURED) + "; per variant " + NOT_MEASURED + ".")
    return [time, memory]


def verdict(results: list[dict[str, Any]], task: str, peak_rss: float | None = None) -> list[str]:
    """The report's "Verdict" section (Markdown lines): a sentence per question the variants ask."""
    if not results:
        return []
    ref = reference(results)
    losses = [r for r in results if r is not ref and r.get("attn") == ref.get("attn")
              and r.get("loss") != ref.get("loss")]
    attentions = [r for r in results if r is not ref and r.get("loss") == ref.get("loss")
                  and r.get("attn") != ref.get("attn")]
    lines = ["## Verdict", ""]
    if losses:
        lines.append("- " + loss_sentence(losses, ref, task))
    if attentions:
        lines.append("- " + attention_sentence(attentions, ref, task))
    lines += ["- " + s for s in cost_sentences(results, ref, peak_rss)]
    return lines + [""]
