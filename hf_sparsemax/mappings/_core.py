"""Shared machinery of the probability mappings.

Every mapping normalises the slices of ``x`` along ``dim``. The work happens on
a 2-D ``[rows, n]`` view with the normalised dimension last, in float32 (or
float64 for float64 input), and the result goes back to the caller's layout
and dtype. Threshold mappings (sparsemax, entmax) find their threshold ``tau``
on the few largest entries of each row only: the support of
``relu(z - tau) ** beta`` lies among the top entries, and the solve on the top
``K`` candidates is exact whenever its support is smaller than ``K``. Rows
that need more candidates are solved again with four times as many, up to the
whole row, so the answer is always exact and the common case reads ``x``
once for ``topk`` and once to write the output.

Masking convention: entries equal to ``-inf`` or at or below
``torch.finfo(x.dtype).min`` are excluded (probability exactly 0); a slice
whose entries are all excluded maps to zeros. NaN or ``+inf`` in a slice makes
that slice NaN and leaves the others untouched.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ._sync_free import DENSE_TOLERANCE_ULPS  # Newton stops once tau moves by at most this many ulp of 1
from ._sync_free import find_threshold as sync_free_threshold
from ._sync_free import near_one as sync_free_near_one
from ._sync_free import solve_on_top as sync_free_on_top
from ._sync_free import threshold_map as sync_free_map

SHORT_ROWS = 2048  # rows up to this length are solved by Newton passes over the whole row, not topk
LONG_ROWS = 16384  # up to here, rows the top candidates cannot solve go to whole-row Newton, not to more candidates
DENSE_MAX_ITER = 50
CHUNK_ELEMENTS = 1 << 20  # rows are finished in blocks of ~4 MiB so the passes after the first hit cache

Solver = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def check_input(x: torch.Tensor, dim: int) -> int:
    """Validate ``x`` and return ``dim`` as a non-negative index."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got dtype {x.dtype}")
    if x.dim() == 0:
        raise ValueError("expected a tensor with at least one dimension, got a scalar")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor with {x.dim()} dimensions")
    return dim % x.dim()


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_below(dtype: torch.dtype) -> float:
    """Entries at or below this value (of the caller's dtype) are excluded."""
    return torch.finfo(dtype).min


def to_rows(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Size]:
    """``[rows, n]`` working view of ``x`` with ``dim`` last, in the work dtype.

    Half-precision inputs are upcast, and their masked entries become ``-inf``
    (``finfo(float16).min`` is an ordinary number in float32).
    """
    moved = x.movedim(dim, -1)
    shape = moved.shape
    rows = moved.reshape(math.prod(shape[:-1]), shape[-1])
    dtype = work_dtype(x.dtype)
    if rows.dtype != dtype:
        rows = rows.to(dtype)
        rows.masked_fill_(rows <= masked_below(x.dtype), float("-inf"))
    return rows.contiguous(), shape


