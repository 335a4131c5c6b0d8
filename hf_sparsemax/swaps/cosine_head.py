"""The cosine-head swap: for a loss on a cosine head (``am_softmax``) the classifier computes cosines.

The head's ``nn.Linear`` keeps its parameters and gets an instance
``forward`` (see :mod:`hf_sparsemax.losses.cosine_head`); a head whose model hard-codes
cross-entropy (BERT, RoBERTa, ...) also gets an instance ``forward`` on the
model computing the loss from ``labels``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .._model import base_model, routes_loss_function
from ..losses.cosine_head import head_linears, install_cosine_head, remove_cosine_head
from ..mappings import registry
from .loss_swap import head_classes, settings_loss, sparse_loss
from .protocol import PatchRequest


class CosineHeadPlan(NamedTuple):
    """A validated cosine-head swap; ``loss_function`` is set for heads that hard-code their loss, else None."""

    loss_function: Callable[..., torch.Tensor] | None


class CosineHeadSwap:
    """The sequence-classification head scores classes by cosine (logits in [-1, 1])."""

    name = "cosine_head"

    def plan(self, model, request: PatchRequest) -> CosineHeadPlan | None:
        inner, settings = base_model(model), request.settings
        if not sparse_loss(settings) or registry.get(settings.loss).head != "cosine":
            return None
        head_linears(inner)  # refuses families whose head is not known
        task = "sequence_classification"
        registry.check_head(registry.get(settings.loss), task, head_classes(inner))
        return CosineHeadPlan(None if routes_loss_function(inner) else settings_loss(settings, task))

    def apply(self, model, plan: CosineHeadPlan) -> None:
        install_cosine_head(base_model(model), plan.loss_function)

    def remove(self, model) -> None:
        remove_cosine_head(base_model(model))
