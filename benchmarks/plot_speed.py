"""The README's speed figure: time against sdpa over the context length, for training, prefill and decoding.

A developer's tool, run by hand when the recorded tables change (matplotlib comes with the ``recipes`` and
``test`` extras)::

    python benchmarks/plot_speed.py          # writes docs/speed-vs-sdpa.png

No number is typed in here: every point is read from a table recorded in docs/speed-attention.md, found by its
section's heading and its header row, so the figure cannot show a number the page does not (the tables were
printed by the benchmark scripts that ``hf-sparsemax bench attention`` has since replaced):

- training, the SmolLM2-shaped 4-layer Llama with random weights (``## Measured``; wall clock, 2 threads), and
  the pretrained SmolLM2-135M on the fortunes text with block skipping (``## Where the time goes, and what is
  not done``);
- prefill and decoding, the pretrained SmolLM2-135M-Instruct, batch 1, each contender in its own process
  (``### Inference: prefill and decoding``; CPU time, 1 thread).

The points also go into the PNG's ``Description`` text chunk (JSON), so ``tests/test_docs.py`` can check that the
committed figure still shows what the tables say.
"""

from __future__ import annotations

import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "speed-attention.md")
FIGURE = os.path.join(ROOT, "docs", "speed-vs-sdpa.png")
CONTENDERS = ("sparsemax", "entmax15", "entmax_bisect(1.3)", "learned alpha (from 1.3)")
SAME = {"learned alpha (1.3)": "learned alpha (from 1.3)"}  # the inference tables' name for the same contender
PANELS = ("training", "training, real text", "prefill", "decoding")
RATIO = re.compile(r"^(\d+(?:\.\d+)?)x?(?:\s|$)")  # "1.09", "0.94x met", "0.91x MISSED (0.8x)"


def section(text: str, heading: str) -> list[str]:
    """The lines under ``heading`` (a whole line of the page) up to the next heading outside a code block."""
    lines = text.splitlines()
    if heading not in lines:
        raise ValueError(f"docs/speed-attention.md has no heading {heading!r}")
    found, fenced = [], False
    for line in lines[lines.index(heading) + 1:]:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            break
        found.append(line)
    return found


def tables(lines: list[str]) -> list[tuple[list[str], list[list[str]]]]:
    """Each markdown table in ``lines`` (indented ones too) as its header's cells and its rows' cells."""
    found, current = [], None
    for line in lines:
        stripped = line.strip()
        if not stripped.startswith("|"):
            current = None
            continue
        cells = [cell.strip() for cell in stripped.strip("|").split("|")]
        if current is None:
            current = (cells, [])
            found.append(current)
        elif not set("".join(cells)) <= set("-: "):
            current[1].append(cells)
    return found


def ratio(cell: str) -> float | None:
    match = RATIO.match(cell)
    return float(match.group(1)) if match else None


def read_points(text: str) -> dict[str, dict[str, list[list[float]]]]:
    """``{panel: {contender: [[context, time / sdpa's], ...]}}``, each point from one row of a recorded table."""
    points: dict[str, dict[str, dict[int, float]]] = {panel: {} for panel in PANELS}

    def add(panel: str, name: str, context: str, value: float | None) -> None:
        name = SAME.get(name, name)
        if name not in CONTENDERS or value is None:
            return
        seen = points[panel].setdefault(name, {})
        if int(context) in seen:
            raise ValueError(f"two recorded values for {panel}, {name}, {context}: say which one the figure shows")
        seen[int(context)] = value

    training = {"training": ("## Measured", ["seq", "attention", "step ms", "x sdpa"]),
                "training, real text": ("## Where the time goes, and what is not done",
                                        ["tokens", "attention", "step", "x sdpa"])}
    for panel, (heading, header) in training.items():
        for cells, rows in tables(section(text, heading)):
            if cells[:4] == header:
                for row in rows:
                    add(panel, row[1], row[0], ratio(row[3]))
    for cells, rows in tables(section(text, "### Inference: prefill and decoding")):
        if cells[:4] != ["context", "batch", "step", "sdpa"]:
            continue
        for row in rows:
            step = {"prefill": "prefill", "decode / token": "decoding"}.get(row[2])
            if row[1] == "1" and step:
                for name, cell in zip(cells[4:], row[4:]):
                    add(step, name, row[0], ratio(cell))
    for panel in PANELS:
        if set(points[panel]) != set(CONTENDERS) and panel != "training, real text":
            raise ValueError(f"{panel}: the tables give {sorted(points[panel])}, not every contender")
    return {panel: {name: [[context, value] for context, value in sorted(by_context.items())]
                    for name, by_context in by_name.items()} for panel, by_name in points.items()}


def plot(points: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plot_speed.py needs matplotlib: pip install -e \".[recipes]\" (or matplotlib alone)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = dict(zip(CONTENDERS, (("#1f77b4", "o"), ("#d62728", "s"), ("#2ca02c", "^"), ("#9467bd", "D"))))
    figure, axes = plt.subplots(1, 3, figsize=(9.6, 3.4), sharey=True, dpi=100)
    titles = {"training": "training step", "prefill": "prefill (no grad)", "decoding": "decoding, per token"}
    for axis, panel in zip(axes, titles):
        axis.axhline(1.0, color="black", linewidth=1)
        for name, (colour, marker) in styles.items():
            xy = points[panel].get(name, [])
            axis.plot([x for x, _ in xy], [y for _, y in xy], color=colour, marker=marker, markersize=5,
                      linewidth=1.5, label=name)
            if panel == "training":
                real = points["training, real text"].get(name, [])
                axis.plot([x for x, _ in real], [y for _, y in real], color=colour, marker=marker, markersize=6,
                          linestyle=":", linewidth=1.2, markerfacecolor="white")
        axis.set_xscale("log", base=2)
        axis.set_xticks([512, 1024, 2048, 4096, 8192], ["512", "1k", "2k", "4k", "8k"])
        axis.minorticks_off()
        axis.set_xlim(400, 10500)
        axis.set_title(titles[panel], fontsize=10)
        axis.set_xlabel("context (tokens)", fontsize=9)
        axis.grid(True, color="#dddddd", linewidth=0.6)
        axis.tick_params(labelsize=8)
    axes[0].set_ylabel("time / sdpa's time", fontsize=9)
    axes[0].set_ylim(0.55, 1.9)
    axes[0].plot([], [], color="grey", marker="o", markerfacecolor="white", linestyle=":",
                 label="training, pretrained on real text")
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=5, fontsize=8, frameon=False)
    figure.suptitle("Time relative to sdpa (below 1: faster) on a 2-core x86 CPU, float32, batch 1; SmolLM2-135M's "
                    "shape (training: random weights, solid)", fontsize=9, x=0.01, ha="left")
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.savefig(path, metadata={"Description": json.dumps(points, sort_keys=True), "Software": None})
    plt.close(figure)


def main() -> None:
    with open(PAGE, encoding="utf-8") as handle:
        points = read_points(handle.read())
    plot(points, FIGURE)
    print(f"{os.path.relpath(FIGURE, ROOT)}: {os.path.getsize(FIGURE) // 1024} KiB")


if __name__ == "__main__":
    main()
