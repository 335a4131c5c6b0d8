"""Per-head query scales applied before any attention kernel: a temperature, and ASEntmax's length scale.

Both multiply the queries ``[B, H, q, D]`` before the attention call, so the scores of head ``h`` at query
position ``i`` are

    s_hi = q_hi k^T * scaling * lambda_h(pos_i) / T_h

and every kernel (the torch path, the fused CPU kernel, the Triton kernels, vLLM's backend) computes the same
attention of the scaled queries unchanged. The position bias, the mask and the sinks are not scaled.

- :class:`HeadTemperature`: one temperature ``T_h > 0`` per query head (attention option ``temperature``);
  fixed (the values live in ``config.hf_sparsemax``) or learned (``learn_temperature``: the parameter
  ``log_temperature = log T``, saved with the weights, so ``T`` stays positive).
- :class:`LengthScale`: ASEntmax's scale (Vasylenko et al., "Long-Context Generalization with Sparse
  Attention", ICLR 2026) ``lambda_h(pos) = delta_h + beta_h * log(pos + 2) ** gamma_h``, learned per head,
  started at the identity (``delta = 1``, ``beta = 0``, ``gamma = 1``: ``lambda = 1`` exactly). ``pos`` is the
  query's absolute position, the one the model's rotary / position embedding uses: the ``position_ids`` the
  model passes to its attention (decoding with a cache included), else ``cache_position``, else the last
  ``q`` of the ``kv`` key positions.

The scale is computed in float32 (float64 for float64 queries), the queries multiplied in that precision and
rounded once to their dtype. A temperature of 1 and the identity length scale give the queries bit for bit.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn

TEMPERATURE_ATTR = "hf_sparsemax_temperature"  # submodule of an attention module: its HeadTemperature
LENGTH_SCALE_ATTR = "hf_sparsemax_length_scale"  # submodule of an attention module: its LengthScale
SCALE_PARAMETERS = ("log_temperature", "delta", "beta", "gamma")  # names of the trainable query-scale parameters


def check_temperatures(values: Any, where: str = "temperature") -> tuple[float, ...]:
    """One layer's temperatures as floats, or a ``ValueError``: a non-empty list of finite numbers > 0."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"{where} must be a non-empty list of per-head temperatures, got {values!r}")
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{where}: temperatures must be finite numbers > 0, got {value!r}")
        out.append(float(value))
    return tuple(out)


