"""Negative log-likelihood losses ``-log p_target`` under a dense mapping (Taylor softmax, perturbed argmax).

For a mapping whose ``p`` is positive wherever the input is (Taylor softmax:
``f(t) >= 1/2`` for even order; perturb_max: every class can win), the loss
``-log p_t`` is finite and perplexity stays finite. Its gradient is
``-(1/p_t) dp_t/dx``, obtained by autograd through the mapping's own backward
(Taylor softmax's closed-form Jacobian; perturb_max's log-space quadrature),
so no formula is repeated here. Same conventions as :mod:`hf_sparsemax.mappings.loss_functions`:
logits ``[..., C]``, targets ``[...]``, ``ignore_index`` items contribute 0
with zero gradient, ``reduction`` ``"mean"`` / ``"sum"`` / ``"none"``, float32
(float64 for float64 logits). A target that points at a masked logit
(``-inf`` / ``finfo.min``) has ``p_t = 0`` and a loss of ``+inf``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .loss_functions import check_loss_args, reduce, safe_target
from ._core import masked_below, to_rows
from .perturb import DEFAULT_POINTS, check_perturb, perturb_log_rows
from .taylor import TaylorSoftmaxFunction, check_order


def nll_loss(logits, target, log_probs: Callable[[torch.Tensor, float], torch.Tensor], ignore_index: int = -100,
             reduction: str = "mean") -> torch.Tensor:
    """``-log p_t`` per item, with ``log_probs(rows [N, C], masked) -> log p [N, C]`` (differentiable)."""
    check_loss_args(logits, target, reduction)
    safe, kept = safe_target(target, logits.shape[-1], ignore_index)
    rows, _ = to_rows(logits, logits.dim() - 1)
    if rows.numel() == 0:
        return reduce(rows.new_zeros(safe.shape), kept, target.shape, reduction) + 0 * logits.sum()
    log_p = log_probs(rows, masked_below(logits.dtype))
    items = -log_p.gather(-1, safe.to(rows.device).unsqueeze(-1)).squeeze(-1)
    return reduce(torch.where(kept.to(rows.device), items, 0.0), kept, target.shape, reduction)


def taylor_log_rows(rows: torch.Tensor, order: int, masked: float) -> torch.Tensor:
    """``log p`` of Taylor softmax on ``[N, C]`` rows; ``-inf`` where ``p = 0`` (masked), with zero gradient there,
    NaN on rows holding NaN or ``+inf``."""
    p = TaylorSoftmaxFunction.apply(rows, 1, order)
    positive = p > 0
    return torch.where(positive, torch.where(positive, p, 1.0).log(), torch.where(torch.isnan(p), p, -math.inf))


def taylor_softmax_loss(logits, target, order: int = 2, ignore_index: int = -100, reduction: str = "mean"):
    """``-log taylor_softmax(x, order)_t``: ``log sum_j f(x_j) - log f(x_t)``, ``f(t) = sum_{m<=order} t**m/m!``."""
    order = check_order(order)
    return nll_loss(logits, target, lambda rows, masked: taylor_log_rows(rows, order, masked), ignore_index,
                    reduction)


def perturb_max_loss(logits, target, noise: str = "gaussian", points: int = DEFAULT_POINTS,
                     ignore_index: int = -100, reduction: str = "mean"):
    """``-log P[argmax(x + eps) = t]`` (see :func:`~hf_sparsemax.perturb_max`); ``gumbel`` gives cross-entropy."""
    check_perturb(noise, points)
    return nll_loss(logits, target, lambda rows, masked: perturb_log_rows(rows, noise, points, masked),
                    ignore_index, reduction)
