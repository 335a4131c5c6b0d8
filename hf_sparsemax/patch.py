"""``patch_model`` / ``unpatch_model``: swap a transformers model's attention and loss (and keep the choice in its config).

Each thing that changes is a swap of :mod:`hf_sparsemax.swaps`
(attention, fused forward, cosine head, loss, matched ``generate``) or of an
engine in :mod:`hf_sparsemax.integrations` (Trainer's guard, peft's alphas,
TRL's token outputs, the model card), all with one protocol: ``plan`` validates and changes
nothing, ``apply`` installs, ``remove`` undoes. This module only
orchestrates: it works out the settings a call asks for, plans every swap
(so a refused patch leaves the model as it was), removes them in reverse
order, applies them in order, and records the settings where
``save_pretrained`` and ``from_pretrained`` find them (:mod:`hf_sparsemax.integrations.load_marks`).
Instances are patched, never classes.
"""

from __future__ import annotations

from typing import Any

from . import integrations, swaps
from ._model import base_model
from .swaps.calibration import calibrate_attention
from .integrations.load_marks import clear as clear_load_marks
from .integrations.load_marks import mark as mark_for_load
from .settings import CONFIG_KEY, SparseSettings
from .swaps import PatchRequest, Swap
from .swaps.loss_swap import compute_loss_func, swaps_loss

SWAPS: tuple[Swap, ...] = (*swaps.SWAPS, *integrations.SWAPS)  # applied in this order, removed in reverse

__all__ = ["SWAPS", "base_model", "compute_loss_func", "patch_model", "requested", "swaps_loss", "unpatch_model"]


def requested(inner, attn=None, loss=None, attn_options=None, loss_options=None) -> PatchRequest | None:
    """The settings a ``patch_model`` call asks for, merged with those in the config (None: nothing to do).

    With no ``attn`` / ``loss`` / options the saved settings are re-applied
    (learned alphas kept, and loaded from the model's folder); an omitted
    ``attn`` or ``loss`` keeps the saved one, and its options unless new ones are given.
    """
    saved = SparseSettings.from_config(inner.config)
    if attn is None and loss is None and not attn_options and not loss_options:
        return None if saved is None else PatchRequest(saved, keep_learned=True, load_saved=True)
    previous = saved or SparseSettings()
    settings = SparseSettings(
        attn=attn if attn is not None else previous.attn,
        attn_options=attn_options if attn is not None or attn_options else previous.attn_options,
        loss=loss if loss is not None else previous.loss,
        loss_options=loss_options if loss is not None or loss_options else previous.loss_options,
    )
    return PatchRequest(settings, keep_learned=attn is None)


