"""Online training with vLLM rollouts: vLLM samples the distribution the patched loss trains, or it is refused.

TRL's online trainers (GRPO, RLOO) with ``use_vllm=True`` draw their rollouts from vLLM. In colocate
mode TRL starts ``LLM(model=model.name_or_path, ...)`` in the training process and copies the trained
weights into it before each generation; in server mode (``trl vllm-serve``) the rollouts come from a
server started on a folder of the user's choice. Either way vLLM samples the model it loaded, with the
sampling parameters TRL builds from its config updated by ``generation_kwargs``.

vLLM samples the trained distribution when hf_sparsemax's logits processor (:mod:`.vllm_plugin`, loaded
by vLLM when hf_sparsemax is installed in its environment) knows the loss: from the loaded folder's
saved settings, or from the request's ``extra_args``. A model patched in memory after
``from_pretrained(base_folder)`` has neither: ``model.name_or_path`` is the base folder, and vLLM would
sample plain softmax while the loss trains a sparse distribution. Under top-k sparse softmax most of
those tokens lie outside the trained support (trained probability 0); TRL's importance-sampling ratios
for them come out 0, and GRPO trains nothing, without a word (measured: loss 0, grad norm 0).

- :func:`vllm_generation_kwargs` gives the ``GRPOConfig(generation_kwargs=...)`` that names the model's
  trained loss in every rollout request (``extra_args``; :mod:`.decoding` reads them).
- :func:`rollout_refusal` is what :mod:`hf_sparsemax.integrations.trainer` checks on a trainer with
  ``args.use_vllm``: ``None`` when vLLM will sample the trained distribution, else the sentence of the
  ``ValueError``. The check runs at the first scoring forward of the first step, after the first
  rollouts and before any optimizer step.

Sparse attention. vLLM computes a folder's saved sparse attention on its CPU backend (:mod:`.backend`), and TRL's
colocate weight sync refreshes the learned alphas, temperatures and length scales it computes with. Rollouts of a
model with sparse attention are then exact where vLLM loads a folder saved with the same attention settings
(``model.save_pretrained(folder)``, then training the model loaded from ``folder``: TRL starts vLLM on
``model.name_or_path``, with no other way to hand it settings), in colocate mode, and no alpha ramp
(:class:`~hf_sparsemax.AlphaScheduleCallback`) is in progress (its alpha and temperatures change at every step
outside the weights). Elsewhere they are refused: server mode (the server's folder is out of sight), a folder
without those settings (vLLM would compute softmax or another attention), a ramp.

Torch only: neither vLLM nor TRL is imported.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from ...mappings import registry
from ...settings import CONFIG_KEY, SparseSettings
from ...decoding.engine import KEY, OFF, OPTION_PREFIX, Choice, engine_samples, request_choice


def trained_choice(settings: SparseSettings | None) -> Choice | None:
    """The distribution a model's settings train (``None``: softmax, as cross-entropy trains)."""
    if settings is None or settings.loss in (None, "cross_entropy"):
        return None
    return Choice.trained(settings.loss, settings.loss_options)


def extra_args(choice: Choice | None) -> dict[str, Any]:
    """The ``SamplingParams.extra_args`` with which a vLLM request samples ``choice`` (``None``: softmax)."""
    if choice is None:
        return {KEY: OFF}
    return {KEY: choice.loss, **{OPTION_PREFIX + name: value for name, value in choice.options}}


