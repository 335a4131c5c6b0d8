"""alpha-entmax (Peters, Niculae & Martins, 2019, "Sparse Sequence-to-Sequence Models").

``entmax_alpha(x) = argmax_{p in simplex} <p, x> + H_alpha(p)`` with the
Tsallis entropy ``H_alpha(p) = (1 - sum_i p_i**alpha) / (alpha (alpha - 1))``;
the solution is ``p_i = relu((alpha - 1) x_i - tau) ** (1 / (alpha - 1))`` with
``tau`` such that ``sum(p) = 1``. alpha -> 1 gives softmax, alpha = 2 sparsemax.

- ``entmax15`` (alpha = 1.5): ``p = relu(x/2 - tau)**2``. With ``z = x/2`` sorted
  descending, ``z_j`` is in the support iff ``sum_{i<=j} (z_i - z_j)**2 < 1``; on
  a support of size ``k``, ``tau = mean_k - sqrt(1/k - var_k)`` (exact).
- ``entmax_bisect`` (any alpha > 1): safeguarded Newton on
  ``h(tau) = ||relu(z - tau)||_beta - 1``, ``beta = 1/(alpha-1)``, bracketed in
  ``[max z - 1, max z]``. For ``beta >= 1`` ``h`` is convex and decreasing, so
  Newton from the left rises monotonically to the root, in one step when a
  single entry dominates; outside that case a bisection step stands in.

Backward: with ``s_i = p_i ** (2 - alpha)`` on the support,
``dx = s * g - s * sum(s * g) / sum(s)``. For alpha, with ``s^ = s / sum(s)``
and ``beta = 1 / (alpha - 1)``,
``dp/dalpha = beta**2 (p - s^) - beta (p log p - s^ sum(p log p))``
("Adaptively Sparse Transformers", Correia, Niculae & Martins, 2019).
"""

from __future__ import annotations

import functools
import numbers

import torch

from .compiled import RowKernels, last_dim_rows, mapping_vjp
from .compiled import mapping as compiled_mapping
from ._sync_free import SOLVERS
from ._sync_free import bisect_solve as sync_free_bisect
from ._core import (
    SupportMapping,
    check_input,
    entmax_vjp,
    map_rows,
    masked_below,
    row_alpha,
    find_threshold,
    solve_on_top,
    support_power,
    threshold_map,
    threshold_support,
    work_dtype,
)
from .sparsemax import check_k, sparsemax

CANDIDATES = 64  # top entries examined first; rows whose support is larger retry with more
MAX_ITER = 100  # Newton/bisection steps when iterating to convergence (float64 bracket of width 1)
TOLERANCE = 1e-13  # on tau - max z, which lies in [-1, 0]: far below float32 resolution


