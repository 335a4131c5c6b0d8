"""What ``patch_model`` writes into a model so that its saved folder loads back as itself.

The config's ``quantization_config`` names the load hook of :mod:`hf_sparsemax.integrations.reload`
(:class:`SparseLoadConfig`), ``attn_implementation`` names the sparse attention,
and for a sparse loss a ``decoding`` sentence, ``generation_config.hf_sparsemax``
and model tags say how to sample what the loss trained. :func:`mark` writes them,
:func:`clear` removes them; learned alphas ride with a peft adapter through its
``modules_to_save``. Kept apart from the hook itself (which calls ``patch_model``)
so that ``patch`` and ``reload`` do not import each other.
"""

from __future__ import annotations

import warnings
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from typing import NamedTuple

from .._model import base_model
from ..attention.interface import ALPHA_ATTR
from ..attention.query_scale import LENGTH_SCALE_ATTR, TEMPERATURE_ATTR
from ..settings import CONFIG_KEY, SparseSettings
from ..swaps import PatchRequest

METHOD = "hf_sparsemax"  # the quant_method naming the load hook
NOTE = "not a quantization: transformers' load hook that hf_sparsemax uses to restore its sparse attention and loss"
TAG = "hf_sparsemax"
FROM_MODEL_CONFIG = "_hf_sparsemax_from_model_config"  # on the model: its generation config's flag before mark
SAMPLING_BEFORE = "_hf_sparsemax_sampling_before"  # on the model: generation config fields mark set (for clear)


class SparseLoadConfig(QuantizationConfigMixin):
    """The ``quantization_config`` entry that makes ``from_pretrained`` call :class:`SparseLoader`."""

    def __init__(self, **kwargs: Any) -> None:
        self.quant_method = METHOD
        self.dequantize = True  # transformers drops the quantizer marks after loading
        self.note = NOTE


def decoding_note(settings: SparseSettings) -> str | None:
    """How to sample from what the loss trained (``None`` for cross-entropy)."""
    from ..decoding.generation import processor_for

    processor = processor_for(settings.loss, settings.loss_options)
    if processor is None:
        return None
    options = {k: v for k, v in settings.loss_options.items() if k != "fused"}
    shown = "(" + ", ".join(f"{k}={v}" for k, v in sorted(options.items())) + ")" if options else ""
    text = (
        f"trained with the {settings.loss}{shown} loss: sample from its distribution. "
        "`import hf_sparsemax` before loading (generate(do_sample=True) then matches), or pass "
        f"generate(logits_processor=[hf_sparsemax.{processor!r}], top_k=0, top_p=1.0, do_sample=True)."
    )
    if settings.loss == "sparse_softmax":
        text += (
            f" Plain transformers samples the same distribution with generate(do_sample=True, "
            f"top_k={options.get('top_k') or 0}, top_p={options.get('top_p') or 1.0})."
        )
    return text


def mark(model, settings: SparseSettings) -> None:
    """Write the load marks of ``settings`` into ``model``'s config, generation config and tags."""
    clear(model)
    if settings.is_default:
        return
    config = model.config
    note = decoding_note(settings)
    if note is not None:
        getattr(config, CONFIG_KEY)["decoding"] = note
    if settings.attention_options is not None:
        config.attn_implementation = settings.attn
    other = getattr(config, "quantization_config", None)
    if other is None:
        config.quantization_config = SparseLoadConfig()
    else:  # a really quantized model keeps its own entry; transformers allows one
        warnings.warn(
            "this model is quantized, so its saved folder cannot name hf_sparsemax's load hook: after "
            "from_pretrained of it, call hf_sparsemax.patch_model(model) to restore the saved settings",
            stacklevel=3,
        )
    tags = [TAG]
    if settings.attention_options is not None:
        tags.append(f"sparse-attention-{settings.attn}")
    if note is not None:
        tags.append(f"sparse-loss-{settings.loss}")
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            options = dict(sorted(settings.loss_options.items()))
            generation.hf_sparsemax = {"loss": settings.loss, "loss_options": options, "decoding": note}
            vars(model).setdefault(FROM_MODEL_CONFIG, generation._from_model_config)  # for clear
            generation._from_model_config = False  # else transformers drops the entry when loading
            if settings.loss == "sparse_softmax":
                set_engine_sampling(model, generation, settings.loss_options)
    model.add_model_tags(tags)


