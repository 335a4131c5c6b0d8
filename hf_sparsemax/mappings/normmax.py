"""alpha-normmax (Blondel, Martins & Niculae, 2020, "Learning with Fenchel-Young Losses"; Santos et al., 2024,
"Sparse and Structured Hopfield Networks").

``normmax_alpha(x) = argmax_{p in simplex} <p, x> - ||p||_alpha`` for ``alpha > 1``. On the support,
``(p_i / ||p||_alpha) ** (alpha - 1) = x_i - tau``, so with ``u = relu(x - tau) ** (1 / (alpha - 1))``:

    p = u / sum(u),   tau such that  sum(u ** alpha) = sum(relu(x - tau) ** gamma) = 1,  gamma = alpha / (alpha - 1).

That threshold equation is alpha'-entmax's on ``gamma x`` with ``alpha' = 2 - 1/alpha`` (whose power is
``1 / (alpha' - 1) = gamma``), so the exact entmax threshold solvers find ``tau``; the output step then raises
``relu(x - tau)`` to ``1 / (alpha - 1)`` instead of ``gamma`` and normalises. ``tau - max(x)`` lies in
``[-1, 0]``; alpha -> 1 tends to argmax, alpha = 2 is ``relu(x - tau)`` normalised.

Fenchel-Young loss (regulariser ``||p||_alpha - 1``): ``(p - e_t) . x + 1 - ||p||_alpha``. With
``x_i - tau = u_i ** (alpha - 1)`` on the support, ``p . x = tau + ||p||_alpha``, so the loss is
``1 + tau - x_t``: one threshold, no pass beyond the mapping's. Gradient ``p - e_t``.

Backward, with ``beta = 1/(alpha - 1)``, ``s = p ** (2 - alpha)`` on the support and ``h = g - <g, p>``:

    dx = beta ||p||_alpha ** (alpha - 1) (h * s - <h, s> p)
    d alpha = -beta <h, p log p> + (beta / alpha) <h, s> (sum p**alpha log p - sum p**alpha log(sum p**alpha) / alpha)

(implicit differentiation of ``sum u**alpha = 1``; both are functions of ``p`` and ``alpha`` alone).
"""

from __future__ import annotations

import functools

import torch

from ._core import check_input, find_threshold, map_rows, masked_below, row_alpha, solve_on_top, support_power
from ._core import threshold_map, work_dtype
from .entmax import CANDIDATES, bisect_solve, check_alpha


