"""The report of ``hf-sparsemax compare``: report.md (a Markdown table), loss curves, attention heatmaps, samples.

Plots use matplotlib's Agg backend (no display needed). In the heatmap, exact
zeros are drawn white: positions the causal mask removes (every variant) and
the extra zeros sparse attention gives; the title counts the share of exact
zeros among the positions the mask allows.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

FIGURE_WIDTH = 12.0  # inches at 110 dpi: 1320 px, the widest a figure gets (the width a report is read at)
HEATMAP_TOKENS = 32  # tokens shown per heatmap (the first ones); more become unreadable at that width
HELD_OUT_COLUMNS = [  # (results key, header, format): a causal LM under one distribution
    ("epsilon_perplexity", "eps-perplexity", "{:.2f}"),
    ("sparsemax_score", "sparsemax score", "{:.4f}"),
    ("jensen_shannon", "Jensen-Shannon", "{:.4f}"),
    ("accuracy", "token accuracy", "{:.3f}"),
    ("zero_prob_share", "held-out p=0 share", "{:.3f}"),
    ("support_size", "mean support", "{:.1f}"),
]
CAUSAL_COLUMNS = [
    ("final_loss", "final train loss", "{:.3f}"),
    ("cross_entropy", "held-out CE", "{:.3f}"),
    *HELD_OUT_COLUMNS,
    ("sample_zero_prob_share", "sampled p=0 share", "{:.3f}"),
    ("heldout_attention_zero_share", "attention zeros (held-out, all heads)", "{:.0%}"),
    ("attention_zero_share", "heatmap head zeros", "{:.0%}"),
    ("train_cpu_seconds", "train CPU s", "{:.0f}"),
]
CLASSIFICATION_COLUMNS = [
    ("final_loss", "final train loss", "{:.3f}"),
    ("accuracy", "accuracy", "{:.3f}"),
    ("macro_f1", "macro-F1", "{:.3f}"),
    ("cross_entropy", "held-out CE", "{:.3f}"),
    ("sparsemax_score", "sparsemax score", "{:.4f}"),
    ("zero_prob_share", "held-out p=0 share", "{:.3f}"),
    ("support_size", "mean support", "{:.2f}"),
    ("train_cpu_seconds", "train CPU s", "{:.0f}"),
]


def columns(task: str):
    return CLASSIFICATION_COLUMNS if task == "sequence_classification" else CAUSAL_COLUMNS


def cell(value: Any, fmt: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return fmt.format(value)


def row_cell(row: dict[str, Any], key: str, fmt: str) -> str:
    """``row[key]``; for a result of several seeds (:mod:`.seeds`) ``mean ± sample standard deviation``."""
    text = cell(row.get(key), fmt)
    std = row.get("spread", {}).get(key, {}).get("std")
    if text and std is not None and len(row.get("seeds", [])) > 1:
        text += " ± " + cell(std, fmt)
    return text


def results_table(results: list[dict[str, Any]], task: str) -> str:
    """A Markdown table: one row per variant, the task's metric columns."""
    cols = columns(task)
    lines = ["| variant | attention | loss | " + " | ".join(h for _, h, _ in cols) + " |",
             "|---|---|---|" + "---:|" * len(cols)]
    for r in results:
        lines.append(f"| {r['variant']} | {r['attn']} | {r['loss']} | "
                     + " | ".join(row_cell(r, k, f) for k, _, f in cols) + " |")
    return "\n".join(lines)


DECODER_COLUMNS = [
    *HELD_OUT_COLUMNS,
    ("outside_support_mass", "mass outside trained support", "{:.4f}"),
]


def decoder_table(results: list[dict[str, Any]]) -> str:
    """A Markdown table: one row per (variant, decoder) of each variant's ``decoders`` results."""
    lines = ["| variant | decoder | " + " | ".join(h for _, h, _ in DECODER_COLUMNS) + " |",
             "|---|---|" + "---:|" * len(DECODER_COLUMNS)]
    for r in results:
        for row in r.get("decoders", []):
            row = {"seeds": r.get("seeds", []), **row}
            lines.append(f"| {r['variant']} | {row['decoder']} | "
                         + " | ".join(row_cell(row, k, f) for k, _, f in DECODER_COLUMNS) + " |")
    return "\n".join(lines)


