"""Perturbed argmax (Berthet et al., 2020, "Learning with Differentiable Perturbed Optimizers").

``perturb_max(x)_i = P[argmax_j (x_j + eps_j) = i]`` for i.i.d. noise ``eps_j``
with density ``f`` and CDF ``F``. Conditioning on ``eps_i = e``,

    p_i = integral f(e) prod_{j != i} F(x_i - x_j + e) de.

With Gumbel noise this is exactly softmax (the Gumbel-max trick); with
Gaussian noise it is the multinomial probit, which has no closed form.

Quadrature. Substituting ``y = x_i + e`` turns every ``p_i`` into an
integral over one shared variable, the value of the maximum:

    p_i = integral f(y - x_i) / F(y - x_i) * G(y) dy,   G(y) = prod_j F(y - x_j),

so one grid of ``points`` nodes serves all ``i``: ``O(n points)`` work per
row, not ``O(n^2 points)``. The survey's inverse-CDF grid (uniform ``t``,
``e = F^-1(t)``, ``p_i = mean_t prod_{j != i} F(x_i - x_j + e_t)``) resolves
probabilities only down to about ``1 / points``: on 50 Gumbel logits of scale
1 its error against softmax is 8e-4 with 256 points and 5e-5 with 1024. A
uniform grid in ``y`` with trapezoid weights converges geometrically for these
smooth integrands (7e-13 with 256 nodes). The grid is
``floor(max x) + [low - gap, high]`` with ``gap`` the row's range of logits
rounded up (Gaussian; capped where ``p`` underflows float64) or
``[-5, log n + 40]`` (Gumbel, whose integrands all sit at the maximum), so it
is locally constant in ``x``. Everything is in log space (``log F`` by
``log_ndtr`` / ``-exp(-z)``) and rows are renormalised to sum to 1. With
Gumbel noise ``f / F = exp(-z)`` and the result is softmax up to rounding.

Cost: ``points`` times a softmax, plus ``[rows, n, points]`` saved for
backward (autograd through the log-space quadrature, so second derivatives
work too). It serves classification heads up to ``MAX_CLASSES`` labels; it is
not offered for attention or vocabularies (a dense distribution at
``points``-fold cost, and no sparse support to exploit).
"""

from __future__ import annotations

import math
import numbers

import torch

from ._core import check_input, from_rows, masked_below, to_rows

NOISES = ("gaussian", "gumbel")
DEFAULT_POINTS = 256
MAX_CLASSES = 4096  # [rows, n, points] per row for backward: meant for label sets, not vocabularies
GUMBEL_FLOOR = -80.0  # log F(z) = -exp(-z) is clamped here: F is 0 to float64 resolution already


def log_cdf(z: torch.Tensor, noise: str) -> torch.Tensor:
    """``log F(z)``."""
    return torch.special.log_ndtr(z) if noise == "gaussian" else -torch.exp(-z.clamp_min(GUMBEL_FLOOR))


def log_density_over_cdf(z: torch.Tensor, noise: str) -> torch.Tensor:
    """``log f(z) - log F(z)``: ``log phi(z) - log Phi(z)`` (Gaussian) or ``-z`` (Gumbel)."""
    if noise == "gumbel":
        return -z
    return -0.5 * z * z - 0.5 * math.log(2 * math.pi) - torch.special.log_ndtr(z)


