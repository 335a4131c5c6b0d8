"""The evaluation-at-length part of a comparison's report (``recipes/convert_long.yaml``, :mod:`.long_context`).

Written when the runs carry ``cross_entropy_by_length``. Per variant, the mean over its seeds of: the held-out
cross-entropy per position bucket, the passkey accuracy per context and depth, the exact attention zeros, the
keys the int8 certificate never read at the decoding context, and the decoding speed beside sdpa's; for a
variant converted by attention transfer, each layer's output error against the softmax parent before, after the
calibration grid and after the fit, and the heads kept wide. The figure ``passkey_heatmap.png`` shows the passkey
accuracy (depth x context) per variant. The targets, each checked when the variants it names ran:

- each converted variant (:data:`CONVERTED`): held-out cross-entropy within :data:`CE_MARGIN` of ``softmax_ce``'s
  in every bucket, at least :data:`MIN_ZEROS` of its attention weights exactly 0;
- each converted variant: passkey accuracy at the contexts within the model's positions (SmolLM2: 8192) no more
  than :data:`CELL_MARGIN` under ``softmax_ce``'s in any cell, and on average at least equal;
- ``entmax15_converted_length``: at the contexts past the positions (rope extended) at least ``softmax_ce``'s
  accuracy on average;
- every sparse variant: at least :data:`MIN_NEVER_READ` of the keys never read at the decoding context;
- each converted variant, where the parent was measured (the untrained model's cross-entropy by position, the
  table's first row): never more than :data:`PARENT_MARGIN` above the parent's in any bucket.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .seeds import by_variant

CE_MARGIN = 0.02
PARENT_MARGIN = 0.005
CELL_MARGIN = 0.10
MIN_NEVER_READ = 0.95
MIN_ZEROS = 0.90
CONVERTED = ("entmax15_converted", "entmax_transferred")  # the variants the quality targets are for


def long_runs(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    return {name: [r for r in rows if r.get("cross_entropy_by_length")] for name, rows in by_variant(results).items()
            if any(r.get("cross_entropy_by_length") for r in rows)}


def mean_nested(runs: list[dict[str, Any]], key: str) -> dict:
    """The mean over ``runs`` of a (possibly nested) dict of numbers under ``key``, its keys in numeric order
    (contexts, depths, bucket starts: ``results.json`` sorts them as text)."""
    first = runs[0][key]
    if isinstance(first, dict):
        order = sorted(first, key=lambda k: float(str(k).split("-")[0]))
        return {k: mean_nested([{key: r[key][k]} for r in runs], key) for k in order}
    values = [r[key] for r in runs]
    return None if any(v is None for v in values) else float(np.mean(values))


def summary(groups: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, runs in groups.items():
        decode = [r.get("decode") or {} for r in runs]
        out[name] = {"seeds": len(runs), "ce": mean_nested(runs, "cross_entropy_by_length"),
                     "passkey": mean_nested(runs, "passkey_accuracy"),
                     "zeros": mean_nested(runs, "attention_zero_share_at_length"),
                     "never": mean_nested(runs, "keys_never_read"),
                     "trials": runs[0]["long_context"]["trials"], "spec": runs[0]["long_context"],
                     "tps": float(np.mean([d["tokens_per_s"] for d in decode])) if all(decode) else None,
                     "sdpa_tps": float(np.mean([d["sdpa_tokens_per_s"] for d in decode])) if all(decode) else None,
                     "ratio": float(np.mean([d["ratio_to_sdpa"] for d in decode])) if all(decode) else None}
    return out


def plot_passkey(results: list[dict[str, Any]], path: str) -> bool:
    """``passkey_heatmap.png``: accuracy, depth (rows) x context (columns), one panel per variant."""
    rows = summary(long_runs(results))
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.4), squeeze=False)
    for ax, (name, row) in zip(axes[0], rows.items()):
        contexts = list(row["passkey"])
        depths = list(row["passkey"][contexts[0]])
        grid = np.array([[row["passkey"][c][d] for c in contexts] for d in depths])
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(depths)):
            for j in range(len(contexts)):
                ax.text(j, i, f"{grid[i, j]:.0%}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(contexts)), [f"{int(c) // 1024}k" for c in contexts])
        ax.set_yticks(range(len(depths)), [f"{float(d):.0%}" for d in depths] if ax is axes[0][0] else [])
        ax.set_xlabel("context (tokens)")
        ax.set_title(f"{name}\n({row['trials']} trial{'s' * (row['trials'] > 1)} a cell, {row['seeds']} seed"
                     f"{'s' * (row['seeds'] > 1)})", fontsize=8)
    axes[0][0].set_ylabel("passkey depth")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def within(row: dict[str, Any], context) -> bool:
    """Whether ``context`` fits the model's own positions (past them the rope was extended)."""
    return int(context) <= row["spec"].get("positions", 8192)