def plot_confusion(results: list[dict[str, Any]], path: str) -> bool:
    """One confusion matrix per variant (rows: true label, columns: predicted), colour = share of the row.

    Returns False (no file) when no result holds a confusion matrix (results written by an older version).
    """
    shown = [r for r in results if r.get("confusion_matrix")]
    if not shown:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(shown[0]["class_names"])
    side = max(3.5, 0.22 * n + 2.5)
    fig, axes = plt.subplots(1, len(shown), figsize=(side * len(shown), side), squeeze=False)
    for ax, r in zip(axes[0], shown):
        matrix = np.asarray(r["confusion_matrix"], dtype=np.float64)
        share = matrix / np.maximum(matrix.sum(1, keepdims=True), 1)
        ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
        names = r["class_names"]
        ax.set_xticks(range(n), names, rotation=90, fontsize=7 if n > 12 else 9)
        ax.set_yticks(range(n), names, fontsize=7 if n > 12 else 9)
        if n <= 12:
            for i in range(n):
                for j in range(n):
                    ax.text(j, i, int(matrix[i, j]), ha="center", va="center", fontsize=8,
                            color="white" if share[i, j] > 0.5 else "black")
        ax.set_xlabel("predicted")
        ax.set_ylabel("true")
        ax.set_title(f"{r['variant']}: accuracy {r.get('accuracy', float('nan')):.3f}, "
                     f"macro-F1 {r.get('macro_f1', float('nan')):.3f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_loss_curves(histories: dict[str, dict[str, list[dict[str, Any]]]], path: str,
                     heldout: dict[str, dict[str, list[tuple[int, float]]]] | None = None) -> None:
    """Training loss per step, one panel per variant (the losses have different scales), one line per run,
    and the held-out loss (the same loss) where it was measured.

    ``histories``: variant -> {line label (``"train"``, or ``"seed 1"`` ...) -> Trainer's log history};
    its ``eval_loss`` entries (a trainer that evaluates during training) are drawn as held-out points.
    ``heldout``: variant -> {line label -> ``[(step, held-out loss)]``}, e.g. the curve points (:mod:`.curves`)
    or the final evaluation.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(1, min(len(histories), int(FIGURE_WIDTH // 4.0)))  # panels wrap at the report's width
    rows = -(-len(histories) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.0 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(histories):]:
        ax.axis("off")
    for ax, (name, runs) in zip(axes.flat, histories.items()):
        for label, history in runs.items():
            steps = [e["step"] for e in history if "loss" in e]
            ax.plot(steps, [e["loss"] for e in history if "loss" in e], marker=".",
                    label="training" if label == "train" else label)
            evals = [(e["step"], e["eval_loss"]) for e in history if "eval_loss" in e]
            evals = sorted(dict(evals + list((heldout or {}).get(name, {}).get(label, []))).items())
            if evals:
                ax.plot(*zip(*evals), marker="o", linestyle="--",
                        label="held-out" if label == "train" else f"{label} held-out")
        ax.legend(fontsize=7)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (the variant's own)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def zero_share(weights: np.ndarray) -> float:
    """Share of exact zeros among the causally allowed positions (lower triangle with the diagonal)."""
    allowed = np.tril(np.ones_like(weights, dtype=bool))
    return float((weights[allowed] == 0).mean())


def head_zero_shares(weights: np.ndarray) -> list[list[float]]:
    """``[layer][head]`` :func:`zero_share` of ``[layer, head, q, kv]`` attention weights."""
    return [[zero_share(head) for head in layer] for layer in weights]


SPARSE_ALPHA = 1.1  # where a head counts as sparse: on SmolLM2 (default recipe) the heads that ended at alpha >= 1.1
# gave 16% exact attention zeros on the heatmap sentence, all 270 heads 2%


def learned_alpha_runs(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results that carry learned alphas per layer and head, before and after training."""
    return [r for r in results if r.get("learned_alpha_start") and r.get("learned_alpha_end")]


