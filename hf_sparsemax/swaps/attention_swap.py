"""The attention swap: the model's attention modules compute a sparse mapping of the scores.

The sparse attentions are registered with transformers' attention interface
on import (:mod:`hf_sparsemax.attention`); the swap sets the implementation
with ``model.set_attn_implementation`` and hangs the options (and, with
``learn_alpha``, a :class:`~hf_sparsemax.attention.LearnedAlpha` per module;
with ``temperature`` / ``length_scale``, a :class:`~hf_sparsemax.attention.query_scale.HeadTemperature` /
:class:`~hf_sparsemax.attention.query_scale.LengthScale`) on each attention module. ``generate``'s own cache then
becomes a :class:`~hf_sparsemax.GrowingCache` where that is exact
(:func:`~hf_sparsemax.attention.blocked.growing_cache.prepare_cache_for_generation`). Removing it gives back the
implementation the model had.
"""

from __future__ import annotations

import glob
import os
from typing import NamedTuple

import torch
from torch import nn

from .._model import base_model
from ..attention.interface import ALPHA_ATTR, ATTENTION_MAPPINGS, OPTIONS_ATTR, AttentionOptions, LearnedAlpha
from ..attention.families import check_supported
from ..attention.interface import num_heads
from ..attention.query_scale import LENGTH_SCALE_ATTR, TEMPERATURE_ATTR, HeadTemperature, LengthScale
from ..settings import SparseSettings
from ..attention.blocked import growing_cache, pages
from .protocol import PatchRequest

ORIGINAL_ATTR = "_hf_sparsemax_original_attn"  # the implementation a model had before its attention was swapped


def set_attention(inner, name: str) -> None:
    """``inner.set_attn_implementation(name)``, reaching every sub-model.

    transformers 5.19 (newer releases do this themselves) skips a sub-model whose config is a copy of the
    same class as the model's (T5's encoder and decoder stacks): those would keep their old attention.
    """
    from transformers import PreTrainedModel

    inner.set_attn_implementation(name)
    for module in inner.modules():
        if module is not inner and isinstance(module, PreTrainedModel) and module.config._attn_implementation != name:
            module.set_attn_implementation(name)


class AttentionPlan(NamedTuple):
    """A validated attention swap.

    ``modules``: the attention modules; ``options``: their options; ``heads``:
    query heads per module (the size of its learned alpha; None without
    ``learn_alpha``); ``kept``: per module, the trained ``LearnedAlpha`` it keeps
    (None: a fresh one); ``load_saved``: load alphas saved in the model's folder; ``scales``: per module,
    its query scales (:class:`QueryScales`).
    """

    modules: list[nn.Module]
    options: AttentionOptions
    heads: list[int | None]
    kept: list[nn.Module | None]
    load_saved: bool
    scales: list["QueryScales"] | None = None


class QueryScales(NamedTuple):
    """One module's query scales: ``temperature`` (per-head values, or None), the learned ``HeadTemperature``
    it keeps (``kept_temperature``, None: a fresh one), ``length_heads`` (heads of its ``LengthScale``, None:
    none) and the trained ``LengthScale`` it keeps (``kept_length``)."""

    temperature: tuple[float, ...] | None
    kept_temperature: nn.Module | None
    length_heads: int | None
    kept_length: nn.Module | None

    def install(self, module: nn.Module, learn_temperature: bool) -> None:
        device = next(module.parameters(), torch.empty(0)).device
        if self.temperature is not None:
            fresh = self.kept_temperature is None
            heat = HeadTemperature(self.temperature, learn_temperature) if fresh else self.kept_temperature
            module.add_module(TEMPERATURE_ATTR, heat.to(device))
        if self.length_heads is not None:
            length = self.kept_length if self.kept_length is not None else LengthScale(self.length_heads)
            module.add_module(LENGTH_SCALE_ATTR, length.to(device))


def plan_query_scales(inner, modules: list[nn.Module], options: AttentionOptions,
                      request: PatchRequest) -> list[QueryScales] | None:
    """Each module's :class:`QueryScales`, or a ``ValueError`` where the temperatures do not fit the model.

    A learned temperature / length scale already in a module is kept when the attention is re-applied
    (``keep_learned``) with the temperatures the config holds (new values given: fresh ones)."""
    if not options.scales_queries:
        return None
    heads = [num_heads(module) for module in modules]
    temperature = options.temperature
    if isinstance(temperature, tuple):
        if len(temperature) != len(modules) or any(len(t) != h for t, h in zip(temperature, heads)):
            raise ValueError(f"temperature holds {[len(t) for t in temperature]} temperatures per layer; this model "
                             f"has {len(modules)} attention layers of {heads} query heads")
    elif temperature is True:
        temperature = tuple((1.0,) * h for h in heads)
    saved = SparseSettings.from_config(inner.config)
    same = saved is not None and saved.attn_options.get("temperature") == request.settings.attn_options.get(
        "temperature")
    plans = []
    for index, (module, count) in enumerate(zip(modules, heads)):
        heat, length = module._modules.get(TEMPERATURE_ATTR), module._modules.get(LENGTH_SCALE_ATTR)
        keep_heat = (request.keep_learned and same and options.learn_temperature and heat is not None
                     and getattr(heat, "learn", False) and len(heat.values) == count)
        keep_length = request.keep_learned and length is not None and length.delta.numel() == count
        plans.append(QueryScales(None if temperature is None else temperature[index], heat if keep_heat else None,
                                 count if options.length_scale else None, length if keep_length else None))
    return plans


