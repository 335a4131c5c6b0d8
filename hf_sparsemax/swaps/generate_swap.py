"""The matched-generate swap: a causal LM with a sparse loss samples from the distribution the loss trains.

``model.generate`` becomes an instance attribute adding the matching logits
processor (see :mod:`hf_sparsemax.decoding.generation`) and switching off
transformers' default ``top_k=50`` truncation.
"""

from __future__ import annotations

from typing import NamedTuple

from .._model import base_model
from ..decoding.generation import install_matched_generate, remove_matched_generate
from .loss_swap import loss_task
from .protocol import PatchRequest


class GeneratePlan(NamedTuple):
    """A matched ``generate`` for this loss (its processor is read from the config at each call)."""

    loss: str


class MatchedGenerateSwap:
    """``model.generate`` samples with the processor of the patched loss."""

    name = "matched_generate"

    def plan(self, model, request: PatchRequest) -> GeneratePlan | None:
        inner = base_model(model)
        if loss_task(inner, request.settings) != "causal_lm" or not hasattr(inner, "generate"):
            return None
        return GeneratePlan(request.settings.loss)

    def apply(self, model, plan: GeneratePlan) -> None:
        install_matched_generate(base_model(model))

    def remove(self, model) -> None:
        remove_matched_generate(base_model(model))
