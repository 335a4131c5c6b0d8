"""Refuse trainer settings that would replace a patched loss by the trainer's own.

A patched model computes its sparse loss in ``model.loss_function`` (or the
fused forward, or the token outputs TRL asks for). Two trainer settings route
around it without a word:

- ``label_smoothing_factor > 0`` (transformers' ``Trainer`` and TRL's
  ``SFTTrainer``, without ``compute_loss_func``): the trainer pops the labels,
  runs the model without them and trains dense label-smoothed cross-entropy
  on the logits;
- TRL's ``loss_type="dft"``: each token's loss ``-log_probs_t`` is weighted by
  ``exp(log_probs_t)``. Under a likelihood loss (``sparse_softmax``,
  ``taylor_softmax``, ``perturb_max``) that weight is the trained
  distribution's ``p_t``, as DFT means it; under a Fenchel-Young loss
  ``exp(-loss_t)`` is no probability, so DFT is refused there;
- TRL's preference and RL trainers (DPO, KTO, GRPO, RLOO: every TRL trainer but
  ``SFTTrainer``) read the ``log_probs`` a patched model answers with as the
  policy's ``log pi(y_t)``. Under a likelihood loss ``-loss_t`` is that (the
  trained distribution's ``log p_t``); under a Fenchel-Young loss it is no
  log-probability, and under AM-softmax the target's margin makes it no
  distribution's, so those trainers are refused there. Where one of them
  runs the model in training without labels and without that request (ORPO,
  CPO, GKD, ... in ``trl.experimental``), it computes its own objective from
  the logits under softmax (ORPO's NLL term is dense cross-entropy): refused
  under every patched loss.

One more setting routes around the distribution the loss trains, rather than the loss: TRL's online trainers with
``use_vllm=True`` draw their rollouts from vLLM, which samples plain softmax unless hf_sparsemax's logits
processor knows the trained loss (from the folder vLLM loads, or from ``generation_kwargs``); such a trainer
is refused until it does (:mod:`hf_sparsemax.integrations.vllm.rollouts`, whose ``vllm_generation_kwargs(model)`` is
the fix), as is one under sparse attention that vLLM would not compute exactly (another folder's attention, server
mode, an alpha ramp).

The check runs in a forward pre-hook of the patched model, only on the calls
these trainers make (a training-mode forward with no ``labels``, or TRL's
``fused_lm_head=True`` request): it looks up the call stack for the
``Trainer.compute_loss`` (for the rollout check, also ``training_step``) that
made the call and reads its settings. Nothing of transformers or TRL is
imported or rebound.
"""

from __future__ import annotations

import functools
import sys

from typing import NamedTuple

import torch

from .._model import base_model
from ..mappings import registry
from ..swaps import PatchRequest
from ..swaps.loss_swap import loss_task
from .vllm.rollouts import rollout_refusal

HOOK_ATTR = "_hf_sparsemax_trainer_guard"
ROLLOUT_HOOK_ATTR = "_hf_sparsemax_rollout_guard"

STACK_DEPTH = 40  # frames searched above the model's pre-hook (wrappers: DDP, peft, accelerate's autocast)


def calling_trainer():
    """The transformers ``Trainer`` whose ``compute_loss`` (or an override of it) made this call, or None."""
    trainer, method = trainer_on_stack(sys._getframe(1))
    return trainer if method == "compute_loss" else None


def trainer_on_stack(frame, methods=("compute_loss", "training_step")):
    """The nearest transformers ``Trainer`` method of ``methods`` above ``frame``: ``(trainer, method name)``, or
    ``(None, None)``. ``training_step`` also covers what a trainer runs before ``compute_loss`` (TRL's online
    trainers generate and score their rollouts there)."""
    for _ in range(STACK_DEPTH):
        if frame is None:
            break
        if frame.f_code.co_name in methods:
            owner = frame.f_locals.get("self")
            if any(c.__name__ == "Trainer" and c.__module__ == "transformers.trainer" for c in type(owner).__mro__):
                return owner, frame.f_code.co_name
        frame = frame.f_back
    return None, None


def refusal(trainer, loss: str, loss_rule: str, asked_for_tokens: bool = True) -> str | None:
    """Why ``trainer`` would not train the patched ``loss``, or None (``asked_for_tokens``: TRL's request, else a
    training call without labels)."""
    if getattr(trainer, "label_smoother", None) is not None and getattr(trainer, "compute_loss_func", None) is None:
        return (f"label_smoothing_factor={trainer.args.label_smoothing_factor} makes the trainer compute dense "
                f"label-smoothed cross-entropy from the logits instead of the patched {loss!r} loss: set "
                "label_smoothing_factor=0")
    if getattr(trainer.args, "loss_type", None) == "dft" and loss_rule == "fenchel_young":
        return (f"TRL's loss_type='dft' weights each token by exp(log_probs), and the patched {loss!r} loss is a "
                "Fenchel-Young loss, whose exp(-loss) is no probability: use loss_type='nll', or a likelihood loss "
                "(sparse_softmax, taylor_softmax, perturb_max) for DFT")
    beyond_sft = trl_beyond_sft(trainer)
    if not asked_for_tokens and beyond_sft and getattr(trainer, "compute_loss_func", None) is None:
        return (f"{type(trainer).__name__} runs the model without labels and computes its own objective from the "
                f"logits under softmax, so the patched {loss!r} loss would not be trained: use SFTTrainer, or a TRL "
                "trainer that asks the model for its log-probabilities (DPO, KTO, GRPO, RLOO) with a likelihood loss")
    if loss_rule in ("fenchel_young", "margin") and beyond_sft:
        return (f"{type(trainer).__name__} reads log_probs as the policy's log-probabilities, and under the patched "
                f"{loss!r} loss the model answers with -loss_t, which is no log-probability ({loss_rule} loss): use "
                "a likelihood loss (sparse_softmax, taylor_softmax, perturb_max), whose -loss_t is log p_t, or "
                "SFTTrainer")
    return None


