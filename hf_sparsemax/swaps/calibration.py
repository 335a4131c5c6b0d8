"""``calibrate_attention``: per-head temperatures that make a swapped attention's outputs match softmax's.

A pretrained softmax model's scores are scaled for softmax: 1.5-entmax of the same scores keeps a handful of
keys. A temperature per query head (:mod:`hf_sparsemax.attention.query_scale`: the scores of head ``h`` divided
by ``T_h``) moves each head back towards what the layer above it was trained on. For each attention layer and
head, ``T_h`` minimises the squared error of the head's attention outputs against softmax's on the same inputs,

    T_h = argmin_T  sum_{batches, rows} || mapping(q_h k^T * scaling / T) v  -  softmax(q_h k^T * scaling) v ||^2

(the rows of padding left out). Why least squares on the outputs and not a divergence of the weights: the output
is what the next layer reads (two weightings of keys with alike values are alike there), and a sparse mapping
gives exact zeros where softmax is positive, so KL(softmax || sparse) is infinite on almost every row and
KL(sparse || softmax) rewards keeping one key.

The inputs of every layer (its queries, keys, values, mask) are those of the model's own softmax attention: one
forward pass per batch through the same model with its attention computed as softmax (no second model in memory;
the queries before any temperature, the length scale kept), which also gives each layer's softmax output. Each
head's error depends on its own temperature only, so one 1-D search per head, all heads at once: a log grid of
``2 ** -2 ... 2 ** 6`` (steps of 2), then ``rounds`` halvings of the step around each head's best; the temperature
a head had is kept where nothing found does better, so calibration never raises the error it measures. The
fit reads at most ``ROWS_PER_BATCH`` query rows of each batch (evenly spaced; each row's own keys and mask):
its cost is ``layers x (9 + 2 rounds) x rows x keys`` mapping entries, whatever the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, NamedTuple

import torch
from torch import nn

from .._model import base_model
from ..attention.interface import OPTIONS_ATTR, is_causal, mask_function, scaled_attention_forward, selected_keys
from ..attention.blocked.pages import take_layer
from ..attention.query_scale import TEMPERATURE_ATTR, apply_factor, query_factor, query_positions
from ..settings import CONFIG_KEY, SparseSettings
from .attention_swap import set_attention

CAPTURE_NAME = "hf_sparsemax_calibration"  # attention implementation of the capturing pass (softmax, recorded)
GRID_LOG2 = (-2.0, 6.0, 1.0)  # first grid of temperatures: 2 ** (start ... stop by step)
ROUNDS = 5  # halvings of the grid's step around each head's best: 2 ** (1 / 2 ** 5), temperatures within 2.2%
ROWS_PER_BATCH = 64  # query rows of a batch (all its sequences) kept for the fit, evenly spaced, the last included
CANDIDATE_BUDGET = 2 ** 24  # score entries of one call evaluating several temperatures at once
DROPPED_KWARGS = ("past_key_values", "past_key_value", "cache")  # not kept with a layer's recorded inputs


class Record(NamedTuple):
    """One attention call of the capturing pass: its inputs, softmax's output ``[B, q, H, D]`` and the weight
    of each query row ``[B, q]`` (0 on padding)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    kwargs: dict[str, Any]
    reference: torch.Tensor
    rows: torch.Tensor


class SoftmaxReference:
    """Stand-in module for the softmax reference: no options (``sparse_softmax`` without a cut is softmax),
    not training, the attention module's own ``is_causal``."""

    training = False

    def __init__(self, module: nn.Module) -> None:
        self.is_causal = getattr(module, "is_causal", True)


RECORDING: dict[str, Any] = {}  # while capturing: "records" {module: [Record]}, "rows" (the batch's padding mask)


def capture_forward(module, query, key, value, attention_mask, **kwargs):
    """The capturing pass's attention: softmax (as the model's own), its inputs and output recorded."""
    take_layer(module)  # an indexer's selection (DeepSeek-V3.2) folded into the recorded mask, as the attention does
    attention_mask = selected_keys(kwargs.pop("indices", None), attention_mask, module, query, key, kwargs)
    reference, _ = scaled_attention_forward(SoftmaxReference(module), query, key, value, attention_mask,
                                            mapping="sparse_softmax", **kwargs)
    records = RECORDING.get("records")
    if records is not None and module in records:
        rows = RECORDING.get("rows")
        if rows is None or rows.shape != query.shape[:1] + query.shape[2:3]:
            rows = torch.ones(query.shape[0], query.shape[2], device=query.device)
        kept = {k: v for k, v in kwargs.items() if k not in DROPPED_KWARGS}
        record = Record(query, key, value, attention_mask, kept, reference, rows.to(query.dtype))
        records[module].append(some_rows(module, record, RECORDING["rows_per_batch"]))
    return reference, None