def patch_model(
    model,
    attn: str | None = None,
    loss: str | None = None,
    *,
    attn_options: dict[str, Any] | None = None,
    loss_options: dict[str, Any] | None = None,
):
    """Swap the attention and / or the loss of a transformers model (or peft model) in place and return it.

    ``attn``: ``None`` (leave as is), ``"softmax"`` (the model's own),
    ``"sparsemax"``, ``"entmax15"``, ``"entmax_bisect"`` (``alpha`` in (1, 2],
    ``learn_alpha``: one trainable alpha per layer and head), ``"sparse_softmax"``
    (``top_k``), ``"taylor_softmax"`` (``order``); every sparse attention takes
    ``chunk_size`` (queries per chunk, recomputed in backward: bounded memory on long sequences) and the
    query scales: ``temperature`` (True: one per head, 1 at start; per-layer lists of per-head values),
    ``learn_temperature`` (trainable), ``calibrate`` (batches of model inputs: the temperatures are fitted by
    :func:`~hf_sparsemax.calibrate_attention` once patched; not kept in the config, the temperatures are) and
    ``length_scale`` (ASEntmax's learned per-position scale); see :mod:`hf_sparsemax.attention.query_scale`.
    ``loss``: ``None`` (leave as is), ``"cross_entropy"`` (the model's own),
    ``"sparse_softmax"`` (``top_k`` / ``top_p``), ``"sparsemax"``, ``"entmax15"``,
    ``"entmax_bisect"`` (``alpha``), ``"taylor_softmax"`` (``order``),
    ``"perturb_max"`` (``noise``, ``points``; label sets up to 4096) or
    ``"am_softmax"`` (``margin``, ``scale``; a sequence-classification head
    becomes a cosine head, undone by :func:`unpatch_model`); the sparse losses also take ``fused``:
    ``True`` makes a causal LM in training mode compute the loss from its
    hidden states with :func:`~hf_sparsemax.fused_head_loss` (no
    ``[tokens, vocab]`` logits; ``outputs.logits`` is then None). With no ``attn`` / ``loss`` the settings
    saved in ``model.config`` are re-applied. Settings are stored in
    ``model.config.hf_sparsemax`` and saved by ``save_pretrained``; with
    hf_sparsemax imported, ``from_pretrained`` of that folder gives the patched
    model back (:mod:`hf_sparsemax.integrations.reload`). A causal
    LM's ``generate(do_sample=True)`` then samples from the distribution the
    loss trains (see :mod:`hf_sparsemax.decoding.generation`), and ``trl.SFTTrainer``
    trains the patched loss (see :mod:`hf_sparsemax.integrations.trl`).
    Everything is validated before anything changes: a ``ValueError`` leaves the model as it was.
    """
    inner = base_model(model)
    attn_options, batches = calibration_batches(attn_options)
    request = requested(inner, attn, loss, attn_options, loss_options)
    if request is None:
        return model
    if batches is not None and request.settings.attention_options is None:
        raise ValueError("attn_options 'calibrate' fits the temperatures of a sparse attention: give attn=...")
    plans = [swap.plan(model, request) for swap in SWAPS]  # every check, before any change
    for swap in reversed(SWAPS):
        swap.remove(model)
    for swap, plan in zip(SWAPS, plans):
        if plan is not None:
            swap.apply(model, plan)
    record(inner, request.settings)
    if batches is not None:
        calibrate_attention(model, batches)
    return model


def calibration_batches(attn_options: dict[str, Any] | None) -> tuple[dict[str, Any] | None, list | None]:
    """``attn_options`` without ``calibrate`` (data, never kept in the config) and its batches (None: not asked);
    ``calibrate`` without a temperature option turns per-head temperatures on."""
    if not attn_options or "calibrate" not in attn_options:
        return attn_options, None
    options = dict(attn_options)
    batches = options.pop("calibrate")
    if isinstance(batches, dict):
        batches = [batches]
    if batches is None or isinstance(batches, (str, bytes)) or not hasattr(batches, "__iter__"):
        raise ValueError(f"attn_options 'calibrate' is a list of batches (dicts of model inputs), got {batches!r}")
    batches = list(batches)
    if not batches:
        raise ValueError("attn_options 'calibrate' got no batches")
    if options.get("temperature") in (None, False):
        options["temperature"] = True
    return options, batches


def record(inner, settings: SparseSettings) -> None:
    """Keep ``settings`` in ``config.hf_sparsemax`` (none for the model's own attention and loss) and mark the
    model so that its saved folder loads back patched."""
    if settings.is_default:
        if hasattr(inner.config, CONFIG_KEY):
            delattr(inner.config, CONFIG_KEY)
    else:
        setattr(inner.config, CONFIG_KEY, settings.to_dict())
    mark_for_load(inner, settings)


def unpatch_model(model):
    """Undo :func:`patch_model`: the model's own attention and loss, and no hf_sparsemax settings in its config."""
    inner = base_model(model)
    for swap in reversed(SWAPS):
        swap.remove(model)
    if hasattr(inner.config, CONFIG_KEY):
        delattr(inner.config, CONFIG_KEY)
    clear_load_marks(inner)
    return model
