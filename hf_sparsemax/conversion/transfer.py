"""``transfer_attention``: each layer's sparse attention fitted to the softmax parent's, layer by layer, at length.

Attention transfer (LoLCATs' first stage): before any end-to-end training, every attention layer's own
parameters are fitted so that its outputs match the parent's softmax attention outputs on the parent's own
inputs (teacher-forced: each layer sees the queries, keys and values the softmax model computes, so no layer
fits to another's drift). For layer ``l`` with records ``r`` (query rows ``i``, weights ``m_i``, 0 on padding):

    E_l(theta) = sum_r sum_i m_i sum_h || A_theta(q_hi, K, V) - softmax(q_hi K^T * scaling) V ||^2
                 / sum_r sum_i m_i sum_h || softmax(q_hi K^T * scaling) V ||^2,

``theta`` the layer's attention parameters: a temperature per head (``log T``, always), a learned alpha per
head (``attn_options={"learn_alpha": True}``) and ASEntmax's length scale (``length_scale=True``) where the
model has them. The temperatures start from :func:`~hf_sparsemax.calibrate_attention`'s grid (the best
temperature per head at the patched alpha); then ``steps`` of Adam on ``E_l`` over all of its records, full
batch, keeping the best parameters seen (so the error after is never above the calibrated one on these rows).

Why rows and not whole blocks: ``rows_per_batch`` query rows spread evenly over each block, each against all
of its keys, give supervision at every position range of a long block (the far positions where the parent's
attention is widest are as represented as the near ones) at a cost of ``rows x keys`` a head, so blocks of
4-8k tokens fit: the records hold each layer's keys and values and the chosen rows' queries (``2 x layers x
tokens x kv width`` floats for the keys and values: ~380 MB for one 8192-token block of SmolLM2-135M) and the
fit holds one layer's gradient at a time.

Heads kept wide (``dense_heads``, hybrid attention): after the fit, the heads whose share of their layer's
error stays largest (``dense_heads`` a share of all query heads in (0, 1), or a count) have their alpha set
to ``dense_alpha`` (default 1.2: within ``1 / (alpha - 1) = 5`` score units of a row's top every key keeps a
weight; 1.125 is the lowest alpha the float32 kernels serve) and their temperature fitted again at it. This
needs per-head alphas (``learn_alpha``). Under grouped-query attention a key-value head shared by a wide head
and sparse ones is read for all of them: the share of keys never read counts key-value heads, and a wide head
costs its whole group's skipping (choose by group with ``by_group=True``: the groups whose summed error share
is largest go wide together).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import nn

from ..attention.interface import ALPHA_ATTR, OPTIONS_ATTR, scaled_attention_forward
from ..attention.query_scale import LENGTH_SCALE_ATTR, TEMPERATURE_ATTR, apply_factor, query_factor, submodule
from .schedule import pre_alpha_of
from ..swaps.calibration import (ROUNDS, Record, fit_layer, record_layers, reference_energy, store_temperatures,
                                 tempered_modules)

DEFAULT_STEPS = 40
DEFAULT_LEARNING_RATE = 0.05
DEFAULT_ROWS = 256
FAST_ALPHA = 1.125  # the lowest alpha the float32 kernels serve (mappings.entmax.precise_in_float32); below it a
#                    layer's every path (training blocks, the fused kernel, the certificate) is the float64 torch path
DEFAULT_DENSE_ALPHA = 1.2  # heads kept wide: every key within 1 / (alpha - 1) = 5 score units of a row's top
DEFAULT_MIN_ALPHA = FAST_ALPHA


def layer_errors(module: nn.Module, records: list[Record], log_temperature: torch.Tensor) -> torch.Tensor:
    """``[H]`` squared output error of each head over ``records`` (differentiable in ``log_temperature``, the
    module's learned alpha and length scale)."""
    mapping = getattr(module, OPTIONS_ATTR).mapping
    total = 0
    for record in records:
        base = query_factor(module, record.query, record.key, record.kwargs, temperature=False)
        factor = (1 if base is None else base) / log_temperature.exp().view(1, -1, 1, 1)
        query = apply_factor(record.query, factor)
        out, _ = scaled_attention_forward(module, query, record.key, record.value, record.mask, mapping=mapping,
                                          **record.kwargs)
        diff = (out - record.reference).float()
        total = total + (diff.square().sum(-1) * record.rows[..., None]).sum((0, 1))
    return total


def trained_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The module's learned alpha and length scale (the temperature is fitted as its own tensor)."""
    params = []
    learned = submodule(module, ALPHA_ATTR)
    if learned is not None:
        params.append(learned.pre_alpha)
    length = submodule(module, LENGTH_SCALE_ATTR)
    if length is not None:
        params += [length.delta, length.beta, length.gamma]
    return params


def fit_gradient(module: nn.Module, records: list[Record], temperatures: list[float], steps: int,
                 learning_rate: float, energy: float, min_alpha: float | None = None) -> tuple[list[float], float]:
    """Adam on the layer's relative error (module docstring) from ``temperatures``, a learned alpha kept at or
    above ``min_alpha`` (projected after each step); the best parameters seen are left in the module. Returns
    ``(temperatures, relative error)``."""
    learned = submodule(module, ALPHA_ATTR)
    floor = None if learned is None or min_alpha is None else pre_alpha_of(min_alpha)
    if floor is not None:
        with torch.no_grad():
            learned.pre_alpha.clamp_(min=floor)
    log_t = torch.tensor(temperatures, dtype=torch.float32).log().requires_grad_(True)
    params = trained_parameters(module)
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam([log_t, *params], lr=learning_rate)
    best = (math.inf, None, None)
    try:
        for step in range(steps + 1):
            optimizer.zero_grad(set_to_none=True)
            error = layer_errors(module, records, log_t).sum() / energy
            value = float(error.detach())
            if value < best[0]:
                best = (value, log_t.detach().clone(), [p.detach().clone() for p in params])
            if step == steps:
                break
            error.backward()
            optimizer.step()
            if floor is not None:
                with torch.no_grad():
                    learned.pre_alpha.clamp_(min=floor)
    finally:
        with torch.no_grad():
            if best[2] is not None:
                for p, value in zip(params, best[2]):
                    p.copy_(value)
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
    return [float(t) for t in best[1].exp()], best[0]


def choose_wide(per_head: list[torch.Tensor], budget: int, groups: list[int], by_group: bool) -> list[tuple[int, int]]:
    """The ``(layer, head)`` pairs to keep wide: the largest shares of their layer's error (whole key-value groups
    with ``by_group``), ``budget`` query heads at most."""
    scored = []
    for layer, shares in enumerate(per_head):
        if by_group:
            size = shares.numel() // groups[layer]
            for group, share in enumerate(shares.view(groups[layer], size).sum(-1).tolist()):
                scored.append((share, layer, list(range(group * size, (group + 1) * size))))
        else:
            scored += [(share, layer, [head]) for head, share in enumerate(shares.tolist())]
    chosen: list[tuple[int, int]] = []
    for _, layer, heads in sorted(scored, key=lambda item: -item[0]):
        if len(chosen) + len(heads) > budget:
            continue
        chosen += [(layer, head) for head in heads]
    return sorted(chosen)


def check_budget(dense_heads, total: float) -> int:
    """``dense_heads`` as a count of query heads, or a ``ValueError``."""
    if isinstance(dense_heads, bool) or not isinstance(dense_heads, (int, float)) or not math.isfinite(dense_heads):
        raise ValueError(f"dense_heads must be a share in [0, 1) or a count of heads, got {dense_heads!r}")
    if isinstance(dense_heads, float) and 0 <= dense_heads < 1:
        return round(dense_heads * total) if total < math.inf else 0
    if isinstance(dense_heads, int) and 0 <= dense_heads <= total:
        return dense_heads if total < math.inf else 0
    raise ValueError(f"dense_heads must be a share in [0, 1) or a whole number of heads in [0, {total}], "
                     f"got {dense_heads!r}")


def check_arguments(steps: int = DEFAULT_STEPS, learning_rate: float = DEFAULT_LEARNING_RATE,
                    rows_per_batch: int = DEFAULT_ROWS, dense_heads: float | int = 0,
                    dense_alpha: float = DEFAULT_DENSE_ALPHA, by_group: bool = False,
                    min_alpha: float | None = DEFAULT_MIN_ALPHA) -> None:
    """:func:`transfer_attention`'s options, or a ``ValueError`` naming the first one out of range."""
    if min_alpha is not None and (isinstance(min_alpha, bool) or not isinstance(min_alpha, (int, float))
                                  or not 1 < min_alpha < 2):
        raise ValueError(f"min_alpha must be an alpha in (1, 2) or None, got {min_alpha!r}")
    for name, value, low in (("steps", steps, 0), ("rows_per_batch", rows_per_batch, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if (isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float))
            or not 0 < learning_rate < math.inf):
        raise ValueError(f"learning_rate must be a finite number > 0, got {learning_rate!r}")
    if isinstance(dense_alpha, bool) or not isinstance(dense_alpha, (int, float)) or not 1 < dense_alpha < 2:
        raise ValueError(f"dense_alpha must be an alpha in (1, 2), got {dense_alpha!r}")
    if not isinstance(by_group, bool):
        raise ValueError(f"by_group must be True or False, got {by_group!r}")
    check_budget(dense_heads, math.inf)


def transfer_attention(model, batches: Iterable[dict[str, Any]], *, steps: int = DEFAULT_STEPS,
                       learning_rate: float = DEFAULT_LEARNING_RATE, rows_per_batch: int = DEFAULT_ROWS,
                       dense_heads: float | int = 0, dense_alpha: float = DEFAULT_DENSE_ALPHA,
                       by_group: bool = False, min_alpha: float | None = DEFAULT_MIN_ALPHA,
                       progress: bool = False) -> dict[str, Any]:
    """Fit each attention layer of a patched model to the model's own softmax attention (module docstring).

    ``model``: patched with a sparse attention and per-head temperatures (``attn_options={"temperature": True}``,
    plus ``learn_alpha`` / ``length_scale`` to fit those too), or a ``PeftModel`` around one. ``batches``: a few
    long blocks of the user's text (dicts of model inputs, ``labels`` ignored), as long as the contexts the model
    will see. ``steps`` / ``learning_rate``: Adam on each layer's error (0 steps: the calibration grid alone);
    ``rows_per_batch``: query rows of each batch the fit reads; ``min_alpha``: learned alphas kept at or above it
    (default 1.125, the lowest alpha the float32 kernels serve; None: no bound). Fitted freely the alphas fall
    towards 1, softmax's shape, and the supports widen: a higher bound trades the fit for sparsity; at the patched
    alpha the alphas stay there and only the temperatures and the length scale move; ``dense_heads``, ``dense_alpha``, ``by_group``: heads kept wide (module docstring; 0: none).

    The fitted temperatures go to the modules and ``config.hf_sparsemax`` (``save_pretrained`` keeps them), the
    alphas and length scales to their parameters (saved with the weights). Returns ``{"layers": [{"layer",
    "error_before", "error_calibrated", "error_after", "temperatures", "alphas"}], "error_before",
    "error_calibrated", "error_after", "dense_heads": [[layer, head], ...]}``: relative output errors on these
    batches, per layer and their means.
    """
    check_arguments(steps, learning_rate, rows_per_batch, dense_heads, dense_alpha, by_group, min_alpha)
    inner, settings, modules = tempered_modules(model, "transfer_attention")
    heads = [len(getattr(m, TEMPERATURE_ATTR).values) for m in modules]
    budget = check_budget(dense_heads, sum(heads))
    if budget and any(submodule(m, ALPHA_ATTR) is None for m in modules):
        raise ValueError("dense_heads sets an alpha per head: patch with attn='entmax_bisect' and attn_options="
                         "{'alpha': 1.5, 'learn_alpha': True, 'temperature': True}")
    batches = list(batches)
    lengths = [int(b["input_ids"].shape[-1]) for b in batches if isinstance(b, dict) and "input_ids" in b]
    records = record_layers(model, modules, batches, rows_per_batch)
    bar = progress_bar(len(modules), progress)
    layers, shares = [], []
    for index, module in enumerate(modules):
        rows = records[module]
        energy = max(reference_energy(rows), torch.finfo(torch.float64).tiny)
        with torch.no_grad():
            temperatures, before, calibrated = fit_layer(module, rows, ROUNDS)
        after = calibrated
        if steps:
            temperatures, after = fit_gradient(module, rows, temperatures, steps, learning_rate, energy, min_alpha)
        getattr(module, TEMPERATURE_ATTR).assign(temperatures)
        with torch.no_grad():
            log_t = torch.tensor(temperatures).log()
            shares.append(layer_errors(module, rows, log_t) / energy)
        layers.append({"layer": index, "error_before": before, "error_calibrated": calibrated, "error_after": after,
                       "temperatures": temperatures, "alphas": alphas_of(module)})
        bar.update(1)
    bar.close()
    wide = choose_wide(shares, budget, [kv_groups(m, h) for m, h in zip(modules, heads)], by_group) if budget else []
    for layer in sorted({layer for layer, _ in wide}):
        module = modules[layer]
        picked = [head for lay, head in wide if lay == layer]
        with torch.no_grad():
            submodule(module, ALPHA_ATTR).pre_alpha[picked] = pre_alpha_of(dense_alpha)
            temperatures, _, error = fit_layer(module, records[module], ROUNDS)
        getattr(module, TEMPERATURE_ATTR).assign(temperatures)
        layers[layer].update(error_after=error, temperatures=temperatures, alphas=alphas_of(module))
    store_temperatures(inner, settings, modules, [layer["temperatures"] for layer in layers])
    mean = lambda key: sum(layer[key] for layer in layers) / len(layers)  # noqa: E731
    return {"layers": layers, "error_before": mean("error_before"), "error_calibrated": mean("error_calibrated"),
            "error_after": mean("error_after"), "dense_heads": [list(pair) for pair in wide],
            "block_lengths": lengths}


def alphas_of(module: nn.Module) -> list[float] | None:
    learned = submodule(module, ALPHA_ATTR)
    return None if learned is None else [float(a) for a in learned().detach().flatten()]


def kv_groups(module: nn.Module, heads: int) -> int:
    """Key-value heads of an attention module (its query heads where it says nothing)."""
    config = getattr(module, "config", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    return kv if heads % kv == 0 else heads


def progress_bar(total: int, show: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="attention transfer", unit="layer", disable=not show)
