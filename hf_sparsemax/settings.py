"""The choices a user made, as a small validated object kept in ``model.config``.

Saved by ``save_pretrained`` inside ``config.json`` under ``hf_sparsemax``
(sorted keys, with the library version), read back by ``patch_model(model)``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from .attention.interface import ATTENTION_MAPPINGS, AttentionOptions
from .mappings import registry

CONFIG_KEY = "hf_sparsemax"
ATTENTIONS = ("softmax", *ATTENTION_MAPPINGS)


@dataclasses.dataclass
class SparseSettings:
    """``attn`` / ``loss`` names and their options; ``None`` or the defaults mean "as the model was"."""

    attn: str | None = None
    attn_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    loss: str | None = None
    loss_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.attn_options = dict(self.attn_options or {})
        self.loss_options = dict(self.loss_options or {})
        if self.attn in registry.REGISTRY and self.attn not in ATTENTION_MAPPINGS:
            raise registry.REGISTRY[self.attn].refuse("attention")
        if self.attn not in (None, *ATTENTIONS):
            raise ValueError(f"attn={self.attn!r} is unknown: choose one of {list(ATTENTIONS)}")
        if self.attn_options and self.attn in (None, "softmax"):
            raise ValueError(f"attn_options {self.attn_options} given without a sparse attn")
        if self.attn in ATTENTION_MAPPINGS:
            AttentionOptions.from_settings(self.attn, self.attn_options)  # validates the option names and values
        if self.loss not in (None, "cross_entropy"):
            if self.loss in registry.REGISTRY and self.loss not in registry.names("loss"):
                raise registry.REGISTRY[self.loss].refuse("loss")
            if self.loss not in registry.names("loss"):
                raise ValueError(
                    f"loss={self.loss!r} is unknown: choose one of {['cross_entropy', *registry.names('loss')]}"
                )
            registry.loss_options(self.loss, self.loss_options)  # validates the option names and values
        elif self.loss_options:
            raise ValueError(f"loss_options {self.loss_options} given without a sparse loss")

    @property
    def attention_options(self) -> AttentionOptions | None:
        """The validated options of a sparse ``attn`` (``None`` for the model's own attention)."""
        if self.attn not in ATTENTION_MAPPINGS:
            return None
        return AttentionOptions.from_settings(self.attn, self.attn_options)

    @property
    def is_default(self) -> bool:
        return self.attn in (None, "softmax") and self.loss in (None, "cross_entropy")

    def to_dict(self) -> dict[str, Any]:
        from . import __version__

        data = dataclasses.asdict(self)
        data["attn_options"] = dict(sorted(self.attn_options.items()))
        data["loss_options"] = dict(sorted(self.loss_options.items()))
        data["version"] = __version__
        return dict(sorted(data.items()))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SparseSettings":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names - {"version", "decoding"})  # decoding: a note for people
        if unknown:
            warnings.warn(f"hf_sparsemax settings: ignoring unknown keys {unknown}", stacklevel=2)
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_config(cls, config) -> "SparseSettings | None":
        data = getattr(config, CONFIG_KEY, None)
        return None if data is None else cls.from_dict(dict(data))