def vllm_generation_kwargs(model, generation_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``generation_kwargs`` for TRL's online trainers with ``use_vllm=True`` that make vLLM sample the
    distribution ``model``'s patched loss trains.

    ``GRPOConfig(use_vllm=True, generation_kwargs=vllm_generation_kwargs(model))``: every rollout request
    carries ``extra_args`` naming the trained loss and its options, so vLLM's hf_sparsemax logits processor
    samples it whichever folder vLLM loaded (colocate mode: ``model.name_or_path``; server mode: the
    folder ``trl vllm-serve`` was started on, whose environment must have hf_sparsemax installed). A model
    trained with cross-entropy gets ``{"hf_sparsemax": "off"}``: vLLM's own softmax. ``generation_kwargs``:
    other sampling parameters to keep (their own ``extra_args`` are kept too, hf_sparsemax's keys
    replaced).

    A model with sparse attention: vLLM computes the attention of the folder it loads, which the trainer's
    guard checks (:func:`rollout_refusal`).
    """
    settings = SparseSettings.from_config(model.config)
    kwargs = dict(generation_kwargs or {})
    kept = {key: value for key, value in dict(kwargs.get("extra_args") or {}).items()
            if key != KEY and not key.startswith(OPTION_PREFIX)}
    kwargs["extra_args"] = {**kept, **extra_args(trained_choice(settings))}
    return kwargs


def attention_refusal(trainer, settings: SparseSettings | None, mode: str, path) -> str | None:
    """Why vLLM's rollouts would not compute the sparse attention of a model with these ``settings`` (``mode``:
    TRL's ``vllm_mode``; ``path``: the folder vLLM loads in colocate mode), or ``None``: no sparse attention, or
    vLLM computes it exactly (module docstring)."""
    if settings is None or settings.attention_options is None:
        return None
    trains = f"this model trains {settings.attn} attention (hf_sparsemax)"
    if mode == "server":
        return (f"{trains}, and in vllm_mode='server' the rollouts come from a server whose attention hf_sparsemax "
                "cannot see: use vllm_mode='colocate' on a folder saved with this attention, or use_vllm=False")
    saved = folder_settings(path)
    if saved is None or not same_attention(saved.attention_options, settings.attention_options):
        loaded = "softmax" if saved is None or saved.attention_options is None else f"other {saved.attn} settings"
        return (f"{trains}, and vLLM loads {str(path)!r}, whose attention is {loaded}: save the patched model "
                "(save_pretrained) and train it loaded from that folder, or use_vllm=False")
    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", None) or []
    if any(getattr(callback, "ramping", False) for callback in callbacks):
        return (f"{trains}, and an alpha ramp (AlphaScheduleCallback) is in progress, which changes the attention "
                "at every step where vLLM computes the saved one: use use_vllm=False for the conversion")
    return None


def same_attention(a, b) -> bool:
    """Whether two attention options compute the same attention (the kernel and query chunks aside)."""
    return a is not None and b is not None and dataclasses.replace(a, kernel="auto", chunk_size=None) \
        == dataclasses.replace(b, kernel="auto", chunk_size=None)


def folder_settings(path: str | os.PathLike | None) -> SparseSettings | None:
    """The hf_sparsemax settings saved in a local folder's ``config.json`` (``None``: none, or no local folder)."""
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    with open(os.path.join(path, "config.json")) as handle:
        data = json.load(handle).get(CONFIG_KEY)
    return None if data is None else SparseSettings.from_dict(dict(data))


def same_distribution(a: Choice | None, b: Choice | None) -> bool:
    if a is None or b is None:
        return a is b
    parsed = [registry.loss_options(c.loss, dict(c.options)).options for c in (a, b)]
    return a.loss == b.loss and parsed[0] == parsed[1]


def rollout_refusal(trainer, model) -> str | None:
    """Why ``trainer``'s vLLM rollouts would not sample what ``model``'s patched loss trains, or ``None``.

    ``None`` too for a trainer without ``args.use_vllm``. Reads the trainer's ``args``: ``vllm_mode``,
    ``generation_kwargs`` (its ``extra_args``, ``top_k``, ``top_p``), ``top_k``, ``top_p``; in colocate mode
    the folder vLLM loads, ``model.name_or_path``; and its callbacks (an alpha ramp in progress).
    """
    args = getattr(trainer, "args", None)
    if not getattr(args, "use_vllm", False):
        return None
    settings = SparseSettings.from_config(model.config)
    name = type(trainer).__name__
    mode = getattr(args, "vllm_mode", "colocate")
    path = getattr(getattr(trainer, "model", None), "name_or_path", None) or getattr(model, "name_or_path", None)
    try:
        reason = attention_refusal(trainer, settings, mode, path)
    except ValueError as error:
        return f"{name} with use_vllm=True loads {path!r} into vLLM, which refuses it: {error}"
    if reason is not None:
        return f"{name} with use_vllm=True: {reason}"
    trained = trained_choice(settings)
    kwargs = dict(getattr(args, "generation_kwargs", None) or {})
    extra = dict(kwargs.get("extra_args") or {})
    top_k, top_p = kwargs.get("top_k", getattr(args, "top_k", None)), kwargs.get("top_p", getattr(args, "top_p", None))
    fix = ("pass GRPOConfig(generation_kwargs=hf_sparsemax.vllm_generation_kwargs(model)) (the same for "
           "RLOOConfig), or use_vllm=False")
    if mode == "server":
        if KEY not in extra:
            if trained is not None and engine_samples(trained, top_k, top_p) and not any(
                    k.startswith(OPTION_PREFIX) for k in extra):
                return None  # vLLM's own top-k / top-p sample it, whatever the server's folder
            return (f"{name} with use_vllm=True and vllm_mode='server' samples its rollouts from the folder the "
                    f"vLLM server loaded, which hf_sparsemax cannot see, while the patched loss trains "
                    f"{trained or 'softmax'}: {fix}; install hf-sparsemax in the server's environment")
        path, folder = None, None
    else:
        try:
            folder = trained_choice(folder_settings(path))
        except ValueError as error:
            return f"{name} with use_vllm=True loads {path!r} into vLLM, which refuses it: {error}"
    try:
        sampled = request_choice(folder, extra)
    except ValueError as error:
        return f"{name} with use_vllm=True: generation_kwargs['extra_args'] is refused by hf_sparsemax: {error}"
    if same_distribution(sampled, trained):
        return None
    if sampled is None and trained is not None and engine_samples(trained, top_k, top_p):
        return None  # a top-k / top-p sparse softmax that vLLM's own top_k / top_p (TRL's config) sample exactly
    source = "its generation_kwargs' extra_args" if KEY in extra else f"the folder it loads, {path!r}"
    return (f"{name} with use_vllm=True would sample its rollouts with vLLM from {sampled or 'softmax'} (from "
            f"{source}) while the patched loss trains {trained or 'softmax'}: {fix}")