def some_rows(module: nn.Module, record: Record, count: int) -> Record:
    """``record`` with about ``count`` of its query rows (all sequences together; evenly spaced, the last kept),
    each with its own mask: the causal mask the attention would have applied made explicit."""
    batch, q_len = record.query.shape[0], record.query.shape[-2]
    per_sequence = max(1, count // batch)
    if q_len <= per_sequence:
        return record
    index = torch.linspace(q_len - 1, 0, per_sequence).round().long().flip(0).unique().to(record.query.device)
    mask, kv = record.mask, record.key.shape[-2]
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=record.query.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(record.query.dtype).min)
    if mask is not None:
        mask = mask[..., :kv]
        mask = mask.index_select(-2, index) if mask.shape[-2] == q_len else mask
    elif is_causal(module, q_len, None, record.kwargs):
        hidden = torch.arange(kv, device=index.device)[None, :] > (index + kv - q_len)[:, None]
        mask = torch.zeros(hidden.shape, dtype=record.query.dtype, device=index.device).masked_fill(
            hidden, torch.finfo(record.query.dtype).min)[None, None]
    kwargs = {k: v for k, v in record.kwargs.items() if k != "cache_position"}
    kwargs["position_ids"] = query_positions(record.query, record.key, record.kwargs).index_select(-1, index)
    return Record(record.query.index_select(-2, index), record.key, record.value, mask, kwargs,
                  record.reference.index_select(1, index), record.rows.index_select(1, index))


def register_capture() -> None:
    """Register the capturing attention (and the sparse attentions' mask function) under :data:`CAPTURE_NAME`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAPTURE_NAME, capture_forward)
    AttentionMaskInterface.register(CAPTURE_NAME, mask_function)


def record_layers(model, modules: list[nn.Module], batches: Iterable[dict[str, Any]],
                  rows_per_batch: int = ROWS_PER_BATCH) -> dict[nn.Module, list[Record]]:
    """Each module's :class:`Record` of every batch (at most ``rows_per_batch`` query rows of it), from forward
    passes of ``model`` with softmax attention."""
    inner = base_model(model)
    implementation = inner.config._attn_implementation
    training = model.training
    register_capture()
    records = {module: [] for module in modules}
    RECORDING.update(records=records, rows_per_batch=rows_per_batch)
    try:
        set_attention(inner, CAPTURE_NAME)
        model.eval()
        with torch.no_grad():
            for batch in batches:
                if not isinstance(batch, dict):
                    raise ValueError(f"calibrate_attention: each batch is a dict of model inputs, got {type(batch)}")
                inputs = {k: v.to(inner.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
                          if k != "labels"}
                RECORDING["rows"] = inputs.get("attention_mask")
                model(**inputs)
    finally:
        RECORDING.clear()
        set_attention(inner, implementation)
        model.train(training)
    if not any(records.values()):
        raise ValueError("calibrate_attention got no batches (or the model called none of its attention layers)")
    return records


def head_errors(module: nn.Module, records: list[Record], temperatures: torch.Tensor) -> torch.Tensor:
    """``[G, H]`` squared output error of each head under each of ``temperatures [G, H]`` (summed over records)."""
    mapping = getattr(module, OPTIONS_ATTR).mapping
    errors = torch.zeros(temperatures.shape, dtype=torch.float64)
    for record in records:
        query, key = record.query, record.key
        base = query_factor(module, query, key, record.kwargs, temperature=False)
        batch, heads, q_len = query.shape[:3]
        per_call = max(1, CANDIDATE_BUDGET // (batch * heads * q_len * key.shape[-2]))
        for start in range(0, temperatures.shape[0], per_call):
            temps = temperatures[start:start + per_call].to(query.device)
            count = temps.shape[0]
            factor = (1 if base is None else base.float()) / temps.view(count, 1, heads, 1, 1).float()
            queries = apply_factor(query.unsqueeze(0).expand(count, *query.shape), factor).flatten(0, 1)
            mask = record.mask
            if mask is not None and mask.shape[0] == batch and batch > 1:
                mask = mask.repeat(count, *([1] * (mask.dim() - 1)))
            out, _ = scaled_attention_forward(module, queries, key.repeat(count, 1, 1, 1),
                                              record.value.repeat(count, 1, 1, 1), mask, mapping=mapping,
                                              **record.kwargs)
            diff = (out.view(count, *record.reference.shape) - record.reference).double()
            errors[start:start + count] += (diff.square().sum(-1) * record.rows[None, :, :, None]).sum((1, 2)).cpu()
    return errors


def reference_energy(records: list[Record]) -> float:
    """``sum ||softmax output||^2`` over the rows weighed (the denominator of the relative errors)."""
    return float(sum((r.reference.double().square().sum((-1, -2)) * r.rows).sum() for r in records))


def fit_layer(module: nn.Module, records: list[Record], rounds: int) -> tuple[list[float], float, float]:
    """Temperatures of one layer's heads, and its relative output error before and after (see the module)."""
    start = torch.tensor(getattr(module, TEMPERATURE_ATTR).current(), dtype=torch.float64)
    heads = start.numel()
    low, high, step = GRID_LOG2
    exponents = torch.arange(low, high + step / 2, step, dtype=torch.float64)
    candidates = torch.cat([start[None], (2.0 ** exponents)[:, None].expand(-1, heads)])
    errors = head_errors(module, records, candidates)
    before = errors[0]
    best_error, best = errors.min(0)
    best_t = candidates.gather(0, best[None])[0]
    for _ in range(rounds):  # halve the bracket: the best so far, or half a step either side of it
        step /= 2
        candidates = best_t[None] * 2.0 ** torch.tensor([[-step], [step]], dtype=torch.float64)
        error, index = head_errors(module, records, candidates).min(0)
        better = error < best_error
        best_t = torch.where(better, candidates.gather(0, index[None])[0], best_t)
        best_error = torch.where(better, error, best_error)
    energy = max(reference_energy(records), torch.finfo(torch.float64).tiny)
    return best_t.tolist(), float(before.sum()) / energy, float(best_error.sum()) / energy


