"""The report's figures stay readable at the report's width (report.FIGURE_WIDTH at 110 dpi)."""

import numpy as np
from matplotlib import image

from hf_sparsemax.app import report

WIDEST = int(report.FIGURE_WIDTH * 110) + 1


def test_the_heatmap_wraps_its_panels_and_shows_the_first_tokens(tmp_path):
    rng = np.random.default_rng(0)
    tokens = [f"t{i}" for i in range(40)]
    maps = {f"variant{v}": (np.tril(rng.random((40, 40))), tokens) for v in range(5)}
    path = tmp_path / "heatmap.png"
    report.plot_attention(maps, str(path), layer=11, head=1)
    height, width = image.imread(path).shape[:2]
    assert width <= WIDEST and height > width  # 5 panels of 32 tokens: rows of at most 2, not one 3564-px row
    few = {name: (weights[:6, :6], tokens[:6]) for name, (weights, tokens) in list(maps.items())[:2]}
    report.plot_attention(few, str(path), layer=0, head=0)
    assert image.imread(path).shape[1] <= WIDEST


def test_the_loss_curves_wrap_and_draw_the_held_out_loss(tmp_path):
    history = [{"step": s, "loss": 3.0 - 0.1 * s} for s in range(1, 6)] + [{"step": 5, "eval_loss": 2.9}]
    histories = {f"variant{v}": {"train": history} for v in range(5)}
    path = tmp_path / "curves.png"
    report.plot_loss_curves(histories, str(path), {"variant0": {"train": [(0, 3.1), (5, 2.8)]}})
    height, width = image.imread(path).shape[:2]
    assert width <= WIDEST and height >= 2 * 3.2 * 110 - 1  # 5 panels: two rows of three