def trl_beyond_sft(trainer) -> bool:
    """Whether ``trainer`` is one of TRL's trainers other than ``SFTTrainer`` (by class module, no import): those
    read ``log_probs`` as the policy's, or compute their own objective from the logits."""
    classes = type(trainer).__mro__
    from_trl = any(c.__module__.split(".")[0] == "trl" for c in classes)
    return from_trl and not any(c.__name__ == "SFTTrainer" and c.__module__.startswith("trl") for c in classes)


def check_trainer(module, kwargs: dict, loss: str | None, loss_rule: str | None) -> None:
    """Raise ``ValueError`` when a trainer is about to train something else than the patched loss (``loss=None``:
    a model with sparse attention and no sparse loss; only its vLLM rollouts are checked)."""
    asked_for_tokens = bool(kwargs.get("fused_lm_head"))
    trains_without_labels = module.training and torch.is_grad_enabled() and kwargs.get("labels") is None
    if not (asked_for_tokens or trains_without_labels):
        return
    trainer, method = trainer_on_stack(sys._getframe(1))
    if trainer is None:
        return
    reason = None
    if loss is not None and method == "compute_loss":
        reason = refusal(trainer, loss, loss_rule, asked_for_tokens)
    if reason is None:
        reason = rollout_refusal(trainer, module)
    if reason is not None:
        raise ValueError(reason)


def install_trainer_guard(model, loss: str, loss_rule: str) -> None:
    """Check every call of ``model`` for a trainer that would bypass ``loss`` (undone by :func:`remove_trainer_guard`).

    Registered before any other pre-hook of this library (it must see ``fused_lm_head`` before it is translated).
    """
    install_hook(model, HOOK_ATTR, loss, loss_rule)


def remove_trainer_guard(model) -> None:
    remove_hook(model, HOOK_ATTR)


def install_rollout_guard(model) -> None:
    """For a model with sparse attention: refuse TRL's vLLM rollouts (vLLM's attention kernels compute softmax), also
    when no sparse loss (whose guard checks them too) is patched. Undone by :func:`remove_rollout_guard`."""
    install_hook(model, ROLLOUT_HOOK_ATTR, None, None)


def remove_rollout_guard(model) -> None:
    remove_hook(model, ROLLOUT_HOOK_ATTR)


def install_hook(model, attr: str, loss: str | None, loss_rule: str | None) -> None:
    """The guard's pre-hook on ``model``, first of its pre-hooks, its handle kept as ``attr`` (replacing one there)."""
    remove_hook(model, attr)
    guard = functools.partial(pre_hook, loss=loss, loss_rule=loss_rule)
    setattr(model, attr, model.register_forward_pre_hook(guard, with_kwargs=True, prepend=True))


def remove_hook(model, attr: str) -> None:
    handle = vars(model).pop(attr, None)
    if handle is not None:
        handle.remove()


def pre_hook(module, args, kwargs, loss: str | None, loss_rule: str | None):
    check_trainer(module, kwargs, loss, loss_rule)
    return None


class TrainerGuardPlan(NamedTuple):
    """``loss`` / ``loss_rule``: the patched loss the trainers must train (None: no sparse loss swapped);
    ``rollouts``: the attention is sparse, which vLLM's rollouts would not compute."""

    loss: str | None
    loss_rule: str | None
    rollouts: bool


class TrainerGuardSwap:
    """The guards of this module on a patched model: its loss (when the loss swap applies), its rollouts (sparse
    attention)."""

    name = "trainer_guard"

    def plan(self, model, request: PatchRequest) -> TrainerGuardPlan | None:
        settings = request.settings
        loss = settings.loss if loss_task(base_model(model), settings) is not None else None
        rollouts = settings.attention_options is not None
        if loss is None and not rollouts:
            return None
        return TrainerGuardPlan(loss, registry.get(loss).loss_rule if loss else None, rollouts)

    def apply(self, model, plan: TrainerGuardPlan) -> None:
        inner = base_model(model)
        if plan.loss is not None:
            install_trainer_guard(inner, plan.loss, plan.loss_rule)
        if plan.rollouts:
            install_rollout_guard(inner)

    def remove(self, model) -> None:
        inner = base_model(model)
        remove_trainer_guard(inner)
        remove_rollout_guard(inner)
