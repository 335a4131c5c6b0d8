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

Torch only: neither vLLM nor TRL is imported.
"""

from __future__ import annotations

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

    Raises ``ValueError`` for a model with sparse attention: vLLM's attention kernels compute softmax, so
    its rollouts would come from another model (train it with ``use_vllm=False``).
    """
    settings = SparseSettings.from_config(model.config)
    refuse_attention(settings)
    kwargs = dict(generation_kwargs or {})
    kept = {key: value for key, value in dict(kwargs.get("extra_args") or {}).items()
            if key != KEY and not key.startswith(OPTION_PREFIX)}
    kwargs["extra_args"] = {**kept, **extra_args(trained_choice(settings))}
    return kwargs


def refuse_attention(settings: SparseSettings | None) -> None:
    if settings is not None and settings.attention_options is not None:
        raise ValueError(
            f"this model trains {settings.attn} attention (hf_sparsemax), and vLLM's attention kernels compute "
            "softmax: its rollouts would come from another model; use use_vllm=False (rollouts from the patched "
            "model's generate)"
        )


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
    ``generation_kwargs`` (its ``extra_args``, ``top_k``, ``top_p``), ``top_k``, ``top_p``; and in colocate
    mode the folder vLLM loads, ``model.name_or_path``.
    """
    args = getattr(trainer, "args", None)
    if not getattr(args, "use_vllm", False):
        return None
    settings = SparseSettings.from_config(model.config)
    name = type(trainer).__name__
    try:
        refuse_attention(settings)
    except ValueError as error:
        return f"{name} with use_vllm=True: {error}"
    trained = trained_choice(settings)
    kwargs = dict(getattr(args, "generation_kwargs", None) or {})
    extra = dict(kwargs.get("extra_args") or {})
    top_k, top_p = kwargs.get("top_k", getattr(args, "top_k", None)), kwargs.get("top_p", getattr(args, "top_p", None))
    mode = getattr(args, "vllm_mode", "colocate")
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
        path = getattr(getattr(trainer, "model", None), "name_or_path", None) or getattr(model, "name_or_path", None)
        try:
            saved = folder_settings(path)
            refuse_attention(saved)  # vLLM itself would refuse that folder
            folder = trained_choice(saved)
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
