"""Exact KV skipping at decode time: page summaries beside the cache, and the pages they prove weigh nothing.

A decoding step of alpha-entmax attention (alpha > 1) gives key ``j`` of a score row ``s`` the weight

    p_j = relu((alpha - 1)(s_j - shift) - tau) ** (1 / (alpha - 1)),   shift = max s,

so ``p_j = 0`` exactly when ``s_j <= cut = shift + tau / (alpha - 1)`` (the threshold in the scores' units). Two
facts make ``cut`` certifiable without reading every key (THEORY.md, "Exact KV skipping at decode time"):

- the ``cut`` of a subset of the keys is at most the ``cut`` of all of them (adding a key never lowers the
  threshold), so a ``cut_S`` solved over the keys of a few pages is a lower bound of the true one;
- with the per-channel ``min_c``, ``max_c`` of a page's keys (its summary, ``2 D`` numbers for ``PAGE`` keys),
  every score of the page is at most ``U = scaling * sum_c max(q_c min_c, q_c max_c) + max(mask over the page)``
  (Quest, Tang et al. 2024, ranks pages by this bound; here it certifies them).

A page with ``U <= cut_S`` for every query row of its kv head has weight exactly 0: its keys and values are never
read. :func:`skipping_attention` scores ``FIRST_PAGES`` pages (the first, the last full one, the best-bounded
others) and the partly filled last page, solves ``cut_S`` with the mapping's own exact solver, keeps every page
not certified, and solves the kept keys: the same threshold and weights as over all keys (the keys left out
have weight 0), so the output is the full computation's to rounding. The certificate keeps a margin of
``sqrt(eps)`` relative to ``cut`` (far above the rounding of the scores and the bound).

The summaries live on transformers' cache layer (``DynamicLayer``, ``StaticLayer``) as :class:`PageSummary`,
brought up to date incrementally: a decoding step adds a full page every ``PAGE`` keys, the first step past
``MIN_KEYS`` summarises the prefix. The attention function does not receive the cache, so a forward pre-hook
on each attention module (:func:`remember_cache`, installed by the attention swap) hands it the module's cache
layer, and checks before the cache changes that the summary still describes its keys (the same tensor, not
modified in place, not cropped); a cropped or reset cache gets a new summary, and a beam search's reorder
(``reorder_cache``) reorders the summary and its codes with the keys (:func:`follow_reorders`). The summary also carries
the keys' int8 copies where the fused kernel serves the step (:mod:`.keycodes`: a per-key bound that certifies
rotary keys, where page bounds certify none; the pages are then not summarised). Switched off with the
environment variable ``HF_SPARSEMAX_KV_SKIP=0``.
"""

from __future__ import annotations

import functools
import os
import types
import weakref

import torch

from ...mappings import compiled
from ...mappings._core import masked_below
from .growing_cache import GrowingLayer
from .step_memo import Memo, reference, same

PAGE = 64  # keys a page
MIN_KEYS = 1024  # cached keys from which a decoding step skips pages (measured: below, the full step is as fast)
FIRST_PAGES = 8  # pages scored first (with the partly filled last one)
RETRY = 32  # steps a layer waits after a try that kept more than MAX_KEPT of its pages
MAX_KEPT = 0.5  # share of the pages above which the full step is cheaper than gathering the kept ones
GATHER_VALUES_BELOW = 0.25  # share of a head's keys with weight up to which P V reads only their values
ENVIRONMENT = "HF_SPARSEMAX_KV_SKIP"
SUMMARY_ATTR = "hf_sparsemax_pages"  # on a cache layer: its PageSummary
LAYER_ATTR = "_hf_sparsemax_cache_layer"  # on an attention module, from its pre-hook to its attention call
# on an attention module, set by its pre-hook: whether this call was given output_attentions=True (a module that
# takes it by name and does not pass it on to its attention function: Falcon from transformers 5.25)
WEIGHTS_ATTR = "_hf_sparsemax_weights_asked"
COUNTS = {"calls": 0, "pages": 0, "skipped": 0}  # attention calls that skipped, pages they had, pages not read


def enabled() -> bool:
    """Whether decoding steps skip pages (not switched off by ``HF_SPARSEMAX_KV_SKIP=0``)."""
    return os.environ.get(ENVIRONMENT, "1") != "0"


def skipped_share() -> float:
    """The share of pages never read by the calls counted in :data:`COUNTS` (0 when there were none)."""
    return COUNTS["skipped"] / COUNTS["pages"] if COUNTS["pages"] else 0.0