def from_rows(rows: torch.Tensor, shape: torch.Size, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`to_rows`."""
    return rows.to(dtype).reshape(shape).movedim(-1, dim)


def map_rows(x: torch.Tensor, dim: int, rows_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Apply ``rows_fn`` to the ``[rows, n]`` working view of ``x`` and return the caller's layout."""
    rows, shape = to_rows(x, dim)
    if rows.numel() == 0:
        return x.new_zeros(x.shape)
    return from_rows(rows_fn(rows), shape, dim, x.dtype)


def row_alpha(alpha: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    """Per-row ``alpha`` as ``[rows, 1]`` for a tensor ``alpha`` broadcastable to ``x``."""
    slice_shape = list(x.shape)
    slice_shape[dim] = 1
    try:
        full = alpha.detach().expand(slice_shape)
    except RuntimeError:
        raise ValueError(
            f"alpha of shape {tuple(alpha.shape)} must broadcast to {tuple(slice_shape)} "
            f"(the input's shape with size 1 along dim={dim})"
        ) from None
    return full.movedim(dim, -1).reshape(-1, 1).to(work_dtype(x.dtype))


def mark_special_rows(tau: torch.Tensor, top1: torch.Tensor, masked: float) -> torch.Tensor:
    """``tau = +inf`` for fully masked rows (output 0) and NaN for rows whose maximum is NaN or ``+inf``."""
    tau = tau.masked_fill(top1 <= masked, float("inf"))
    return tau.masked_fill(torch.isnan(top1) | (top1 == float("inf")), float("nan"))


def solve_on_top(rows: torch.Tensor, solve: Solver, k0: int, masked: float, *row_args: torch.Tensor, alpha=None):
    """Row maximum ``m``, threshold ``tau - m`` and support size of each row (``[rows, 1]``).

    ``solve(top, valid, *row_args)`` gets the top-``K`` entries of some rows,
    sorted descending, in float64, with ``valid`` marking the non-masked ones,
    and returns ``(tau - top_1, support_size)``; the answer is exact for a row
    when its support size is below ``K`` (or ``K`` is the whole row). Working
    relative to the maximum keeps float32 rounding of ``tau`` below an ulp of 1.
    Fully masked rows get ``m = 0, tau = +inf`` (so ``relu(x - tau)`` is 0);
    rows holding NaN or ``+inf`` get ``tau = NaN``. Given ``alpha`` (the rows' alpha, which
    :func:`dense_fits`), rows whose support exceeds the first retry's candidates are solved by whole-row
    Newton (:func:`dense_solve`) instead of more candidates: wide supports (flat rows) cost a sort otherwise.
    """
    if torch.compiler.is_compiling():
        return sync_free_on_top(rows, solve, k0, masked, *row_args)
    n_rows, n = rows.shape
    k = min(k0, n)
    top = rows.topk(k, dim=-1).values.double()
    valid = top > masked
    tau, size = solve(top, valid, *row_args)
    first = top[:, :1]
    tau = mark_special_rows(tau, first, masked)
    shift = first.masked_fill(first <= masked, 0.0).to(rows.dtype)
    pending = (size >= k) & valid[:, :1]
    while k < n and bool(pending.any()):
        k = min(4 * k, n)
        idx = pending.squeeze(1).nonzero().squeeze(1)
        if alpha is not None and k > 4 * k0:  # after one retry, wide supports: whole rows by Newton, no sort
            a = alpha.index_select(0, idx) if isinstance(alpha, torch.Tensor) else alpha
            _, tau[idx], size[idx] = dense_solve(rows.index_select(0, idx), a, masked)
            break
        sub = rows.index_select(0, idx)
        top = (sub.topk(k, dim=-1).values if k < n else sub.sort(dim=-1, descending=True).values).double()
        t, s = solve(top, top > masked, *(a.index_select(0, idx) for a in row_args))
        tau[idx], size[idx] = t, s
        pending = torch.zeros_like(pending)
        pending[idx] = s >= k
    return shift.contiguous(), tau.contiguous(), size  # a strided [rows, 1] operand slows broadcasting 5x


def dense_solve(rows: torch.Tensor, alpha: float | torch.Tensor, masked: float):
    """Same contract as :func:`solve_on_top`, by Newton passes over whole (short) rows.

    ``torch.topk`` costs several softmaxes on short rows; a pass over a block
    of rows in cache costs a fraction of one. Newton on
    ``h(tau) = ||relu(z - tau)||_beta - 1`` from ``tau = max z - 1`` rises
    monotonically to the root (for alpha = 2 it is Michelot's algorithm) and
    stops once no row's ``tau`` moves by more than a few ulp (the noise floor of
    its sums; quadratic convergence takes 3-7 passes). Needs
    ``1 < alpha <= 2`` with ``beta = 1/(alpha-1)`` moderate (:func:`dense_fits`). Works on
    ``d = x - max``: ``u' = relu(d - tau / (alpha - 1))``, ``u = (alpha - 1) u'``.
    ``alpha`` is a float or ``[rows, 1]`` (one per row).
    """
    step = max(1, CHUNK_ELEMENTS // max(1, rows.shape[1]))
    part = lambda a, i: a[i : i + step] if isinstance(a, torch.Tensor) else a  # noqa: E731
    parts = [dense_solve_block(rows[i : i + step], part(alpha, i), masked) for i in range(0, rows.shape[0], step)]
    return tuple(torch.cat(column) for column in zip(*parts))


def dense_solve_block(rows: torch.Tensor, alpha: float | torch.Tensor, masked: float):
    am1 = alpha.double() - 1 if isinstance(alpha, torch.Tensor) else alpha - 1
    beta = 1 / am1
    exponent = (beta - 1).to(rows.dtype) if isinstance(beta, torch.Tensor) else beta - 1
    zero_power = isinstance(exponent, torch.Tensor) and bool((exponent == 0).any())  # 0**0 = 1 off the support
    top1 = rows.amax(-1, keepdim=True)
    dead = top1 <= masked
    shift = top1.masked_fill(dead, 0.0)
    d = torch.sub(rows, shift)
    tau = torch.full_like(shift, -1.0, dtype=torch.float64)
    u, work = torch.empty_like(rows), torch.empty_like(rows)
    tolerance = DENSE_TOLERANCE_ULPS * torch.finfo(rows.dtype).eps  # rounding of the sums moves tau by ~1 ulp
    for _ in range(DENSE_MAX_ITER):
        torch.sub(d, (tau / am1).to(rows.dtype), out=u).clamp_min_(0)
        if isinstance(beta, float) and beta == 1:
            total, slope = u.sum(-1, keepdim=True), torch.sign(u, out=work).sum(-1, keepdim=True)
        elif isinstance(beta, float) and beta == 2:
            total, slope = torch.linalg.vector_norm(u, 2, -1, keepdim=True).square_(), u.sum(-1, keepdim=True)
        else:  # one power a pass: u**beta = u**(beta-1) * u (u >= 0, beta > 1)
            torch.pow(u, exponent, out=work)
            slope = (work.masked_fill_(u == 0, 0) if zero_power else work).sum(-1, keepdim=True)
            total = torch.linalg.vecdot(work, u).unsqueeze(-1)
        total, slope = total.double() * am1**beta, slope.double() * am1 ** (beta - 1)
        norm = total.pow(am1)
        step = (norm - 1) * (total / norm) / slope
        step = step.masked_fill_(dead | ~torch.isfinite(step), 0.0)
        tau = tau + step
        if bool((step.abs() <= tolerance).all()):
            break
    size = torch.sign(torch.sub(d, (tau / am1).to(rows.dtype), out=u).clamp_min_(0), out=work).sum(-1, keepdim=True)
    return shift, mark_special_rows(tau, top1, masked), size.long()


def find_threshold(rows: torch.Tensor, masked: float, alpha: float | torch.Tensor, solve: Solver, k0: int, *row_args):
    """Row maximum, ``tau - max`` and support size.

    Whole-row Newton for rows up to ``SHORT_ROWS`` and for alphas near 1 (:func:`near_one`, any length); top
    candidates otherwise, with whole-row Newton for the rows (up to ``LONG_ROWS``) they do not settle.
    """
    if torch.compiler.is_compiling():  # same answer, no host sync (see _sync_free)
        return sync_free_threshold(rows, masked, alpha, solve, k0, *row_args)
    if rows.shape[-1] <= SHORT_ROWS or near_one(alpha):
        if not isinstance(alpha, torch.Tensor) and dense_fits(alpha, rows.dtype):
            return dense_solve(rows, alpha, masked)
        if isinstance(alpha, torch.Tensor) and dense_fits(alpha, rows.dtype):  # one host test
            return dense_solve(rows, row_args[0] if row_args else alpha.expand(rows.shape[0], 1), masked)
    if rows.shape[-1] <= LONG_ROWS and dense_fits(alpha, rows.dtype):  # attention rows: wide supports by Newton
        per_row = alpha.expand(rows.shape[0], 1) if isinstance(alpha, torch.Tensor) else alpha
        per_row = row_args[0] if row_args else per_row
        return solve_on_top(rows, solve, k0, masked, *row_args, alpha=per_row)
    return solve_on_top(rows, solve, k0, masked, *row_args)


def near_one(alpha: float | torch.Tensor) -> bool:
    """Whether some alpha is near 1 (:func:`._sync_free.near_one`; one host read for a tensor)."""
    return sync_free_near_one(float(alpha.min()) if isinstance(alpha, torch.Tensor) else alpha)


def dense_fits(alpha: float | torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`dense_solve` suits ``alpha`` (every alpha of a tensor) in ``dtype``.

    Needs ``1 < alpha <= 2`` (``h`` convex) and ``u ** beta`` finite: ``u``
    goes up to ``1 / (alpha - 1) = beta`` in ``x`` units, so ``beta * log2(beta)``
    must stay below the dtype's largest exponent (with room for the sums):
    about ``alpha >= 1.007`` in float64 and ``alpha >= 1.05`` in float32.
    """
    low, high = torch.stack([alpha.min(), alpha.max()]).tolist() if isinstance(alpha, torch.Tensor) else (alpha, alpha)
    if not 1 < low <= high <= 2:  # also False for NaN
        return False
    beta = 1 / (low - 1)
    return beta * math.log2(max(beta, 1.0)) <= math.log2(torch.finfo(dtype).max) - 32


def threshold_map(
    rows: torch.Tensor,
    shift: torch.Tensor,
    tau: torch.Tensor,
    scale: float | torch.Tensor | None = None,
    power: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``relu(scale * (x - shift) - tau) ** power`` for each row, block by block (into ``out``, which may be ``rows``).

    The one output step of sparsemax (scale 1, power 1: the defaults, None), 1.5-entmax (1/2, 2)
    and alpha-entmax (alpha - 1, 1/(alpha - 1)). ``shift``, ``tau`` and tensor
    ``scale`` / ``power`` are ``[rows, 1]``. (A float default would be read by ``torch.compile(dynamic=True)`` as a
    symbolic input shared by every caller, which dynamo cannot lift into two autograd Functions of one graph.)
    """
    scale, power = 1.0 if scale is None else scale, 1.0 if power is None else power
    if torch.compiler.is_compiling():
        return sync_free_map(rows, shift, tau, scale, power)
    out = torch.empty_like(rows) if out is None else out
    tau = tau.to(rows.dtype)
    step = max(1, CHUNK_ELEMENTS // max(1, rows.shape[1]))
    for start in range(0, rows.shape[0], step):
        block = slice(start, start + step)
        o = torch.sub(rows[block], shift[block], out=out[block])
        if isinstance(scale, torch.Tensor) or scale != 1:
            o.mul_(scale[block] if isinstance(scale, torch.Tensor) else scale)
        o.sub_(tau[block]).clamp_min_(0)
        if isinstance(power, torch.Tensor):
            o.pow_(power[block])
        elif power == 2:
            o.square_()
        elif power != 1:
            o.pow_(power)
    return out


def threshold_support(
    rows: torch.Tensor,
    shift: torch.Tensor,
    tau: torch.Tensor,
    size: torch.Tensor,
    scale: float | torch.Tensor | None = None,
    power: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The support of ``relu(scale * (x - shift) - tau) ** power`` as ``(index, p)``, both ``[rows, K]``.

    ``K`` is the largest support size (``size`` from :func:`find_threshold`):
    the ``K`` largest entries of each row hold its support, and the entries
    among them outside a smaller support get ``p = 0``. The same output step
    as :func:`threshold_map`, on ``K`` columns instead of the whole row.
    """
    k = min(max(1, int(size.max())), rows.shape[-1])
    values, index = rows.topk(k, dim=-1)
    return index, threshold_map(values, shift, tau, scale, power)


class SupportPower(torch.autograd.Function):
    """``u ** e`` where ``u > 0`` and exactly 0 elsewhere (``u >= 0``), with an exact derivative everywhere.

    ``d/du = e u ** (e - 1)`` on ``u > 0`` and 0 at ``u = 0``: the support of
    a sparse mapping is locally constant, so an entry outside it has no
    derivative to pass on, while plain ``u ** e`` gives ``0 * inf = NaN`` there
    for ``e < 1`` (``sqrt(p)`` at ``p = 0``). For a tensor exponent,
    ``d/de = u ** e log u`` on ``u > 0``, 0 elsewhere. The backward is built
    from this Function again, so every order of derivative is exact.
    """

    @staticmethod
    def forward(ctx, u: torch.Tensor, exponent: float | torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(u, exponent if isinstance(exponent, torch.Tensor) else None)
        ctx.exponent = exponent
        return support_power_values(u, exponent)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        u, exponent_tensor = ctx.saved_tensors
        e = ctx.exponent if exponent_tensor is None else exponent_tensor
        du = grad * e * SupportPower.apply(u, e - 1)
        de = None
        if exponent_tensor is not None and ctx.needs_input_grad[1]:
            log_u = torch.where(u > 0, torch.where(u > 0, u, 1).log(), 0)
            de = (grad * SupportPower.apply(u, e) * log_u).sum_to_size(exponent_tensor.shape)
        return du, de


def support_power_values(u: torch.Tensor, exponent: float | torch.Tensor) -> torch.Tensor:
    """The values of :class:`SupportPower`, with fast paths for common float exponents (no graph)."""
    if isinstance(exponent, torch.Tensor) or exponent < 0:  # NaN stays NaN, as in u.pow below
        return torch.where((u > 0) | torch.isnan(u), u.pow(exponent), 0)
    if exponent == 0:
        return (u > 0).to(u.dtype)
    if exponent == 1:
        return u.clone()
    if exponent == 0.5:
        return u.sqrt()
    return u * u if exponent == 2 else u.pow(exponent)


def support_power(u: torch.Tensor, exponent: float | torch.Tensor) -> torch.Tensor:
    """``u ** exponent`` on ``u > 0``, 0 elsewhere: plain ops without a graph, :class:`SupportPower` with one.

    Inside a backward pass this takes the fast path unless the caller asked
    for a graph (``create_graph=True``), so first derivatives cost nothing more.
    """
    needs_graph = torch.is_grad_enabled() and (
        u.requires_grad or (isinstance(exponent, torch.Tensor) and exponent.requires_grad))
    return SupportPower.apply(u, exponent) if needs_graph else support_power_values(u, exponent)


def support_backward(grad: torch.Tensor, weights: torch.Tensor, dim: int) -> torch.Tensor:
    """Backward shared by sparsemax and entmax: the Jacobian is ``diag(s) - s s^T / sum(s)``.

    With support weights ``s_i = p_i ** (2 - alpha)`` on the support (0 elsewhere:
    the support indicator for sparsemax, ``sqrt(p)`` for 1.5-entmax),
    ``dx = s * g - s * sum(s * g) / sum(s)``; with ``s = p`` it is softmax's backward.
    """
    sg = grad * weights
    total = weights.sum(dim, keepdim=True)
    mean = sg.sum(dim, keepdim=True) / total.masked_fill(total == 0, 1)
    return sg.addcmul_(weights, mean, value=-1)


def entmax_vjp(p: torch.Tensor, g: torch.Tensor, alpha: float | torch.Tensor, dim: int, alpha_grad: bool,
               weights: torch.Tensor | None = None, log_p: torch.Tensor | None = None):
    """``(J_x^T g, J_alpha^T g)`` of alpha-entmax at its output ``p`` (the second summed along ``dim``, or None).

    With ``s = p ** (2 - alpha)`` on the support: ``dx = s g - s sum(s g) / sum(s)``; with
    ``s^ = s / sum(s)`` and ``beta = 1 / (alpha - 1)``:
    ``dp/dalpha = beta**2 (p - s^) - beta (p log p - s^ sum(p log p))``.
    Differentiable operations on ``p`` and ``alpha`` only, exact at ``p = 0``
    (:func:`support_power`), so double backward through ``p`` is exact. A caller that already holds ``s`` and
    ``log p`` on the support (the compiled kernels: from ``log u``) passes them as ``weights`` and ``log_p``.
    """
    weights = support_power(p, 2 - alpha) if weights is None else weights
    d_alpha = None
    if alpha_grad:
        beta = 1 / (alpha - 1)
        skewed = weights / weights.sum(dim, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
        support = p > 0
        log_p = torch.where(support, p, 1).log() if log_p is None else log_p
        plogp = torch.where(support, p * log_p, 0)
        entropy_term = plogp.sum(dim, keepdim=True)
        dp = beta * beta * (p - skewed) - beta * (plogp - skewed * entropy_term)
        d_alpha = (g * dp).sum(dim, keepdim=True)
    return support_backward(g, weights, dim), d_alpha


class SupportMapping(torch.autograd.Function):
    """A mapping whose Jacobian ``diag(s) - s s^T / sum(s)`` depends on its output only, ``s = weights_fn(p)``.

    ``rows_fn(rows, masked)`` computes the mapping of ``[rows, n]`` float rows.
    The backward is made of differentiable operations on the saved output
    ``p`` (whose own derivative is this Function's backward again), so double
    backward and Hessian-vector products are exact wherever the support is
    locally constant, provided ``weights_fn`` has an exact derivative on
    ``p = 0`` too (the support indicator, ``p``, or :func:`support_power`).

    ``kernels`` (a :class:`.compiled.RowKernels`, or None): the mapping's compiled path; attention-sized float32
    rows then take one compiled kernel forward and one backward, the same values as ``rows_fn`` and
    ``weights_fn`` (which every other input keeps).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, rows_fn, weights_fn, kernels=None) -> torch.Tensor:
        out = None
        if kernels is not None and not torch.compiler.is_compiling():
            out = kernels.forward(x, dim)
        if out is None:
            out = map_rows(x, dim, lambda rows: rows_fn(rows, masked_below(x.dtype)))
        ctx.dim, ctx.weights_fn, ctx.kernels = dim, weights_fn, kernels
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (p,) = ctx.saved_tensors
        dx = None
        if ctx.kernels is not None and not torch.compiler.is_compiling():
            dx = ctx.kernels.vjp(p, grad, ctx.dim)
        if dx is None:
            dtype = work_dtype(grad.dtype)
            dx = support_backward(grad.to(dtype), ctx.weights_fn(p.to(dtype)), ctx.dim).to(grad.dtype)
        return dx, None, None, None, None
