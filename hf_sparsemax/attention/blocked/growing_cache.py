"""A transformers ``Cache`` that appends a token without copying the layer's keys and values.

transformers' ``DynamicCache`` appends with ``torch.cat``: every decoding step copies each layer's whole K and V
(O(n) a token, O(n^2) a generation). :class:`GrowingLayer` keeps them in buffers ``[B, Hkv, capacity, D]`` and
writes a step's keys after the filled ones; ``keys`` / ``values`` are views of the filled part
``buffer[:, :, :n]`` (rows contiguous, heads and batch strided by the capacity). When a step does not fit, the
buffers are reallocated with ``growth`` times the keys they hold (:func:`grown_size`: rounded down to
:data:`ROUND` keys, never below the new length rounded up): a key is copied ``1 / (growth - 1)`` times on
average over a generation, against ``n / 2`` times by ``torch.cat``. Right after a reallocation the buffers
hold at most ``growth`` times the keys and values cached, or the length rounded up to ``ROUND`` keys where that is
more (short caches); between reallocations less (:meth:`GrowingCache.nbytes`). ``growth=1.04`` keeps the memory
within 5% from 1260 keys, at the price of a reallocation every 4% of the length.

The library's page summaries and int8 key codes (:mod:`.pages`, :mod:`.keycodes`) follow the layer as they
follow a ``DynamicLayer``: the attention module's pre-hook checks that the summary describes ``layer.keys`` (the
same view, its buffer not written since) before the step appends, so the summary and codes are carried across
appends and reallocations (the filled keys keep their values), and a crop, reorder or reset gives a new view
(a new summary, or a reordered one).

Under autograd (a forward with gradients on that appends: a training step with ``use_cache=True``, an RL rollout
with gradients) the layer appends as a ``DynamicLayer`` does, with ``torch.cat``, and drops its buffers: the keys
and values it returns may be saved for backward, and a later step's write into their buffers (after them, or
over them after a crop or reorder) would be an in-place change autograd refuses at backward. The next step
without gradients takes the keys into new buffers.

``crop`` and beam search's ``reorder_cache`` are in place: keys kept stay where they are, and the slots after a
crop are written again by later steps (a view taken before the crop sees those writes; the cache's own views
never do). Anything else that replaces ``keys`` / ``values`` (``batch_select_indices``,
``batch_repeat_interleave``, an offload) leaves tensors that are not views of the buffers: the next ``update``
takes them into new buffers.

On by default for a model whose attention ``patch_model`` made sparse: :func:`prepare_cache_for_generation`
(installed on the model by the attention swap) lets transformers make ``generate``'s cache, then replaces a new
``DynamicCache`` of plain ``DynamicLayer`` s (no sliding window, chunked or linear-attention layer, no offloading,
not an encoder-decoder's) by a ``GrowingCache(GENERATE_GROWTH)``: the same keys and values to the model, so the
same tokens and scores. A cache given to ``generate`` and any ``cache_implementation`` (``"dynamic"`` included)
are left as they are.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..._model import remove_instance_method, set_instance_method

ROUND = 64  # keys: capacities are multiples of it (a page of :mod:`.pages`)
GENERATE_GROWTH = 1.04  # growth of the cache generate makes for a patched model: at most ~5% more than its keys
HOOK_TAG = "hf_sparsemax_growing_cache"  # marks the instance method :func:`prepare_cache_for_generation`


def grown_size(length: int, filled: int, growth: float, unit: int) -> int:
    """Slots of a buffer reallocated to hold ``length`` keys, ``filled`` of them held before: ``growth`` times
    ``filled`` rounded down to a multiple of ``unit``, at least ``length`` rounded up to one (the one rule of
    the cache's buffers and of their int8 codes, :mod:`.keycodes`)."""
    return max(-(-length // unit) * unit, int(filled * growth) // unit * unit)


def check_growth(growth) -> float:
    if isinstance(growth, bool) or not isinstance(growth, (int, float)) or not 1 < growth <= 16:
        raise ValueError(f"GrowingCache: growth must be a number in (1, 16], got {growth!r}")
    return float(growth)


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in preallocated buffers grown ``growth`` times when full
    (module docstring)."""

    def __init__(self, growth: float = 2.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.growth = check_growth(growth)
        self.key_buffer = self.value_buffer = None
        self.views = None  # (keys, values): the views of the buffers this layer made last

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer = self.value_buffer = self.views = None

    @property
    def capacity(self) -> int:
        return 0 if self.key_buffer is None else self.key_buffer.shape[2]

    def views_buffers(self) -> bool:
        """Whether ``keys`` / ``values`` are still the filled part of the buffers (not replaced by another tensor):
        the very views this layer made last (views of the buffers as made: one identity test, where the
        cache's update and the attention's page summary each asked 14 questions of the tensors every step), or
        tensors of the buffers' storage, shape and strides."""
        views = self.views
        if views is not None and views[0] is self.keys and views[1] is self.values:
            return True
        return all(buffer is not None and view.dim() == 4 and view.data_ptr() == buffer.data_ptr()
                   and view.stride() == buffer.stride() and view.shape[:2] == buffer.shape[:2]
                   and view.shape[3] == buffer.shape[3] and view.dtype == buffer.dtype
                   and view.device == buffer.device
                   for view, buffer in ((self.keys, self.key_buffer), (self.values, self.value_buffer)))

    def filled(self) -> int:
        return self.keys.shape[-2] if self.keys is not None and self.keys.dim() == 4 else 0

    def reserve(self, length: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers of at least ``length`` keys holding the filled keys and values (the same buffers where they fit)."""
        filled = self.filled()
        pairs = ((self.keys, key_states), (self.values, value_states))
        if filled and any(old.shape[:2] != new.shape[:2] or old.shape[3] != new.shape[3] for old, new in pairs):
            raise ValueError(f"GrowingCache: keys {tuple(key_states.shape)} / values {tuple(value_states.shape)} "
                             f"do not extend the cached {tuple(self.keys.shape)} / {tuple(self.values.shape)}")
        held = self.views_buffers()
        if held and length <= self.capacity and all(
                buffer.shape[:2] == new.shape[:2] and buffer.shape[3] == new.shape[3] and buffer.dtype == new.dtype
                for buffer, new in ((self.key_buffer, key_states), (self.value_buffer, value_states))):
            return
        size = grown_size(length, filled if held else 0, self.growth, ROUND)
        buffers = []
        for old, new in pairs:
            batch, heads, _, dim = new.shape
            buffer = new.new_empty(batch, heads, size, dim)
            if filled:
                buffer[:, :, :filled].copy_(old)
            buffers.append(buffer)
        self.key_buffer, self.value_buffer = buffers
        self.keys, self.values = (buffer[:, :, :filled] for buffer in buffers)
        self.views = (self.keys, self.values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new keys and values after the filled ones; return the views of all of them. With gradients
        on, ``DynamicLayer``'s append instead (module docstring)."""
        if torch.is_grad_enabled():  # autograd may save the returned keys: later writes into them must not happen
            self.key_buffer = self.value_buffer = self.views = None
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        filled = self.filled()
        length = filled + key_states.shape[-2]
        self.reserve(length, key_states, value_states)
        self.key_buffer[:, :, filled:length].copy_(key_states)
        self.value_buffer[:, :, filled:length].copy_(value_states)
        self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]
        self.views = (self.keys, self.values)
        return self.keys, self.values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search's reorder of the batch rows, in the buffers (new views: a page summary follows it)."""
        if self.get_seq_length() == 0:
            return
        if not self.views_buffers():
            return super().reorder_cache(beam_idx)
        length = self.keys.shape[-2]
        for buffer, view in ((self.key_buffer, self.keys), (self.value_buffer, self.values)):
            buffer[:, :, :length].copy_(view.index_select(0, beam_idx.to(buffer.device)))
        self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]
        self.views = (self.keys, self.values)

    def reset(self) -> None:
        super().reset()
        self.key_buffer = self.value_buffer = self.views = None

    def nbytes(self) -> tuple[int, int]:
        """``(bytes held, bytes of the keys and values cached)``: the buffers against their filled part."""
        if not self.is_initialized or self.keys is None:
            return 0, 0
        cached = self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
        held = sum(b.numel() * b.element_size() for b in (self.key_buffer, self.value_buffer) if b is not None)
        return (held if self.views_buffers() else cached), cached


class GrowingCache(Cache):
    """A ``Cache`` of :class:`GrowingLayer` (one a model layer, made as the model first writes it): pass it to
    ``model.generate(past_key_values=GrowingCache())`` or a forward's ``past_key_values``. ``growth``: the factor
    a full layer's capacity grows by (default 2; 1.05 holds at most 5% more memory than the keys and values)."""

    def __init__(self, growth: float = 2.0) -> None:
        growth = check_growth(growth)
        super().__init__(layer_class_to_replicate=GrowingLayer)
        self.growth = growth

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(GrowingLayer(self.growth))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def nbytes(self) -> tuple[int, int]:
        """``(bytes held by the buffers, bytes of the keys and values they hold)`` over the layers."""
        counts = [layer.nbytes() for layer in self.layers]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)


CACHE_KEYS = ("cache", "past_key_values")  # generate's name for the cache: `cache` from transformers 5.24, before it


def replaceable(model, generation_config, cache) -> bool:
    """Whether ``cache``, the one transformers' ``generate`` just made for ``model`` (none given), is a plain
    ``DynamicCache`` a :class:`GrowingCache` is exact for: every layer a ``DynamicLayer`` (made lazily or from the
    config), not offloaded, no ``cache_implementation`` asked for, not an encoder-decoder."""
    from transformers.cache_utils import DynamicCache

    return (type(cache) is DynamicCache and generation_config.cache_implementation is None
            and not getattr(cache, "offloading", False) and not model.config.is_encoder_decoder
            and getattr(cache, "layer_class_to_replicate", None) in (None, DynamicLayer)
            and all(type(layer) is DynamicLayer for layer in cache.layers))


def prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs):
    """A patched model's ``_prepare_cache_for_generation`` (an instance method, module docstring): transformers'
    own, then its new ``DynamicCache`` replaced by a ``GrowingCache`` where :func:`replaceable` says so."""
    given = any(model_kwargs.get(key) is not None for key in CACHE_KEYS)
    result = type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)
    made = next((key for key in CACHE_KEYS if model_kwargs.get(key) is not None), None)
    if not given and made is not None and replaceable(self, generation_config, model_kwargs[made]):
        cache = model_kwargs[made] = GrowingCache(GENERATE_GROWTH)
        if generation_config.is_assistant:  # as transformers does for its own (crops come back to this cache)
            cache.activate_past_recording()
    return result


def install_default(model) -> None:
    """Make ``generate`` of ``model`` (a transformers model) use a GrowingCache where it would make a plain
    DynamicCache (undone by :func:`remove_default`)."""
    if hasattr(type(model), "_prepare_cache_for_generation"):
        set_instance_method(model, "_prepare_cache_for_generation", prepare_cache_for_generation, HOOK_TAG)


def remove_default(model) -> None:
    remove_instance_method(model, "_prepare_cache_for_generation", HOOK_TAG)