def entmax15_solve(top: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tau - z_1, support size)`` on ``z = x/2`` from the sorted top entries (float64)."""
    z = ((top - top[:, :1]) * 0.5).masked_fill_(~valid, 0.0)
    s1, s2 = z.cumsum(-1), (z * z).cumsum(-1)
    j = torch.arange(1, z.shape[-1] + 1, dtype=z.dtype, device=z.device)
    inside = (s2 - 2 * z * s1 + j * z * z < 1) & valid
    size = inside.sum(-1, keepdim=True)
    k = size.clamp_min(1).to(z.dtype)
    at = (size - 1).clamp_min(0)
    mean = s1.gather(-1, at) / k
    var = s2.gather(-1, at) / k - mean * mean
    return mean - (1 / k - var).clamp_min(0).sqrt(), size


def power(u: torch.Tensor, exponent: float | torch.Tensor) -> torch.Tensor:
    """``u ** exponent`` where ``u > 0`` and 0 elsewhere (``u >= 0``), with fast paths."""
    if isinstance(exponent, torch.Tensor) or exponent < 0:
        return torch.where(u > 0, u.pow(exponent), 0)
    if exponent == 0:
        return (u > 0).to(u.dtype)
    if exponent in (0.5, 1, 2):
        return u.sqrt() if exponent == 0.5 else u if exponent == 1 else u * u
    return u.pow(exponent)


def bisect_solve(
    top: torch.Tensor, valid: torch.Tensor, alpha: float | torch.Tensor, n_iter: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tau - z_1, support size)`` on ``z = (alpha - 1) x`` from the sorted top entries.

    ``alpha`` is a float or ``[rows, 1]``. Newton steps are taken where
    ``beta >= 1`` (alpha <= 2: ``h`` convex) and land inside the bracket;
    bisection otherwise.
    """
    if torch.compiler.is_compiling():  # a fixed number of steps, no convergence test
        return sync_free_bisect(top, valid, alpha, n_iter)
    am1 = alpha.double() - 1 if isinstance(alpha, torch.Tensor) else alpha - 1
    beta = 1 / am1
    newton_rows = beta >= 1
    z = ((top - top[:, :1]) * am1).masked_fill_(~valid, float("-inf"))
    lo = torch.full_like(top[:, :1], -1.0)
    hi = torch.zeros_like(lo)
    tau = lo
    for _ in range(MAX_ITER if n_iter is None else n_iter):
        u = (z - tau).clamp_min_(0)
        total = power(u, beta).sum(-1, keepdim=True)
        norm = total.pow(am1)
        h = norm - 1
        above = h > 0
        lo, hi = torch.where(above, tau, lo), torch.where(above, hi, tau)
        step = (lo + hi) / 2
        if bool(newton_rows if isinstance(newton_rows, bool) else newton_rows.any()):
            slope = power(u, beta - 1).sum(-1, keepdim=True)
            newton = tau + h * (total / norm) / slope
            step = torch.where((newton >= lo) & (newton <= hi) & newton_rows, newton, step)
        converged = n_iter is None and bool(((step - tau).abs() <= TOLERANCE).all())
        tau = step
        if converged:
            break
    return tau, (z > tau).sum(-1, keepdim=True)


def precise_in_float32(alpha: float | torch.Tensor) -> bool:
    """Whether float32 keeps ``relu(u) ** (1/(alpha-1))`` within about 1e-7 for these alphas: all in [1.125, 2].

    Outside, the power amplifies float32 rounding: float64 then. (Literals, not a module-level float:
    ``torch.compile(dynamic=True)`` reads a global float as a symbolic input, which dynamo cannot lift
    into two autograd Functions of one graph, e.g. attention and loss.)
    """
    low, high = 1.125, 2.0
    if isinstance(alpha, torch.Tensor):
        return bool(((alpha >= low) & (alpha <= high)).all())
    return low <= alpha <= high


def entmax15_threshold(rows: torch.Tensor, masked: float, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max(x), tau - max(x)/2)`` of each row, ``[rows, 1]``: ``p = relu((x - max)/2 - (tau - max/2))**2``.

    ``k``: the top candidates examined first on long rows (default ``CANDIDATES``); the answer is exact either way.
    """
    top1, tau, _ = find_threshold(rows, masked, 1.5, entmax15_solve, k or CANDIDATES)
    return top1, tau


def entmax15_rows(rows: torch.Tensor, masked: float, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """1.5-entmax of each row and ``tau - max(x)/2``: ``p = relu((x - max)/2 - (tau - max/2))**2``."""
    top1, tau = entmax15_threshold(rows, masked, k)
    return threshold_map(rows, top1, tau, 0.5, 2), tau


def entmax_bisect_threshold(
    rows: torch.Tensor, alpha: float | torch.Tensor, masked: float, n_iter: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max(x), tau - (alpha-1) max(x))`` of each row, ``[rows, 1]`` (``alpha`` a float or ``[rows, 1]``):
    ``p = relu((alpha-1)(x - max) - (tau - (alpha-1) max)) ** (1/(alpha-1))``."""
    if isinstance(alpha, torch.Tensor):  # per row: reaches the solver as a row argument
        solve, row_args = functools.partial(bisect_solve, n_iter=n_iter), (alpha.to(rows.device),)
    else:
        solve, row_args = functools.partial(bisect_solve, alpha=alpha, n_iter=n_iter), ()
    if n_iter is None:
        top1, tau, _ = find_threshold(rows, masked, alpha, solve, CANDIDATES, *row_args)
    else:  # a fixed number of steps on the candidate sets, as documented
        top1, tau, _ = solve_on_top(rows, solve, CANDIDATES, masked, *row_args)
    return top1, tau


