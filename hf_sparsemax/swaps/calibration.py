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
``2 ** -3 ... 2 ** 6`` (steps of 2 ** 0.25), then ``rounds`` finer grids around each head's best; the temperature
a head had is kept where nothing found does better, so calibration never raises the error it measures.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, NamedTuple

import torch
from torch import nn

from .._model import base_model
from ..attention.interface import OPTIONS_ATTR, mask_function, scaled_attention_forward
from ..attention.pages import take_layer
from ..attention.query_scale import TEMPERATURE_ATTR, apply_factor, query_factor
from ..settings import CONFIG_KEY, SparseSettings
from .attention_swap import set_attention

CAPTURE_NAME = "hf_sparsemax_calibration"  # attention implementation of the capturing pass (softmax, recorded)
GRID_LOG2 = (-3.0, 6.0, 0.25)  # first grid of temperatures: 2 ** (start ... stop by step)
REFINE_POINTS = 9  # points of each finer grid (around a head's best, one step of the grid before either side)
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
    take_layer(module)
    reference, _ = scaled_attention_forward(SoftmaxReference(module), query, key, value, attention_mask,
                                            mapping="sparse_softmax", **kwargs)
    records = RECORDING.get("records")
    if records is not None and module in records:
        rows = RECORDING.get("rows")
        if rows is None or rows.shape != query.shape[:1] + query.shape[2:3]:
            rows = torch.ones(query.shape[0], query.shape[2], device=query.device)
        kept = {k: v for k, v in kwargs.items() if k not in DROPPED_KWARGS}
        records[module].append(Record(query, key, value, attention_mask, kept, reference, rows.to(query.dtype)))
    return reference, None


def register_capture() -> None:
    """Register the capturing attention (and the sparse attentions' mask function) under :data:`CAPTURE_NAME`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAPTURE_NAME, capture_forward)
    AttentionMaskInterface.register(CAPTURE_NAME, mask_function)


def record_layers(model, modules: list[nn.Module], batches: Iterable[dict[str, Any]]) -> dict[nn.Module, list[Record]]:
    """Each module's :class:`Record` of every batch, from forward passes of ``model`` with softmax attention."""
    inner = base_model(model)
    implementation = inner.config._attn_implementation
    training = model.training
    register_capture()
    records = {module: [] for module in modules}
    RECORDING["records"] = records
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
    for _ in range(rounds):
        offsets = torch.linspace(-step, step, REFINE_POINTS, dtype=torch.float64)
        candidates = best_t[None] * 2.0 ** offsets[:, None]
        errors = head_errors(module, records, candidates)
        error, index = errors.min(0)
        better = error < best_error
        best_t = torch.where(better, candidates.gather(0, index[None])[0], best_t)
        best_error = torch.minimum(error, best_error)
        step = 2 * step / (REFINE_POINTS - 1)
    energy = max(reference_energy(records), torch.finfo(torch.float64).tiny)
    return best_t.tolist(), float(before.sum()) / energy, float(best_error.sum()) / energy


def calibrate_attention(model, batches: Iterable[dict[str, Any]], *, rounds: int = 2) -> dict[str, Any]:
    """Fit the per-head temperatures of a model patched with ``attn_options={"temperature": True}`` (or a list)
    so that each layer's sparse attention outputs match the model's softmax attention outputs on ``batches``.

    ``batches``: a few batches of the user's data, each a dict of model inputs (``input_ids``,
    ``attention_mask``, ...; ``labels`` are ignored); ``rounds``: finer grids after the first (each refines
    the temperature by a factor 2 ** (0.25 / 4 ** round)). The objective is least squares on the attention
    outputs (see :mod:`hf_sparsemax.swaps.calibration` for the math and why not a divergence of the weights); the
    softmax reference is the same model with its attention computed as softmax. The fitted temperatures are set
    in the model (learned ones as their parameter's value) and in ``config.hf_sparsemax`` (``save_pretrained``
    keeps them). Returns ``{"layers": [{"layer", "error_before", "error_after", "temperatures"}, ...],
    "error_before", "error_after"}``: the relative output errors ``sum ||out - softmax||^2 / sum ||softmax||^2``
    on these batches (no held-out data), per layer and their mean.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds must be an integer >= 0, got {rounds!r}")
    inner = base_model(model)
    settings = SparseSettings.from_config(inner.config)
    modules = [m for m in inner.modules() if isinstance(m._modules.get(TEMPERATURE_ATTR), nn.Module)]
    if settings is None or settings.attention_options is None or not modules:
        raise ValueError("calibrate_attention needs a model patched with a sparse attention and per-head "
                         "temperatures: hf_sparsemax.patch_model(model, attn=..., attn_options={'temperature': True})")
    records = record_layers(model, modules, batches)
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
