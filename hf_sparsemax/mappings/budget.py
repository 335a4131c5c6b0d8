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
piece in a few passes. They run on the top ``CANDIDATES`` entries of each row only (the support lies among
them unless it reaches the last one; such rows are solved again with more), so the whole row is read
for ``topk`` and once more for the output. A slice with fewer non-excluded entries than
``budget`` (infeasible) gives 1 on each of them, as the entmax package does.

Jacobian on ``A``: ``I - 1 1^T / |A|`` (the shared support backward with the indicator of ``A``);
``dp/dbudget = 1_A / |A|`` (0 where ``A`` is empty: ``p`` is then piecewise constant in ``budget``).
"""

from __future__ import annotations

import math
import numbers

import torch

from ._core import check_input, map_rows, masked_below, support_backward, work_dtype

CANDIDATES = 64  # top entries examined first; rows whose support reaches the last one retry with four times as many
MAX_ITER = 100  # Newton steps fall back on bisection of a float64 bracket: well inside this many


def budget_solve(d: torch.Tensor, budget: float | torch.Tensor, n_iter: int | None = None):
    """``(tau, support size)`` of ``clip(d - tau, 0, 1)`` summing to ``budget`` on float64 rows ``d`` (``-inf``:
    excluded); safeguarded Newton, see the module docstring. Rows with fewer entries than ``budget`` get size
    ``d.shape[-1]`` (their entries are not enough: the caller looks at more)."""
    valid = d > float("-inf")
    short = valid.sum(-1, keepdim=True) < budget
    lo = torch.where(valid, d, float("inf")).amin(-1, keepdim=True).masked_fill(short, 1.0) - 1
    hi = torch.zeros_like(lo)
    tau, done = lo, short.clone()
    eps = torch.finfo(d.dtype).eps
    for _ in range(MAX_ITER if n_iter is None else n_iter):
        v = d - tau
        ones, active = v >= 1, (v > 0) & (v < 1)
        n_ones = ones.sum(-1, keepdim=True, dtype=d.dtype)
        n_active = active.sum(-1, keepdim=True, dtype=d.dtype)
        total = n_ones + torch.where(active, v, 0).sum(-1, keepdim=True)
        above = total >= budget  # f(tau) >= budget: the root is at or right of tau
        lo, hi = torch.where(above, tau, lo), torch.where(above, hi, tau)
        newton = (torch.where(active, d, 0).sum(-1, keepdim=True) + n_ones - budget) / n_active
        inside = (n_active > 0) & (newton > lo) & (newton < hi)  # strictly: at a bracket end it could cycle
        step = torch.where(inside, newton, (lo + hi) / 2)
        settled = 4 * eps * (1 + tau.abs())  # tau is the root of its own piece (to rounding), or the step is nil
        done = done | ((n_active > 0) & ((newton - tau).abs() <= settled)) | (total == budget)
        done = done | ((step - tau).abs() <= settled)
        tau = torch.where(done, tau, step)
        if n_iter is None and bool(done.all()):
            break
    size = (d > tau).sum(-1, keepdim=True)
    return tau, size.masked_fill(short, d.shape[-1])


def budget_rows(rows: torch.Tensor, budget: float | torch.Tensor, masked: float, n_iter: int | None = None):
    """``clip(x - tau, 0, 1)`` of each ``[rows, n]`` row with ``sum = budget`` (a float or ``[rows, 1]``).

    ``tau`` is found on the top ``CANDIDATES`` entries of each row (in float64, relative to the maximum):
    exact when the last candidate lies outside the support, retried with four times as many otherwise.
    """
    valid = rows > masked
    top = rows.amax(-1, keepdim=True)
    bad = torch.isnan(top) | (top == float("inf"))
    infeasible = valid.sum(-1, keepdim=True) < budget  # also every fully masked row
    shift = top.masked_fill(bad | infeasible, 0.0)
    tau = torch.zeros_like(shift, dtype=torch.float64)
    n = rows.shape[-1]
    k = min(n, max(CANDIDATES, 2 * math.ceil(float(budget.max() if isinstance(budget, torch.Tensor) else budget))))
    todo = (~(bad | infeasible)).squeeze(1).nonzero().squeeze(1)
    while todo.numel():
        sub = rows.index_select(0, todo)
        values = (sub.topk(k, dim=-1).values if k < n else sub.sort(dim=-1, descending=True).values).double()
        d = (values - shift.index_select(0, todo).double()).masked_fill_(values <= masked, float("-inf"))
        b = budget.index_select(0, todo) if isinstance(budget, torch.Tensor) else budget
        t, size = budget_solve(d, b, n_iter)
        tau[todo] = t
        if k == n:
            break
        todo = todo[(size >= k).squeeze(1)]  # the support may go on beyond the candidates
        k = min(4 * k, n)
    p = torch.sub(rows, shift).sub_(tau.to(rows.dtype)).clamp_(0, 1)
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

        def rows_fn(rows: torch.Tensor) -> torch.Tensor:
            b = rows_budget.to(rows.device) if isinstance(rows_budget, torch.Tensor) else rows_budget
            return budget_rows(rows, b, masked_below(x.dtype), n_iter)

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
    slice NaN; half precision is computed in float32 (the threshold itself in float64).
    """
    dim = check_input(x, dim)
    budget = check_budget(budget, x.dtype)
    if n_iter is not None and (isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 1):
        raise ValueError(f"n_iter must be None or a positive integer, got {n_iter!r}")
    return BudgetBisectFunction.apply(x, budget, dim, n_iter)
