"""The one protocol every swap point follows, and what ``patch_model`` asks of them.

A swap point is one thing ``patch_model`` changes in a model (its attention,
its loss, its forward, its head, its ``generate``). Each is an object with

- ``plan(model, request) -> plan | None``: check that the model and the
  settings allow the swap and return what ``apply`` needs (a ``NamedTuple``),
  or ``None`` when the settings ask for no swap here; a refusal is a
  ``ValueError`` of one sentence. ``plan`` changes nothing.
- ``apply(model, plan)``: install a plan on a model from which the swap has
  been removed.
- ``remove(model)``: undo ``apply`` (a no-op where nothing is installed).

``model`` is what the user passed (a transformers model or a peft model
around one). ``patch_model`` plans every swap before it applies any, so a
refused patch leaves the model as it was; it removes them in reverse order and
applies them in order (``hf_sparsemax.patch.SWAPS``), and ``unpatch_model``
removes them in reverse order.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

from ..settings import SparseSettings


class PatchRequest(NamedTuple):
    """What a swap is planned from: the settings to reach, and how the call that asked for them was made.

    ``keep_learned``: the attention is re-applied as it was (``attn`` not given),
    so learned alphas already trained in the model stay. ``load_saved``: the
    settings were read back from the config (``patch_model(model)``), so learned
    alphas saved in the model's folder are loaded.
    """

    settings: SparseSettings
    keep_learned: bool = False
    load_saved: bool = False


@runtime_checkable
class Swap(Protocol):
    """One swap point (see the module docstring)."""

    name: str

    def plan(self, model, request: PatchRequest) -> Any | None: ...

    def apply(self, model, plan: Any) -> None: ...

    def remove(self, model) -> None: ...