def normmax_rows(
    rows: torch.Tensor, alpha: float | torch.Tensor, masked: float, n_iter: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha-normmax of each ``[rows, n]`` row (``alpha`` a float or ``[rows, 1]``) and ``tau - max(x)``.

    Fully masked rows give zeros (``tau = +inf``), rows holding NaN or ``+inf`` NaN.
    """
    top = rows.amax(-1, keepdim=True)
    shift = top.masked_fill(~torch.isfinite(top), 0.0)
    gamma = alpha / (alpha - 1)
    scaled = torch.where(rows <= masked, float("-inf"), (rows - shift) * gamma)  # entmax's input: gamma (x - max)
    entmax_alpha = 2 - 1 / alpha
    if isinstance(alpha, torch.Tensor):
        solve, row_args = functools.partial(bisect_solve, n_iter=n_iter), (entmax_alpha,)
    else:
        solve, row_args = functools.partial(bisect_solve, alpha=entmax_alpha, n_iter=n_iter), ()
    if n_iter is None:
        top1, tau, _ = find_threshold(scaled, masked, entmax_alpha, solve, CANDIDATES, *row_args)
    else:  # a fixed number of steps on the candidate sets, as entmax_bisect
        top1, tau, _ = solve_on_top(scaled, solve, CANDIDATES, masked, *row_args)
    tau = tau.masked_fill(torch.isnan(top) | (top == float("inf")), float("nan"))
    u = threshold_map(scaled, top1, tau, entmax_alpha - 1, 1 / (alpha - 1))  # relu(x - max - tau) ** beta
    total = u.sum(-1, keepdim=True)
    return u / total.masked_fill(total == 0, 1.0), tau


def precise_in_float32(alpha: float | torch.Tensor) -> bool:
    """Whether float32 keeps normmax within about 1e-7 for these alphas: all in [8/7, 2] (else float64).

    The solve is alpha'-entmax's (``alpha' = 2 - 1/alpha`` in [1.125, 1.5] there, see
    :func:`.entmax.precise_in_float32`), and the output power ``1/(alpha - 1)`` is at least 1: for
    alpha > 2 it is below 1 and amplifies the rounding of ``x - tau`` near the threshold.
    """
    low, high = 8 / 7, 2.0
    if isinstance(alpha, torch.Tensor):
        return bool(((alpha >= low) & (alpha <= high)).all())
    return low <= alpha <= high


def normmax_vjp(p: torch.Tensor, g: torch.Tensor, alpha: float | torch.Tensor, dim: int, alpha_grad: bool):
    """``(J_x^T g, J_alpha^T g)`` of alpha-normmax at its output ``p`` (see the module docstring).

    Differentiable operations on ``p`` and ``alpha`` (:func:`support_power`), so double backward is exact.
    """
    beta = 1 / (alpha - 1)
    s = support_power(p, 2 - alpha)
    p_alpha = support_power(p, alpha)
    sum_p_alpha = p_alpha.sum(dim, keepdim=True)
    h = g - (g * p).sum(dim, keepdim=True)
    hs = (h * s).sum(dim, keepdim=True)
    norm_power = sum_p_alpha.pow((alpha - 1) / alpha)  # ||p||_alpha ** (alpha - 1)
    dx = beta * norm_power * (h * s - hs * p)
    d_alpha = None
    if alpha_grad:
        support = p > 0
        log_p = torch.where(support, torch.where(support, p, 1).log(), 0)
        plogp = p * log_p
        tiny = torch.finfo(p.dtype).tiny
        entropy = (p_alpha * log_p).sum(dim, keepdim=True) - sum_p_alpha * sum_p_alpha.clamp_min(tiny).log() / alpha
        d_alpha = -beta * (h * plogp).sum(dim, keepdim=True) + beta / alpha * hs * entropy
    return dx, d_alpha


class NormmaxBisectFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha, dim: int, n_iter: int | None) -> torch.Tensor:
        alpha_rows = row_alpha(alpha, x, dim) if isinstance(alpha, torch.Tensor) else alpha
        upcast = x.dtype != torch.float64 and (
            isinstance(alpha, torch.Tensor) and torch.compiler.is_compiling() or not precise_in_float32(alpha_rows))

        def rows_fn(rows: torch.Tensor) -> torch.Tensor:
            a = alpha_rows.to(rows.device) if isinstance(alpha_rows, torch.Tensor) else alpha_rows
            if upcast:
                rows, a = rows.double(), a.double() if isinstance(a, torch.Tensor) else a
            elif isinstance(a, torch.Tensor):
                a = a.to(rows.dtype)
            return normmax_rows(rows, a, masked_below(x.dtype), n_iter)[0]

        out = map_rows(x, dim, rows_fn)
        ctx.dim, ctx.alpha_is_tensor = dim, isinstance(alpha, torch.Tensor)
        ctx.alpha = None if ctx.alpha_is_tensor else alpha
        ctx.save_for_backward(out, *((alpha,) if ctx.alpha_is_tensor else ()))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p, *saved = ctx.saved_tensors
        dtype = work_dtype(grad.dtype)
        alpha = saved[0].to(dtype) if ctx.alpha_is_tensor else ctx.alpha
        alpha_grad = ctx.alpha_is_tensor and ctx.needs_input_grad[1]
        dx, d_alpha = normmax_vjp(p.to(dtype), grad.to(dtype), alpha, ctx.dim, alpha_grad)
        if d_alpha is not None:
            d_alpha = d_alpha.sum_to_size(saved[0].shape).to(saved[0].dtype)
        return dx.to(grad.dtype), d_alpha, None, None


def normmax_bisect(
    x: torch.Tensor, alpha: float | torch.Tensor = 2.0, dim: int = -1, n_iter: int | None = None
) -> torch.Tensor:
    """alpha-normmax along ``dim``: ``argmax_{p in simplex} <p, x> - ||p||_alpha``, ``p = u / sum(u)``,
    ``u = relu(x - tau) ** (1/(alpha-1))`` with ``sum(u ** alpha) = 1``.

    ``alpha`` is a float > 1 or a tensor broadcastable to ``x`` with size 1 along ``dim`` (one alpha per
    slice; a tensor that requires grad receives its gradient). ``n_iter=None`` solves ``tau`` exactly (to
    float precision); an integer runs that many safeguarded Newton steps, as :func:`entmax_bisect`.
    The masking, dtype and NaN conventions of every mapping.
    """
    dim = check_input(x, dim)
    alpha = check_alpha(alpha, x.dtype)
    if isinstance(alpha, torch.Tensor) and alpha.dim() > x.dim():
        raise ValueError(f"alpha has {alpha.dim()} dimensions, more than the input's {x.dim()}")
    if n_iter is not None and (isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 1):
        raise ValueError(f"n_iter must be None or a positive integer, got {n_iter!r}")
    return NormmaxBisectFunction.apply(x, alpha, dim, n_iter)