def reset_counts() -> None:
    COUNTS.update(calls=0, pages=0, skipped=0)


@functools.lru_cache(maxsize=1)
def layer_kinds() -> tuple[type, ...]:
    """The cache layers whose keys a summary can follow: appended to (``DynamicLayer``: a new tensor, the old
    one its prefix) or written in place after the filled length (``StaticLayer``). Not a sliding window (drops
    its oldest keys) nor a quantized cache (hands the attention other tensors than it keeps). The library's
    :class:`.growing_cache.GrowingLayer` appends in place after its filled views (a new view each step).
    (Imported once: every layer's call asks.)"""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    return DynamicLayer, StaticLayer, GrowingLayer


def filled(layer) -> int:
    """Keys written to a cache layer."""
    length = getattr(layer, "cumulative_length", None)
    return int(length) if length is not None else layer.keys.shape[-2]


class PageSummary:
    """Per-channel ``mins``, ``maxs [B, Hkv, pages, D]`` of the first ``pages`` full pages of a layer's keys, and
    what they were taken from: the keys tensor (a weak reference), its in-place version and filled length."""

    def __init__(self, key: torch.Tensor) -> None:
        batch, heads, _, dim = key.shape
        self.mins = self.maxs = key.new_empty(batch, heads, 0, dim)
        self.source, self.version, self.length, self.carried = None, -1, 0, False
        self.wait = 0  # decoding steps before the next try (after one that did not pay: RETRY)
        self.codes = None  # the keys' int8 copies (.keycodes.KeyCodes), where the fused kernel certifies

    @property
    def pages(self) -> int:
        return self.mins.shape[2]

    def describes(self, layer) -> bool:
        """Whether these pages are still pages of ``layer``'s keys (checked before the cache adds keys)."""
        keys = layer.keys
        return (keys is not None and same(self.source, keys) and keys._version == self.version
                and filled(layer) >= self.length)

    def track(self, key: torch.Tensor, length: int) -> "PageSummary":
        """Record that the pages (and codes) describe ``key[..., :length, :]`` (brought up to date on use)."""
        self.source, self.version, self.length, self.carried = reference(key), key._version, length, False
        return self

    def update(self, key: torch.Tensor, length: int) -> "PageSummary":
        """Summarise the full pages of ``key[..., :length, :]`` not summarised yet (``key``: the keys
        :meth:`track` recorded, or a view of their first ``length``, as :func:`filled_part` cuts them)."""
        pages = length // PAGE
        if pages > self.pages:
            new = key[:, :, self.pages * PAGE : pages * PAGE].unflatten(2, (pages - self.pages, PAGE))
            self.mins = torch.cat([self.mins, new.amin(3)], dim=2)
            self.maxs = torch.cat([self.maxs, new.amax(3)], dim=2)
        self.length = length
        return self

    def reorder(self, index: torch.Tensor) -> None:
        """Take batch rows ``index`` (a beam search's reorder), codes included."""
        self.mins, self.maxs = self.mins.index_select(0, index), self.maxs.index_select(0, index)
        if self.codes is not None:
            self.codes.reorder(index)

    def __getstate__(self):  # a copied summary describes no tensor (rebuilt on use)
        return dict(vars(self), source=None, codes=None)


def reorder_with_summary(layer, beam_idx: torch.LongTensor) -> None:
    """``layer.reorder_cache`` (installed by :func:`follow_reorders`): the layer's own reorder, then its summary's
    (where the summary described the keys before): the same pages and codes, in the new order, never re-coded."""
    summary = getattr(layer, SUMMARY_ATTR, None)
    current = summary is not None and summary.describes(layer)
    type(layer).reorder_cache(layer, beam_idx)
    if current and layer.keys is not None and layer.keys.shape[0] == summary.mins.shape[0]:
        summary.reorder(beam_idx.to(summary.mins.device))
        summary.track(layer.keys, summary.length)


def follow_reorders(layer) -> None:
    """Make a cache layer's ``reorder_cache`` reorder its summary too (a bound method on the instance: a deep copy
    of the cache binds it to the copy)."""
    if "reorder_cache" not in vars(layer):
        layer.reorder_cache = types.MethodType(reorder_with_summary, layer)


