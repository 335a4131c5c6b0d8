"""Sparsemax (Martins & Astudillo, 2016, "From Softmax to Sparsemax").

``sparsemax(x) = argmin_{p in simplex} ||p - x||^2 = relu(x - tau)`` with
``tau`` such that the result sums to 1. On the entries sorted descending,
``z_1 >= z_2 >= ...``, the support size is
``k = max{j : 1 + j z_j > z_1 + ... + z_j}`` and ``tau = (z_1 + ... + z_k - 1) / k``.

Jacobian on the support ``S``: ``I - 1 1^T / |S|``, so
``dx = (g - mean_S(g)) * [i in S]``.
"""

from __future__ import annotations

import numbers

import torch

from .compiled import RowKernels
from ._core import SupportMapping, check_input, find_threshold, threshold_map, threshold_support
from ._sync_free import SOLVERS

CANDIDATES = 32  # top entries examined first; rows whose support is larger retry with more


def sparsemax_solve(top: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tau - top_1, support size)`` from the sorted top entries of each row (float64).

    ``tau`` is returned relative to the row maximum ``top_1``, where it lies in
    ``[-1, 0)``: that keeps its rounding to float32 below one ulp of 1.
    """
    z = (top - top[:, :1]).masked_fill_(~valid, 0.0)
    cumulative = z.cumsum(-1)
    j = torch.arange(1, z.shape[-1] + 1, dtype=z.dtype, device=z.device)
    size = ((1 + j * z > cumulative) & valid).sum(-1, keepdim=True)
    tau = (cumulative.gather(-1, (size - 1).clamp_min(0)) - 1) / size.clamp_min(1)
    return tau, size


def sparsemax_threshold(rows: torch.Tensor, masked: float, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max(x), tau - max(x))`` of each row, ``[rows, 1]``: sparsemax is ``relu((x - max) - (tau - max))``.

    ``k``: the top candidates examined first on long rows (default ``CANDIDATES``); the answer is exact either way.
    """
    top1, tau, _ = find_threshold(rows, masked, 2.0, sparsemax_solve, k or CANDIDATES)
    return top1, tau


def sparsemax_rows(rows: torch.Tensor, masked: float, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparsemax of each row and ``tau - max(x)``: ``p = relu((x - max) - (tau - max))``."""
    top1, tau = sparsemax_threshold(rows, masked, k)
    return threshold_map(rows, top1, tau), tau


def sparsemax_support(rows: torch.Tensor, masked: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(index, p, tau - max)`` with ``index, p`` of shape ``[rows, K]``: the support of :func:`sparsemax_rows` only."""
    top1, tau, size = find_threshold(rows, masked, 2.0, sparsemax_solve, CANDIDATES)
    return (*threshold_support(rows, top1, tau, size), tau)


def support_indicator(p: torch.Tensor) -> torch.Tensor:
    return torch.sign(p)  # p >= 0: the indicator of p > 0 in one float pass


def check_k(k) -> int | None:
    """``k`` of sparsemax / entmax15 (the entmax package's partial-sort size): None or a positive integer."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1):
        raise ValueError(f"k must be None or a positive integer, got {k!r}")
    return None if k is None else int(k)


def sparsemax(x: torch.Tensor, dim: int = -1, k: int | None = None) -> torch.Tensor:
    """Sparsemax along ``dim``: the Euclidean projection of ``x`` onto the simplex.

    ``p = relu(x - tau)`` with ``sum(p) = 1``; exact zeros outside the support.
    Entries that are ``-inf`` or at most ``finfo(x.dtype).min`` get 0; a slice
    with no other entry maps to zeros. Half-precision input is computed in
    float32. Backward: ``dx = (g - mean_S(g)) * [p > 0]``.

    ``k`` (as in the entmax package) is how many of the largest entries the threshold search examines first;
    rows whose support is larger are searched again with more, so the output is the same exact sparsemax
    for every ``k`` (short rows are solved over the whole row and ignore it).
    """
    dim = check_input(x, dim)
    k = check_k(k)
    return SupportMapping.apply(x, dim, lambda rows, masked: sparsemax_rows(rows, masked, k)[0], support_indicator, KERNELS)


KERNELS = RowKernels(2.0, lambda rows, masked, alpha: sparsemax_threshold(rows, masked))
SOLVERS.update(sparsemax_solve=sparsemax_solve)  # for the compiled path's exact fallback
