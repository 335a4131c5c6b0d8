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

The weights of one head are ``p = mapping(q k^T * scale + mask)`` over the keys, with the registry's row
solver of the saved mapping (:mod:`hf_sparsemax.mappings.registry`: the one implementation that training,
losses and decoding use); masked keys are ``-inf`` (weight exactly 0). A learned alpha is one value per query
head. Decode steps (one new token a request) run as one padded batch; the other requests one at a time, their
queries in blocks whose scores stay within :data:`~hf_sparsemax.attention.blocks.ATTENTION_BUDGET` entries.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from ...attention.blocks import block_queries
from ...attention.interface import AttentionOptions
from ...mappings import registry
from ...mappings._core import masked_below
from ...mappings.entmax import precise_in_float32
from ...settings import SparseSettings


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

    def weights(self, scores: torch.Tensor) -> torch.Tensor:
        """``mapping(scores)`` along the keys of ``scores [B, H, q, kv]`` (masked keys ``-inf``: weight 0)."""
        entry = registry.REGISTRY[self.mapping]
        rows, options = scores.reshape(-1, scores.shape[-1]), self.options
        alpha = getattr(options, "alpha", None)
        if self.alpha is not None:  # one per score row, as the blocked attention of transformers passes them
            alpha = self.alpha.to(scores.device).view(1, -1, 1).expand(scores.shape[:-1]).reshape(-1, 1)
        if alpha is not None and not precise_in_float32(alpha):
            rows = rows.double()  # as the mapping computes such alphas (float32 rounding grows with 1 / (alpha - 1))
        if self.alpha is not None:
            options = dataclasses.replace(options, alpha=alpha.to(rows.dtype))
        return entry.rows(rows, masked_below(rows.dtype), options).to(scores.dtype).view(scores.shape)


def cache_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[blocks * block_size, 2, kv_heads, head_size]`` view of a ``[blocks, kv_heads, block_size, 2 * head_size]``
    cache (see the module docstring)."""
    if not kv_cache.is_contiguous():
        raise ValueError("the paged KV cache of a sparse-attention layer must be one contiguous tensor")
    blocks, kv_heads, block_size, both = kv_cache.shape
    return kv_cache.view(blocks * block_size, 2, kv_heads, both // 2)


def write_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's ``key`` / ``value`` ``[tokens, kv_heads, head_size]`` in their slots (negative: skipped;
    tokens past ``slot_mapping``: padding)."""
    rows = cache_rows(kv_cache)
    count = min(key.shape[0], slot_mapping.shape[0])
    slots, key, value = slot_mapping[:count].long(), key[:count], value[:count]
    kept = slots >= 0
    if not bool(kept.all()):
        slots, key, value = slots[kept], key[kept], value[kept]
    rows.index_copy_(0, slots, torch.stack([key, value], 1).to(rows.dtype))


def key_slots(block_table: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[R, max(lengths)]`` cache rows of each request's keys in order (slot 0 past a request's length)."""
    positions = torch.arange(int(lengths.max()), device=block_table.device)
    blocks = block_table.long().gather(1, (positions // block_size).expand(len(lengths), -1).clamp_max(
        block_table.shape[1] - 1))
    slots = blocks * block_size + positions % block_size
    return slots.masked_fill_(positions >= lengths[:, None], 0)


def attend(query, keys, values, lengths, new, scale, attention: SparseAttention, first=0):
    """Output ``[R, q, H, D]`` of the queries ``[R, q, H, D]`` over ``keys`` / ``values [R, kv, Hkv, D]``.

    Request ``r`` has ``lengths[r]`` keys, ``new[r]`` of them new; ``query`` holds its new rows
    ``first ... first + q - 1`` (rows past ``new[r]``: padding, output 0).
    """
    batch, rows, heads, dim = query.shape
    kv_heads = keys.shape[2]
    groups = heads // kv_heads
    q = query.permute(0, 2, 1, 3).reshape(batch, kv_heads, groups * rows, dim)
    scores = torch.matmul(q, keys.permute(0, 2, 3, 1)).mul_(scale).view(batch, kv_heads, groups, rows, -1)
    row = torch.arange(first, first + rows, device=query.device)
    last_seen = (lengths - new)[:, None] + row  # [R, q]: the last key each query row sees
    key = torch.arange(scores.shape[-1], device=query.device)
    hidden = (key > last_seen[..., None]) | (row >= new[:, None])[..., None]  # [R, q, kv]
    scores.masked_fill_(hidden[:, None, None], float("-inf"))
    p = attention.weights(scores.view(batch, heads, rows, -1)).view(batch, kv_heads, groups * rows, -1)
    if values.shape[0] > 1:  # a padded batch: keys past a request's length are another's (or unwritten) slots
        padded = key[None] >= lengths[:, None]
        values = values.masked_fill(padded[:, :, None, None], 0)  # weight 0 times whatever they hold (NaN too) is 0
    out = torch.matmul(p.to(values.dtype), values.permute(0, 2, 1, 3))
    return out.view(batch, heads, rows, dim).transpose(1, 2)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, scale: float,
                    attention: SparseAttention, output: torch.Tensor | None = None) -> torch.Tensor:
    """The sparse attention of ``query [tokens, H, D]`` over each request's cached keys (the step's own keys already
    written by :func:`write_cache`).

    Returns ``[tokens, H, D]`` (into ``output`` when given); rows past ``query_start_loc[-1]`` are left as they are.
    """
    rows = cache_rows(kv_cache)
    keys_of, values_of = rows[:, 0], rows[:, 1]
    block_size = kv_cache.shape[2]
    starts = batch.query_start_loc.long().cpu()
    lengths = batch.seq_lens.long().to(query.device)
    new = (starts[1:] - starts[:-1]).to(query.device)
    table = batch.block_table.to(query.device)
    out = torch.zeros_like(query) if output is None else output
    decode = (new == 1).nonzero().squeeze(1)
    if decode.numel():  # one padded batch: a row for each request
        slots = key_slots(table[decode], lengths[decode], block_size)
        tokens = starts[:-1].to(query.device)[decode]
        found = attend(query[tokens][:, None], keys_of[slots], values_of[slots], lengths[decode], new[decode], scale,
                       attention)
        out[tokens] = found[:, 0].to(out.dtype)
    for request in (new > 1).nonzero().squeeze(1).tolist():
        start, stop = int(starts[request]), int(starts[request + 1])
        length = lengths[request : request + 1]
        slots = key_slots(table[request : request + 1], length, block_size)
        keys, values = keys_of[slots], values_of[slots]
        step = block_queries(1, query.shape[1], stop - start, int(length))
        for first in range(0, stop - start, step):
            here = slice(start + first, min(start + first + step, stop))
            found = attend(query[here][None], keys, values, length, new[request : request + 1], scale, attention,
                           first)
            out[here] = found[0].to(out.dtype)
    return out
