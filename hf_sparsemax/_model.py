"""What the swap points need to know about a transformers model, and how they shadow its methods.

``base_model`` unwraps a peft ``PeftModel``; ``model_task`` reads the head's
task from transformers' ``loss_type`` (as ``model.loss_function`` reads it: :func:`loss_type`); ``set_instance_method`` shadows a class
method on one instance only, tagged so that it can be removed again (every
swap of this library is undoable). Kept apart from ``patch.py`` and
``generation.py`` so that neither has to import the other.
"""

from __future__ import annotations

import functools
import inspect
import types

from torch import nn

TASKS = {  # transformers loss_type -> task of the head
    "ForCausalLM": "causal_lm",
    "ForConditionalGeneration": "causal_lm",
    "ForSequenceClassification": "sequence_classification",
    "ForTokenClassification": "token_classification",
    "ForMaskedLM": "token_classification",
}


def base_model(model) -> nn.Module:
    """The transformers model inside a peft ``PeftModel`` (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    inner = get_base() if callable(get_base) else model
    if not hasattr(inner, "config") or not hasattr(inner, "loss_type"):
        raise ValueError(f"expected a transformers PreTrainedModel or a peft PeftModel, got {type(model).__name__}")
    return inner


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward takes its cache by (a transformers model, peft unwrapped): ``cache`` from
    transformers 5.24 (which deprecates ``past_key_values``), ``past_key_values`` before."""
    return _cache_keyword(type(base_model(model)))


@functools.lru_cache(maxsize=None)
def _cache_keyword(cls: type) -> str:
    """:func:`cache_keyword` of a model class (read once a class: it is asked at every decoding step)."""
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def loss_type(model) -> str:
    """The loss type whose loss ``model.loss_function`` computes: ``model.loss_type``, or ``"ForCausalLM"`` where
    that is None or unknown to transformers (its own fallback: GPT-2's ``GPT2LMHeadModel``, BERT's
    ``BertLMHeadModel``, ...)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    value = getattr(model, "loss_type", None)
    return value if value in LOSS_MAPPING else "ForCausalLM"


def model_task(model) -> str:
    task = TASKS.get(loss_type(model))
    if task is None or not routes_loss_function(model):
        raise ValueError(
            f"{type(model).__name__} (loss_type={getattr(model, 'loss_type', None)!r}) does not route its loss "
            f"through model.loss_function for a supported head ({sorted(set(TASKS.values()))}); for such models "
            "pass hf_sparsemax.compute_loss_func(...) to Trainer(compute_loss_func=...)"
        )
    return task


def routes_loss_function(model) -> bool:
    """Whether the model's forward calls ``self.loss_function`` (else it hard-codes its loss)."""
    forward = inspect.unwrap(type(model).forward)
    return "loss_function" in getattr(getattr(forward, "__code__", None), "co_names", ())


def set_instance_method(model, name: str, method, tag: str) -> None:
    """Shadow ``type(model).name`` by ``method(self, ...)`` on this instance only, marked ``tag`` for removal.

    ``method`` is bound to ``model`` (not closed over it), so ``copy.deepcopy(model)`` gives a copy whose
    method runs on the copy's own weights.
    """
    setattr(method, tag, True)
    setattr(model, name, types.MethodType(method, model))


def remove_instance_method(model, name: str, tag: str) -> None:
    """Undo :func:`set_instance_method` (the class's method shows through again)."""
    if getattr(vars(model).get(name), tag, False):
        delattr(model, name)
