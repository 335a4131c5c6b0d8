"""The loss swap: ``model.loss_function`` becomes the chosen loss, with transformers' calling conventions.

It uses transformers' own hook, ``model.loss_function`` (a setter exists),
never a new ``loss_type`` nor a replaced ``LOSS_MAPPING`` entry: Trainer's
``num_items_in_batch`` counting keeps recognising the causal-LM label shift.
:func:`compute_loss_func` gives the same loss to ``Trainer(compute_loss_func=...)``
for heads that hard-code cross-entropy.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

from .._model import base_model, loss_type, model_task, routes_loss_function
from ..losses.names import make_loss
from ..mappings import registry
from ..settings import SparseSettings
from .protocol import PatchRequest

TASKS = ("causal_lm", "sequence_classification", "token_classification")
LOSS_TYPE_ATTR = "_hf_sparsemax_loss_type"  # the loss_type a model had before the swap named transformers' fallback


def reduce_items(loss_sum: torch.Tensor, num_items_in_batch, fallback_count: torch.Tensor) -> torch.Tensor:
    """``sum / num_items_in_batch`` (Trainer's exact gradient accumulation) or the mean over counted items."""
    if num_items_in_batch is None:
        return loss_sum / fallback_count.clamp_min(1)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss_sum.device)
    return loss_sum / num_items_in_batch


def head_classes(model) -> int | None:
    """Number of classes the head scores: the vocabulary of an LM head, else ``num_labels``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear):
        return head.out_features
    return getattr(model.config, "num_labels", None)


def sparse_loss(settings: SparseSettings) -> bool:
    """Whether the settings ask for a loss other than the model's own."""
    return settings.loss not in (None, "cross_entropy")


def loss_task(inner, settings: SparseSettings) -> str | None:
    """The head task the sparse loss is computed for (``None``: the model's own loss); ``ValueError`` if none."""
    if not sparse_loss(settings):
        return None
    if registry.get(settings.loss).head == "cosine":
        return "sequence_classification"  # the cosine head swap checks the head (and takes over hard-coded losses)
    return model_task(inner)


def swaps_loss(model, loss: str | None) -> bool:
    """Whether ``patch_model(model, loss=loss)`` can swap the loss (else use :func:`compute_loss_func`)."""
    if loss in (None, "cross_entropy") or registry.get(loss).head == "cosine":
        return True
    return routes_loss_function(base_model(model))


def task_loss(task: str, loss: Callable, ignore_index: int = -100) -> Callable[..., torch.Tensor]:
    """A ``loss_function`` with transformers' calling conventions for one head type."""

    def summed(logits, labels, num_items_in_batch, ignore):
        labels = labels.reshape(-1).to(logits.device)
        total = loss(logits.reshape(-1, logits.shape[-1]), labels, ignore_index=ignore, reduction="sum")
        return reduce_items(total, num_items_in_batch, (labels != ignore).sum())

    if task == "causal_lm":

        def causal_lm_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=ignore_index,
                           shift_labels=None, **kwargs):
            if shift_labels is None:
                shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
            return summed(logits, shift_labels, num_items_in_batch, ignore_index)

        return causal_lm_loss

    if task == "sequence_classification":

        def sequence_classification_loss(logits=None, labels=None, pooled_logits=None, config=None,
                                         num_items_in_batch=None, ignore_index=ignore_index, **kwargs):
            scores = pooled_logits if pooled_logits is not None else logits
            problem = getattr(config, "problem_type", None)
            if problem not in (None, "single_label_classification") or scores.shape[-1] < 2 or labels.is_floating_point():
                raise ValueError(
                    f"sparse losses need single-label classification with >= 2 labels (got problem_type={problem!r}, "
                    f"{scores.shape[-1]} labels)"
                )
            return summed(scores, labels, num_items_in_batch, ignore_index)

        return sequence_classification_loss

    def token_classification_loss(logits, labels, config=None, num_items_in_batch=None, vocab_size=None,
                                  ignore_index=ignore_index, **kwargs):
        return summed(logits, labels, num_items_in_batch, ignore_index)

    return token_classification_loss


def settings_loss(settings: SparseSettings, task: str) -> Callable[..., torch.Tensor]:
    """The ``loss_function`` of the settings' sparse loss for a head of ``task``."""
    return task_loss(task, make_loss(settings.loss, **settings.loss_options))


class LossPlan(NamedTuple):
    """A validated loss swap: the head's task, the ``loss_function`` it gets, the loss's name and loss rule."""

    task: str
    loss_function: Callable[..., torch.Tensor]
    loss: str
    loss_rule: str


class LossSwap:
    """``model.loss_function`` (an instance attribute) computes the sparse loss.

    Trainer settings that would train another loss (label smoothing, TRL's DFT on a
    Fenchel-Young loss) are refused by :mod:`hf_sparsemax.integrations.trainer`'s guard.
    """

    name = "loss"

    def plan(self, model, request: PatchRequest) -> LossPlan | None:
        inner, settings = base_model(model), request.settings
        task = loss_task(inner, settings)
        if task is None:
            return None
        entry = registry.get(settings.loss)
        registry.check_head(entry, task, head_classes(inner))
        return LossPlan(task, settings_loss(settings, task), entry.name, entry.loss_rule)

    def apply(self, model, plan: LossPlan) -> None:
        inner = base_model(model)
        inner.loss_function = plan.loss_function
        if plan.task == "causal_lm" and getattr(inner, "loss_type", None) != loss_type(inner):
            # transformers' fallback (loss_type None: GPT-2, BERT's LM head) made explicit, so that Trainer counts
            # num_items_in_batch over the shifted labels the loss trains (its check: LOSS_MAPPING.get(loss_type))
            setattr(inner, LOSS_TYPE_ATTR, inner.loss_type)
            inner.loss_type = loss_type(inner)

    def remove(self, model) -> None:
        inner = base_model(model)
        vars(inner).pop("_loss_function", None)
        if LOSS_TYPE_ATTR in vars(inner):
            inner.loss_type = vars(inner).pop(LOSS_TYPE_ATTR)


def compute_loss_func(loss: str, task: str = "causal_lm", ignore_index: int = -100, **loss_options):
    """A ``Trainer(compute_loss_func=...)`` callable for heads that hard-code cross-entropy.

    Called by Trainer as ``fn(outputs, labels, num_items_in_batch=...)`` with
    unshifted labels; returns ``sum / num_items_in_batch`` so gradient
    accumulation is exact. ``task``: ``"causal_lm"`` (labels shifted),
    ``"sequence_classification"`` or ``"token_classification"``.
    """
    if task not in TASKS:
        raise ValueError(f"task must be causal_lm, sequence_classification or token_classification, got {task!r}")
    loss_fn = make_loss(loss, **loss_options)
    registry.check_head(registry.get(loss), task)
    head_loss = task_loss(task, loss_fn, ignore_index)

    def compute(outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if task == "sequence_classification":
            return head_loss(logits=logits, labels=labels, num_items_in_batch=num_items_in_batch)
        return head_loss(logits, labels, num_items_in_batch=num_items_in_batch)

    compute.__name__ = f"{loss}_{task}_loss"
    return compute
