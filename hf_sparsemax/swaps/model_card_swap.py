"""The model-card swap: a patched model's ``save_pretrained`` also writes a README.md saying how to serve it.

``model.save_pretrained`` becomes an instance attribute (undone by ``remove``) that calls the class's
method, then :func:`hf_sparsemax.serving.model_card.write_card` (Trainer checkpoints go through it too).
"""

from __future__ import annotations

from typing import NamedTuple

from .._model import base_model, remove_instance_method, set_instance_method
from ..settings import SparseSettings
from .protocol import PatchRequest

TAG = "hf_sparsemax_model_card"


class ModelCardPlan(NamedTuple):
    """A card is written at each save, from the settings in the config then (``settings``: those planned)."""

    settings: SparseSettings


class ModelCardSwap:
    name = "model_card"

    def plan(self, model, request: PatchRequest) -> ModelCardPlan | None:
        if request.settings.is_default or not hasattr(base_model(model), "save_pretrained"):
            return None
        return ModelCardPlan(request.settings)

    def apply(self, model, plan: ModelCardPlan) -> None:
        inner = base_model(model)
        original = type(inner).save_pretrained

        def save_pretrained(self, save_directory, *args, **kwargs):
            from ..serving.model_card import write_card

            result = original(self, save_directory, *args, **kwargs)
            settings = SparseSettings.from_config(self.config)
            if settings is not None and kwargs.get("is_main_process", True):
                write_card(save_directory, settings)
            return result

        save_pretrained.__doc__ = original.__doc__
        set_instance_method(inner, "save_pretrained", save_pretrained, TAG)

    def remove(self, model) -> None:
        remove_instance_method(base_model(model), "save_pretrained", TAG)
