"""A saved sparse model loads back as exactly that model, never silently as a softmax one.

``patch_model`` writes into the model's config (so ``save_pretrained`` and
every Trainer checkpoint carry it):

- ``hf_sparsemax``: the settings (:class:`~hf_sparsemax.settings.SparseSettings`),
  plus, for a sparse loss, ``decoding``: one sentence saying how to sample
  from the distribution the loss trained.
- ``attn_implementation`` (sparse attention only): transformers reads this
  key of ``config.json`` at load. With hf_sparsemax imported it selects the
  registered sparse attention; without it ``from_pretrained`` raises
  ``ValueError: Specified attn_implementation="entmax15" is not supported``.
- ``quantization_config = {"quant_method": "hf_sparsemax", ...}``: the load
  hook below.
- For a sparse loss, ``generation_config.hf_sparsemax`` (the same
  ``decoding`` sentence, kept by ``generation_config.json``) and model tags
  (``hf_sparsemax``, ``sparse-loss-<name>``, ``sparse-attention-<name>``), which
  transformers, Trainer and peft write into the model cards they create.

The load hook. transformers 5.23 runs plugin code around weight loading for
one config key only, ``quantization_config``, dispatched through its public
registries (``register_quantization_config`` / ``register_quantizer``).
hf_sparsemax registers there a loader that quantizes nothing
(:class:`SparseLoader`): before the weights load it adds the learned-alpha
modules, so their saved values load like any weight (local folder, hub cache,
shards); after, it re-applies the saved settings with ``patch_model``
(attention options, loss, matched ``generate``); and, as its config says
``dequantize=True``, transformers then drops the quantizer marks: the model
is not reported as quantized. It acts only on folders whose config names
it; nothing of transformers is rebound. :func:`remove_load_hook` unregisters
it, :func:`install_load_hook` (run on import) registers it again.

Without hf_sparsemax, transformers warns "Unknown quantization type, got
hf_sparsemax ... we will skip the quantization" and loads the plain weights:
a model with only a sparse loss (a normal model) loads, and its config and
generation config say how to decode it. The price: such a folder cannot also
be loaded with another ``quantization_config`` (bitsandbytes, ...);
transformers refuses with a ``ValueError``. To load it quantized:
:func:`remove_load_hook`, ``from_pretrained(..., quantization_config=...)``,
then ``patch_model(model)`` (learned alphas are read from a local folder).

With peft, the learned alphas of a patched ``PeftModel`` are listed in the
adapter's ``modules_to_save``: ``PeftModel.save_pretrained`` saves them beside
the adapter and ``PeftModel.from_pretrained`` on a base patched with the same
attention restores them. The base must be that patched model (loaded from
its saved folder, or patched by hand): on a plain base peft finds no alphas
to restore.
"""

from __future__ import annotations

import warnings
from typing import Any

from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from .attention import ALPHA_ATTR
from .settings import CONFIG_KEY, SparseSettings

METHOD = "hf_sparsemax"  # the quant_method naming the load hook
NOTE = "not a quantization: transformers' load hook that hf_sparsemax uses to restore its sparse attention and loss"
TAG = "hf_sparsemax"


class SparseLoadConfig(QuantizationConfigMixin):
    """The ``quantization_config`` entry that makes ``from_pretrained`` call :class:`SparseLoader`."""

    def __init__(self, **kwargs: Any) -> None:
        self.quant_method = METHOD
        self.dequantize = True  # transformers drops the quantizer marks after loading
        self.note = NOTE


