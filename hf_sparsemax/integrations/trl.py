"""TRL's fused-head request, answered by a patched model with its own loss.

TRL's trainers wrap a causal LM's ``forward`` (``trl.trainer.utils.add_fused_lm_head``)
and call ``model(**batch, labels=labels, fused_lm_head=True)``. TRL's wrapper then
runs the backbone and computes ``log p_t`` under softmax itself, so a patched
``model.loss_function`` is never reached; ``SFTTrainer`` optimises

    loss = -sum_t log_probs_t / num_items_in_batch       (log_probs_t = 0 where the label is -100),

and logs the mean of ``entropy_t`` and of ``is_top1_t`` over the counted tokens.

A model patched with a sparse loss answers that request itself, so TRL trains
the patched loss with no step from the user:

- a forward pre-hook on this instance (``register_forward_pre_hook(with_kwargs=True)``)
  replaces ``fused_lm_head=True`` by a private keyword, which TRL's wrapper,
  seeing no ``fused_lm_head``, passes on to the forward it wraps;
- that forward (an instance attribute installed by ``patch_model`` and
  removed by ``unpatch_model``, like the fused forward) returns
  :class:`TokenLossOutput`, TRL's fields computed under the patched loss:

  ``log_probs_t = -loss_t``, the per-token patched loss (for ``sparse_softmax``
  with the target kept, ``log p_t`` of the sparse distribution), so TRL's loss is
  ``sum_t loss_t / num_items_in_batch``: exactly ``model(**batch, labels=...).loss``;
  ``entropy_t = -sum_i p_i log p_i`` of the trained distribution ``p`` (finite:
  ``0 log 0 = 0``); ``is_top1_t = [argmax_i p_i = t]``.

With ``loss_options={"fused": True}`` (and a plain ``nn.Linear`` head) the
loss, the entropies and the argmaxes come from one chunked pass of
:func:`~hf_sparsemax.losses.fused.SparseHeadLossFunction` over the hidden states (no
``[tokens, vocab]`` logits, no second pass over the head); the per-token values
are exact, and the gradient reaches the model through their sum (TRL's loss
weighs every token alike). Otherwise the model's forward gives the logits, the
losses are taken per token from them, and the entropies from the same
support routines (no full mapping over the vocabulary).

Nothing in TRL or transformers is rebound: the hook and the forward belong to
this model instance and are removed by ``unpatch_model``. trl need not be
installed. Other TRL trainers that send the same request (DPO, KTO, GRPO,
RLOO) receive the same fields and read ``log_probs`` as the policy's
``log pi(y_t)``: right under a likelihood loss, so they run there; under a
Fenchel-Young or AM-softmax loss they are refused (:mod:`~hf_sparsemax.integrations.trainer`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import NamedTuple

import torch
from torch import nn
from transformers.utils import ModelOutput

from .._model import base_model, remove_instance_method
from ..losses.fused import CHUNK_TOKENS, SparseHeadLossFunction, support_function
from ..losses.fused_heads import HeadValues, head_transform, head_values
from ..losses.names import loss_mapping, make_loss
from ..mappings.loss_functions import safe_target
from ..mappings import registry
from ..mappings._core import masked_below, work_dtype
from ..settings import SparseSettings
from ..swaps import PatchRequest
from ..swaps.loss_swap import loss_task

REQUEST = "_hf_sparsemax_token_outputs"  # the private keyword the pre-hook puts in place of fused_lm_head=True
HOOK_ATTR = "_hf_sparsemax_trl_hook"
TAG = "hf_sparsemax_token_outputs"
BELOW = "_hf_sparsemax_below"  # on the installed forward: the instance forward it shadows (None: the class's)


@dataclasses.dataclass
class TokenLossOutput(ModelOutput):
    """TRL's ``FusedCausalLMOutput`` fields under the patched loss; per-token fields are 0 where the label is -100.

    ``loss``: ``sum_t loss_t / num_items_in_batch`` (the counted tokens without it);
    ``log_probs``: ``-loss_t``; ``entropy``: Shannon entropy of the trained
    distribution ``p``; ``log_sum_sq_probs``: ``log sum_i p_i^2`` (DPO's WPO
    weight); ``mean_logits``: the mean of the model's logits over the vocabulary
    (TRL's ``logits/*`` metrics); ``is_top1``: whether the label is the most
    probable token; ``label_mask``: whether the label is counted; ``aux_loss``:
    the MoE load-balancing loss when router logits were requested. Shapes are
    ``[batch, seq_len - 1]`` (``[batch, seq_len]`` with ``shift_labels``); all but
    ``loss`` and ``log_probs`` carry no gradient.
    """

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def translate_request(module, args, kwargs):
    """Forward pre-hook: ``fused_lm_head=True`` -> the private keyword (TRL's wrapper passes it through)."""
    if not kwargs.get("fused_lm_head"):
        return None
    kwargs = {k: v for k, v in kwargs.items() if k != "fused_lm_head"}
    kwargs[REQUEST] = True
    return args, kwargs


def install_token_outputs(model) -> None:
    """Let ``model`` answer TRL's ``fused_lm_head=True`` with its patched loss (undone by :func:`remove_token_outputs`).

    The forward is bound to the model (``copy.deepcopy`` rebinds it to the copy)
    and keeps the instance forward it shadows (the fused one, or TRL's wrapper
    when patching after the trainer was built) to call on plain requests.
    """
    below = vars(model).get("forward")

    def forward(self, *args, **kwargs):
        if below is None:  # a partial, not a bound method: dynamo rebuilds that as ``self.forward`` (this wrapper)
            call_below = functools.partial(type(self).forward, self)
        elif isinstance(below, types.MethodType) and below.__self__ is model:  # our fused forward: on self's weights
            call_below = types.MethodType(below.__func__, self)
        else:
            call_below = below
        if kwargs.pop(REQUEST, False):
            return token_outputs(self, call_below, args, kwargs)
        return call_below(*args, **kwargs)

    forward.__signature__ = inspect.signature(type(model).forward)
    forward.__doc__ = type(model).forward.__doc__
    setattr(forward, TAG, True)
    setattr(forward, BELOW, below)
    model.forward = types.MethodType(forward, model)
    setattr(model, HOOK_ATTR, model.register_forward_pre_hook(translate_request, with_kwargs=True))


def remove_token_outputs(model) -> None:
    handle = vars(model).pop(HOOK_ATTR, None)
    if handle is not None:
        handle.remove()
    current = vars(model).get("forward")
    if getattr(current, TAG, False):
        below = getattr(current, BELOW)
        remove_instance_method(model, "forward", TAG)
        if below is not None:
            model.forward = below


def token_outputs(model, forward, args, kwargs) -> TokenLossOutput:
    """The patched loss per token, its distribution's entropy and top-1 hits, for TRL's fused-head request."""
    settings = SparseSettings.from_config(model.config)
    if settings is None or settings.loss in (None, "cross_entropy"):
        raise ValueError("fused_lm_head=True reached hf_sparsemax on a model without a sparse loss; "
                         "re-run hf_sparsemax.patch_model(model, loss=...)")
    labels, shift_labels = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    if labels is None and shift_labels is None:
        raise ValueError("fused_lm_head=True needs labels (or shift_labels)")
    target = shift_labels if shift_labels is not None else labels[..., 1:]
    kwargs["use_cache"] = False
    options = {k: v for k, v in settings.loss_options.items() if k != "fused"}
    head = model.get_output_embeddings()
    aux_loss = None
    fused = settings.loss_options.get("fused") and type(head) is nn.Linear
    if kwargs.get("output_router_logits", getattr(model.config, "output_router_logits", False)):
        fused = False  # the model's own forward adds the router load-balancing loss
    if fused:
        transform = head_transform(model)
        hidden = backbone_hidden(model, args, kwargs)
        hidden = hidden if shift_labels is not None else hidden[:, :-1]
        target = target.to(hidden.device)
        mask = target != -100
        stats = fused_token_stats(hidden, head, target, settings.loss, options, head_values(model, transform))
        count, total = mask.sum().clamp_min(1), stats.total
        # value -loss_t per token; gradient of the summed loss, spread evenly (TRL sums the tokens)
        log_probs = -(scatter(stats.losses, mask) + (total - total.detach()) * mask / count)
    else:
        outputs = forward(*args, **kwargs)
        logits = outputs.logits if shift_labels is not None else outputs.logits[:, :-1]
        target = target.to(logits.device)
        mask = target != -100
        log_probs = -make_loss(settings.loss, **options)(logits, target, reduction="none")
        stats = dense_token_stats(logits[mask], target[mask], settings.loss, options)
        aux_loss = getattr(outputs, "aux_loss", None)
    denominator = mask.sum().clamp_min(1) if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(denominator):
        denominator = denominator.to(log_probs.device)
    loss = -log_probs.sum() / denominator
    if aux_loss is not None:
        loss = loss + getattr(model.config, "router_aux_loss_coef", 0.0) * aux_loss
    return TokenLossOutput(loss=loss, log_probs=log_probs, entropy=scatter(stats.entropy, mask),
                           log_sum_sq_probs=scatter(stats.log_sum_sq_probs, mask),
                           mean_logits=scatter(stats.mean_logits, mask), is_top1=scatter(stats.is_top1, mask),
                           label_mask=mask, aux_loss=aux_loss)


def backbone_hidden(model, args, kwargs) -> torch.Tensor:
    """The last hidden states of ``model``'s base model, from the arguments of ``model.forward``."""
    arguments = inspect.signature(type(model).forward).bind(model, *args, **kwargs).arguments
    inputs = {k: v for k, v in arguments.items() if k not in ("self", "labels", "logits_to_keep", "kwargs")}
    return getattr(model, model.base_model_prefix)(**inputs, **arguments.get("kwargs", {}))[0]


class TokenStats(NamedTuple):
    """Per counted token: the entropy of the trained distribution, whether the label is its most probable token,
    ``log sum_i p_i^2``, the mean logit, the loss (fused pass only); ``total``: the summed loss with its gradient
    (fused pass only)."""

    entropy: torch.Tensor
    is_top1: torch.Tensor
    log_sum_sq_probs: torch.Tensor
    mean_logits: torch.Tensor
    losses: torch.Tensor | None = None
    total: torch.Tensor | None = None


def fused_token_stats(hidden, head, target, loss, options, values: HeadValues) -> TokenStats:
    """Per counted token ``loss_t``, ``entropy_t``, ``is_top1_t`` and the summed loss, from one chunked head pass.

    The loss's support routine is wrapped to record, for each chunk, the
    per-token losses, ``-sum p log p`` over the support and whether the
    label is the most probable token; :class:`SparseHeadLossFunction` does the rest
    (sparse backward).
    """
    flat = target.reshape(-1)
    kept = (flat != -100).nonzero().squeeze(1)
    safe_target(flat.index_select(0, kept), head.weight.shape[0], -100)  # raises on out-of-range labels
    support = support_function(loss, options)
    records = []

    def recording_support(rows, t, masked):
        index, p, items = support(rows, t, masked)
        with torch.no_grad():
            records.append((items.float(), *token_stats(index, p, t, rows)))
        return index, p, items

    tokens = hidden.reshape(-1, hidden.shape[-1]).index_select(0, kept)
    total = SparseHeadLossFunction.apply(tokens, head.weight, head.bias, flat.index_select(0, kept),
                                         recording_support, values.softcap, CHUNK_TOKENS, values.scale)
    if not records:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return TokenStats(empty, empty.bool(), empty, empty, empty, total)
    items, *stats = (torch.cat(column) for column in zip(*records))
    return TokenStats(*stats, items, total)


@torch.no_grad()
def dense_token_stats(logits, target, loss, options) -> TokenStats:
    """``entropy_t`` and ``is_top1_t`` for ``[N, V]`` logits, ``CHUNK_TOKENS`` rows at a time.

    ``p`` comes from the loss's support routine where it has one (compact),
    else from its mapping over the whole vocabulary.
    """
    dtype, masked = work_dtype(logits.dtype), masked_below(logits.dtype)
    if registry.loss_options(loss, options).entry.fused:
        support = support_function(loss, options)
        distribution = lambda rows, t: support(rows, t, masked)[:2]  # noqa: E731
    else:
        mapping = loss_mapping(loss, **options)
        distribution = lambda rows, t: (None, mapping(rows))  # noqa: E731
    stats = [token_stats(*distribution(rows.to(dtype), t), t, rows)
             for rows, t in zip(logits.split(CHUNK_TOKENS), target.split(CHUNK_TOKENS))]
    if not stats:
        empty = logits.new_zeros(0, dtype=torch.float32)
        return TokenStats(empty, target.new_zeros(0, dtype=torch.bool), empty, empty)
    return TokenStats(*(torch.cat(column) for column in zip(*stats)))


def token_stats(index, p: torch.Tensor, t: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per row of logits ``rows``: ``-sum_i p_i log p_i``, ``[argmax_i p_i = t]``, ``log sum_i p_i^2`` and the mean
    of ``rows`` (the first four fields of :class:`TokenStats`); ``p`` dense (``index`` None) or over ``index``."""
    top = p.argmax(-1, keepdim=True)
    if index is not None:
        top = index.gather(-1, top)
    return (-torch.special.xlogy(p, p).sum(-1).float(), top.squeeze(-1) == t, p.square().sum(-1).log().float(),
            rows.mean(-1, dtype=torch.float32))  # no float copy of the [chunk, vocab] rows


def scatter(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per counted token ``values`` laid out as ``mask`` (0 / False elsewhere)."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


class TokenOutputsPlan(NamedTuple):
    """TRL's per-token fields for this loss (the loss and its options are read from the config at each call)."""

    loss: str


class TokenOutputsSwap:
    """``model(..., fused_lm_head=True)`` returns TRL's per-token fields under the patched loss.

    The forward it installs sits above the fused forward, so it is applied after it and removed before it.
    """

    name = "token_outputs"

    def plan(self, model, request: PatchRequest) -> TokenOutputsPlan | None:
        if loss_task(base_model(model), request.settings) != "causal_lm":
            return None
        return TokenOutputsPlan(request.settings.loss)

    def apply(self, model, plan: TokenOutputsPlan) -> None:
        install_token_outputs(base_model(model))

    def remove(self, model) -> None:
        remove_token_outputs(base_model(model))