def grid(rows: torch.Tensor, valid: torch.Tensor, noise: str, points: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes ``y [rows, K]`` and ``log`` trapezoid weights ``[rows, K]`` of each row's quadrature."""
    top = torch.where(valid, rows, -math.inf).amax(-1, keepdim=True)
    anchor = torch.nan_to_num(top, neginf=0.0).floor()
    u = torch.linspace(0, 1, points, dtype=rows.dtype, device=rows.device)
    if noise == "gaussian":
        bottom = torch.where(valid, rows, math.inf).amin(-1, keepdim=True)
        gap = torch.nan_to_num(top - bottom, nan=0.0, posinf=0.0, neginf=0.0).ceil().clamp(0, 80)
        low, high = -9.0 - gap, torch.full_like(gap, 10.0)
    else:
        low = torch.full_like(anchor, -5.0)
        high = torch.full_like(anchor, 40.0 + math.ceil(math.log(rows.shape[-1])))
    nodes = anchor + low + u * (high - low)
    weight = torch.ones(points, dtype=rows.dtype, device=rows.device)
    weight[0] = weight[-1] = 0.5
    return nodes, (weight * (high - low) / (points - 1)).log()


def check_perturb(noise: str, points: int) -> None:
    if noise not in NOISES:
        raise ValueError(f"perturb_max noise must be one of {list(NOISES)}, got {noise!r}")
    if isinstance(points, bool) or not isinstance(points, numbers.Integral) or points < 2:
        raise ValueError(f"perturb_max points (quadrature nodes) must be an integer >= 2, got {points!r}")


def perturb_log_rows(rows: torch.Tensor, noise: str = "gaussian", points: int = DEFAULT_POINTS,
                     masked: float = -math.inf) -> torch.Tensor:
    """``log p`` of each ``[rows, n]`` row (``-inf`` at masked entries and on fully masked rows)."""
    if rows.shape[-1] > MAX_CLASSES:
        raise ValueError(
            f"perturb_max supports at most {MAX_CLASSES} classes per row (it costs {points} softmaxes and keeps "
            f"[rows, n, points] for backward), got {rows.shape[-1]}: use sparsemax, entmax15 or sparse_softmax "
            "for large label sets and vocabularies"
        )
    bad = (torch.isnan(rows) | (rows == math.inf)).any(-1, keepdim=True)
    valid = (rows > masked) & ~bad
    x = torch.where(valid, rows, 0.0)
    with torch.no_grad():
        nodes, log_weight = grid(rows, valid, noise, points)
    z = nodes.unsqueeze(1) - x.unsqueeze(-1)  # z_ik = y_k - x_i: [rows, n, K]
    log_max_cdf = torch.where(valid.unsqueeze(-1), log_cdf(z, noise), 0.0).sum(1, keepdim=True)  # log G(y_k)
    scores = log_weight.unsqueeze(1) + log_density_over_cdf(z, noise) + log_max_cdf
    log_q = torch.where(valid, torch.logsumexp(scores, -1), -math.inf)
    any_valid = valid.any(-1, keepdim=True)
    log_p = torch.where(valid, torch.log_softmax(torch.where(any_valid, log_q, 0.0), -1), -math.inf)
    return torch.where(bad, torch.where(bad, rows, 0.0) * math.nan, log_p)  # NaN, and a NaN gradient, on bad rows


def perturb_max(x: torch.Tensor, dim: int = -1, noise: str = "gaussian", points: int = DEFAULT_POINTS) -> torch.Tensor:
    """``p_i = P[argmax_j (x_j + eps_j) = i]`` along ``dim`` for i.i.d. ``gaussian`` or ``gumbel`` noise.

    Computed deterministically by quadrature with ``points`` nodes (see the
    module docstring); ``gumbel`` gives softmax. At most ``MAX_CLASSES``
    entries per slice. Masked entries (``-inf`` or at most ``finfo.min``) get
    0, fully masked slices zeros; NaN or ``+inf`` makes the slice NaN.
    Half precision is computed in float32. Gradient by autograd through the
    log-space quadrature.
    """
    dim = check_input(x, dim)
    check_perturb(noise, points)
    rows, shape = to_rows(x, dim)
    if rows.numel() == 0:
        return x * 0  # empty, and part of the graph like every mapping's output
    return from_rows(perturb_log_rows(rows, noise, points, masked_below(x.dtype)).exp(), shape, dim, x.dtype)