class SparseLoader(HfQuantizer):
    """Restores a saved hf_sparsemax model while ``from_pretrained`` loads it (quantizes nothing)."""

    requires_calibration = False
    requested_attention = None

    def update_attn_implementation(self, config):
        self.requested_attention = config._attn_implementation  # config.json's, or from_pretrained's argument
        return config

    def _process_model_before_weight_loading(self, model, **kwargs):
        settings = SparseSettings.from_config(model.config)
        options = settings.attention_options if settings is not None else None
        if options is not None and options.learn_alpha:
            from .patch import attention_plan

            add_learned_alpha(model, attention_plan(model, settings))
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        from .patch import patch_model

        missing = [name for name, param in model.named_parameters()
                   if name.endswith(f"{ALPHA_ATTR}.pre_alpha") and not getattr(param, "_is_hf_initialized", False)]
        if missing:
            raise ValueError(
                f"{model.name_or_path}: its config says learn_alpha but the checkpoint has no learned alphas "
                f"({missing[0]}, ...); save the model with save_pretrained after hf_sparsemax.patch_model"
            )
        settings = SparseSettings.from_config(model.config) or SparseSettings()
        saved = settings.attn
        if saved not in (None, "softmax") and self.requested_attention not in (None, saved):
            warnings.warn(
                f"{model.name_or_path} was saved with {saved} attention; attn_implementation="
                f"{self.requested_attention!r} is ignored so that the saved model comes back. To switch: "
                f"hf_sparsemax.patch_model(model, attn='softmax') then model.set_attn_implementation(...)",
                stacklevel=2,
            )
        if settings.loss not in (None, "cross_entropy") and not has_loss_head(model, settings):
            return patch_model(model, loss="cross_entropy")  # a body loaded without the head its loss trained
        return patch_model(model)  # no attn / loss: re-applies config.hf_sparsemax, keeping the loaded alphas

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True


def has_loss_head(model, settings: SparseSettings) -> bool:
    """Whether the model has a head whose loss ``patch_model`` can swap to ``settings.loss``
    (``AutoModel`` gives a body without one)."""
    from .patch import loss_plan

    try:
        loss_plan(model, settings)
    except ValueError:
        return False
    return True


def add_learned_alpha(model, plan) -> None:
    """Give each attention module its ``LearnedAlpha`` (empty, on the loading device) before the weights load."""
    from .attention import LearnedAlpha

    modules, options, heads = plan
    for module, count in zip(modules, heads):
        if ALPHA_ATTR not in module._modules:
            module.add_module(ALPHA_ATTR, LearnedAlpha(count, options.alpha))


def install_load_hook() -> None:
    """Register the load hook with transformers (done on ``import hf_sparsemax``)."""
    AUTO_QUANTIZATION_CONFIG_MAPPING.setdefault(METHOD, SparseLoadConfig)
    AUTO_QUANTIZER_MAPPING.setdefault(METHOD, SparseLoader)


def remove_load_hook() -> None:
    """Unregister the load hook: saved sparse models then load as transformers alone would load them."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(METHOD) is SparseLoadConfig:
        del AUTO_QUANTIZATION_CONFIG_MAPPING[METHOD]
    if AUTO_QUANTIZER_MAPPING.get(METHOD) is SparseLoader:
        del AUTO_QUANTIZER_MAPPING[METHOD]


def decoding_note(settings: SparseSettings) -> str | None:
    """How to sample from what the loss trained (``None`` for cross-entropy)."""
    from .generation import processor_for

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
            generation._from_model_config = False  # else transformers drops the entry when loading
    model.add_model_tags(tags)


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
    if model.model_tags:
        ours = (TAG, "sparse-loss-", "sparse-attention-")
        model.model_tags = [tag for tag in model.model_tags if not tag.startswith(ours)]


def keep_alpha_with_adapter(model) -> None:
    """List the learned alphas in the active adapter's ``modules_to_save`` (peft saves and restores them)."""
    from peft.tuners.tuners_utils import BaseTuner
    from peft.utils.other import set_additional_trainable_modules

    adapter = model.active_adapter
    config = model.peft_config[adapter]
    names = list(config.modules_to_save or [])
    if ALPHA_ATTR not in names:
        config.modules_to_save = [*names, ALPHA_ATTR]
    set_additional_trainable_modules(model.base_model, config, BaseTuner.get_model_config(model), adapter)


def release_alpha_from_adapter(model) -> None:
    """Undo :func:`keep_alpha_with_adapter` in every adapter's config (the alpha modules themselves are gone)."""
    for config in model.peft_config.values():
        names = getattr(config, "modules_to_save", None)
        if names and ALPHA_ATTR in names:
            config.modules_to_save = [name for name in names if name != ALPHA_ATTR] or None
