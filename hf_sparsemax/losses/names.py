"""Losses by their registered name: what patch_model, Trainer, the fused head and decoding look up.

:mod:`hf_sparsemax.mappings.loss_functions` holds the loss functions and knows no names; the
registry of mappings (:mod:`hf_sparsemax.mappings.registry`) names them with
their options; this module turns a name and its options into a loss, the
distribution that loss trains, or the generic mapping loss.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..mappings.loss_functions import callable_mapping_loss
from ..mappings import registry, sparse_softmax


def mapping_loss(
    logits, target, mapping: str | Callable[[torch.Tensor], torch.Tensor], ignore_index: int = -100,
    reduction: str = "mean", **options
) -> torch.Tensor:
    """``(stop_gradient(p) - e_t) . x`` with ``p = mapping(x)`` along the last dim: gradient ``p - e_t``.

    ``mapping`` is a callable or a registered name (``"sparsemax"``,
    ``"taylor_softmax"``, ...), whose ``options`` may be given as keywords.
    A training loss for any mapping; the value is not comparable across
    mappings (it can be negative), so log a quality metric beside it.
    """
    mapping = registry.mapping_function(mapping, **options)
    return callable_mapping_loss(logits, target, mapping, ignore_index, reduction)


def __getattr__(name: str):
    """``LOSS_FUNCTIONS`` / ``LOSS_OPTIONS`` (name -> loss / option names), read from the registry of mappings."""
    if name == "LOSS_FUNCTIONS":
        return {n: registry.REGISTRY[n].loss for n in registry.names("loss")}
    if name == "LOSS_OPTIONS":
        return {n: (*(f.name for f in dataclasses.fields(registry.REGISTRY[n].options)), "fused")
                for n in registry.names("loss")}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_loss(name: str, **options) -> Callable[..., torch.Tensor]:
    """``loss(logits, target, ignore_index=-100, reduction="mean")`` for a registered loss name and its options.

    The option ``fused`` is validated here and otherwise ignored: it tells
    :func:`~hf_sparsemax.patch_model` where to compute the loss, not what it is.
    """
    entry, parsed, _ = registry.loss_options(name, options)
    fn, values = entry.loss, registry.option_values(parsed)

    def loss(logits, target, ignore_index: int = -100, reduction: str = "mean"):
        return fn(logits, target, ignore_index=ignore_index, reduction=reduction, **values)

    loss.__name__ = f"{name}_loss"
    return loss


def loss_mapping(name: str, **options) -> Callable[[torch.Tensor], torch.Tensor]:
    """The distribution a loss trains, as a mapping over the last dim (cross-entropy: softmax).

    Evaluation metrics and decoding use it, so they see what training saw.
    """

    if name == "cross_entropy":
        return lambda x: sparse_softmax(x)
    entry, parsed, _ = registry.loss_options(name, options)
    return entry.distribution(parsed)