def cells(row: dict[str, Any], short: bool) -> dict[tuple[str, str], float]:
    return {(c, d): v for c, depths in row["passkey"].items() if within(row, c) == short
            for d, v in depths.items()}


def parent_lines(rows: dict[str, dict[str, Any]], parent: dict[str, float]) -> list[str]:
    """The target against the untrained parent's cross-entropy by position, for each converted variant."""
    lines = []
    for name in CONVERTED:
        conv = rows.get(name)
        if conv is None:
            continue
        gaps = {b: conv["ce"][b] / parent[b] - 1 for b in conv["ce"] if b in parent}  # buckets in numeric order
        text = ", ".join(f"{b}: {g:+.1%}" for b, g in gaps.items())
        lines.append(f"- `{name}` never more than {PARENT_MARGIN:.1%} above the untrained parent's held-out CE in "
                     f"any bucket: **{verdict(all(g <= PARENT_MARGIN for g in gaps.values()))}**: {text}.")
    return lines


def targets(rows: dict[str, dict[str, Any]], parent: dict[str, float] | None = None) -> list[str]:
    """Report lines for each target whose variants ran (module docstring)."""
    soft, lines = rows.get("softmax_ce"), []
    if soft is None:
        return parent_lines(rows, parent) if parent else lines
    length = rows.get("entmax15_converted_length")
    for name in CONVERTED:
        conv = rows.get(name)
        if conv is None:
            continue
        gaps = {b: conv["ce"][b] / soft["ce"][b] - 1 for b in soft["ce"] if b in conv["ce"]}
        text = ", ".join(f"{b}: {conv['ce'][b]:.3f} vs {soft['ce'][b]:.3f} ({g:+.1%})" for b, g in gaps.items())
        lines.append(f"- `{name}` within {CE_MARGIN:.0%} of softmax_ce's held-out CE in every bucket: "
                     f"**{verdict(all(g <= CE_MARGIN for g in gaps.values()))}**: {text}.")
        if conv["zeros"] is not None:
            lines.append(f"- `{name}` with >= {MIN_ZEROS:.0%} of its attention weights exactly 0: "
                         f"**{verdict(conv['zeros'] >= MIN_ZEROS)}**: {conv['zeros']:.1%}.")
        mine, theirs = cells(conv, True), cells(soft, True)
        if theirs:
            worst = min(mine[k] - theirs[k] for k in theirs)
            mean_gap = float(np.mean([mine[k] - theirs[k] for k in theirs]))
            ok = worst >= -CELL_MARGIN and mean_gap >= 0
            lines.append(f"- `{name}` passkey at contexts <= {conv['spec'].get('positions', 8192)} no worse "
                         f"than softmax_ce (every cell within {CELL_MARGIN:.0%}, on average at least equal): "
                         f"**{verdict(ok)}**: mean {float(np.mean(list(mine.values()))):.0%} vs "
                         f"{float(np.mean(list(theirs.values()))):.0%}, worst cell {worst:+.0%} "
                         f"({conv['trials']} trial(s) a cell).")
    if length is not None:
        mine, theirs = cells(length, False), cells(soft, False)
        if theirs:
            a, b = float(np.mean(list(mine.values()))), float(np.mean(list(theirs.values())))
            lines.append(f"- length-scale variant at contexts > {length['spec'].get('positions', 8192)} (rope "
                         f"extended) at least as good as softmax_ce on the passkey: **{verdict(a >= b)}**: {a:.0%} vs "
                         f"{b:.0%} (the cross-entropy at those lengths is not measured: the held-out documents are "
                         f"{length['spec']['length']} tokens).")
    for name, row in rows.items():
        if name != "softmax_ce" and row["never"] is not None:
            lines.append(f"- `{name}` decoding at {row['spec']['decode_context']} tokens with >= {MIN_NEVER_READ:.0%} "
                         f"keys never read: **{verdict(row['never'] >= MIN_NEVER_READ)}**: {row['never']:.2%}.")
    return lines + (parent_lines(rows, parent) if parent else [])


def percent(value) -> str:
    return "" if value is None else f"{value:.0%}"


