"""Budget sparsemax, a k-subset relaxation (Blondel, Martins & Niculae, 2020, "Learning with Fenchel-Young
Losses"; the ``budget_bisect`` of the entmax package).

``budget_bisect(x, budget) = argmax <p, x> - ||p||**2 / 2  s.t.  0 <= p <= 1, sum(p) = budget``: the
Euclidean projection of ``x`` onto the capped simplex, ``p = clip(x - tau, 0, 1)`` with ``tau`` such that
``sum(p) = budget``. ``budget = 1`` gives sparsemax; an integer ``budget = k`` with the top ``k`` entries
ahead of the rest by at least 1 gives their indicator. The slices sum to ``budget``, not 1: this is a
weighting of a soft ``k``-subset, not a probability distribution (no loss, no decoding).

``f(tau) = sum clip(x - tau, 0, 1)`` is piecewise linear and decreasing: with the active set
``A = {0 < x - tau < 1}`` and ``O = {x - tau >= 1}``, the root of its current piece is
``tau = (sum_A x + |O| - budget) / |A|``. Those Newton steps, safeguarded by bisection in
``[min x - 1, max x]`` (a step that does not land strictly inside the bracket is a bisection step:
``f`` is neither convex nor concave, and Newton alone can cycle between two pieces), reach the exact
piece in a few passes. A slice with fewer non-excluded entries than
``budget`` (infeasible) gives 1 on each of them, as the entmax package does.

Jacobian on ``A``: ``I - 1 1^T / |A|`` (the shared support backward with the indicator of ``A``);
``dp/dbudget = 1_A / |A|`` (0 where ``A`` is empty: ``p`` is then piecewise constant in ``budget``).
"""

from __future__ import annotations

import numbers

import torch

from ._core import check_input, map_rows, masked_below, support_backward, work_dtype

MAX_ITER = 100  # Newton steps fall back on bisection of a float64 bracket: well inside this many


def budget_rows(rows: torch.Tensor, budget: float | torch.Tensor, masked: float, n_iter: int | None = None):
    """``clip(x - tau, 0, 1)`` of each ``[rows, n]`` row with ``sum = budget`` (a float or ``[rows, 1]``)."""
    valid = rows > masked
    top = rows.amax(-1, keepdim=True)
    bad = torch.isnan(top) | (top == float("inf"))
    infeasible = valid.sum(-1, keepdim=True) < budget  # also every fully masked row
    shift = top.masked_fill(bad | infeasible, 0.0)
    d = torch.where(valid, rows - shift, float("-inf"))
    lo = (torch.where(valid, d, float("inf")).amin(-1, keepdim=True) - 1).double()
    lo = lo.masked_fill(bad | infeasible, 0.0)
    hi = torch.zeros_like(lo)
    tau = lo
    eps = torch.finfo(rows.dtype).eps
    done = bad | infeasible
    for _ in range(MAX_ITER if n_iter is None else n_iter):
        v = d - tau.to(rows.dtype)
        ones, active = v >= 1, (v > 0) & (v < 1)
        n_ones = ones.sum(-1, keepdim=True, dtype=torch.float64)
        n_active = active.sum(-1, keepdim=True, dtype=torch.float64)
        total = n_ones + torch.where(active, v, 0).sum(-1, keepdim=True, dtype=torch.float64)
        above = total >= budget  # f(tau) >= budget: the root is at or right of tau
        lo, hi = torch.where(above, tau, lo), torch.where(above, hi, tau)
        newton = (torch.where(active, d, 0).sum(-1, keepdim=True, dtype=torch.float64) + n_ones - budget) / n_active
        inside = (n_active > 0) & (newton > lo) & (newton < hi)  # strictly: at a bracket end it could cycle
        step = torch.where(inside, newton, (lo + hi) / 2)
        settled = 4 * eps * (1 + tau.abs())  # tau is the root of its own piece (to rounding), or the step is nil
        done = done | ((n_active > 0) & ((newton - tau).abs() <= settled)) | (total == budget)
        done = done | ((step - tau).abs() <= settled)
        tau = torch.where(done, tau, step)
        if n_iter is None and bool(done.all()):
            break
    p = (d - tau.to(rows.dtype)).clamp_(0, 1)
    p = torch.where(infeasible, valid.to(rows.dtype), p)
    return p.masked_fill(bad, float("nan"))


