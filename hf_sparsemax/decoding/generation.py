"""Decoding that matches training: logits processors and the generate of a patched model.

transformers samples ``multinomial(softmax(scores))``. A processor that returns
``log p`` (``-inf`` outside the support) therefore makes it draw exactly from
``p`` - here the distribution the patched loss trains. Temperature ``T``
divides the logits before the mapping, ``p = mapping(x / T)``; in
transformers 5 the user's processors run before its own temperature / top-k
/ top-p warpers, so a patched model's ``generate`` moves the temperature into
these processors and turns the default ``top_k=50`` off. A ``top_k`` /
``top_p`` passed explicitly to ``generate`` still applies, after the mapping:
it truncates the trained distribution further and renormalises.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from .._model import base_model, remove_instance_method, set_instance_method
from ..losses.names import loss_mapping
from ..mappings import registry
from ..settings import SparseSettings


class MappingLogitsProcessor(LogitsProcessor):
    """Log-probabilities of the distribution a registered loss trains, ``mapping(scores / T)``.

    ``MappingLogitsProcessor("taylor_softmax", order=4)``; any name of
    ``hf_sparsemax.mappings.registry.names("processor")``.
    """

    loss_name = ""

    def __init__(self, loss: str | None = None, temperature: float = 1.0, **options):
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not temperature > 0:
            raise ValueError(f"temperature must be a float > 0, got {temperature!r}")
        self.loss_name = loss or self.loss_name
        entry = registry.get(self.loss_name)
        if not entry.processor:
            raise entry.refuse("processor")
        self.temperature = float(temperature)
        self.options = options
        self.mapping = loss_mapping(self.loss_name, **options)  # validates the options

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        x = scores.float()
        if self.temperature != 1.0:
            x = x / self.temperature
        return self.mapping(x).log().to(scores.dtype)

    def __repr__(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.options.items())
        name = "" if type(self) in NAMED_PROCESSORS.values() else f"{self.loss_name!r}, "
        return f"{type(self).__name__}({name}temperature={self.temperature}{options})"


_MappingLogitsProcessor = MappingLogitsProcessor  # the former private name


class SparseSoftmaxLogitsProcessor(_MappingLogitsProcessor):
    """Log-probabilities of ``sparse_softmax(scores / T, top_k, top_p)``: the top-k / top-p sparse softmax."""

    loss_name = "sparse_softmax"

    def __init__(self, top_k: int | None = None, top_p: float | None = None, temperature: float = 1.0):
        super().__init__(None, temperature, top_k=top_k, top_p=top_p)


class SparsemaxLogitsProcessor(_MappingLogitsProcessor):
    """Log-probabilities of ``sparsemax(scores / T)``, with its full support."""

    loss_name = "sparsemax"

    def __init__(self, temperature: float = 1.0):
        super().__init__(None, temperature)


class EntmaxLogitsProcessor(_MappingLogitsProcessor):
    """Log-probabilities of ``entmax_bisect(scores / T, alpha)`` (1.5-entmax at the default)."""

    loss_name = "entmax_bisect"

    def __init__(self, alpha: float = 1.5, temperature: float = 1.0):
        super().__init__(None, temperature, alpha=alpha)
        if alpha == 1.5:
            self.mapping = loss_mapping("entmax15")


NAMED_PROCESSORS = {  # the loss names with a processor class of their own (same distribution as the generic one)
    "sparse_softmax": SparseSoftmaxLogitsProcessor,
    "sparsemax": SparsemaxLogitsProcessor,
    "entmax_bisect": EntmaxLogitsProcessor,
}


def processor_for(loss: str | None, options: dict[str, Any], temperature: float = 1.0) -> LogitsProcessor | None:
    """The processor sampling from what ``loss`` trains (None for cross-entropy)."""
    if loss in (None, "cross_entropy"):
        return None
    options = {k: v for k, v in options.items() if k != "fused"}
    if loss == "entmax15":
        return EntmaxLogitsProcessor(1.5, temperature)
    if loss in NAMED_PROCESSORS:
        return NAMED_PROCESSORS[loss](temperature=temperature, **options)
    return MappingLogitsProcessor(loss, temperature, **options)


def logits_processors(model, temperature: float = 1.0) -> LogitsProcessorList:
    """The ``LogitsProcessorList`` matching the model's patched loss (empty for cross-entropy)."""

    settings = SparseSettings.from_config(base_model(model).config) or SparseSettings()
    processor = processor_for(settings.loss, settings.loss_options, temperature)
    return LogitsProcessorList([processor] if processor is not None else [])


