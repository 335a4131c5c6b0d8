"""A saved sparse attention over a serving engine's paged KV cache, in torch (engine-neutral: no vLLM import).

:mod:`hf_sparsemax.integrations.vllm.plugin` hands vLLM's attention calls to :func:`paged_attention`; the main
test suite drives it with fake batches and caches. One engine step holds the new tokens of several requests
back to back (``query_start_loc``); request ``r`` has ``L = seq_lens[r]`` tokens in the cache once the step's
keys are written, ``m`` of them new, so its query row ``i`` sees the keys ``j <= L - m + i``: the same rule
covers a prefill, a chunk of a long prompt, a prompt whose prefix was already cached, and a decode step.

The cache. Each layer's ``[blocks, kv_heads, block_size, 2 * head_size]`` tensor (the shape of vLLM's CPU
backend) is read here as ``[blocks * block_size, 2, kv_heads, head_size]``: the key and value of the token in
slot ``s = block * block_size + offset`` sit in row ``s`` (this module's own layout, not the C++ kernels': a
layer only ever reads what it wrote). ``block_table[r]`` lists request ``r``'s blocks in order.

The weights of one head are ``p = mapping(q k^T * scale + mask)`` over the keys, with the exact threshold of the
saved mapping (the fused kernel's or the blocked attention's, as transformers runs them; elsewhere the registry's
solver, :mod:`hf_sparsemax.mappings.registry`, its compiled row kernel from :data:`MIN_SCORES` scores); masked
keys get weight exactly 0. A learned alpha is one value per query head. Under a half-precision model
(bfloat16, float16) the cache stays in the model's dtype and the rows a layer reads are cast to float32 (exact), so
the scores, the masks, the weights and ``P V`` are float32 computations and only the output is rounded to the
model's dtype, as transformers' path computes a half model's sparse attention
(:func:`hf_sparsemax.attention.blocked.blocks.work_operands`): both choose their supports from the same float32 scores.

One step, many layers. Everything that depends on the step's layout only (which requests decode, the cache rows
of each request's keys, the masks) is a :class:`StepPlan`, built once a step (:func:`step_plan`; vLLM's
backend keeps it on the step's attention metadata, which every layer gets) and read by every layer. A layer runs
the decode steps (one new token a request) as one padded batched call of the fused CPU kernel
(:func:`kernel_decode`, :func:`hf_sparsemax.attention.cpu.fused.paged_decode`), which reads each request's keys and
values in place through their slots; the other requests one at a time, on their keys and values gathered with
one index, through transformers' blocked threshold attention (:func:`blocked_prefill`: the same scoring, masks,
alpha per head and solver, the fused kernel's blocks included). The mappings the kernel and the blocked
attention leave out (``sparse_softmax``, alphas solved in float64, float16 caches) are scored and solved here
(:func:`attend`), queries in blocks whose scores stay within
:data:`~hf_sparsemax.attention.blocked.blocks.ATTENTION_BUDGET` entries. The plan checks the step's slots (the
decode requests' keys, the written rows) against the cache once, for all its layers (a host read:
:class:`~hf_sparsemax.attention.cpu.fused.CheckedSlots`); the decode rows' gather index is made only where the
general path gathers them. A request whose whole prompt is new in the step
(no cached prefix, not a later chunk) is attended over the step's own keys and values (as written: cast to the
cache's dtype), not gathered back out of the cache.

The int8 key certificate (:mod:`hf_sparsemax.attention.blocked.keycodes`). The first decode step of a layer with a
request of at least :data:`~hf_sparsemax.attention.blocked.pages.MIN_KEYS` keys (``HF_SPARSEMAX_KV_SKIP=0``: never;
cache blocks of a multiple of its ``BLOCK`` slots) makes the cache's :class:`~.keycodes.SlotCodes`, coding every
slot as it is; from then on :func:`write_cache` codes each slot it writes in the same step (one kernel call), so
a slot's codes are always its present key's, and the decode steps read only the keys the certificate does not
exclude (the same output bit for bit). The codes are kept per cache tensor (:data:`SLOT_CODES`), so layers that
share a cache share them; :func:`certificate_bytes` reports their memory.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ...attention.blocked.blocks import HALF, block_queries, threshold_attention
from ...attention.blocked.keycodes import BLOCK, KeyCodes, SlotCodes, take_turn, tally
from ...attention.blocked.pages import MIN_KEYS
from ...attention.blocked.pages import enabled as skipping_enabled
from ...attention.cpu.fused import KEY_DTYPES, CheckedSlots, checked_slots, paged_decode
from ...attention.interface import AttentionOptions
from ...mappings import compiled, registry
from ...mappings._core import masked_below
from ...mappings.entmax import precise_in_float32
from ...settings import SparseSettings

MIN_SCORES = 4096  # scores of a call from which the compiled threshold kernel solves them (fewer: the eager solver)
SLOT_CODES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a cache tensor -> its SlotCodes (layers sharing it too)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a layer's scores, masks, weights and ``P V`` are computed in: float32 for a half-precision model."""
    return torch.float32 if dtype in HALF else dtype


