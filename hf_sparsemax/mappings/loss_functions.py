"""Sparse training losses whose gradient is ``p - onehot(target)`` for a sparse ``p``.

- ``sparse_softmax_loss`` (Su Jianlin, 2020): ``logsumexp(x[Omega]) - x[t]``
  with ``Omega`` the kept set of :func:`~hf_sparsemax.sparse_softmax`.
- Fenchel-Young losses of alpha-entmax (Blondel, Martins & Niculae, 2020,
  "Learning with Fenchel-Young Losses"):
  ``L = (p - e_t) . x + H_alpha(p)``, ``H_alpha(p) = (1 - sum p**alpha) / (alpha (alpha - 1))``,
  ``p = entmax_alpha(x)``; ``L >= 0``, zero iff ``p = e_t``; alpha = 2 is the
  sparsemax loss ``1/2 - x_t + 1/2 sum_S (x_i**2 - tau**2)``.
  On the support ``(alpha - 1) x_i - tau = p_i**(alpha - 1)``, so
  ``p . x = max x + (tau' + sum p**alpha) / (alpha - 1)`` with ``tau'`` the
  threshold relative to the maximum: no pass over ``x`` beyond the mapping's.
  By the envelope theorem ``dL/dalpha = dH_alpha(p)/dalpha`` at fixed ``p``.
- ``mapping_loss``: for any mapping ``p(x)``, ``(stop_gradient(p) - e_t) . x``
  has gradient ``p - e_t``: a training signal for a new mapping for free (its
  value is not a quality measure; report cross-entropy or accuracy beside it).

All take logits ``[..., C]`` and targets ``[...]``; items whose target is
``ignore_index`` contribute 0 and get no gradient; ``reduction`` is ``"mean"``
(over the counted items, 0 with zero gradient when there are none), ``"sum"``
or ``"none"``. Losses are float32 (float64 for float64 logits). Nothing here
synchronises with the device except target validation on CPU tensors.
NaN or ``+inf`` in a row makes its item and its gradient NaN; a target at an
excluded entry (``-inf`` / ``finfo.min``, a fully masked row too) has loss
``+inf``. Every loss is twice differentiable: its Hessian is the mapping's
Jacobian ``dp/dx`` (see :class:`SparseLossFunction`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ._core import masked_below, support_backward, to_rows
from .entmax import check_alpha, entmax15_rows, entmax_bisect_rows, entmax_vjp, precise_in_float32
from .entmax import sqrt_on_support
from .normmax import normmax_rows, normmax_vjp
from .normmax import precise_in_float32 as normmax_in_float32
from .sparse_softmax import check_top, sparse_softmax_rows
from .sparsemax import check_k, sparsemax_rows, support_indicator

REDUCTIONS = ("mean", "sum", "none")


def module_reduction(reduction: str, allowed: tuple[str, ...] = REDUCTIONS) -> str:
    """A loss module's ``reduction``, validated, with the entmax package's ``"elementwise_mean"`` read as ``"mean"``.

    Every loss class takes the names entmax's loss classes take, so a module built as for entmax constructs
    unchanged; the loss functions keep one spelling (entmax's functions have no ``reduction``).
    """
    name = "mean" if reduction == "elementwise_mean" else reduction
    if not isinstance(name, str) or name not in allowed:
        raise ValueError(f"reduction must be one of {allowed} (or entmax's 'elementwise_mean' for 'mean'), "
                         f"got {reduction!r}")
    return name


def check_loss_args(logits: torch.Tensor, target: torch.Tensor, reduction: str) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise ValueError("logits must be a floating-point tensor of shape [..., num_classes]")
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError("target must be an integer tensor of class indices")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} must equal logits shape without its last dim, "
                         f"{tuple(logits.shape[:-1])}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def safe_target(target: torch.Tensor, num_classes: int, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(target with ignored items set to 0, kept mask)``; out-of-range targets raise on CPU."""
    target = target.reshape(-1).long()
    kept = target != ignore_index
    outside = ((target < 0) | (target >= num_classes)) & kept  # a mask, not an index: no data-dependent shape
    if target.device.type == "cpu" and not torch.compiler.is_compiling() and bool(outside.any()):
        raise ValueError(f"target holds class indices outside [0, {num_classes}) that are not ignore_index={ignore_index}")
    return torch.where(kept, target, 0), kept


class SparseLossFunction(torch.autograd.Function):
    """Per-item loss and its gradient ``(p - e_t) * grad`` for one mapping (``items_fn``).

    ``items_fn(rows, target, masked)`` returns ``(p, loss per item)`` on the ``[N, C]``
    float rows; ``alpha`` (None, or a tensor of one alpha per item) gets ``dL/dalpha = dH_alpha(p)/dalpha``.

    ``p`` is a second output (the public losses drop it) so that the gradient
    ``p - e_t`` is a differentiable function of it: in double backward the
    derivative reaches ``p`` and comes back here as ``grad_p``, answered with
    the mapping's Jacobian ``vjp(p, grad_p, alpha_rows) -> (dx, dalpha per row)``
    (a function of ``p`` only; the Jacobian in ``alpha`` too for a tensor ``alpha``).
    ``items_fn`` gives a target at an excluded entry (``-inf`` / ``finfo.min``)
    a loss of ``+inf`` (:func:`excluded_target`).
    """

    @staticmethod
    def forward(ctx, logits, target, kept, alpha, items_fn, vjp, *options):
        rows, _ = to_rows(logits, logits.dim() - 1)
        masked = masked_below(logits.dtype)
        p, items = items_fn(rows, target, masked, *options)
        items = torch.where(kept, items, 0.0)
        ctx.save_for_backward(p, target, kept, alpha)
        ctx.logits_shape, ctx.logits_dtype, ctx.vjp, ctx.n_options = logits.shape, logits.dtype, vjp, len(options)
        ctx.set_materialize_grads(False)
        return items, p

    @staticmethod
    def backward(ctx, grad_items, grad_p):
        p, target, kept, alpha = ctx.saved_tensors
        alpha_rows = None if alpha is None else alpha.to(p.dtype).reshape(-1, 1)
        dx = d_alpha = None
        if grad_items is not None:
            g = torch.where(kept, grad_items, 0.0).to(p.dtype).unsqueeze(-1)
            dx = (p * g).scatter_add_(-1, target.unsqueeze(-1), -g)
            if alpha is not None and ctx.needs_input_grad[3]:
                d_alpha = tsallis_alpha_grad(p, alpha_rows) * g
        if grad_p is not None:  # double backward: the mapping's Jacobian, from p
            dx_p, d_alpha_p = ctx.vjp(p, grad_p.to(p.dtype), alpha_rows)
            dx = dx_p if dx is None else dx + dx_p
            if d_alpha_p is not None and ctx.needs_input_grad[3]:
                d_alpha = d_alpha_p if d_alpha is None else d_alpha + d_alpha_p
        if d_alpha is not None:
            d_alpha = d_alpha.reshape(alpha.shape).to(alpha.dtype)
        if dx is not None:
            dx = dx.reshape(ctx.logits_shape).to(ctx.logits_dtype)
        return dx, None, None, d_alpha, None, None, *(None,) * ctx.n_options


def support_vjp(weights_fn: Callable[[torch.Tensor], torch.Tensor]):
    """``vjp`` of a mapping whose Jacobian is ``diag(s) - s s^T / sum(s)``, ``s = weights_fn(p)``."""

    def vjp(p, grad_p, alpha_rows):
        return support_backward(grad_p, weights_fn(p), -1), None

    return vjp


def entmax_loss_vjp(alpha: float | None):
    """``vjp`` of alpha-entmax: a float ``alpha``, or None for the per-row ``alpha_rows`` of a tensor alpha."""

    def vjp(p, grad_p, alpha_rows):
        a = alpha if alpha_rows is None else alpha_rows
        return entmax_vjp(p, grad_p, a, -1, alpha_rows is not None)

    return vjp


def tsallis_alpha_grad(p: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """``d/dalpha (1 - sum p**alpha) / (alpha (alpha - 1))`` at fixed ``p``, per row."""
    support = p > 0
    p_alpha = torch.where(support, p.pow(alpha), 0)
    s = p_alpha.sum(-1, keepdim=True)
    s_log = torch.where(support, p_alpha * p.clamp_min(torch.finfo(p.dtype).tiny).log(), 0).sum(-1, keepdim=True)
    denom = alpha * (alpha - 1)
    return (-s_log * denom - (1 - s) * (2 * alpha - 1)) / (denom * denom)


def fenchel_young_items(p, tau, alpha, rows, target, masked: float = float("-inf")) -> torch.Tensor:
    """``(p - e_t) . x + H_alpha(p)`` per row from the threshold ``tau`` relative to the maximum.

    ``+inf`` where the target is excluded (at most ``masked``), NaN on rows holding NaN or ``+inf``.
    """
    top = rows.amax(-1, keepdim=True)
    if isinstance(alpha, torch.Tensor):
        sum_p_alpha = (p * p.pow(alpha - 1)).sum(-1, keepdim=True)
    else:  # sum p**alpha without a [N, C] temporary
        sum_p_alpha = torch.linalg.vector_norm(p, ord=alpha, dim=-1, keepdim=True).pow(alpha)
    p_dot_x = (tau.to(p.dtype) + sum_p_alpha) / (alpha - 1)
    entropy = (1 - sum_p_alpha) / (alpha * (alpha - 1))
    x_t = rows.gather(-1, target.unsqueeze(-1))
    items = (p_dot_x + entropy - (x_t - top)).squeeze(-1).clamp_min(0)
    return excluded_target(items, x_t.squeeze(-1), top.squeeze(-1) < float("inf"), masked)


def reduce(items: torch.Tensor, kept: torch.Tensor, target_shape, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return items.reshape(target_shape)
    total = items.sum()
    return total if reduction == "sum" else total / kept.sum().clamp_min(1)


def run_loss(logits, target, ignore_index, reduction, items_fn, vjp, alpha=None, options=()) -> torch.Tensor:
    """The loss of ``items_fn``; float ``options`` reach it as arguments, not in its closure (compiled with
    ``dynamic=True`` a float may be symbolic, and dynamo cannot lift one from a closure into the Function)."""
    check_loss_args(logits, target, reduction)
    safe, kept = safe_target(target, logits.shape[-1], ignore_index)
    if logits.numel() == 0:
        out = logits.new_zeros(target.shape, dtype=torch.float32)
        return reduce(out.reshape(-1), kept, target.shape, reduction) + 0 * logits.sum()
    items, _ = SparseLossFunction.apply(logits, safe, kept, alpha, items_fn, vjp, *options)
    return reduce(items, kept, target.shape, reduction)


def excluded_target(items: torch.Tensor, x_t: torch.Tensor, row_ok: torch.Tensor, masked: float) -> torch.Tensor:
    """``+inf`` where the target logit ``x_t`` is excluded (``-inf`` / at most ``finfo.min``; a fully masked row too).

    The target then has probability 0, as for the likelihood losses. Rows
    that hold NaN or ``+inf`` (``row_ok`` False) stay NaN. All ``[N]``.
    """
    return items.masked_fill((x_t <= masked) & row_ok, float("inf"))


def sparse_softmax_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    top_k: int | None = None,
    top_p: float | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Sparse softmax cross-entropy: ``logsumexp(x[Omega]) - x[t]``; gradient ``sparse_softmax(x) - e_t``.

    ``Omega`` is what top-k then top-p decoding keeps (see :func:`~hf_sparsemax.sparse_softmax`);
    the target is not forced into ``Omega``. Neither option: plain cross-entropy.
    """
    top_k, top_p = check_top(top_k, top_p)

    def items_fn(rows, t, masked, top_p):
        p = sparse_softmax_rows(rows, top_k, top_p, masked)
        p_j, j = p.max(-1, keepdim=True)  # any kept j: logsumexp(x[Omega]) = x_j - log p_j
        x_t = rows.gather(-1, t.unsqueeze(-1)).squeeze(-1)
        items = rows.gather(-1, j).squeeze(-1) - x_t - p_j.log().squeeze(-1)
        return p, excluded_target(items, x_t, ~torch.isnan(p_j.squeeze(-1)), masked)

    return run_loss(logits, target, ignore_index, reduction, items_fn, support_vjp(lambda p: p), options=(top_p,))


def sparsemax_loss(
    logits, target, ignore_index: int = -100, reduction: str = "mean", k: int | None = None
) -> torch.Tensor:
    """Sparsemax (Fenchel-Young) loss ``1/2 - x_t + 1/2 sum_S (x_i**2 - tau**2)``; gradient ``sparsemax(x) - e_t``.

    ``k``: as in :func:`~hf_sparsemax.sparsemax` (where the threshold search starts; the loss does not depend on it).
    """
    k = check_k(k)

    def items_fn(rows, t, masked):
        p, tau = sparsemax_rows(rows, masked, k)
        return p, fenchel_young_items(p, tau, 2.0, rows, t, masked)

    return run_loss(logits, target, ignore_index, reduction, items_fn, support_vjp(support_indicator))


def entmax15_loss(
    logits, target, ignore_index: int = -100, reduction: str = "mean", k: int | None = None
) -> torch.Tensor:
    """1.5-entmax Fenchel-Young loss ``(p - e_t) . x + H_1.5(p)``; gradient ``entmax15(x) - e_t``.

    ``k``: as in :func:`~hf_sparsemax.entmax15` (where the threshold search starts; the loss does not depend on it).
    """
    k = check_k(k)

    def items_fn(rows, t, masked):
        p, tau = entmax15_rows(rows, masked, k)
        return p, fenchel_young_items(p, tau, 1.5, rows, t, masked)

    return run_loss(logits, target, ignore_index, reduction, items_fn, support_vjp(sqrt_on_support))


def sparsemax_bisect_loss(logits, target, ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """The entmax package's ``sparsemax_bisect_loss``: the sparsemax loss, solved exactly (:func:`sparsemax_loss`)."""
    return sparsemax_loss(logits, target, ignore_index, reduction)


def normmax_bisect_loss(
    logits, target, alpha: float = 2.0, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """alpha-normmax Fenchel-Young loss ``(p - e_t) . x + 1 - ||p||_alpha = 1 + tau - x_t``; gradient ``p - e_t``.

    ``p = normmax_bisect(x, alpha)`` and ``tau`` its threshold (:mod:`hf_sparsemax.mappings.normmax`);
    ``>= 0``, zero iff ``p = e_t``. ``alpha`` is a float > 1 (a tensor ``alpha`` is for the mapping only).
    """
    if isinstance(alpha, torch.Tensor):
        raise ValueError("normmax_bisect_loss takes a float alpha > 1, not a tensor (normmax_bisect, the mapping, "
                         "takes one per slice)")
    alpha = check_alpha(alpha)
    work_in_float64 = not normmax_in_float32(alpha)

    def items_fn(rows, t, masked):
        work = rows.double() if work_in_float64 else rows
        p, tau = normmax_rows(work, alpha, masked)
        top = work.amax(-1, keepdim=True)
        x_t = work.gather(-1, t.unsqueeze(-1))
        items = (1 + tau - (x_t - top)).squeeze(-1).clamp_min(0)
        items = excluded_target(items, x_t.squeeze(-1), top.squeeze(-1) < float("inf"), masked)
        return p.to(rows.dtype), items.to(rows.dtype)

    def vjp(p, grad_p, alpha_rows):
        return normmax_vjp(p, grad_p, alpha, -1, False)

    return run_loss(logits, target, ignore_index, reduction, items_fn, vjp)


def entmax_bisect_loss(
    logits, target, alpha: float | torch.Tensor = 1.5, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """alpha-entmax Fenchel-Young loss ``(p - e_t) . x + H_alpha(p)``; gradient ``p - e_t``.

    ``alpha`` is a float > 1 or a tensor broadcastable to ``target``'s shape
    (one alpha per item, or one for all); a tensor that requires grad gets
    ``dL/dalpha = dH_alpha(p)/dalpha``.
    """
    alpha = check_alpha(alpha)
    alpha_tensor = None
    if isinstance(alpha, torch.Tensor):
        try:
            per_item = alpha.detach().to(torch.float64).expand(target.shape).reshape(-1, 1)
        except RuntimeError:
            raise ValueError(f"alpha of shape {tuple(alpha.shape)} must broadcast to target shape "
                             f"{tuple(target.shape)}") from None
        alpha_tensor = alpha.expand(target.shape).reshape(-1)  # one alpha per item (autograd sums back)
    else:
        per_item = alpha

    def items_fn(rows, t, masked, per_item):
        a = per_item.to(rows.device) if isinstance(per_item, torch.Tensor) else per_item
        in_graph = isinstance(a, torch.Tensor) and torch.compiler.is_compiling()  # float64 without a host test
        work = rows if rows.dtype == torch.float64 or (not in_graph and precise_in_float32(a)) else rows.double()
        a_work = a.to(work.dtype) if isinstance(a, torch.Tensor) else a
        p, tau = entmax_bisect_rows(work, a_work, masked)
        return p.to(rows.dtype), fenchel_young_items(p, tau, a_work, work, t, masked).to(rows.dtype)

    vjp = entmax_loss_vjp(None if alpha_tensor is not None else alpha)
    return run_loss(logits, target, ignore_index, reduction, items_fn, vjp, alpha_tensor, options=(per_item,))


class StopGradientLossFunction(torch.autograd.Function):
    """``(stop_gradient(p) - e_t) . x`` per item with ``p = mapping(x)``; gradient ``(p - e_t) * grad``.

    First-order backward reads the ``p`` saved in forward. Asked for a graph
    (``create_graph=True``) it recomputes ``p`` from the saved logits through
    the mapping's own autograd, so the second derivative is the mapping's
    Jacobian ``dp/dx`` (the logits are kept for that: a reference, no copy).
    """

    @staticmethod
    def forward(ctx, logits, target, kept, mapping):
        rows, _ = to_rows(logits, logits.dim() - 1)
        p = mapping(rows).to(rows.dtype)
        top = rows.amax(-1, keepdim=True)
        shifted = torch.where(p > 0, rows - top, 0)
        x_t = rows.gather(-1, target.unsqueeze(-1))
        items = (p * shifted).sum(-1) - (x_t - top).squeeze(-1)
        items = excluded_target(items, x_t.squeeze(-1), top.squeeze(-1) < float("inf"), masked_below(logits.dtype))
        ctx.save_for_backward(logits, p, target, kept)
        ctx.mapping = mapping
        return torch.where(kept, items, 0.0)

    @staticmethod
    def backward(ctx, grad_items):
        logits, p, target, kept = ctx.saved_tensors
        if torch.is_grad_enabled():  # a graph is wanted: p as a function of the logits
            rows, _ = to_rows(logits, logits.dim() - 1)
            p = ctx.mapping(rows).to(rows.dtype)
        g = torch.where(kept, grad_items, 0.0).to(p.dtype).unsqueeze(-1)
        dx = (p * g).scatter_add_(-1, target.unsqueeze(-1), -g)
        return dx.reshape(logits.shape).to(logits.dtype), None, None, None


def callable_mapping_loss(
    logits, target, mapping: Callable[[torch.Tensor], torch.Tensor], ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``(stop_gradient(p) - e_t) . x`` with ``p = mapping(x)`` along the last dim: gradient ``p - e_t``.

    The engine of :func:`hf_sparsemax.mapping_loss` (which also takes a
    registered name); the value is not comparable across mappings. Its
    second derivative is the mapping's Jacobian.
    """
    check_loss_args(logits, target, reduction)
    safe, kept = safe_target(target, logits.shape[-1], ignore_index)
    if logits.numel() == 0:
        out = logits.new_zeros(target.shape, dtype=torch.float32)
        return reduce(out.reshape(-1), kept, target.shape, reduction) + 0 * logits.sum()
    items = StopGradientLossFunction.apply(logits, safe.to(logits.device), kept.to(logits.device), mapping)
    return reduce(items, kept, target.shape, reduction)


class _LossModule(nn.Module):
    loss_fn: Callable = None

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", **options):
        super().__init__()
        self.ignore_index, self.reduction, self.options = ignore_index, module_reduction(reduction), options

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return type(self).loss_fn(logits, target, ignore_index=self.ignore_index, reduction=self.reduction,
                                  **self.options)

    def extra_repr(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}{options}"


class SparseSoftmaxLoss(_LossModule):
    """Module form of :func:`sparse_softmax_loss`."""

    loss_fn = staticmethod(sparse_softmax_loss)

    def __init__(self, top_k=None, top_p=None, ignore_index: int = -100, reduction: str = "mean"):
        check_top(top_k, top_p)
        super().__init__(ignore_index, reduction, top_k=top_k, top_p=top_p)


class SparsemaxLoss(_LossModule):
    """Module form of :func:`sparsemax_loss`."""

    loss_fn = staticmethod(sparsemax_loss)


class Entmax15Loss(_LossModule):
    """Module form of :func:`entmax15_loss`."""

    loss_fn = staticmethod(entmax15_loss)


class EntmaxBisectLoss(_LossModule):
    """Module form of :func:`entmax_bisect_loss`; a tensor ``alpha`` (e.g. a Parameter) is learned."""

    loss_fn = staticmethod(entmax_bisect_loss)

    def __init__(self, alpha: float | torch.Tensor = 1.5, ignore_index: int = -100, reduction: str = "mean"):
        super().__init__(ignore_index, reduction)
        self.alpha = alpha

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return entmax_bisect_loss(logits, target, self.alpha, self.ignore_index, self.reduction)