def remember_cache(module, args, kwargs) -> None:
    """Forward pre-hook of an attention module: keep a reference to its cache layer for the attention call, and
    mark whether the layer's summary still describes the keys the cache is about to extend; note whether the call
    asks for the attention weights (:data:`WEIGHTS_ATTR`)."""
    if torch.compiler.is_compiling():  # a compiled model takes the materialised path: nothing to hand over
        return None
    vars(module)[WEIGHTS_ATTR] = bool(kwargs.get("output_attentions"))
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layers, index = getattr(cache, "layers", None), getattr(module, "layer_idx", None)
    layer = None
    if isinstance(layers, list) and isinstance(index, int) and 0 <= index < len(layers):
        layer = layers[index] if type(layers[index]) in layer_kinds() else None
    summary = getattr(layer, SUMMARY_ATTR, None) if getattr(layer, "keys", None) is not None else None
    if summary is not None:
        summary.carried = summary.describes(layer)
    vars(module)[LAYER_ATTR] = None if layer is None else weakref.ref(layer)


def install(module) -> None:
    module.register_forward_pre_hook(remember_cache, with_kwargs=True)


def uninstall(module) -> None:
    for handle, hook in list(module._forward_pre_hooks.items()):
        if hook is remember_cache:
            del module._forward_pre_hooks[handle]
            module._forward_pre_hooks_with_kwargs.pop(handle, None)
    vars(module).pop(LAYER_ATTR, None)
    vars(module).pop(WEIGHTS_ATTR, None)


def take_layer(module):
    """The cache layer the module's pre-hook found for this call (None without one), forgotten by the module."""
    ref = vars(module).pop(LAYER_ATTR, None)
    return None if ref is None else ref()


