"""The attention swap: the model's attention modules compute a sparse mapping of the scores.

The sparse attentions are registered with transformers' attention interface
on import (:mod:`hf_sparsemax.attention`); the swap sets the implementation
with ``model.set_attn_implementation`` and hangs the options (and, with
``learn_alpha``, a :class:`~hf_sparsemax.attention.LearnedAlpha` per module)
on each attention module. Removing it gives back the implementation the
model had.
"""

from __future__ import annotations

import glob
import os
from typing import NamedTuple

import torch
from torch import nn

from .._model import base_model
from ..attention.interface import ALPHA_ATTR, ATTENTION_MAPPINGS, OPTIONS_ATTR, AttentionOptions, LearnedAlpha
from ..attention.interface import check_supported, num_heads
from ..attention import pages
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
    (None: a fresh one); ``load_saved``: load alphas saved in the model's folder.
    """

    modules: list[nn.Module]
    options: AttentionOptions
    heads: list[int | None]
    kept: list[nn.Module | None]
    load_saved: bool


def load_learned_alpha(inner) -> int:
    """Copy learned alphas saved by ``save_pretrained`` back into the model; returns how many modules got one.

    ``from_pretrained`` drops them (the plain model has no such parameters);
    they are read from the safetensors files of the folder the model came from.
    """
    folder = getattr(inner, "name_or_path", None) or getattr(inner.config, "_name_or_path", "")
    if not folder or not os.path.isdir(folder):
        return 0
    from safetensors import safe_open

    owners = {name: module for name, module in inner.named_modules() if ALPHA_ATTR in module._modules}
    suffix = f".{ALPHA_ATTR}.pre_alpha"
    loaded = 0
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                owner = owners.get(key[: -len(suffix)]) if key.endswith(suffix) else None
                if owner is not None:
                    learned = owner._modules[ALPHA_ATTR]
                    learned = getattr(learned, "original_module", learned)  # peft's wrapper: the base's own alpha
                    with torch.no_grad():
                        learned.pre_alpha.copy_(handle.get_tensor(key))
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
        return AttentionPlan(modules, options, heads, kept, request.load_saved and options.learn_alpha)

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
        set_attention(inner, plan.options.mapping)
        if plan.load_saved:
            load_learned_alpha(inner)

    def remove(self, model) -> None:
        inner = base_model(model)
        for module in inner.modules():
            vars(module).pop(OPTIONS_ATTR, None)
            pages.uninstall(module)
            module._modules.pop(ALPHA_ATTR, None)
        original = vars(inner).pop(ORIGINAL_ATTR, None)
        if inner.config._attn_implementation in ATTENTION_MAPPINGS:
            set_attention(inner, original or ("sdpa" if getattr(inner, "_supports_sdpa", False) else "eager"))
