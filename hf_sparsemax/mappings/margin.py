"""Additive-margin softmax (AM-Softmax; Wang et al., 2018, "Additive Margin Softmax for Face Verification").

A cosine head scores class ``c`` by ``cos_c = <h, w_c> / (|h| |w_c|)`` in
``[-1, 1]`` (``h`` the pooled feature the plain head's ``nn.Linear`` reads,
``w_c`` its weight row; the bias is not used). The loss is cross-entropy of
``s * (cos - m * onehot(t))``:

    L = -log( e^{s (cos_t - m)} / (e^{s (cos_t - m)} + sum_{c != t} e^{s cos_c}) ),

so the target must beat every other class by the margin ``m`` in cosine
before the loss flattens out. At inference the model's distribution is
``softmax(s * cos)`` (no margin).

The cosine head that produces ``cos`` is :mod:`hf_sparsemax.losses.cosine_head`.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from .loss_functions import check_loss_args, reduce, safe_target
from ._core import check_input, masked_below, work_dtype
from .sparse_softmax import sparse_softmax

COSINE_SLACK = 1e-3  # cosines beyond [-1 - slack, 1 + slack] cannot come from a cosine head


def check_margin(margin, scale) -> tuple[float, float]:
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not 0 <= margin < 2:
        raise ValueError(f"am_softmax margin must be a float in [0, 2) (a cosine margin), got {margin!r}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not 0 < scale < float("inf"):
        raise ValueError(f"am_softmax scale must be a finite float > 0, got {scale!r}")
    return float(margin), float(scale)


def am_softmax_loss(cosines, target, margin: float = 0.35, scale: float = 30.0, ignore_index: int = -100,
                    reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``scale * (cosines - margin * onehot(target))``; ``cosines`` in ``[-1, 1]``.

    Gradient (autograd): ``scale * (softmax(z) - e_t)`` with ``z`` the margin
    logits. Cosines outside ``[-1, 1]`` (checked on CPU tensors) mean the
    model has no cosine head: a ``ValueError`` says how to get one.
    """
    margin, scale = check_margin(margin, scale)
    check_loss_args(cosines, target, reduction)
    safe, kept = safe_target(target, cosines.shape[-1], ignore_index)
    work = torch.float64 if cosines.dtype == torch.float64 else torch.float32
    rows = cosines.reshape(-1, cosines.shape[-1]).to(work)
    if rows.device.type == "cpu" and rows.numel() and bool((rows.abs() > 1 + COSINE_SLACK).any()):
        raise ValueError("am_softmax_loss takes cosines in [-1, 1], got values outside: give the model a cosine "
                         "head with hf_sparsemax.patch_model(model, loss='am_softmax')")
    if rows.numel() == 0:
        return reduce(rows.new_zeros(safe.shape), kept, target.shape, reduction) + 0 * cosines.sum()
    safe = safe.to(rows.device)
    z = scale * (rows - margin * nn.functional.one_hot(safe, rows.shape[-1]).to(work))
    items = torch.logsumexp(z, -1) - z.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return reduce(torch.where(kept.to(rows.device), items, 0.0), kept, target.shape, reduction)


def am_softmax(cosines: torch.Tensor, dim: int = -1, margin: float = 0.35, scale: float = 30.0) -> torch.Tensor:
    """The distribution an AM-softmax head predicts: ``softmax(scale * cosines)`` (the margin is a training device).

    The masking conventions of every mapping: an entry at ``-inf`` or at most
    ``finfo.min`` gets 0, a fully masked slice zeros, NaN or ``+inf`` makes its slice NaN.
    """
    check_margin(margin, scale)
    dim = check_input(cosines, dim)
    x = scale * cosines.to(work_dtype(cosines.dtype))
    return sparse_softmax(x.masked_fill(cosines <= masked_below(cosines.dtype), -math.inf), dim).to(cosines.dtype)