class PagedBatch(NamedTuple):
    """One engine step's layout: ``query_start_loc [R + 1]``, ``seq_lens [R]`` (cached + new tokens),
    ``block_table [R, max_blocks]``, ``slot_mapping [tokens]`` (a negative slot: a padding token, not cached)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


@dataclasses.dataclass(frozen=True)
class SparseAttention:
    """One layer's saved attention: the registry entry, its options, and a learned alpha per query head (or None)."""

    mapping: str
    options: Any
    alpha: torch.Tensor | None = None  # [heads] float32, learned (1 + sigmoid(pre_alpha)); None: the options' alpha

    @classmethod
    def from_settings(cls, settings: SparseSettings, alpha: torch.Tensor | None = None) -> "SparseAttention":
        """The attention of a folder's saved settings; ``alpha`` its layer's learned alphas (``learn_alpha``)."""
        options: AttentionOptions | None = settings.attention_options
        if options is None:
            raise ValueError(f"these settings have no sparse attention (attn={settings.attn!r})")
        if options.learn_alpha and alpha is None:
            raise ValueError(f"this folder's {settings.attn} attention learned one alpha per head: the layer's "
                             "alphas are needed (they did not load)")
        if not options.learn_alpha and alpha is not None:
            raise ValueError("learned alphas given for an attention that did not learn them")
        return cls(options.mapping, options.options, alpha)

    @functools.cached_property
    def float64(self) -> bool:
        """Whether the weights are solved in float64 (alphas that float32 rounding would spoil; read once)."""
        alpha = self.alpha if self.alpha is not None else getattr(self.options, "alpha", None)
        return alpha is not None and not precise_in_float32(alpha)

    def weights(self, scores: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        """``mapping(scores)`` along the keys of ``scores [B, H, q, kv]`` (masked keys at or below ``finfo.min``:
        weight 0); ``overwrite``: ``scores`` may hold the weights after (no copy)."""
        entry = registry.REGISTRY[self.mapping]
        rows, options = scores.reshape(-1, scores.shape[-1]), self.options
        if not overwrite and rows.data_ptr() == scores.data_ptr():
            rows = rows.clone()
        if self.float64:
            rows = rows.double()  # as the mapping computes such alphas (float32 rounding grows with 1 / (alpha - 1))
        alpha = entry.fenchel_young_alpha(options) if entry.threshold is not None else None
        if self.alpha is not None:  # one per score row, as the blocked attention of transformers passes them
            alpha = self.alpha.to(rows).view(1, -1, 1).expand(scores.shape[:-1]).reshape(-1, 1)
            options = dataclasses.replace(options, alpha=alpha)
        masked = masked_below(rows.dtype)
        if entry.threshold is None:
            p = entry.rows(rows, masked, options)
        else:  # the compiled row kernel from MIN_SCORES scores, else the eager exact solver (as decoding does)
            p, _ = compiled.weights(rows, masked, alpha, entry.threshold, minimum=MIN_SCORES)
        return p.to(scores.dtype).view(scores.shape)

    def kernel_alpha(self, kv_heads: int, groups: int) -> float | torch.Tensor | None:
        """The alpha the fused kernel solves this attention's rows with (a float, or ``[1, Hkv, G, 1, 1]``
        learned), or None where it does not (a mapping without a threshold, alphas solved in float64)."""
        entry = registry.REGISTRY[self.mapping]
        if entry.threshold is None or self.float64:
            return None
        if self.alpha is not None:
            return self.alpha.view(1, kv_heads, groups, 1, 1)
        return float(entry.fenchel_young_alpha(self.options))


@dataclasses.dataclass(frozen=True)
class QueryScales:
    """One layer's query scales (:mod:`hf_sparsemax.attention.query_scale`), for this rank's heads: ``temperature``
    ``[heads]`` and ASEntmax's length scale ``(delta, beta, gamma)``, each ``[heads]`` float32 (None: none)."""

    temperature: torch.Tensor | None = None
    length: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def apply(self, query: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """``query [tokens, H, D]`` scaled as transformers scales it: ``lambda(pos) / T`` in float32 (float64
        queries: float64), each token at its position in its request, rounded once to the query's dtype."""
        dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        factor = None
        if self.length is not None:
            delta, beta, gamma = (t.to(query.device, dtype).view(1, -1, 1) for t in self.length)
            grow = torch.log(token_positions(batch, query.shape[0]).to(dtype) + 2).view(-1, 1, 1)
            factor = delta + beta * grow ** gamma
        if self.temperature is not None:
            temps = self.temperature.to(query.device, dtype).view(1, -1, 1)
            factor = 1 / temps if factor is None else factor / temps
        return query if factor is None else (query.to(dtype) * factor).to(query.dtype)


def token_positions(batch: PagedBatch, count: int) -> torch.Tensor:
    """``[count]`` position of each of a step's first ``count`` tokens in its request: request ``r``'s ``m`` new
    tokens sit at ``seq_lens[r] - m ... seq_lens[r] - 1`` (read without a host sync)."""
    starts = batch.query_start_loc.long()
    new = starts[1:] - starts[:-1]
    first = batch.seq_lens.long() - new
    request = torch.repeat_interleave(torch.arange(len(new), device=starts.device), new, output_size=count)
    return torch.arange(count, device=starts.device) - starts[request] + first[request]


def cache_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[blocks * block_size, 2, kv_heads, head_size]`` view of a ``[blocks, kv_heads, block_size, 2 * head_size]``
    cache (see the module docstring)."""
    if not kv_cache.is_contiguous():
        raise ValueError("the paged KV cache of a sparse-attention layer must be one contiguous tensor")
    blocks, kv_heads, block_size, both = kv_cache.shape
    return kv_cache.view(blocks * block_size, 2, kv_heads, both // 2)


def key_slots(block_table: torch.Tensor, lengths: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """``[R, width]`` cache rows of each request's keys in order; past a request's length, the row of its first
    key (written, so finite: its weight there is 0)."""
    positions = torch.arange(width, device=block_table.device)
    blocks = block_table.long().gather(1, (positions // block_size).expand(len(lengths), -1).clamp_max(
        block_table.shape[1] - 1))
    slots = blocks * block_size + positions % block_size
    return torch.where(positions < lengths[:, None], slots, slots[:, :1])


def gather_index(slots: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[2 * R * kv_heads * width]``: the rows of the cache seen as ``[rows, head_size]`` (:func:`cache_rows`
    flattened) that hold the keys, then the values, of each kv head at ``slots [R, width]``: one
    ``index_select`` gathers them as ``[2, R, kv_heads, width, head_size]`` (each request's keys, and values, one
    contiguous batch of matrices)."""
    parts = torch.arange(2 * kv_heads, device=slots.device).view(2, 1, kv_heads, 1)  # (key or value) * kv_heads + head
    return (slots[None, :, None, :] * (2 * kv_heads) + parts).reshape(-1)


def gather(kv_cache: torch.Tensor, index: torch.Tensor, requests: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)``, each ``[requests, kv_heads, width, head_size]`` and contiguous, at a :func:`gather_index`."""
    rows = cache_rows(kv_cache)
    found = rows.view(-1, rows.shape[-1]).index_select(0, index).view(2, requests, rows.shape[2], width, -1)
    return found[0], found[1]


def causal_mask(first: int, stop: int, length: int, new: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask ``[1, 1, 1, stop - first, length]`` of a request's new query rows ``first ... stop - 1``
    (``length`` keys, ``new`` of them new): 0 on the keys ``j <= length - new + i``, ``finfo.min`` after."""
    last_seen = torch.arange(first, stop, device=device) + (length - new)
    hidden = torch.arange(length, device=device) > last_seen[:, None]
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, masked_below(dtype))[
        None, None, None]


class DecodePlan(NamedTuple):
    """The requests of a step with one new token each, as one padded batch of ``requests x keys`` keys
    (``seen``: their keys in all, padding left out)."""

    tokens: slice | torch.Tensor  # their query rows (a slice when they are consecutive)
    slots: CheckedSlots  # [requests, keys] long: the cache rows of their keys (padding: a request's first key), read
    # in place by the fused kernel, checked against the cache once a step (the general path gathers them)
    mask: torch.Tensor | None  # [requests, 1, 1, 1, keys] additive: finfo.min on the padding (None: no padding)
    requests: int
    keys: int
    seen: int


class PrefillBlock(NamedTuple):
    """Query rows ``first ... stop - 1`` (of a request's new rows) and their causal mask, or None (built per layer:
    the step's masks would be large)."""

    first: int
    stop: int
    mask: torch.Tensor | None


class PrefillPlan(NamedTuple):
    """A request with several new tokens: its query rows ``start ... stop - 1`` and the cache rows of its keys."""

    start: int
    stop: int
    index: torch.Tensor  # its keys and values in the cache (:func:`gather_index`)
    length: int
    blocks: list[PrefillBlock]


@dataclasses.dataclass
class StepPlan:
    """What every layer of one engine step reads from the step's layout (see the module docstring)."""

    batch: PagedBatch  # the step it was built for (compared by identity: :meth:`serves`)
    block_size: int
    heads: int
    kv_heads: int
    dtype: torch.dtype
    write_slots: CheckedSlots  # [n] long: the cache rows of the step's first n key / value rows (checked once)
    write_rows: torch.Tensor | None  # which of those n rows are cached (None: all)
    decode: DecodePlan | None
    prefills: list[PrefillPlan]

    def serves(self, batch: PagedBatch, kv_cache: torch.Tensor, query: torch.Tensor) -> bool:
        """Whether this plan is the one of ``batch`` for this layer's cache and queries."""
        return (all(mine is theirs for mine, theirs in zip(self.batch, batch))
                and (self.kv_heads, self.block_size) == kv_cache.shape[1:3] and self.heads == query.shape[1]
                and self.dtype == query.dtype)


MASK_BUDGET = 1 << 20  # mask entries a step plan keeps for its prefill blocks (more: built in each layer)


def step_plan(batch: PagedBatch, kv_cache: torch.Tensor, query: torch.Tensor) -> StepPlan:
    """The :class:`StepPlan` of ``batch`` for layers with caches and queries shaped as ``kv_cache`` and ``query``
    (the only host reads of a step: its layout)."""
    (blocks, kv_heads, block_size, _), (_, heads, _) = kv_cache.shape, query.shape
    dtype, device = query.dtype, query.device
    work = work_dtype(dtype)  # the masks' dtype
    starts, lengths = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    new = [stop - start for start, stop in zip(starts[:-1], starts[1:])]
    table = batch.block_table.to(device)
    write_slots, write_rows = cached_rows(batch.slot_mapping[: starts[-1]].to(device))
    write_slots = checked_slots(write_slots, blocks * block_size, device)
    decode = None
    decoding = [request for request, count in enumerate(new) if count == 1]
    if decoding:
        tokens = [starts[request] for request in decoding]
        keys = max(lengths[request] for request in decoding)
        decode_lengths = torch.tensor([lengths[request] for request in decoding], device=device)
        index = torch.tensor(decoding, device=device)
        consecutive = tokens == list(range(tokens[0], tokens[0] + len(tokens)))
        mask = None
        if min(lengths[request] for request in decoding) < keys:
            hidden = torch.arange(keys, device=device) >= decode_lengths[:, None]  # [requests, keys]
            mask = torch.zeros(hidden.shape, dtype=work, device=device).masked_fill_(hidden, masked_below(work))
            mask = mask[:, None, None, None]
        slots = checked_slots(key_slots(table[index], decode_lengths, block_size, keys), blocks * block_size, device)
        decode = DecodePlan(slice(tokens[0], tokens[-1] + 1) if consecutive else torch.tensor(tokens, device=device),
                            slots, mask, len(decoding), keys, sum(lengths[request] for request in decoding))
    prefills, entries = [], sum(count * lengths[request] for request, count in enumerate(new) if count > 1)
    for request in (request for request, count in enumerate(new) if count > 1):
        length, count = lengths[request], new[request]
        step = block_queries(1, heads, count, length)
        blocks = [PrefillBlock(first, min(first + step, count),
                               causal_mask(first, min(first + step, count), length, count, work, device)
                               if entries <= MASK_BUDGET else None) for first in range(0, count, step)]
        slots = key_slots(table[request : request + 1], torch.tensor([length], device=device), block_size, length)
        prefills.append(PrefillPlan(starts[request], starts[request + 1], gather_index(slots, kv_heads), length,
                                    blocks))
    return StepPlan(batch, block_size, heads, kv_heads, dtype, write_slots, write_rows, decode, prefills)


def cached_rows(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(slots, rows)``: the cache rows of a step's tokens that are cached (``slot_mapping`` negative: a padding
    token, not cached) and which of the tokens those are (None: all)."""
    slots = slot_mapping.long()
    kept = slots >= 0
    if bool(kept.all()):
        return slots, None
    rows = kept.nonzero().squeeze(1)
    return slots[rows], rows


def write_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                plan: StepPlan | None = None) -> None:
    """Store the step's ``key`` / ``value`` ``[tokens, kv_heads, head_size]`` in their slots (negative: skipped;
    tokens past ``slot_mapping``: padding); with ``plan`` (the step's), its slots, not ``slot_mapping``'s."""
    rows = cache_rows(kv_cache)
    if plan is None:
        slots, kept = cached_rows(slot_mapping[: min(key.shape[0], slot_mapping.shape[0])])
    else:
        slots, kept = plan.write_slots, plan.write_rows  # checked against the cache's rows once a step
    written = slots.slots if isinstance(slots, CheckedSlots) else slots
    key, value = (key[: len(written)], value[: len(written)]) if kept is None else (key[kept], value[kept])
    rows[:, 0].index_copy_(0, written, key.to(rows.dtype))  # in place, key and value apart: no stacked copy
    rows[:, 1].index_copy_(0, written, value.to(rows.dtype))
    codes = SLOT_CODES.get(kv_cache)
    if codes is not None:  # the certificate's codes of the slots just written (their new keys)
        codes.write(rows[:, 0], slots)


def slot_codes(kv_cache: torch.Tensor, decode: DecodePlan, block_size: int) -> SlotCodes | None:
    """The cache's :class:`~.keycodes.SlotCodes` for a decode batch the certificate serves (a request of at least
    ``MIN_KEYS`` keys, skipping on, cache blocks of whole code blocks, a head size the codes serve), made and
    coded from the cache's keys the first time; None elsewhere."""
    if decode.keys < MIN_KEYS or block_size % BLOCK or not skipping_enabled():
        return None
    codes = SLOT_CODES.get(kv_cache)
    if codes is None:
        keys = cache_rows(kv_cache)[:, 0]
        if keys.dtype not in KEY_DTYPES or not KeyCodes.serves(keys):
            return None
        codes = SLOT_CODES[kv_cache] = SlotCodes(keys)
        logging.getLogger(__name__).info("hf_sparsemax: the int8 key certificate of a %d-slot paged cache: %.1f MiB "
                                         "(all such caches: %.1f MiB)", keys.shape[0], codes.nbytes() / 2 ** 20,
                                         certificate_bytes() / 2 ** 20)
    return codes if codes.written else None


