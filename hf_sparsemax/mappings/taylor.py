"""Taylor softmax (de Brebisson & Vincent, 2016; Banerjee et al., 2020).

``p_i = f(x_i) / sum_j f(x_j)`` with ``f(t) = sum_{m <= order} t**m / m!``,
positive for even ``order``. Not shift-invariant; heavier tails than softmax.
To stay finite for any input, each row is scaled by ``s = max(1, max|x|)``:
``f(t) / s**order = sum_m (t/s)**m * s**(m - order) / m!``, which changes no
ratio. Jacobian: ``dp_i/dx_j = delta_ij f'(x_i)/Z - p_i f'(x_j)/Z`` with
``f'`` the Taylor polynomial of order ``order - 1``, so
``dx = f'(x)/Z * (g - sum(g * p))``.
"""

from __future__ import annotations

import math
import numbers

import torch

from ._core import check_input, from_rows, masked_below, to_rows


def scaled_taylor(u: torch.Tensor, scale: torch.Tensor, order: int, degree: int) -> torch.Tensor:
    """``sum_{m <= degree} (u*scale)**m / m! / scale**order`` by Horner's rule in ``u``."""
    acc = (scale ** (degree - order)) / math.factorial(degree)
    for m in range(degree - 1, -1, -1):
        acc = acc * u + (scale ** (m - order)) / math.factorial(m)
    return acc


def taylor_rows(rows: torch.Tensor, order: int, masked: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, f'(x) / Z)`` of each row of a ``[rows, n]`` tensor.

    Differentiable in ``rows`` (the scale ``s`` is held constant: it cancels
    from every ratio), which is what the double backward uses.
    """
    valid = rows > masked
    if rows.numel() == 0:
        return rows.clone(), rows.clone()
    with torch.no_grad():
        scale = torch.where(valid, rows.abs(), 0).amax(-1, keepdim=True).clamp_min(1.0)
        scale = torch.where(torch.isnan(rows).any(-1, keepdim=True), float("nan"), scale)
    u = torch.where(valid, rows, 0) / scale
    f = torch.where(valid, scaled_taylor(u, scale, order, order), 0)
    total = f.sum(-1, keepdim=True)
    total = total.masked_fill(total == 0, 1.0)
    slope = torch.where(valid, scaled_taylor(u, scale, order, order - 1), 0)
    return f / total, slope / total


class TaylorSoftmaxFunction(torch.autograd.Function):
    """Taylor softmax with the closed-form backward ``dx = f'(x)/Z * (g - sum(g * p))``.

    First-order backward reads the ``p`` and ``f'(x)/Z`` saved in forward.
    Asked for a graph (``create_graph=True``: double backward, Hessian-vector
    products) it recomputes both from the saved input with differentiable
    operations, so the second derivative is exact.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, order: int) -> torch.Tensor:
        rows, shape = to_rows(x, dim)
        p, slope = taylor_rows(rows, order, masked_below(x.dtype))
        ctx.dim, ctx.order = dim, order
        ctx.save_for_backward(x, p.reshape(shape).movedim(-1, dim), slope.reshape(shape).movedim(-1, dim))
        return from_rows(p, shape, dim, x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, p, slope = ctx.saved_tensors
        if torch.is_grad_enabled():  # a graph is wanted: p and slope as functions of x
            rows, shape = to_rows(x, ctx.dim)
            p, slope = taylor_rows(rows, ctx.order, masked_below(x.dtype))
            p, slope = (t.reshape(shape).movedim(-1, ctx.dim) for t in (p, slope))
        g = grad.to(p.dtype)
        dx = slope * (g - (g * p).sum(ctx.dim, keepdim=True))
        return dx.to(grad.dtype), None, None


def taylor_softmax(x: torch.Tensor, dim: int = -1, order: int = 2) -> torch.Tensor:
    """Taylor softmax along ``dim``: ``f(x_i) / sum_j f(x_j)``, ``f(t) = sum_{m<=order} t**m/m!``.

    ``order`` must be a positive even integer (``f`` is then positive).
    Masked entries get 0; a fully masked slice maps to zeros.
    """
    dim = check_input(x, dim)
    return TaylorSoftmaxFunction.apply(x, dim, check_order(order))


def check_order(order) -> int:
    """A positive even Taylor order (``f`` is then positive everywhere)."""
    if isinstance(order, bool) or not isinstance(order, numbers.Integral) or order < 2 or order % 2:
        raise ValueError(f"taylor_softmax needs a positive even order, got {order!r}")
    return int(order)