class HeadTemperature(nn.Module):
    """One temperature per query head; the scores are divided by it (the queries multiplied by ``1 / T``).

    Fixed values are kept as plain floats (a model cast to half precision keeps them exact); learned ones as the
    parameter ``log_temperature`` (float32, trained in an optimizer group of their own: :func:`query_scale_parameters`).
    ``exponent`` (1 unless a conversion's alpha ramp sets it): the temperatures used are ``T_h ** exponent``, so the
    values (and a saved or checkpointed parameter) always hold the fitted ``T_h``, whatever the ramp's step.
    """

    def __init__(self, values: Sequence[float], learn: bool = False) -> None:
        super().__init__()
        values = check_temperatures(values)
        self.learn = learn
        self.values = values
        self.exponent = 1.0
        self.cached: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        if learn:
            self.log_temperature = nn.Parameter(torch.tensor(values, dtype=torch.float32).log())

    def extra_repr(self) -> str:
        return f"heads={len(self.values)}, learn={self.learn}"

    def forward(self, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[H]`` temperatures ``T_h ** exponent``."""
        if self.learn:
            log = self.log_temperature.to(device=device, dtype=dtype)
            return (log if self.exponent == 1.0 else log * self.exponent).exp()
        key = (torch.device(device) if device is not None else torch.device("cpu"), dtype, self.exponent)
        if key not in self.cached:
            self.cached[key] = torch.tensor([value ** self.exponent for value in self.values], dtype=dtype,
                                            device=key[0])
        return self.cached[key]

    def set_exponent(self, exponent: float) -> None:
        """Use ``T_h ** exponent`` (a conversion's ramp) without changing the fitted ``T_h``."""
        self.exponent, self.cached = float(exponent), {}

    def current(self) -> list[float]:
        """The temperatures as floats."""
        return [float(t) for t in self.forward().detach().cpu()] if self.learn else list(self.values)

    def assign(self, values: Sequence[float]) -> None:
        """Set the temperatures (calibration): the parameter's value where learned, else the fixed floats."""
        values = check_temperatures(values)
        if len(values) != len(self.values):
            raise ValueError(f"{len(values)} temperatures for {len(self.values)} heads")
        self.values, self.cached = values, {}
        if self.learn:
            with torch.no_grad():
                self.log_temperature.copy_(torch.tensor(values, dtype=torch.float32).log())


class LengthScale(nn.Module):
    """ASEntmax's per-head, per-position query scale ``delta + beta * log(pos + 2) ** gamma`` (learned)."""

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.delta = nn.Parameter(torch.ones(num_heads, dtype=torch.float32))
        self.beta = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32))
        self.gamma = nn.Parameter(torch.ones(num_heads, dtype=torch.float32))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[N, H, q, 1]`` scales at ``positions [N, q]``."""
        grow = torch.log(positions.to(dtype) + 2)[:, None, :, None]
        view = (1, -1, 1, 1)
        delta, beta, gamma = (p.to(device=positions.device, dtype=dtype).view(view)
                              for p in (self.delta, self.beta, self.gamma))
        return delta + beta * grow ** gamma


def query_positions(query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """``[N, q]`` absolute positions of the queries (``N``: 1 or the batch; see the module docstring)."""
    q_len = query.shape[-2]
    ids = kwargs.get("position_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() == 3:  # multimodal rotary ids [3, B, q]: the first (text) row
        ids = ids[0]
    if isinstance(ids, torch.Tensor) and ids.dim() in (1, 2) and ids.shape[-1] == q_len:
        return ids.reshape(-1, q_len).to(query.device)
    cache_position = kwargs.get("cache_position")
    if isinstance(cache_position, torch.Tensor) and cache_position.numel() == q_len:
        return cache_position.reshape(1, q_len).to(query.device)
    start = max(key.shape[-2] - q_len, 0)
    return torch.arange(start, start + q_len, device=query.device).view(1, q_len)


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision a scale is computed and applied in: float64 for float64 queries, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def submodule(module: nn.Module, name: str) -> nn.Module | None:
    """``module``'s submodule ``name``, or None: a dictionary lookup (``getattr`` with a default pays
    ``nn.Module.__getattr__``'s exception on a miss, and attention calls ask on every step)."""
    return module.__dict__.get("_modules", {}).get(name)


def query_factor(module: nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any],
                 temperature: bool = True) -> torch.Tensor | None:
    """``lambda(pos) / T`` broadcastable to ``query [B, H, q, D]`` (None: the module scales nothing);
    ``temperature=False`` leaves the temperature out (calibration divides by its own)."""
    heat = submodule(module, TEMPERATURE_ATTR) if temperature else None
    length = submodule(module, LENGTH_SCALE_ATTR)
    if heat is None and length is None:
        return None
    dtype, heads = scale_dtype(query.dtype), query.shape[1]
    factor = None
    if length is not None:
        if length.delta.numel() != heads:
            raise ValueError(f"the length scale has {length.delta.numel()} heads, the attention {heads}")
        factor = length(query_positions(query, key, kwargs), dtype)
    if heat is not None:
        temps = heat(query.device, dtype)
        if temps.numel() != heads:
            raise ValueError(f"{temps.numel()} temperatures for an attention of {heads} query heads")
        temps = temps.view(1, heads, 1, 1)
        factor = 1 / temps if factor is None else factor / temps
    return factor


def apply_factor(query: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """``query * factor`` in the factor's precision, rounded once to the query's dtype."""
    if factor is None:
        return query
    return (query.to(factor.dtype) * factor).to(query.dtype)


def scale_queries(module: nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """The queries the attention kernels see: scaled by the module's temperature and length scale, if any."""
    return apply_factor(query, query_factor(module, query, key, kwargs))


def query_scale_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable temperatures (``log_temperature``) and length-scale parameters (``delta``, ``beta``,
    ``gamma``) of a patched model, named as ``named_parameters`` names them: put them in an optimizer group of
    their own (their own learning rate, no weight decay; decay would pull ``log T`` to 0 and ``delta`` to 0)."""
    owners = (TEMPERATURE_ATTR, LENGTH_SCALE_ATTR)
    return [(name, p) for name, p in model.named_parameters()
            if p.requires_grad and name.rsplit(".", 2)[-1] in SCALE_PARAMETERS
            and any(f"{owner}." in name for owner in owners)]
