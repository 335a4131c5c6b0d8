"""Which causal-LM heads the fused loss reproduces, and how: the per-family head transforms, as data.

A causal LM's forward turns the last hidden states ``h`` into logits with its
``lm_head`` and then, in some families, a fixed transform:

    logits = c * tanh(s * lm_head(h) / c)   (c: final soft-capping; no tanh without it)

with ``s`` a multiplier (Cohere's ``logit_scale``, Falcon-H1's
``lm_head_multiplier``) or a divisor (Granite's ``logits_scaling``). The fused
head loss (:func:`hf_sparsemax.fused_head_loss`) recomputes the logits from
``h`` chunk by chunk, so it must apply the same transform: a family is fused
only if it is in :data:`HEAD_TRANSFORMS`, the table below, which was read off
each family's ``*ForCausalLM.forward`` in transformers 5.23 and re-read on 5.24 (every entry
is tested fused == unfused). Anything else (a family not listed, a subclass
with its own ``forward``, a mixture-of-experts model asked for its router's
load-balancing loss, a scale held in a tensor) is refused with ``ValueError``
rather than trained on a silently different objective.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import typing


@dataclasses.dataclass(frozen=True)
class HeadTransform:
    """How one family derives its logits from ``lm_head(h)``; each field is a dotted attribute path on the model.

    ``multiply``: logits times that value; ``divide``: logits divided by it
    (applied as a multiplication by the reciprocal: equal up to one float
    rounding, exactly equal for powers of two such as Granite's 8 and 16);
    ``softcap``: final ``c * tanh(x / c)`` (its value may be None: no capping).
    ``router_aux_loss``: the forward adds ``router_aux_loss_coef`` times a
    load-balancing loss when ``output_router_logits`` is on (not fused: refused).
    """

    multiply: str | None = None
    divide: str | None = None
    softcap: str | None = None
    router_aux_loss: bool = False


PLAIN = HeadTransform()  # logits = lm_head(h)
GEMMA_CAP = HeadTransform(softcap="config.final_logit_softcapping")
MOE = HeadTransform(router_aux_loss=True)

HEAD_TRANSFORMS: dict[str, HeadTransform] = {  # config.model_type -> its causal LM's head transform
    "llama": PLAIN,
    "mistral": PLAIN,
    "qwen2": PLAIN,
    "qwen3": PLAIN,
    "phi3": PLAIN,
    "smollm3": PLAIN,
    "olmo2": PLAIN,
    "starcoder2": PLAIN,
    "gemma": PLAIN,
    "gpt_neox": PLAIN,
    "opt": PLAIN,
    "gptj": PLAIN,  # lm_head with a bias
    "falcon": PLAIN,
    "gemma2": GEMMA_CAP,
    "gemma3_text": GEMMA_CAP,
    "granite": HeadTransform(divide="config.logits_scaling"),
    "granitemoe": HeadTransform(divide="config.logits_scaling", router_aux_loss=True),
    "cohere": HeadTransform(multiply="logit_scale"),
    "cohere2": HeadTransform(multiply="logit_scale"),
    "falcon_h1": HeadTransform(multiply="model.lm_head_multiplier"),
    "mixtral": MOE,
    "qwen3_moe": MOE,
    "gpt_oss": MOE,
}


def causal_lm_class(model_type: str):
    """The transformers ``*ForCausalLM`` class of a model type (the class whose forward the table describes)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def head_transform(model) -> HeadTransform:
    """The table entry for ``model`` (a transformers causal LM), after checking its values; else ``ValueError``."""
    model_type = getattr(model.config, "model_type", None)
    transform = HEAD_TRANSFORMS.get(model_type)
    if transform is None:
        raise ValueError(
            f"loss_options fused=True: the output head of {type(model).__name__} (model_type={model_type!r}) is not "
            f"known to the fused loss, which could silently train another objective; drop fused (the unfused loss "
            f"is exact) or use one of {sorted(HEAD_TRANSFORMS)}"
        )
    family_forward = inspect.unwrap(causal_lm_class(model_type).forward)
    if inspect.unwrap(type(model).forward) is not family_forward:
        raise ValueError(
            f"loss_options fused=True: {type(model).__name__} has its own forward, not that of "
            f"{causal_lm_class(model_type).__name__} which the fused loss reproduces; drop fused"
        )
    head_values(model, transform)
    if transform.router_aux_loss and getattr(model.config, "output_router_logits", False):
        raise router_refusal(model)
    return transform


def router_refusal(model) -> ValueError:
    return ValueError(
        f"loss_options fused=True leaves out the router load-balancing loss that {type(model).__name__} adds with "
        "output_router_logits=True: set config.output_router_logits=False, or drop fused"
    )


class HeadValues(typing.NamedTuple):
    """The head transform's values for :func:`~hf_sparsemax.fused_head_loss` (None: not applied)."""

    scale: float | None
    softcap: float | None


def head_values(model, transform: HeadTransform) -> HeadValues:
    """``logit_scale`` and ``softcap`` for :func:`~hf_sparsemax.fused_head_loss`, read from the model now."""
    scale = None
    for path, invert in ((transform.multiply, False), (transform.divide, True)):
        if path is not None:
            value = positive_number(model, path)
            scale = 1.0 / value if invert else value
    softcap = None
    if transform.softcap is not None and attribute(model, transform.softcap) is not None:
        softcap = positive_number(model, transform.softcap)
    return HeadValues(scale, softcap)


def attribute(model, path: str):
    value = model
    for name in path.split("."):
        value = getattr(value, name)
    return value


def positive_number(model, path: str) -> float:
    value = attribute(model, path)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"loss_options fused=True needs model.{path} to be a positive finite number (a tensor or a "
                         f"learned value is not supported), got {value!r}; drop fused")
    return float(value)
