"""What a serving engine samples for each request, and the batched logits step that makes it so.

Engine-neutral and torch-only (no vLLM import): :mod:`hf_sparsemax.integrations.vllm.plugin` adapts it to
vLLM's logits-processor interfaces, and the main test suite drives it with fake batches.

A request's :class:`Choice` is the folder's trained loss (``config.json``'s ``hf_sparsemax``
settings) unless the request's extra arguments say otherwise:

- ``hf_sparsemax``: a loss name (``"sparsemax"``, ``"entmax_bisect"``, ...) to sample from instead,
  or ``"off"`` for the engine's own softmax sampling;
- ``hf_sparsemax_<option>``: an option of that loss (``hf_sparsemax_top_k=5``,
  ``hf_sparsemax_alpha=1.3``, ``hf_sparsemax_order=4``); without ``hf_sparsemax`` they change the
  options of the folder's loss.

Flat keys with scalar values, so that they also pass through an OpenAI-compatible server's
``vllm_xargs``. The distribution is the registry's mapping of the loss
(:func:`hf_sparsemax.losses.names.loss_mapping`); the step writes ``log p`` (``-inf`` outside the
support) into the logits, so that the engine's ``softmax`` + draw samples ``p`` exactly.

Temperature. ``p = mapping(x / T)`` as in :mod:`hf_sparsemax.decoding.generation`. Where the engine divides the
logits by ``T`` before the step (vLLM V1 runs argmax-invariant processors after its temperature),
:meth:`BatchDecoding.apply` is called with ``scaled=True`` and maps the rows as they come. Where the
engine divides after the step (vLLM V1's other processors, vLLM's Model Runner V2), it writes
``T * log mapping(x / T)``, which the engine's division turns into ``log mapping(x / T)``. Greedy
requests (``T`` = 0) get ``log mapping(x)``: their argmax is the mode of the trained distribution.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Mapping

import numpy as np
import torch

from ..losses.names import loss_mapping
from ..mappings import registry
from ..mappings._core import masked_below
from ..settings import SparseSettings

KEY = "hf_sparsemax"  # the extra argument naming the loss ("off": the engine's softmax)
OPTION_PREFIX = KEY + "_"
OFF = "off"
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (vLLM's threshold)
PER_REQUEST_REFUSED = {
    "perturb_max": "perturb_max costs `points` (default 256) softmaxes per row and supports at most 4096 classes: "
                   "it is sampled only as the trained loss of a folder with such a vocabulary, not on request",
}


def decoding_losses() -> tuple[str, ...]:
    """The losses a causal LM can be sampled from (the registry's processors for causal LM heads)."""
    return tuple(name for name in registry.names("processor") if "causal_lm" in registry.REGISTRY[name].tasks)


@dataclasses.dataclass(frozen=True)
class Choice:
    """One request's distribution: a loss and the options of its mapping."""

    loss: str
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def make(cls, loss: str, options: Mapping[str, Any] | None = None) -> "Choice":
        """The choice of ``loss`` with ``options``, the mapping's own: a ``ValueError`` (a request's 400) names
        those a request can set; ``fused``, which says how a loss is computed in training, is not one."""
        if loss not in decoding_losses():
            raise ValueError(f"{KEY}={loss!r}: not a loss to sample from; choose one of {[*decoding_losses(), OFF]}")
        options = dict(options or {})
        registry.REGISTRY[loss].parse(options, what="sampling options")  # names and values, a sentence saying which
        return cls(loss, tuple(sorted(options.items())))

    @classmethod
    def trained(cls, loss: str, loss_options: Mapping[str, Any] | None = None) -> "Choice":
        """The distribution ``loss`` trains with ``loss_options`` (their ``fused`` dropped: not a sampling option)."""
        return cls.make(loss, {k: v for k, v in dict(loss_options or {}).items() if k != "fused"})

    @property
    def keeps_argmax(self) -> bool:
        """Whether ``argmax(p) == argmax(x)`` for every ``x`` (the engine may skip the step for greedy requests)."""
        return registry.REGISTRY[self.loss].keeps_argmax

    def mapping(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return loss_mapping(self.loss, **dict(self.options))

    def log_mapping(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> log mapping(x)`` along the last dim of ``[rows, n]`` (``-inf`` outside the support).

        A sparse mapping with a support routine in the registry (sparsemax, entmax, top-k sparse softmax)
        computes its support only and scatters ``log p`` into a row of ``-inf``: the same values as
        ``mapping(x).log()`` without a pass over the vocabulary for ``p`` and another for ``log``.
        """
        entry, options, _ = registry.loss_options(self.loss, dict(self.options))
        if entry.support is None or (self.loss == "sparse_softmax" and options.top_k is None):
            mapping = self.mapping()
            return lambda x: mapping(x).log_()

        def log_mapping(x: torch.Tensor) -> torch.Tensor:
            index, p = entry.support(x, masked_below(x.dtype), options)[:2]
            return torch.full_like(x, float("-inf")).scatter_(-1, index, p.to(x.dtype).log_())
        return log_mapping

    def __str__(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in self.options)
        return f"{self.loss}({options})"


def folder_choice(config) -> Choice | None:
    """The trained loss of a model config (``None``: cross-entropy or no hf_sparsemax settings)."""
    settings = SparseSettings.from_config(config)
    if settings is None or settings.loss in (None, "cross_entropy"):
        return None
    return Choice.trained(settings.loss, settings.loss_options)


def request_choice(default: Choice | None, extra_args: Mapping[str, Any] | None) -> Choice | None:
    """The distribution one request samples: ``default`` (the folder's) changed by its extra arguments."""
    extra = dict(extra_args or {})
    name = extra.get(KEY)
    options = {key[len(OPTION_PREFIX):]: value for key, value in extra.items() if key.startswith(OPTION_PREFIX)}
    if name is None and not options:
        return default
    if name == OFF:
        if options:
            raise ValueError(f"{KEY}='off' with options {sorted(options)}: give one or the other")
        return None
    if name is None:
        if default is None:
            raise ValueError(f"options {sorted(options)} given, but this model has no hf_sparsemax loss: "
                             f"name one with {KEY}=<loss>")
        return Choice.make(default.loss, {**dict(default.options), **options})
    if not isinstance(name, str):
        raise ValueError(f"{KEY} must be a loss name or 'off', got {name!r}")
    if name in PER_REQUEST_REFUSED and (default is None or default.loss != name):
        raise ValueError(PER_REQUEST_REFUSED[name])
    return Choice.make(name, options)


def engine_samples(choice: Choice | None, top_k: int | None, top_p: float | None) -> bool:
    """Whether the engine's own top-k / top-p (``top_k`` <= 0: off, ``top_p`` 1: off) already sample ``choice``.

    True for a top-k / top-p sparse softmax whose options are the request's: a folder trained with it
    carries them in ``generation_config.json``, which engines take as default sampling parameters. Mapping
    the logits as well would cut the distribution twice (top-p of an already top-p-cut distribution keeps
    fewer tokens), so the step leaves those requests to the engine.
    """
    if choice is None or choice.loss != "sparse_softmax":
        return False
    options = dict(choice.options)
    return ((options.get("top_k") or 0) == max(top_k or 0, 0)
            and float(options.get("top_p") or 1.0) == float(1.0 if top_p is None else top_p))


class BatchDecoding:
    """Per-slot choices and temperatures of a batch, and the logits step for any rows of it.

    ``set(slot, choice, temperature)`` / ``clear(slot)`` / ``move(a, b)`` / ``swap(a, b)`` follow the
    engine's batch; :meth:`apply` maps each group of rows that share a choice in one batched call
    (a Python loop over the distinct choices of the batch, never over rows). ``handles`` picks the
    choices this instance maps (another instance may take the rest).
    """

    def __init__(self, handles: Callable[[Choice], bool] = lambda choice: True) -> None:
        self.handles = handles
        self.slots: dict[int, tuple[Choice, float]] = {}
        self._mappings: dict[Choice, Callable[[torch.Tensor], torch.Tensor]] = {}
        self._groups: list[tuple[Choice, list[int]]] | None = []
        self._index: dict[tuple[Hashable, str], torch.Tensor] = {}

    def set(self, slot: int, choice: Choice | None, temperature: float = 1.0) -> None:
        if choice is None or not self.handles(choice):
            self.clear(slot)
            return
        if choice not in self._mappings:
            self._mappings[choice] = choice.log_mapping()
        self.slots[slot] = (choice, float(temperature))
        self._groups = None

    def clear(self, slot: int) -> None:
        if self.slots.pop(slot, None) is not None:
            self._groups = None

    def move(self, source: int, target: int) -> None:
        """The request at ``source`` now sits at ``target`` (``source`` becomes empty)."""
        entry = self.slots.pop(source, None)
        self.slots.pop(target, None)
        if entry is not None:
            self.slots[target] = entry
        self._groups = None

    def swap(self, a: int, b: int) -> None:
        first, second = self.slots.pop(a, None), self.slots.pop(b, None)
        if first is not None:
            self.slots[b] = first
        if second is not None:
            self.slots[a] = second
        self._groups = None

    def groups(self) -> list[tuple[Choice, list[int]]]:
        """``(choice, slots)`` for each distinct choice in the batch."""
        if self._groups is None:
            grouped: dict[Choice, list[int]] = {}
            for slot, (choice, _) in sorted(self.slots.items()):
                grouped.setdefault(choice, []).append(slot)
            self._groups = list(grouped.items())
            self._mappings = {choice: self._mappings[choice] for choice in grouped}  # none kept for gone requests
            self._index = {}
            self._slot_temperatures = np.ones(max(self.slots, default=0) + 1)
            for slot, (_, temperature) in self.slots.items():
                self._slot_temperatures[slot] = temperature if temperature >= GREEDY_BELOW else 1.0
        return self._groups

    def apply(self, logits: torch.Tensor, slot_of_row: np.ndarray | None = None, scaled: bool = False) -> torch.Tensor:
        """Write ``log p`` into the rows of the batch's requests (in place; returns ``logits``).

        ``slot_of_row``: the slot of each logits row (default: row = slot). ``scaled``: the engine
        already divided the rows by their temperature (else the compensated form above).
        """
        for choice, slots in self.groups():
            rows = self._rows(choice, slots, logits, slot_of_row)
            whole = isinstance(rows, slice)
            x = logits if whole else logits[rows]
            mapping = self._mappings[choice]
            if scaled:
                out = mapping(x)
            else:
                temperature = self._temperatures(choice, slots, rows, slot_of_row, x)
                out = mapping(x / temperature).mul_(temperature)
            if whole:
                logits.copy_(out)
            else:
                logits[rows] = out
        return logits

    def _rows(self, choice: Choice, slots: list[int], logits: torch.Tensor, slot_of_row: np.ndarray | None):
        if slot_of_row is not None:
            rows = np.flatnonzero(np.isin(slot_of_row, slots))
            if len(rows) == logits.shape[0]:
                return slice(None)
            return torch.from_numpy(rows).to(logits.device)
        if len(slots) == logits.shape[0] and slots[-1] == len(slots) - 1:
            return slice(None)  # the whole batch: no gather / scatter
        key = (choice, "rows")
        if key not in self._index:
            self._index[key] = torch.tensor(slots, dtype=torch.long, device=logits.device)
        return self._index[key]

    def _temperatures(self, choice: Choice, slots: list[int], rows, slot_of_row: np.ndarray | None,
                      x: torch.Tensor) -> torch.Tensor:
        """``[rows, 1]`` temperatures of the rows (1 for greedy requests)."""
        if slot_of_row is not None:
            row_slots = slot_of_row if isinstance(rows, slice) else slot_of_row[rows.cpu().numpy()]
            return torch.from_numpy(self._slot_temperatures[row_slots]).to(x.device, x.dtype)[:, None]
        key = (choice, "temperature")
        if key not in self._index:
            values = [self.slots[slot][1] for slot in slots]
            self._index[key] = torch.tensor([[t if t >= GREEDY_BELOW else 1.0] for t in values], dtype=x.dtype,
                                            device=x.device)
        return self._index[key]