def tempered_modules(model, caller: str) -> tuple[nn.Module, SparseSettings, list[nn.Module]]:
    """``(inner model, its settings, its attention modules with per-head temperatures)``, or a ``ValueError``
    saying how to patch the model for ``caller``."""
    inner = base_model(model)
    settings = SparseSettings.from_config(inner.config)
    modules = [m for m in inner.modules() if isinstance(m._modules.get(TEMPERATURE_ATTR), nn.Module)]
    if settings is None or settings.attention_options is None or not modules:
        raise ValueError(f"{caller} needs a model patched with a sparse attention and per-head temperatures: "
                         "hf_sparsemax.patch_model(model, attn=..., attn_options={'temperature': True})")
    return inner, settings, modules


def calibrate_attention(model, batches: Iterable[dict[str, Any]], *, rounds: int = ROUNDS,
                        rows_per_batch: int = ROWS_PER_BATCH) -> dict[str, Any]:
    """Fit the per-head temperatures of a model patched with ``attn_options={"temperature": True}`` (or a list)
    so that each layer's sparse attention outputs match the model's softmax attention outputs on ``batches``.

    ``batches``: a few batches of the user's data, each a dict of model inputs (``input_ids``,
    ``attention_mask``, ...; ``labels`` are ignored); ``rounds``: halvings of the first grid's step (a factor 2)
    around each head's best; ``rows_per_batch``: query rows of each batch the fit reads (evenly spaced). The objective is least squares on the attention
    outputs (see :mod:`hf_sparsemax.swaps.calibration` for the math and why not a divergence of the weights); the
    softmax reference is the same model with its attention computed as softmax. The fitted temperatures are set
    in the model (learned ones as their parameter's value) and in ``config.hf_sparsemax`` (``save_pretrained``
    keeps them). Returns ``{"layers": [{"layer", "error_before", "error_after", "temperatures"}, ...],
    "error_before", "error_after"}``: the relative output errors ``sum ||out - softmax||^2 / sum ||softmax||^2``
    on these batches (no held-out data), per layer and their mean.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds must be an integer >= 0, got {rounds!r}")
    if isinstance(rows_per_batch, bool) or not isinstance(rows_per_batch, int) or rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be a positive integer, got {rows_per_batch!r}")
    inner, settings, modules = tempered_modules(model, "calibrate_attention")
    records = record_layers(model, modules, batches, rows_per_batch)
    layers = []
    for index, module in enumerate(modules):
        with torch.no_grad():
            temperatures, before, after = fit_layer(module, records[module], rounds)
        getattr(module, TEMPERATURE_ATTR).assign(temperatures)
        layers.append({"layer": index, "error_before": before, "error_after": after, "temperatures": temperatures})
    store_temperatures(inner, settings, modules, [layer["temperatures"] for layer in layers])
    return {"layers": layers, "error_before": sum(l["error_before"] for l in layers) / len(layers),
            "error_after": sum(l["error_after"] for l in layers) / len(layers)}


def store_temperatures(inner, settings: SparseSettings, modules: list[nn.Module], values: list[list[float]]) -> None:
    """Keep the temperatures in ``config.hf_sparsemax`` (``attn_options.temperature``; the rest of it as it
    was) and in the modules' options."""
    settings.attn_options["temperature"] = values
    options = settings.attention_options  # validates
    for module in modules:
        if isinstance(getattr(module, OPTIONS_ATTR, None), type(options)):
            setattr(module, OPTIONS_ATTR, dataclasses.replace(getattr(module, OPTIONS_ATTR),
                                                              temperature=options.temperature))
    saved = dict(getattr(inner.config, CONFIG_KEY))
    saved["attn_options"] = dict(sorted(settings.attn_options.items()))
    setattr(inner.config, CONFIG_KEY, saved)