def strided_rows(layer, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``key`` / ``value`` are a :class:`.growing_cache.GrowingLayer`'s views of its buffers (rows
    contiguous, heads strided by the capacity: the fused kernel reads them by their strides; page gathers read a
    contiguous copy)."""
    return isinstance(layer, GrowingLayer) and value is layer.values and layer.views_buffers()


def page_summary(layer, key: torch.Tensor, value: torch.Tensor, mask) -> tuple[PageSummary, int] | None:
    """``(summary, filled length)`` of the cache ``layer`` if this call got its keys, or None: no layer, too few
    keys (fewer than ``MIN_KEYS``, or not one full page), skipping switched off."""
    if layer is None or layer.keys is not key or not enabled():
        return None
    if not (key.is_contiguous() and value.is_contiguous() or strided_rows(layer, key, value)):
        return None
    length = filled(layer)
    if length < max(MIN_KEYS, PAGE) or (length < key.shape[-2] and mask is None):  # unwritten slots need a mask
        return None
    summary = getattr(layer, SUMMARY_ATTR, None)
    if (summary is None or not (summary.carried or same(summary.source, key) and key._version == summary.version)
            or summary.mins.shape[:2] != key.shape[:2]):
        summary = PageSummary(key)
        setattr(layer, SUMMARY_ATTR, summary)
        follow_reorders(layer)
    return summary.track(key, length), length


def filled_part(layer, key: torch.Tensor, value: torch.Tensor, mask):
    """``(key, value, mask)`` of a decoding call without the cache slots not written yet, where ``mask`` (additive
    or boolean, over ``key``'s slots) masks every one of them for every query row: a static cache's step then costs
    its filled length, not its size. The slots cut weigh exactly 0 in every mapping, so the output is the one over
    the filled keys alone (a ``DynamicCache``'s). Where the mask then lets every row see every filled slot (no
    padding: additive zeros, or all True), it is dropped (None): adding 0 to a score changes no score, so the step
    is the same without it, and the kernel reads no mask per key. Anything else (no layer, not this layer's keys,
    no mask, a slot past the filled length the mask lets some row see) is returned as it is. The mask's analysis
    is made once a step, for the first layer, and reused by the others (:mod:`.step_memo`)."""
    if layer is None or mask is None or layer.keys is not key or mask.shape[-1] != key.shape[-2]:
        return key, value, mask
    length = filled(layer)
    if not 0 < length < key.shape[-2]:
        return key, value, mask
    hides, sees_all = HIDES_TAIL((mask,), (mask._version, mask.shape, length))
    if not hides:
        return key, value, mask
    return key[:, :, :length], value[:, :, :length], None if sees_all else mask[..., :length]


def hides_tail(mask, version: int, shape, length: int) -> tuple[bool, bool]:
    """``(hides, sees_all)``: whether the additive or boolean ``mask`` hides every slot from ``length`` on from
    every query row, and whether it lets every row see every slot before it (additive 0, or True, throughout)
    (``version`` and ``shape``: what :data:`HIDES_TAIL` compares, the mask's in-place version counter and size)."""
    rest, head = mask[..., length:], mask[..., :length]
    if rest.dtype == torch.bool:
        return not bool(rest.any()), bool(head.all())
    return bool((rest <= masked_below(rest.dtype)).all()), bool((head == 0).all())


HIDES_TAIL = Memo(hides_tail)  # once a step for all layers: the same mask object, version and filled length


def page_bounds(query: torch.Tensor, summary: PageSummary, mask, scaling: float) -> torch.Tensor:
    """``U [B, Hkv, G q, pages]``: an upper bound of every (masked) score of each page, for each query row
    (``query [B, Hkv, G, q, D]``; ``mask`` additive ``[B | 1, Hkv | 1, G | 1, q, kv]`` or None)."""
    batch, kv_heads, groups, rows, dim = query.shape
    q = query.reshape(batch, kv_heads, groups * rows, dim)
    maxs, mins = summary.maxs.to(q.dtype), summary.mins.to(q.dtype)  # a half cache's keys: exact in float32
    bound = torch.matmul(q.clamp_min(0), maxs.transpose(-1, -2))
    bound.add_(torch.matmul(q.clamp_max(0), mins.transpose(-1, -2))).mul_(scaling)
    if mask is not None:
        pages = summary.pages
        worst = mask[..., : pages * PAGE].unflatten(-1, (pages, PAGE)).amax(-1)
        bound.add_(worst.expand(batch, kv_heads, groups, rows, pages).reshape(bound.shape))
    return bound


def gather_pages(problem, pages: torch.Tensor, full: int, length: int, valid: torch.Tensor | None = None):
    """``(scores [B, Hkv, G q, m], rows of K and V [B Hkv m])`` of the keys of ``pages [B, Hkv, k]`` (page indices
    per kv head) and of the partly filled last page ``[full, length)``; pages where ``valid`` is False are masked."""
    query, key, mask = problem.query, problem.key, problem.mask
    batch, kv_heads, groups, rows, dim = query.shape
    device = key.device
    positions = (pages.unsqueeze(-1) * PAGE + torch.arange(PAGE, device=device)).flatten(-2)
    if valid is not None:
        valid = valid.unsqueeze(-1).expand(*valid.shape, PAGE).flatten(-2)
    if length > full:
        tail = torch.arange(full, length, device=device).expand(batch, kv_heads, -1)
        positions = torch.cat([positions, tail], dim=-1)
        if valid is not None:
            valid = torch.cat([valid, valid.new_ones(tail.shape)], dim=-1)
    starts = torch.arange(batch * kv_heads, device=device).view(batch, kv_heads, 1) * key.shape[-2]
    index = (positions + starts).flatten()
    keys = take_rows(key, index).view(batch, kv_heads, -1, dim).to(query.dtype)  # half: exact
    q = query.reshape(batch, kv_heads, groups * rows, dim)
    scores = torch.matmul(q, keys.transpose(-1, -2))
    if mask is not None:
        seen = mask.expand(batch, kv_heads, groups, rows, mask.shape[-1])
        seen = seen.gather(-1, positions[:, :, None, None, :].expand(batch, kv_heads, groups, rows, -1))
        scores = torch.add(seen.reshape(scores.shape), scores, alpha=problem.scaling)
    else:
        scores.mul_(problem.scaling)
    if valid is not None:
        scores.masked_fill_(~valid.unsqueeze(2), masked_below(scores.dtype))
    return scores, index


def skipping_attention(problem, summary: PageSummary, length: int, row_alpha, minimum: int):
    """Output ``[B, Hkv, G q, D]`` of a decoding step (:class:`.blocks.Problem`, keys ``[0, length)``) from the
    pages the certificate cannot exclude (module docstring), or None where the full step is the way: a row whose
    first pages are all masked (no certificate), too many pages kept to pay, or the layer's last try kept too
    many (then the next ``RETRY`` steps do not try: the bound is loose on keys whose channels vary within a page).
    """
    batch, kv_heads = problem.key.shape[:2]
    summary.update(problem.key, length)
    full, pages = summary.pages * PAGE, summary.pages
    COUNTS["calls"] += 1
    COUNTS["pages"] += batch * kv_heads * pages
    if summary.wait > 0:
        summary.wait -= 1
        return None
    summary.wait = RETRY
    masked = masked_below(problem.query.dtype)
    bound = page_bounds(problem.query, summary, problem.mask, problem.scaling)
    rank = bound.amax(2)
    rank[..., 0] = rank[..., -1] = float("inf")  # the first page (a sink) and the most recent full one
    first = rank.topk(min(FIRST_PAGES, pages), dim=-1, sorted=False).indices
    scores, index = gather_pages(problem, first, full, length)
    rows = scores.view(-1, scores.shape[-1])
    shift = rows.amax(-1, keepdim=True)  # the solver's shift: the row's maximum
    if bool((shift <= masked).any()):
        return None
    p, tau = compiled.weights(rows, masked, row_alpha, problem.threshold, minimum=minimum)
    cut = shift + tau / (row_alpha - 1)
    cut = cut - torch.finfo(cut.dtype).eps ** 0.5 * (1 + cut.abs())  # weight 0 at or below: certified
    kept = (bound > cut.view(*bound.shape[:-1], 1)).any(2)  # [B, Hkv, pages]: some row may weigh the page
    kept.scatter_(-1, first, True)
    most, total = torch.stack([kept.sum(-1).max(), kept.sum()]).tolist()
    if most > MAX_KEPT * pages:
        return None
    summary.wait = 0
    COUNTS["skipped"] += batch * kv_heads * pages - total
    if most != first.shape[-1]:  # pages beyond the first ones may count: solve them too
        chosen = kept.to(torch.uint8).topk(most, dim=-1, sorted=False).indices
        scores, index = gather_pages(problem, chosen, full, length, kept.gather(-1, chosen))
        rows = scores.view(-1, scores.shape[-1])
        p = compiled.weights(rows, masked, row_alpha, problem.threshold, minimum=minimum)[0]
    return weighted_values(p.view(scores.shape), problem.value, index)


def take_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor.reshape(-1, D).index_select(0, index)`` for ``tensor [B, H, n, D]``, without copying a tensor whose
    rows are contiguous and heads evenly strided (a cache's filled part: a growing cache's views, a static cache's
    first slots) as ``reshape`` would: the rows are read from the buffer it views."""
    batch, heads, length, dim = tensor.shape
    room = tensor.stride(1) // dim if dim else 0  # rows from one head's first to the next's
    viewed = (tensor.stride(3) == 1 and tensor.stride(2) == dim and tensor.stride(1) == room * dim
              and tensor.stride(0) == heads * room * dim and length <= room
              and tensor.storage_offset() + batch * heads * room * dim
              <= tensor.untyped_storage().nbytes() // tensor.element_size())
    if not viewed or room == length:
        return tensor.reshape(-1, dim).index_select(0, index)
    rows = tensor.as_strided((batch * heads * room, dim), (dim, 1))
    return rows.index_select(0, index + torch.div(index, length, rounding_mode="floor") * (room - length))


def weighted_values(p: torch.Tensor, value: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """``p V`` (``p [B, Hkv, G q, m]``) over the rows of ``V`` some weight of their kv head is nonzero on, in ``p``'s
    dtype.

    ``index``: the rows of ``value.reshape(-1, D)`` the ``m`` columns of ``p`` weigh (``[B Hkv m]``), or None for
    ``value [B, Hkv, m, D]`` itself (then from ``MIN_KEYS`` keys: at 512 the search for the support cost more
    than it saved). Where at most ``GATHER_VALUES_BELOW`` of the columns carry weight (a kv
    head's rows: 2 to 20 keys of 2048 for sparsemax on real text), only their value rows are read (the padding
    of a head with fewer gathers weight 0); else one dense product. A half-precision ``value`` (a decoding step's
    cache, left as it is) has only the rows read cast to ``p``'s float32, at every length: exact, and no copy of
    the whole cache.
    """
    batch, kv_heads, rows, keys = p.shape
    dim = value.shape[-1]
    half = value.dtype != p.dtype
    if index is None and keys < MIN_KEYS and not half:  # short rows: the dense product costs less than the search
        return torch.matmul(p, value)
    live = p.ne(0).any(2)  # [B, Hkv, m]
    most = int(live.sum(-1).max())
    if index is None and (most > GATHER_VALUES_BELOW * keys or not value.is_contiguous()):
        return torch.matmul(p, value.to(p.dtype))
    if index is None:
        index = torch.arange(batch * kv_heads * keys, device=p.device)
    if most <= GATHER_VALUES_BELOW * keys:
        chosen = live.to(torch.uint8).topk(most, dim=-1, sorted=False).indices  # [B, Hkv, most]
        p = p.gather(-1, chosen.unsqueeze(2).expand(batch, kv_heads, rows, most))
        index = index.view(batch, kv_heads, keys).gather(-1, chosen)
    values = take_rows(value, index.flatten()).view(batch, kv_heads, -1, dim)
    return torch.matmul(p, values.to(p.dtype))
