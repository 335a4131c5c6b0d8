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
- For the top-k / top-p sparse softmax loss, ``top_k`` / ``top_p`` / ``do_sample=True`` in the
  generation config: engines without hf_sparsemax (vLLM, TGI, plain ``generate``) read them as their
  default sampling and so sample the trained distribution.
- For a sparse loss, ``generation_config.hf_sparsemax`` (the same
  ``decoding`` sentence, kept by ``generation_config.json``) and model tags
  (``hf_sparsemax``, ``sparse-loss-<name>``, ``sparse-attention-<name>``), which
  transformers, Trainer and peft write into the model cards they create.

vLLM: with hf_sparsemax installed in its environment, the ``quantization_config`` entry is a vLLM
quantization method that quantizes nothing (:mod:`hf_sparsemax.integrations.vllm.plugin`), and vLLM samples
the trained loss; without it vLLM refuses the folder (``Unknown quantization method: hf_sparsemax``)
rather than serve it as a softmax model. ``--hf-overrides '{"quantization_config": null}'`` serves it
anyway, with the generation config's sampling.

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

from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

from ..attention.interface import ALPHA_ATTR
from ..swaps.attention_swap import LEARNED
from .load_marks import METHOD, SparseLoadConfig
from ..settings import SparseSettings

PATCH_MODEL = None  # hf_sparsemax.patch_model, handed to install_load_hook

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
        if options is not None and (options.learn_alpha or options.learn_temperature or options.length_scale):
            from ..swaps import ATTENTION, PatchRequest

            add_learned_alpha(ATTENTION.plan(model, PatchRequest(settings)))
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        learned = tuple(f"{attr}.{param}" for attr, params in LEARNED for param in params)
        missing = [name for name, param in model.named_parameters()
                   if name.endswith(learned) and not getattr(param, "_is_hf_initialized", False)]
        if missing:
            kind = {"pre_alpha": ("learn_alpha", "alphas"), "log_temperature": ("learn_temperature", "temperatures")}
            option, what = kind.get(missing[0].rsplit(".", 1)[-1], ("length_scale", "length scales"))
            raise ValueError(
                f"{model.name_or_path}: its config says {option} but the checkpoint has no learned {what} "
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
            return PATCH_MODEL(model, loss="cross_entropy")  # a body loaded without the head its loss trained
        return PATCH_MODEL(model)  # no attn / loss: re-applies config.hf_sparsemax, keeping the loaded alphas

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True


def has_loss_head(model, settings: SparseSettings) -> bool:
    """Whether the model has a head whose loss ``patch_model`` can swap to ``settings.loss``
    (``AutoModel`` gives a body without one)."""
    from ..swaps import COSINE_HEAD, LOSS, PatchRequest

    try:
        for swap in (COSINE_HEAD, LOSS):
            swap.plan(model, PatchRequest(settings))
    except ValueError:
        return False
    return True


def add_learned_alpha(plan) -> None:
    """Give each attention module of an attention plan its ``LearnedAlpha``, learned ``HeadTemperature`` and
    ``LengthScale`` (as the plan asks; values overwritten by the weights) before the weights load."""
    from ..attention.interface import LearnedAlpha

    for module, count in zip(plan.modules, plan.heads):
        if count is not None and ALPHA_ATTR not in module._modules:
            module.add_module(ALPHA_ATTR, LearnedAlpha(count, plan.options.alpha))
    for module, scales in zip(plan.modules, plan.scales or ()):
        scales.install(module, plan.options.learn_temperature)


def install_load_hook(patch_model) -> None:
    """Register the load hook with transformers (done on ``import hf_sparsemax``); ``patch_model`` is what the hook
    calls on a loaded model (handed in, so that this module imports nothing above it)."""
    global PATCH_MODEL
    PATCH_MODEL = patch_model
    AUTO_QUANTIZATION_CONFIG_MAPPING.setdefault(METHOD, SparseLoadConfig)
    AUTO_QUANTIZER_MAPPING.setdefault(METHOD, SparseLoader)


def remove_load_hook() -> None:
    """Unregister the load hook: saved sparse models then load as transformers alone would load them."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(METHOD) is SparseLoadConfig:
        del AUTO_QUANTIZATION_CONFIG_MAPPING[METHOD]
    if AUTO_QUANTIZER_MAPPING.get(METHOD) is SparseLoader:
        del AUTO_QUANTIZER_MAPPING[METHOD]
