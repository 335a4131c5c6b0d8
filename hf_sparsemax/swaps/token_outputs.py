"""The TRL swap: a causal LM with a sparse loss answers TRL's ``fused_lm_head=True`` with that loss.

A forward pre-hook and an instance ``forward`` (see :mod:`hf_sparsemax.trl_support`);
the forward sits above the fused forward, so it is applied after it and removed before it.
"""

from __future__ import annotations

from typing import NamedTuple

from .._model import base_model
from ..trl_support import install_token_outputs, remove_token_outputs
from .loss_swap import loss_task
from .protocol import PatchRequest


class TokenOutputsPlan(NamedTuple):
    """TRL's per-token fields for this loss (the loss and its options are read from the config at each call)."""

    loss: str


class TokenOutputsSwap:
    """``model(..., fused_lm_head=True)`` returns TRL's per-token fields under the patched loss."""

    name = "token_outputs"

    def plan(self, model, request: PatchRequest) -> TokenOutputsPlan | None:
        if loss_task(base_model(model), request.settings) != "causal_lm":
            return None
        return TokenOutputsPlan(request.settings.loss)

    def apply(self, model, plan: TokenOutputsPlan) -> None:
        install_token_outputs(base_model(model))

    def remove(self, model) -> None:
        remove_token_outputs(base_model(model))