def certificate_bytes() -> int:
    """Bytes of the int8 certificate's codes kept beside the live paged caches (:data:`SLOT_CODES`)."""
    return sum(codes.nbytes() for codes in SLOT_CODES.values())


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
           attention: SparseAttention) -> torch.Tensor:
    """Output ``[R, H, q, D]`` of the queries ``[R, Hkv, G, q, D]`` (query head ``h`` is kv head ``h // G``) over
    ``keys`` / ``values [R, Hkv, kv, D]``, ``mask`` additive, broadcastable to ``[R, Hkv, G, q, kv]`` (or None:
    every key seen). Half-precision operands are computed in float32 (:func:`work_dtype`; the output too: the
    caller rounds it to the model's dtype)."""
    work = work_dtype(query.dtype)
    query, keys, values = query.to(work), keys.to(work), values.to(work)
    batch, kv_heads, groups, rows, dim = query.shape
    scores = torch.matmul(query.reshape(batch, kv_heads, groups * rows, dim), keys.transpose(-1, -2))
    grouped = scores.view(batch, kv_heads, groups, rows, -1)
    if mask is None:
        scores.mul_(scale)
    else:
        torch.add(mask, grouped, alpha=scale, out=grouped)
    p = attention.weights(scores.view(batch, kv_heads * groups, rows, -1), overwrite=True)
    out = torch.matmul(p.view(scores.shape).to(values.dtype), values)  # [R, Hkv, G q, D]
    return out.view(batch, kv_heads * groups, rows, dim)