def check_budget(budget: float | torch.Tensor, dtype: torch.dtype = torch.float32) -> float | torch.Tensor:
    """Validate ``budget`` (a finite real > 0, or a floating tensor of them)."""
    if isinstance(budget, torch.Tensor):
        if not budget.is_floating_point():
            budget = budget.to(dtype if dtype.is_floating_point else torch.float32)
        if budget.numel() and not torch.compiler.is_compiling() and not bool(
                ((budget > 0) & torch.isfinite(budget)).all()):
            raise ValueError("budget must be finite and > 0 everywhere")
        return budget
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise ValueError(f"budget must be a float or a tensor, got {type(budget).__name__}")
    if not 0 < budget < float("inf"):
        raise ValueError(f"budget must be a finite float > 0, got {budget!r}")
    return float(budget)


def row_budget(budget: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    """Per-slice ``budget`` as ``[rows, 1]`` float64 for a tensor broadcastable to ``x`` with size 1 along ``dim``."""
    slice_shape = list(x.shape)
    slice_shape[dim] = 1
    if budget.dim() > x.dim():
        raise ValueError(f"budget has {budget.dim()} dimensions, more than the input's {x.dim()}")
    try:
        full = budget.detach().expand(slice_shape)
    except RuntimeError:
        raise ValueError(f"budget of shape {tuple(budget.shape)} must broadcast to {tuple(slice_shape)} "
                         f"(the input's shape with size 1 along dim={dim})") from None
    return full.movedim(dim, -1).reshape(-1, 1).double()


def active_set(p: torch.Tensor) -> torch.Tensor:
    """The indicator of ``0 < p < 1``, where ``p`` moves with ``x`` (a constant: no derivative of its own)."""
    return ((p > 0) & (p < 1)).to(p.dtype)


class BudgetBisectFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, budget, dim: int, n_iter: int | None) -> torch.Tensor:
        rows_budget = row_budget(budget, x, dim) if isinstance(budget, torch.Tensor) else budget

        def rows_fn(rows: torch.Tensor) -> torch.Tensor:  # in float64: p = x - tau keeps the ulp of x, not of p
            b = rows_budget.to(rows.device) if isinstance(rows_budget, torch.Tensor) else rows_budget
            return budget_rows(rows.double(), b, masked_below(x.dtype), n_iter).to(rows.dtype)

        out = map_rows(x, dim, rows_fn)
        ctx.dim, ctx.budget_is_tensor = dim, isinstance(budget, torch.Tensor)
        ctx.save_for_backward(out, *((budget,) if ctx.budget_is_tensor else ()))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p, *saved = ctx.saved_tensors
        dtype = work_dtype(grad.dtype)
        g, weights = grad.to(dtype), active_set(p.to(dtype))
        dx = support_backward(g, weights, ctx.dim)
        d_budget = None
        if ctx.budget_is_tensor and ctx.needs_input_grad[1]:
            size = weights.sum(ctx.dim, keepdim=True)
            d_budget = (g * weights).sum(ctx.dim, keepdim=True) / size.masked_fill(size == 0, 1)
            d_budget = d_budget.sum_to_size(saved[0].shape).to(saved[0].dtype)
        return dx.to(grad.dtype), d_budget, None, None


def budget_bisect(
    x: torch.Tensor, budget: float | torch.Tensor = 2.0, dim: int = -1, n_iter: int | None = None
) -> torch.Tensor:
    """Budget sparsemax along ``dim``: ``clip(x - tau, 0, 1)`` with ``sum = budget`` (see the module docstring).

    ``budget`` is a float > 0 or a tensor broadcastable to ``x`` with size 1 along ``dim`` (one per slice; one
    that requires grad receives its gradient). ``n_iter=None`` solves exactly; an integer runs that many
    safeguarded Newton steps. Excluded entries (``-inf`` / ``finfo.min``) get 0; a slice with fewer other
    entries than ``budget`` gets 1 on each of them (a fully masked slice zeros); NaN or ``+inf`` makes the
    slice NaN; the solve runs in float64 (``p = x - tau`` would otherwise carry the rounding of ``x``).
    """
    dim = check_input(x, dim)
    budget = check_budget(budget, x.dtype)
    if n_iter is not None and (isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 1):
        raise ValueError(f"n_iter must be None or a positive integer, got {n_iter!r}")
    return BudgetBisectFunction.apply(x, budget, dim, n_iter)