def matched_generate_kwargs(model, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``generate`` arguments that sample from the trained distribution, keeping what the user passed."""
    matched = logits_processors(model)
    if not matched:
        return kwargs
    kwargs = dict(kwargs)
    config = kwargs.get("generation_config") or model.generation_config
    do_sample = kwargs.get("do_sample", config.do_sample)
    if do_sample:
        temperature = kwargs.get("temperature", config.temperature)
        if temperature is not None and temperature != 1.0:
            matched = logits_processors(model, temperature)
            kwargs["temperature"] = 1.0
        kwargs.setdefault("top_k", 0)  # transformers' default top_k=50 would cut sparsemax / entmax
        kwargs.setdefault("top_p", 1.0)
    user = LogitsProcessorList(kwargs.get("logits_processor") or [])
    user_types = {type(p) for p in user}
    kwargs["logits_processor"] = LogitsProcessorList([*user, *(p for p in matched if type(p) not in user_types)])
    return kwargs


def install_matched_generate(model) -> None:
    """Make ``model.generate`` (an instance attribute, undone by ``remove_matched_generate``) sample matched."""
    original = type(model).generate

    def generate(self, *args, **kwargs):
        return original(self, *args, **matched_generate_kwargs(self, kwargs))

    generate.__doc__ = original.__doc__
    set_instance_method(model, "generate", generate, "hf_sparsemax_matched")


def remove_matched_generate(model) -> None:
    remove_instance_method(model, "generate", "hf_sparsemax_matched")


def decoding_report(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int = 32,
    loss: str | None = None,
    loss_options: dict[str, Any] | None = None,
    matched: bool = True,
    seed: int = 0,
    **generate_kwargs,
) -> dict[str, Any]:
    """How far sampling strays from the training-time distribution, per generated token.

    The training distribution is that of ``loss`` / ``loss_options`` (default:
    the model's patched loss; cross-entropy means softmax). Generation samples
    with the model's matched decoding (``matched=True``) or with plain
    transformers sampling and ``generate_kwargs`` (``matched=False``, e.g.
    ``top_k=50``). Per token: the support size of the training distribution,
    whether the sampled token had probability 0 under it, and the training
    mass outside the decoder's support. A matched model gives 0 and 0.
    """

    inner = base_model(model)
    if loss is None:
        settings = SparseSettings.from_config(inner.config) or SparseSettings()
        loss, loss_options = settings.loss or "cross_entropy", settings.loss_options
    mapping = loss_mapping(loss, **(loss_options or {}))
    if not prompts:
        raise ValueError("give at least one prompt")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    encoded = tokenizer(list(prompts), return_tensors="pt", padding=True).to(inner.device)
    kwargs = dict(do_sample=True, max_new_tokens=max_new_tokens, output_logits=True, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id, **generate_kwargs)
    torch.manual_seed(seed)
    with torch.no_grad():
        if matched:
            out = model.generate(**encoded, **kwargs)
        else:
            out = type(inner).generate(inner, **encoded, **kwargs)
    new_tokens = out.sequences[:, encoded.input_ids.shape[1]:]
    alive = torch.ones(len(prompts), dtype=torch.bool, device=new_tokens.device)
    support, zero, truncated, decoder_support = [], [], [], []
    for step, (logits, scores) in enumerate(zip(out.logits, out.scores)):
        token = new_tokens[:, step]
        p = mapping(logits.float())
        kept = scores > float("-inf")
        rows = alive.nonzero().squeeze(1)
        support += (p > 0).sum(-1)[rows].tolist()
        zero += (p.gather(-1, token[:, None]).squeeze(1) == 0)[rows].tolist()
        truncated += (1 - (p * kept).sum(-1)).clamp_min(0)[rows].tolist()
        decoder_support += kept.sum(-1)[rows].tolist()
        if tokenizer.eos_token_id is not None:
            alive &= token != tokenizer.eos_token_id
    count = max(len(zero), 1)
    return {
        "loss": loss,
        "loss_options": dict(loss_options or {}),
        "matched": matched,
        "tokens": len(zero),
        "zero_prob_share": sum(zero) / count,
        "mean_support_size": sum(support) / count,
        "mean_decoder_support_size": sum(decoder_support) / count,
        "mean_truncated_mass": sum(truncated) / count,
        "per_token": {"support_size": support, "zero_prob": zero, "truncated_mass": truncated},
        "texts": tokenizer.batch_decode(new_tokens, skip_special_tokens=True),
    }