def kernel_decode(rows: torch.Tensor, kv_cache: torch.Tensor, decode: DecodePlan, scale: float,
                  attention: SparseAttention, block_size: int | None = None) -> torch.Tensor | None:
    """Output ``[R, H, 1, D]`` (float32) of the decode requests' ``rows [R, Hkv, G, 1, D]`` by the fused kernel
    (:func:`hf_sparsemax.attention.cpu.fused.paged_decode`: the cache read in place through the requests' slots, no
    gather; the exact threshold on each row's candidates, ``P V`` over the support; with ``block_size``, the
    cache's, the int8 certificate where :func:`slot_codes` serves it), or None where it does not serve the call
    (then :func:`attend` on gathered rows)."""
    batch, kv_heads, groups, _, dim = rows.shape
    alpha = attention.kernel_alpha(kv_heads, groups)
    if alpha is None or rows.dtype not in (torch.float32, *HALF):
        return None
    cache = cache_rows(kv_cache)
    codes = None if block_size is None else slot_codes(kv_cache, decode, block_size)
    certify = codes is not None and take_turn(codes)
    out = paged_decode(rows.float(), cache[:, 0], cache[:, 1], decode.slots, decode.mask, alpha, scale,
                       codes=codes if certify else None)
    if out is not None and certify:
        tally(codes, kv_heads * decode.seen)
    return None if out is None else out.view(batch, kv_heads * groups, 1, -1)


