"""The fused-forward swap (``loss_options={"fused": True}``): a causal LM's training loss from its hidden states.

In training mode with ``labels`` the instance ``forward`` runs the base model,
shifts the labels as transformers does and returns
``CausalLMOutputWithPast(loss=fused_head_loss(...), logits=None)``: the
``[tokens, vocab]`` logits are never formed. The family's head transform
(logit scale, soft-capping) comes from
:data:`~hf_sparsemax.losses.fused_heads.HEAD_TRANSFORMS`, its values read at each
call. In eval mode, without labels (``generate``), or when the head is not a
plain ``nn.Linear`` (e.g. a LoRA adapter on ``lm_head``) the class's forward
runs unchanged, with its (unfused, equal) patched loss.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

from torch import nn

from .._model import base_model, model_task, remove_instance_method, set_instance_method
from ..losses.fused import fused_head_loss
from ..losses.fused_heads import head_transform, head_values, router_refusal
from .protocol import PatchRequest

TAG = "hf_sparsemax_fused"


def check_fusable(model) -> None:
    """A causal LM whose forward is ``base model -> lm_head -> a known head transform`` (see :mod:`.fused_heads`)."""
    params = inspect.signature(type(model).forward).parameters
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if (model_task(model) != "causal_lm" or "logits_to_keep" not in params or "labels" not in params
            or not isinstance(head, nn.Linear) or not hasattr(model, model.base_model_prefix)):
        raise ValueError(
            f"loss_options fused=True needs a causal LM whose forward runs its base model then an nn.Linear lm_head "
            f"(with logits_to_keep, as LlamaForCausalLM); {type(model).__name__} is not one: drop fused"
        )
    head_transform(model)


class FusedForwardPlan(NamedTuple):
    """A validated fused forward: the loss name and its mapping options (``fused`` left out)."""

    loss: str
    options: dict[str, Any]


def install_fused_forward(model, loss: str, options: dict[str, Any]) -> None:
    """Make ``model.forward`` (an instance attribute) compute the training loss from hidden states (module doc)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = type(model).forward
    signature = inspect.signature(original)
    transform = head_transform(model)

    def forward(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        labels = arguments.get("labels")
        head = self.get_output_embeddings()
        if labels is None or not self.training or type(head) is not nn.Linear:
            return original(self, *args, **kwargs)
        inputs = {k: v for k, v in arguments.items() if k not in ("self", "labels", "logits_to_keep", "kwargs")}
        router = inputs.get("output_router_logits")
        if transform.router_aux_loss and (getattr(self.config, "output_router_logits", False) if router is None
                                          else router):
            raise router_refusal(self)  # the forward would add a load-balancing loss the fused path leaves out
        values = head_values(self, transform)
        extra = dict(arguments.get("kwargs", {}))
        num_items_in_batch = extra.pop("num_items_in_batch", None)
        shift_labels = extra.pop("shift_labels", None)
        outputs = getattr(self, self.base_model_prefix)(**inputs, **extra)
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        hidden = outputs[0]
        loss_value = fused_head_loss(
            hidden, head.weight, shift_labels.to(hidden.device), loss, bias=head.bias, softcap=values.softcap,
            logit_scale=values.scale, num_items_in_batch=num_items_in_batch, **options,
        )
        return CausalLMOutputWithPast(loss=loss_value, logits=None, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)

    forward.__signature__ = inspect.signature(original)
    forward.__doc__ = original.__doc__
    set_instance_method(model, "forward", forward, TAG)


class FusedForwardSwap:
    """``model.forward`` (an instance attribute) computes the fused head loss in training."""

    name = "fused_forward"

    def plan(self, model, request: PatchRequest) -> FusedForwardPlan | None:
        settings = request.settings
        if not settings.loss_options.get("fused", False):
            return None
        check_fusable(base_model(model))
        return FusedForwardPlan(settings.loss, {k: v for k, v in settings.loss_options.items() if k != "fused"})

    def apply(self, model, plan: FusedForwardPlan) -> None:
        install_fused_forward(base_model(model), plan.loss, plan.options)

    def remove(self, model) -> None:
        remove_instance_method(base_model(model), "forward", TAG)