def learned_alpha_summary(r: dict[str, Any], threshold: float = SPARSE_ALPHA) -> dict[str, Any]:
    """What the alphas of one run learned: heads in all, their share at ``alpha >= threshold`` at the start and
    the end, the largest change, and the attention zeros (on the heatmap sentence, allowed cells) of the heads
    at or past the threshold at the end and of all heads (None without per-head zeros)."""
    start, end = np.asarray(r["learned_alpha_start"]), np.asarray(r["learned_alpha_end"])
    sparse = end >= threshold
    zeros = np.asarray(r["attention_zero_heads"]) if r.get("attention_zero_heads") else None
    return {"heads": int(end.size), "sparse_start": float((start >= threshold).mean()),
            "sparse_end": float(sparse.mean()), "max_change": float(np.abs(end - start).max()),
            "mean_change": float((end - start).mean()),
            "sparse_zeros": float(zeros[sparse].mean()) if zeros is not None and sparse.any() else None,
            "all_zeros": float(zeros.mean()) if zeros is not None else None}


def span(values) -> str:
    """``"low-high"`` of a nested list of numbers, 3 decimals (one number when they all round alike)."""
    low, high = f"{np.min(values):.3f}", f"{np.max(values):.3f}"
    return low if low == high else f"{low}-{high}"


def learned_alpha_section(results: list[dict[str, Any]], threshold: float = SPARSE_ALPHA) -> list[str]:
    """report.md lines on what each learned-alpha run learned; says so plainly when the alphas did not move."""
    runs = learned_alpha_runs(results)
    if not runs:
        return []
    lines = ["## Learned alphas", "",
             f"One alpha per layer and head, `alpha = 1 + sigmoid(a)`, trained with the model (figure: "
             f"`learned_alphas.png`, start and end). A head counts as sparse at alpha >= {threshold}; attention "
             "zeros are the share of exact zeros on the heatmap sentence (cells the causal mask allows).", ""]
    for r in runs:
        s = learned_alpha_summary(r, threshold)
        rate = f", alpha learning rate {r['alpha_learning_rate']:g}" if r.get("alpha_learning_rate") else ""
        text = (f"- `{r.get('run', r['variant'])}`{rate}: {s['heads']} heads, alpha from "
                f"{span(r['learned_alpha_start'])} to {span(r['learned_alpha_end'])} "
                f"(mean change {s['mean_change']:+.4f}, "
                f"largest {s['max_change']:.4f}); heads at alpha >= {threshold}: {s['sparse_start']:.0%} at the "
                f"start, {s['sparse_end']:.0%} at the end")
        if s["sparse_zeros"] is not None:
            text += f", giving {s['sparse_zeros']:.0%} attention zeros"
        if s["all_zeros"] is not None:
            text += f" (all heads: {s['all_zeros']:.0%})"
        lines.append(text + ".")
        if s["max_change"] < 0.01:
            lines.append("  The alphas did not move (no head changed by 0.01): this run learned no sparsity; "
                         "give the alphas their own learning rate (`alpha_learning_rate`) or more steps.")
    return lines + [""]