def blocked_prefill(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int, scale: float,
                    attention: SparseAttention) -> torch.Tensor | None:
    """Output ``[m, H, D]`` of a request's ``m`` new query rows ``rows [m, H, D]`` over its ``length`` keys
    (``keys`` / ``values [1, Hkv, length, D]``, the last ``m`` new: query ``i`` sees ``j <= length - m + i``) by
    transformers' blocked threshold attention without autograd (:func:`.blocks.threshold_attention`: the same
    scoring, masks, alpha per head and solver as a model's prefill, the fused kernel's blocks included), or None
    where it does not apply (the mappings :meth:`SparseAttention.kernel_alpha` leaves out: then :func:`attend`)."""
    count, heads, _ = rows.shape
    if attention.kernel_alpha(keys.shape[1], heads // keys.shape[1]) is None or rows.dtype not in (
            torch.float32, *HALF):
        return None
    entry = registry.REGISTRY[attention.mapping]
    query = rows.transpose(0, 1)[None]  # [1, H, m, D]
    mask = None  # a whole prompt: the plain causal mask, built per block
    if length != count:  # a chunk, or a prompt whose prefix was cached: its own rows' causal mask
        mask = causal_mask(0, count, length, count, work_dtype(rows.dtype), rows.device)[0]
    alpha = None if attention.alpha is None else attention.alpha.to(rows.device).view(1, heads, 1, 1)
    with torch.no_grad():
        out = threshold_attention(query, keys, values, mask, causal=mask is None, alpha=alpha,
                                  fixed_alpha=entry.fenchel_young_alpha(attention.options), scaling=scale,
                                  threshold=entry.threshold, block=block_queries(1, heads, count, length),
                                  reference=None)
    return out[0].transpose(0, 1)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, scale: float,
                    attention: SparseAttention, output: torch.Tensor | None = None,
                    plan: StepPlan | None = None, key: torch.Tensor | None = None,
                    value: torch.Tensor | None = None) -> torch.Tensor:
    """The sparse attention of ``query [tokens, H, D]`` over each request's cached keys (the step's own keys already
    written by :func:`write_cache`); ``plan``: the step's :func:`step_plan` (built here when not given); ``key`` /
    ``value [tokens, Hkv, D]``: the step's own, as written (or None): a whole new prompt reads them, not the cache.

    Returns ``[tokens, H, D]`` (into ``output`` when given); rows past ``query_start_loc[-1]`` are left as they are.
    """
    if plan is None:
        plan = step_plan(batch, kv_cache, query)
    out = torch.zeros_like(query) if output is None else output
    _, heads, dim = query.shape
    kv_heads = plan.kv_heads
    groups = heads // kv_heads
    if plan.decode is not None:  # one padded batch: a row for each request
        decode = plan.decode
        rows = query[decode.tokens].view(decode.requests, kv_heads, groups, 1, dim)
        found = kernel_decode(rows, kv_cache, decode, scale, attention, plan.block_size)
        if found is None:  # the general path: the keys and values gathered, the registry's solver
            index = gather_index(decode.slots.slots, kv_heads)
            keys, values = gather(kv_cache, index, decode.requests, decode.keys)
            found = attend(rows, keys, values, decode.mask, scale, attention)
        out[decode.tokens] = found.view(decode.requests, heads, dim).to(out.dtype)
    for request in plan.prefills:
        count = request.stop - request.start
        if key is not None and value is not None and count == request.length and plan.write_rows is None:
            here = slice(request.start, request.stop)  # a whole new prompt: its keys are the step's own, as written
            keys, values = (t[here].to(kv_cache.dtype).transpose(0, 1)[None] for t in (key, value))
        else:  # a chunk or a cached prefix: its keys gathered out of the cache
            keys, values = gather(kv_cache, request.index, 1, request.length)
        found = blocked_prefill(query[request.start : request.stop], keys, values, request.length, scale, attention)
        if found is not None:  # transformers' blocked attention (and its fused kernel's blocks)
            out[request.start : request.stop] = found.to(out.dtype)
            continue
        for block in request.blocks:
            mask = block.mask if block.mask is not None else causal_mask(
                block.first, block.stop, request.length, count, work_dtype(query.dtype), query.device)
            here = slice(request.start + block.first, request.start + block.stop)
            rows = query[here].view(1, -1, kv_heads, groups, dim).permute(0, 2, 3, 1, 4)
            found = attend(rows, keys, values, mask, scale, attention)  # [1, H, rows, D]
            out[here] = found[0].transpose(0, 1).to(out.dtype)
    return out