def set_engine_sampling(model, generation, options: dict) -> None:
    """``top_k`` / ``top_p`` / ``do_sample=True`` in the generation config: what engines without hf_sparsemax
    (vLLM, TGI, plain ``generate``) read as default sampling, and with them sample a top-k / top-p sparse
    softmax exactly. ``top_k=0`` when only ``top_p`` was trained (transformers would fill in 50);
    ``do_sample=True`` keeps the config valid for ``save_pretrained``."""
    vars(model)[SAMPLING_BEFORE] = {name: getattr(generation, name, None) for name in ("top_k", "top_p", "do_sample")}
    generation.top_k = options.get("top_k") or 0
    generation.top_p = options.get("top_p") or 1.0
    generation.do_sample = True


def is_load_hook_entry(entry) -> bool:
    """Whether a ``quantization_config`` is this module's (a dict when it was loaded without hf_sparsemax)."""
    return isinstance(entry, SparseLoadConfig) or (isinstance(entry, dict) and entry.get("quant_method") == METHOD)


def clear(model) -> None:
    """Remove what :func:`mark` wrote."""
    config = model.config
    if is_load_hook_entry(getattr(config, "quantization_config", None)):
        del config.quantization_config
    if "attn_implementation" in vars(config):
        del config.attn_implementation
    generation = getattr(model, "generation_config", None)
    if generation is not None and "hf_sparsemax" in vars(generation):
        del generation.hf_sparsemax
    for name, value in vars(model).pop(SAMPLING_BEFORE, {}).items():
        if generation is not None:
            setattr(generation, name, value)
    from_model_config = vars(model).pop(FROM_MODEL_CONFIG, None)
    if generation is not None and from_model_config is not None:
        generation._from_model_config = from_model_config
    if model.model_tags:
        ours = (TAG, "sparse-loss-", "sparse-attention-")
        model.model_tags = [tag for tag in model.model_tags if not tag.startswith(ours)]
        if not model.model_tags and "model_tags" in vars(model):
            del model.model_tags  # the class's default (None) shows through again


LEARNED_MODULES = (ALPHA_ATTR, TEMPERATURE_ATTR, LENGTH_SCALE_ATTR)  # attention submodules an adapter may keep


def keep_alpha_with_adapter(model, names: tuple[str, ...] = (ALPHA_ATTR,)) -> None:
    """List the learned alphas (and learned temperatures / length scales: ``names``) in the active adapter's
    ``modules_to_save`` (peft saves and restores them)."""
    from peft.tuners.tuners_utils import BaseTuner
    from peft.utils.other import set_additional_trainable_modules

    adapter = model.active_adapter
    config = model.peft_config[adapter]
    listed = list(config.modules_to_save or [])
    config.modules_to_save = [*listed, *(name for name in names if name not in listed)]
    set_additional_trainable_modules(model.base_model, config, BaseTuner.get_model_config(model), adapter)


def release_alpha_from_adapter(model) -> None:
    """Undo :func:`keep_alpha_with_adapter` in every adapter's config (the learned modules themselves are gone)."""
    for config in model.peft_config.values():
        names = getattr(config, "modules_to_save", None)
        if names and set(names) & set(LEARNED_MODULES):
            config.modules_to_save = [name for name in names if name not in LEARNED_MODULES] or None


class AdapterAlphaPlan(NamedTuple):
    """The learned alphas (temperatures, length scales) of a peft model's attention are listed in its active
    adapter's ``modules_to_save``: ``names``, their attribute names."""

    names: tuple[str, ...]


class AdapterAlphaSwap:
    """peft saves a model's learned alphas with its adapter and restores them on load (undone by ``remove``)."""

    name = "adapter_alpha"

    def plan(self, model, request: PatchRequest) -> AdapterAlphaPlan | None:
        options = request.settings.attention_options
        if options is None or model is base_model(model):
            return None
        names = tuple(name for name, learned in zip(LEARNED_MODULES, (
            options.learn_alpha, options.learn_temperature, options.length_scale)) if learned)
        return AdapterAlphaPlan(names) if names else None

    def apply(self, model, plan: AdapterAlphaPlan) -> None:
        keep_alpha_with_adapter(model, plan.names)

    def remove(self, model) -> None:
        if model is not base_model(model):
            release_alpha_from_adapter(model)