LEARNED = ((ALPHA_ATTR, ("pre_alpha",)), (TEMPERATURE_ATTR, ("log_temperature",)),
           (LENGTH_SCALE_ATTR, ("delta", "beta", "gamma")))  # attention submodules saved with the weights


def load_learned(inner) -> int:
    """Copy learned alphas, temperatures and length scales saved by ``save_pretrained`` back into the model;
    returns how many tensors it copied.

    ``from_pretrained`` drops them (the plain model has no such parameters);
    they are read from the safetensors files of the folder the model came from.
    """
    folder = getattr(inner, "name_or_path", None) or getattr(inner.config, "_name_or_path", "")
    if not folder or not os.path.isdir(folder):
        return 0
    from safetensors import safe_open

    targets = {}
    for name, module in inner.named_modules():
        for attr, params in LEARNED:
            learned = module._modules.get(attr)
            learned = getattr(learned, "original_module", learned)  # peft's wrapper: the base's own module
            for param in params:
                if learned is not None and isinstance(getattr(learned, param, None), nn.Parameter):
                    targets[f"{name}.{attr}.{param}"] = getattr(learned, param)
    loaded = 0
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                target = targets.get(key)
                if target is not None:
                    with torch.no_grad():
                        target.copy_(handle.get_tensor(key))
                    loaded += 1
    return loaded


class AttentionSwap:
    """The attention modules compute ``options.mapping`` (with learned alphas if asked)."""

    name = "attention"

    def plan(self, model, request: PatchRequest) -> AttentionPlan | None:
        options = request.settings.attention_options
        if options is None:
            return None
        modules = check_supported(base_model(model))
        heads = [num_heads(module) if options.learn_alpha else None for module in modules]
        kept = []
        for module, count in zip(modules, heads):
            learned = module._modules.get(ALPHA_ATTR)
            keep = request.keep_learned and count is not None and learned is not None
            kept.append(learned if keep and learned.pre_alpha.numel() == count else None)
        scales = plan_query_scales(base_model(model), modules, options, request)
        learned = options.learn_alpha or options.learn_temperature or options.length_scale
        return AttentionPlan(modules, options, heads, kept, request.load_saved and learned, scales)

    def apply(self, model, plan: AttentionPlan) -> None:
        inner = base_model(model)
        if ORIGINAL_ATTR not in vars(inner) and inner.config._attn_implementation not in ATTENTION_MAPPINGS:
            setattr(inner, ORIGINAL_ATTR, inner.config._attn_implementation)
        for module, count, kept in zip(plan.modules, plan.heads, plan.kept):
            setattr(module, OPTIONS_ATTR, plan.options)
            pages.install(module)  # hands the attention its cache layer: exact KV skipping while decoding
            if count is not None:
                device = next(module.parameters(), torch.empty(0)).device
                module.add_module(ALPHA_ATTR, kept if kept is not None else LearnedAlpha(count, plan.options.alpha).to(device))
        for module, scales in zip(plan.modules, plan.scales or ()):
            scales.install(module, plan.options.learn_temperature)
        set_attention(inner, plan.options.mapping)
        growing_cache.install_default(inner)  # generate's own cache appends without copying (where exact)
        if plan.load_saved:
            load_learned(inner)

    def remove(self, model) -> None:
        inner = base_model(model)
        growing_cache.remove_default(inner)
        for module in inner.modules():
            vars(module).pop(OPTIONS_ATTR, None)
            pages.uninstall(module)
            for name in (ALPHA_ATTR, TEMPERATURE_ATTR, LENGTH_SCALE_ATTR):
                module._modules.pop(name, None)
        original = vars(inner).pop(ORIGINAL_ATTR, None)
        if inner.config._attn_implementation in ATTENTION_MAPPINGS:
            set_attention(inner, original or ("sdpa" if getattr(inner, "_supports_sdpa", False) else "eager"))