def section(results: list[dict[str, Any]], parent: dict[str, Any] | None = None) -> list[str]:
    """report.md lines: the tables at length (means over seeds), the decoding speed, the targets. ``parent``:
    :func:`.long_context.parent_at_length` of the untrained model, the cross-entropy table's first row."""
    rows = summary(long_runs(results))
    if not rows:
        return []
    first = next(iter(rows.values()))
    spec = first["spec"]
    buckets = list(first["ce"])
    lines = ["## At length", "",
             f"Held-out cross-entropy by token position on {spec['documents']} held-out document(s) of "
             f"{spec['length']} tokens (entries never trained on, joined by the end-of-sequence token); passkey "
             f"retrieval, greedy, {spec['trials']} trial(s) a cell, depths {spec['depths']}; contexts past "
             f"the model's {spec.get('positions', 8192)} positions with the rotary positions interpolated "
             f"x{spec['rope_factor']}. Exact zeros:"
             f" every layer and head on the first {spec['zeros_length']} held-out tokens. Keys never read: the int8 "
             f"certificate over the decoding steps at {spec['decode_context']} tokens. Mean over the seeds.", "",
             "| variant | seeds | " + " | ".join(f"CE {b}" for b in buckets) + " | exact zeros | keys never read |",
             "|---|---:|" + "---:|" * (len(buckets) + 2)]
    soft = rows.get("softmax_ce")
    before = (parent or {}).get("cross_entropy_by_length")
    if before and set(before) != set(buckets):  # a parent measured on other documents (a resumed, changed spec)
        before = None
    if before:
        ce = " | ".join(f"{before[b]:.3f}" + (f" ({before[b] / soft['ce'][b] - 1:+.1%})" if soft is not None else "")
                        for b in buckets)
        lines.append(f"| parent, before any training | | {ce} | | |")
    for name, row in rows.items():
        ce = " | ".join(f"{row['ce'][b]:.3f}" + (f" ({row['ce'][b] / soft['ce'][b] - 1:+.1%})"
                                                  if soft is not None and name != "softmax_ce" else "")
                        for b in buckets)
        never = "" if row["never"] is None else f"{row['never']:.2%}"
        lines.append(f"| {name} | {row['seeds']} | {ce} | {percent(row['zeros'])} | {never} |")
    for context in first["passkey"]:
        depths = list(first["passkey"][context])
        rope = "" if within(first, context) else f", rope x{spec['rope_factor']}"
        lines += ["", f"Passkey accuracy at {context} tokens{rope}:", "",
                  "| variant | " + " | ".join(f"depth {float(d):.0%}" for d in depths) + " | mean |",
                  "|---|" + "---:|" * (len(depths) + 1)]
        for name, row in rows.items():
            values = [row["passkey"][context][d] for d in depths]
            lines.append(f"| {name} | " + " | ".join(percent(v) for v in values) + f" | {percent(np.mean(values))} |")
    lines += ["", f"Decoding at {spec['decode_context']} tokens ({spec['decode_steps']} steps, each timed beside the "
              "same model's step with its attention switched to sdpa, on a copy of the same cache; medians, wall "
              "clock):", "",
              "| variant | tokens/s | sdpa tokens/s | speed vs sdpa |", "|---|---:|---:|---:|"]
    for name, row in rows.items():
        if row["tps"] is not None:
            lines.append(f"| {name} | {row['tps']:.2f} | {row['sdpa_tps']:.2f} | {row['ratio']:.2f}x |")
    lines += transfer_lines(results)
    where = "; the parent's: `parent_at_length.json`" if before else ""
    checked = targets(rows, before) or ["- (the variants the targets name did not run)"]
    return lines + ["", "Targets at length:", "", *checked,
                    "", "Per run: `cross_entropy_by_length`, `passkey_accuracy`, `keys_never_read_by_context`, "
                    f"`decode` in each run's `results.json`{where}; the heatmap: `passkey_heatmap.png`.", ""]


def transfer_lines(results: list[dict[str, Any]]) -> list[str]:
    """report.md lines for the variants converted by attention transfer: the layers' relative output errors
    against the softmax parent (before, after the calibration grid, after the fit; mean and worst layer) and the
    heads kept wide, per run."""
    runs = [r for r in results if isinstance(r.get("transfer"), dict)]
    if not runs:
        return []
    lines = ["", "Attention transfer: each layer's relative output error against the softmax parent on the transfer "
             "blocks (mean over the layers, and the worst layer), before, after the calibration grid and after the "
             "fit:", "",
             "| variant | seed | blocks | before | calibrated | after | worst layer after | heads kept wide |",
             "|---|---:|---|---:|---:|---:|---:|---|"]
    for run in runs:
        t = run["transfer"]
        worst = max(range(len(t["layers"])), key=lambda i: t["layers"][i][2]) if t["layers"] else None
        wide = ", ".join(f"{layer}.{head}" for layer, head in t["dense_heads"]) or "none"
        worst_text = "" if worst is None else f"{t['layers'][worst][2]:.4f} (layer {worst})"
        lines.append(f"| {run['variant']} | {run.get('seed')} | {t['blocks']} x {t['block_size']} | "
                     f"{t['error_before']:.4f} | {t['error_calibrated']:.4f} | {t['error_after']:.4f} | "
                     f"{worst_text} | {wide} |")
    return lines