def entmax_bisect_rows(
    rows: torch.Tensor, alpha: float | torch.Tensor, masked: float, n_iter: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha-entmax of each row (``alpha`` a float or ``[rows, 1]``) and ``tau - (alpha-1) max(x)``."""
    top1, tau = entmax_bisect_threshold(rows, alpha, masked, n_iter)
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.to(rows.dtype)
    return threshold_map(rows, top1, tau, alpha - 1, 1 / (alpha - 1)), tau


def entmax15_support(rows: torch.Tensor, masked: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(index, p, tau)`` with ``index, p`` of shape ``[rows, K]``: the support of :func:`entmax15_rows` only."""
    top1, tau, size = find_threshold(rows, masked, 1.5, entmax15_solve, CANDIDATES)
    return (*threshold_support(rows, top1, tau, size, 0.5, 2), tau)


def entmax_bisect_support(
    rows: torch.Tensor, alpha: float, masked: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(index, p, tau)`` with ``index, p`` of shape ``[rows, K]``: the support of :func:`entmax_bisect_rows`
    for a float ``alpha`` (iterated to convergence)."""
    solve = functools.partial(bisect_solve, alpha=alpha, n_iter=None)
    top1, tau, size = find_threshold(rows, masked, alpha, solve, CANDIDATES)
    return (*threshold_support(rows, top1, tau, size, alpha - 1, 1 / (alpha - 1)), tau)


class EntmaxBisectFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha, dim: int, n_iter: int | None) -> torch.Tensor:
        alpha_rows = row_alpha(alpha, x, dim) if isinstance(alpha, torch.Tensor) else alpha
        masked = masked_below(x.dtype)
        choose_in_graph = torch.compiler.is_compiling() and isinstance(alpha, torch.Tensor)
        upcast = x.dtype != torch.float64 and not choose_in_graph and not precise_in_float32(alpha_rows)

        def rows_fn(rows: torch.Tensor) -> torch.Tensor:
            a = alpha_rows.to(rows.device) if isinstance(alpha_rows, torch.Tensor) else alpha_rows
            if choose_in_graph and x.dtype != torch.float64:  # float64: precise for every alpha, no host test
                return entmax_bisect_rows(rows.double(), a.double(), masked, n_iter)[0].to(rows.dtype)
            if upcast:
                rows, a = rows.double(), a.double() if isinstance(a, torch.Tensor) else a
            return entmax_bisect_rows(rows, a, masked_below(x.dtype), n_iter)[0]

        out = None
        if (n_iter is None and x.dtype == torch.float32 and not torch.compiler.is_compiling()
                and precise_in_float32(alpha_rows)):
            out = compiled_mapping(x, dim, alpha_rows, lambda rows, masked, a: entmax_bisect_threshold(rows, a, masked))
        if out is None:
            out = map_rows(x, dim, rows_fn)
        ctx.dim, ctx.alpha_is_tensor = dim, isinstance(alpha, torch.Tensor)
        ctx.alpha = None if ctx.alpha_is_tensor else alpha  # a float stays a float: no .item() in backward
        ctx.save_for_backward(out, *((alpha,) if ctx.alpha_is_tensor else ()))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """The closed-form Jacobians of :func:`entmax_vjp`; differentiable again (double backward, also in alpha)."""
        p, *saved = ctx.saved_tensors
        dtype = work_dtype(grad.dtype)
        alpha = saved[0] if ctx.alpha_is_tensor else ctx.alpha  # a float stays a float: no .item() when compiled
        alpha_grad = ctx.alpha_is_tensor and ctx.needs_input_grad[1]
        found = None
        if not torch.compiler.is_compiling() and last_dim_rows(p, ctx.dim) is not None:  # one kernel
            rows_alpha = row_alpha(alpha, p, ctx.dim) if ctx.alpha_is_tensor else alpha
            found = mapping_vjp(p, grad, ctx.dim, rows_alpha, alpha_grad)
        if found is not None:
            dx, d_alpha = found
            if d_alpha is not None:  # [rows, 1] in the order of the rows of p: back to p's layout, then alpha's
                d_alpha = d_alpha.view(*p.shape[:-1], 1)
        else:
            a = alpha.to(dtype) if ctx.alpha_is_tensor else alpha
            dx, d_alpha = entmax_vjp(p.to(dtype), grad.to(dtype), a, ctx.dim, alpha_grad)
        if d_alpha is not None:
            d_alpha = d_alpha.sum_to_size(alpha.shape).to(alpha.dtype)
        return dx.to(grad.dtype), d_alpha, None, None


def check_alpha(alpha: float | torch.Tensor, dtype: torch.dtype = torch.float32) -> float | torch.Tensor:
    """Validate alpha (a real > 1, or a tensor of them); return a float or a floating tensor."""
    if isinstance(alpha, torch.Tensor):
        if not alpha.is_floating_point():
            alpha = alpha.to(dtype if dtype.is_floating_point else torch.float32)
        if alpha.numel() and not torch.compiler.is_compiling() and not bool((alpha > 1).all()):  # eager check
            raise ValueError("alpha must be > 1 everywhere (alpha = 1 is softmax; use torch.softmax)")
        return alpha
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise ValueError(f"alpha must be a float or a tensor, got {type(alpha).__name__}")
    if not 1 < alpha < float("inf"):
        raise ValueError(f"alpha must be a finite float > 1, got {alpha!r} (alpha = 1 is softmax)")
    return float(alpha)


def sqrt_on_support(p: torch.Tensor) -> torch.Tensor:
    """``sqrt(p)``, 1.5-entmax's support weights, with derivative 0 (not ``inf``) at ``p = 0``."""
    return support_power(p, 0.5)


def entmax15(x: torch.Tensor, dim: int = -1, k: int | None = None) -> torch.Tensor:
    """1.5-entmax along ``dim``: ``p = relu(x/2 - tau)**2`` with ``sum(p) = 1`` (exact threshold).

    Same masking and dtype conventions as :func:`sparsemax`, and the same ``k`` (how many of the largest
    entries the threshold search examines first; the output does not depend on it).
    Backward: ``dx = s*g - s*sum(s*g)/sum(s)`` with ``s = sqrt(p)``.
    """
    dim = check_input(x, dim)
    k = check_k(k)
    return SupportMapping.apply(x, dim, lambda rows, masked: entmax15_rows(rows, masked, k)[0], sqrt_on_support, KERNELS_15)


def sparsemax_bisect(x: torch.Tensor, dim: int = -1, n_iter: int | None = None) -> torch.Tensor:
    """Sparsemax found by the alpha-entmax solver: :func:`entmax_bisect` at ``alpha = 2``.

    ``n_iter=None`` (exact) gives the values of :func:`sparsemax`, which it then computes; an integer runs
    that many safeguarded Newton steps, as :func:`entmax_bisect`. The entmax package's ``sparsemax_bisect``.
    """
    if n_iter is None:
        check_input(x, dim)
        return sparsemax(x, dim)
    return entmax_bisect(x, 2.0, dim, n_iter)


def entmax_bisect(
    x: torch.Tensor, alpha: float | torch.Tensor = 1.5, dim: int = -1, n_iter: int | None = None
) -> torch.Tensor:
    """alpha-entmax along ``dim``: ``p = relu((alpha-1) x - tau)**(1/(alpha-1))``, ``sum(p) = 1``.

    ``alpha`` is a float > 1 or a tensor broadcastable to ``x`` with size 1
    along ``dim`` (one alpha per slice); a tensor ``alpha`` that requires grad
    receives its gradient. ``n_iter=None`` iterates until ``tau`` is exact far
    below float32 resolution; an integer runs exactly that many safeguarded
    Newton steps on each candidate set.
    """
    dim = check_input(x, dim)
    alpha = check_alpha(alpha, x.dtype)
    if isinstance(alpha, torch.Tensor) and alpha.dim() > x.dim():
        raise ValueError(f"alpha has {alpha.dim()} dimensions, more than the input's {x.dim()}")
    if n_iter is not None and (not isinstance(n_iter, int) or n_iter < 1):
        raise ValueError(f"n_iter must be None or a positive integer, got {n_iter!r}")
    return EntmaxBisectFunction.apply(x, alpha, dim, n_iter)


KERNELS_15 = RowKernels(1.5, lambda rows, masked, alpha: entmax15_threshold(rows, masked))
SOLVERS.update(entmax15_solve=entmax15_solve, bisect_solve=bisect_solve)  # for the compiled path's exact fallback
