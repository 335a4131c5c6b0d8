"""AM-softmax's cosine head: a sequence-classification head that scores classes by cosine.

The loss and the distribution are :mod:`hf_sparsemax.mappings.margin`'s. The head swap is
instance-level and reversible: the head's ``nn.Linear`` keeps its parameters (same state-dict keys) and gets an instance
``forward`` computing the cosines; :func:`remove_cosine_head` deletes it. The
head of each family is data (``COSINE_HEADS``: the module whose output is
the logits, fed the pooled feature by the model's own forward), so the cosine
logits follow exactly the plain head's pooling path; other families are
refused. Heads that hard-code cross-entropy (BERT, RoBERTa, ...) also get an
instance ``forward`` on the model that computes this loss from ``labels``.
"""

from __future__ import annotations

import inspect
import types

import torch
from torch import nn

# model_type -> the nn.Linear (dotted path) that turns the pooled feature into the class logits
COSINE_HEADS = {
    "bert": "classifier",
    "roberta": "classifier.out_proj",
    "distilbert": "classifier",
    "modernbert": "classifier",
    "llama": "score",
    "mistral": "score",
    "qwen2": "score",
    "gpt2": "score",
}
LOSS_FORWARD_TAG = "hf_sparsemax_am_softmax"


def cosine_forward(self: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """``cos(hidden, weight_c)`` for every class ``c`` (the bias is not used)."""
    weight = self.weight.to(hidden.dtype)
    return nn.functional.linear(nn.functional.normalize(hidden, dim=-1), nn.functional.normalize(weight, dim=-1))


def head_linears(model) -> list[nn.Linear]:
    """The ``nn.Linear`` modules of a sequence-classification model's head, or a ``ValueError`` saying why not."""
    family = getattr(model.config, "model_type", None)
    path = COSINE_HEADS.get(family)
    if path is None or getattr(model, "loss_type", None) != "ForSequenceClassification":
        raise ValueError(
            f"loss='am_softmax' turns a sequence-classification head into a cosine head; {type(model).__name__} "
            f"is not one of the families whose head is known ({sorted(COSINE_HEADS)}, *ForSequenceClassification)"
        )
    problem = getattr(model.config, "problem_type", None)
    if problem not in (None, "single_label_classification") or model.config.num_labels < 2:
        raise ValueError(f"am_softmax needs single-label classification with >= 2 labels (got problem_type="
                         f"{problem!r}, {model.config.num_labels} labels)")
    head = model.get_submodule(path)
    # a peft ModulesToSaveWrapper holds the original head and its trainable copies: every copy becomes cosine
    linears = [head] if isinstance(head, nn.Linear) else [m for m in head.modules() if isinstance(m, nn.Linear)]
    if not linears or not all(m.out_features == model.config.num_labels for m in linears) or (
            not isinstance(head, nn.Linear) and type(head).__name__ != "ModulesToSaveWrapper"):
        raise ValueError(f"the {family} head {path!r} is {type(head).__name__}, not an nn.Linear to "
                         f"{model.config.num_labels} labels: it cannot become a cosine head")
    return linears


def install_cosine_head(model, loss_function=None) -> None:
    """Make the head compute cosines; with ``loss_function``, also compute the loss from ``labels``.

    ``loss_function`` is for heads that hard-code cross-entropy: the model's
    forward then runs without ``labels`` and the loss is computed from its
    (cosine) logits with transformers' ``loss_function`` conventions.
    """
    for linear in head_linears(model):
        linear.forward = types.MethodType(cosine_forward, linear)
    if loss_function is not None:
        install_loss_forward(model, loss_function)


def remove_cosine_head(model) -> None:
    """Undo :func:`install_cosine_head` (a no-op on a model without one)."""
    for module in model.modules():
        if getattr(vars(module).get("forward"), "__func__", None) is cosine_forward:
            del module.forward
    if getattr(vars(model).get("forward"), LOSS_FORWARD_TAG, False):
        del model.forward


def install_loss_forward(model, loss_function) -> None:
    """An instance ``forward`` that runs the model without ``labels`` and returns ``loss_function``'s loss."""
    original = type(model).forward
    signature = inspect.signature(original)

    def forward(*args, **kwargs):
        arguments = signature.bind(model, *args, **kwargs).arguments
        labels = arguments.pop("labels", None)
        extra = dict(arguments.pop("kwargs", {}))
        num_items_in_batch = extra.pop("num_items_in_batch", None)
        arguments.pop("self", None)
        outputs = original(model, **arguments, **extra)
        if labels is None:
            return outputs
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        loss = loss_function(logits=logits, labels=labels, config=model.config, num_items_in_batch=num_items_in_batch)
        if isinstance(outputs, dict):
            return type(outputs)(loss=loss, **{k: v for k, v in outputs.items() if k != "loss"})
        return (loss, *outputs)

    forward.__signature__ = inspect.signature(original.__get__(model))
    forward.__doc__ = original.__doc__
    setattr(forward, LOSS_FORWARD_TAG, True)
    model.forward = forward