def plot_learned_alphas(results: list[dict[str, Any]], path: str, threshold: float = SPARSE_ALPHA) -> bool:
    """Per learned-alpha run: its alphas per layer (rows) and head (columns) at the start and the end, on one
    colour scale, and each head's attention zeros; heads at ``alpha >= threshold`` are marked with a dot.

    Returns False (no file) when no result holds learned alphas per head.
    """
    runs = learned_alpha_runs(results)
    if not runs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if any(r.get("attention_zero_heads") for r in runs) else 2
    layers, heads = np.asarray(runs[0]["learned_alpha_end"]).shape
    size = (max(3.0, 0.35 * heads + 1.8), max(3.0, 0.16 * layers + 1.5))
    fig, axes = plt.subplots(len(runs), panels, figsize=(size[0] * panels, size[1] * len(runs)), squeeze=False)
    for row, r in zip(axes, runs):
        start, end = np.asarray(r["learned_alpha_start"]), np.asarray(r["learned_alpha_end"])
        low, high = min(start.min(), end.min()), max(start.max(), end.max(), threshold)
        for ax, values, when in ((row[0], start, "start"), (row[1], end, "end")):
            image = ax.imshow(values, cmap="magma", vmin=low, vmax=high, aspect="auto")
            ys, xs = np.nonzero(values >= threshold)
            ax.scatter(xs, ys, s=6, c="cyan")
            ax.set_title(f"{r.get('run', r['variant'])}: alpha at the {when}\n"
                         f"{(values >= threshold).mean():.0%} of heads at alpha >= {threshold}", fontsize=9)
            fig.colorbar(image, ax=ax, fraction=0.05)
        if panels == 3 and r.get("attention_zero_heads"):
            zeros = np.asarray(r["attention_zero_heads"])
            image = row[2].imshow(zeros, cmap="viridis", vmin=0, vmax=1, aspect="auto")
            row[2].set_title(f"attention zeros per head (end): {zeros.mean():.0%}", fontsize=9)
            fig.colorbar(image, ax=row[2], fraction=0.05)
        for ax in row:
            ax.set_xlabel("head")
            ax.set_ylabel("layer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_attention(maps: dict[str, tuple[np.ndarray, list[str]]], path: str, layer: int, head: int) -> None:
    """One heatmap per variant of the same sentence (its first :data:`HEATMAP_TOKENS` tokens); exact zeros white.
    Panels wrap into rows so the figure stays :data:`FIGURE_WIDTH` wide."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = min(HEATMAP_TOKENS, max(len(tokens) for _, tokens in maps.values()))
    panel = max(3.5, 0.2 * size + 1.6)
    cols = max(1, min(len(maps), int(FIGURE_WIDTH // panel)))
    rows = -(-len(maps) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(panel * cols, (panel + 0.4) * rows), squeeze=False)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    for ax in axes.flat[len(maps):]:
        ax.axis("off")
    for ax, (name, (weights, tokens)) in zip(axes.flat, maps.items()):
        shown = weights[:size, :size]
        image = ax.imshow(np.ma.masked_equal(shown, 0.0), cmap=cmap, vmin=0, vmax=max(float(shown.max()), 1e-9))
        ax.set_xticks(range(len(tokens[:size])), tokens[:size], rotation=90, fontsize=7)
        ax.set_yticks(range(len(tokens[:size])), tokens[:size], fontsize=7)
        cut = f", first {size} of {len(tokens)} tokens" if len(tokens) > size else ""
        ax.set_title(f"{name}\nlayer {layer} head {head}: {zero_share(weights):.0%} exact zeros{cut}", fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_samples(results: list[dict[str, Any]], prompts: list[str], path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for r in results:
            handle.write(f"=== {r.get('run', r['variant'])} ({r['attn']} attention, {r['loss']} loss; "
                         f"matched decoding) ===\n")
            for prompt, text in zip(prompts, r.get("texts", [])):
                handle.write(f"{prompt}{text}\n---\n")
            handle.write("\n")


def write_report(folder: str, recipe, results: list[dict[str, Any]], seconds: float, figures: list[str],
                 runs: list[dict[str, Any]] | None = None, extra: list[str] | None = None,
                 peak_rss: float | None = None, heatmap: tuple[int, int] | None = None) -> str:
    """report.md of a comparison; returns its path. It opens with the verdict (:mod:`.verdict`) computed from
    the table. ``runs``: per-run results (each variant's first seed) for the learned alphas, ``results`` when
    not given; ``extra``: lines of a section of its own (the conversion's, :mod:`.convert_report`), before the
    figures; ``peak_rss``: the run's peak resident memory in bytes; ``heatmap``: the heatmap's (layer, head)."""
    from .verdict import verdict

    lines = [f"# hf-sparsemax compare: recipe `{recipe.name}`", "", *verdict(results, recipe.task, peak_rss),
             f"Model `{recipe.model}`, task `{recipe.task}`, data `{recipe.data.source}`"
             f"{' ' + str(recipe.data.categories) if recipe.data.categories else ''}; "
             f"{'LoRA ' + str(recipe.lora) if recipe.lora is not None else 'full fine-tuning'}; "
             f"wall-clock {seconds:.0f} s (model loading included); held-out examples scored: "
             f"{results[0].get('eval_examples', '?') if results else 0}"
             f"{' blocks' if recipe.task == 'causal_lm' else ''}.", ""]
    if recipe.seeds is not None:
        lines += [f"Each variant trained once per seed ({', '.join(map(str, recipe.seeds))}: `training.seed`, i.e. "
                  "LoRA's initialisation and the order of the training blocks; the same data split and held-out "
                  "blocks for every seed). Cells: mean ± sample standard deviation over the seeds (`inf` when a "
                  "seed gave `inf`); min / max and every seed's own results in `results.json` "
                  "(`spread`, `runs`).", ""]
    loads = [load for r in (runs or results) for load in r.get("train_load", [])]
    load = f" (1-minute load average while training: {min(loads):.1f}-{max(loads):.1f})" if loads else ""
    lines += [results_table(results, recipe.task), "",
              f"`train CPU s`: CPU seconds this process spent training the variant, over all its threads{load}; "
              "wall-clock seconds and the load are in `results.json` (`train_seconds`, `train_load`)."
              + (" `attention zeros (held-out, all heads)`: the share of exact zeros among the attention weights "
                 f"of every layer and head on the first {recipe.eval.curve_blocks} held-out blocks (cells the "
                 "causal mask allows; `eval.curve_blocks`); `heatmap head zeros`: layer "
                 f"{(heatmap or (recipe.eval.heatmap_layer, 0))[0]}, head {recipe.eval.heatmap_head} on the "
                 "heatmap sentence alone."
                 if recipe.task == "causal_lm" else ""), ""]
    if recipe.task == "causal_lm":
        lines += ["Held-out metrics are computed under each model's own distribution (the mapping its loss "
                  "trains): cross-entropy is `inf` as soon as one held-out token gets probability 0; "
                  "epsilon-perplexity (eps = " + str(recipe.eval.epsilon) + "), sparsemax score and "
                  "Jensen-Shannon stay finite. `sampled p=0 share`: tokens drawn by matched decoding that the "
                  "training distribution gives probability 0 (0 when decoding matches training). Final train "
                  "losses are each variant's own loss and are not comparable across losses.", ""]
    if any(r.get("decoders") for r in results):
        lines += ["## Decoders a user would use", "",
                  "Each trained variant scored under every distribution it could be sampled from, on the same "
                  "held-out blocks: `matched` is the distribution its loss trains (what this library's `generate` "
                  "samples); a softmax-trained model also under top-k=10, top-p=0.9 and transformers' default "
                  "top_k=50, each renormalised over the kept tokens; a sparse-trained model also under plain "
                  "`generate` without this library (softmax of the raw logits, top_k=50). `mass outside trained "
                  "support`: the probability that decoder gives tokens the trained distribution rules out (p = 0), "
                  "averaged over held-out positions; the chance a sampled token is one training excluded.", "",
                  decoder_table(results), ""]
    lines += learned_alpha_section(results if runs is None else runs)
    lines += extra or []
    for figure in figures:
        lines += [f"![{figure}]({figure})", ""]
    if recipe.task == "causal_lm":
        lines += ["Samples (matched decoding): `samples.txt`. "]
    lines += ["Trained adapters / weights: `<variant>/model/`; settings: `<variant>/variant.json`; "
              "logs: `<variant>/log_history.json`; all numbers: `results.json`.", ""]
    path = os.path.join(folder, "report.md")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines))
    return path
