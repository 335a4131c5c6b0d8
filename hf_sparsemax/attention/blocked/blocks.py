"""Memory-bounded threshold attention: query blocks within a budget, one threshold per row kept for backward.

For the threshold mappings (sparsemax, 1.5-entmax, alpha-entmax; the registry
entries with a ``threshold``) the weights of a query row are

    p = relu((alpha - 1)(s - shift) - tau) ** (1 / (alpha - 1)),   s = q k^T * scaling + mask,

so one number per row (``tau``; ``shift`` is the row's maximum) gives back the whole row. The
forward runs the queries in blocks whose scores ``[B, H, block, kv]`` hold at
most ``ATTENTION_BUDGET`` entries (all queries in one block when the whole
``[B, H, q, kv]`` fits; at long lengths ``MIN_BLOCK_QUERIES`` queries, see
:func:`block_queries`), solves each row's threshold, and keeps only
``tau`` (in the scores' dtype: 4 bytes a row in float32, as a flash kernel's
log-sum-exp; ``shift`` is the row's maximum, found again): nothing of size
``q x kv`` outlives a block. The backward recomputes each block's scores and maps them with
the saved threshold (one pass; no solve), then, with ``s_i = p_i ** (2 - alpha)``
on the support (the mapping's Jacobian, :func:`~hf_sparsemax.mappings.entmax.entmax_vjp`):

    dV = P^T dO,   dP = dO V^T,   dS = s * (dP - <s, dP> / <s, 1>),   dQ = dS K * scaling,   dK = dS^T Q * scaling

and, for a learned per-head alpha, its closed-form derivative. Keys that the
mask excludes for every query of a block (the future under a causal mask, the
past beyond a sliding window, padding) are skipped in the forward and the
backward: their weights are exactly 0. A plain causal mask is never
materialised (``causal=True``, sdpa's ``is_causal``): each block masks its own
future keys, so no ``[q, kv]`` tensor is held at any length.

Block skipping: keys that no query of a block weighs (every head, every row:
the sparsity the mapping produces, 89% of the keys a block sees for sparsemax
on real text at 2048 tokens) have exactly zero weights and zero gradients.
The forward finds them from the block's weights (one reduction) and keeps them
as bits (one a key a block, :func:`pack_bits`); the backward gathers the live
keys' rows of ``K`` and ``V`` and runs every product above and the Jacobian
over those alone (at most ``GATHER_BELOW`` of the keys live; else the whole
range), and the forward's ``P V`` does the same at most
``GATHER_WEIGHTS_BELOW`` live (it copies the weights' live columns). A row's
maximum always has a nonzero weight, so its shift is found again from the
live keys. Before that, each block is solved over its candidate keys alone where they are few
(:func:`candidate_keys`: a key ``1 / (alpha - 1)`` below every row's maximum has weight exactly 0), and half-
precision operands are computed in float32 (:func:`work_operands`). Grouped-query heads share their key
and value head without copies. A double backward (``create_graph=True``)
recomputes the blocks through the mapping's own differentiable Function, so
second derivatives stay exact.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ...mappings import compiled
from ...mappings._core import masked_below
from ..cpu.fused import block_rows

ATTENTION_BUDGET = 1 << 20  # attention weights held at once (entries of [B, H, q_block, kv]: 4 MiB in float32)
DEVICE_ATTENTION_BUDGET = 1 << 26  # ... on an accelerator (256 MiB in float32), where each block costs launches
MIN_BLOCK_QUERIES = 64  # ... unless that leaves fewer queries a block: every block reads all its keys and values
GATHER_BELOW = 0.9  # a block whose queries weigh at most this share of its keys: its backward gathers them ...
GATHER_WEIGHTS_BELOW = 0.5  # ... and at most this share: its P V too (copying the weights' live columns)
COMPACT_MIN_ELEMENTS = 1 << 12  # candidate scores from which the compiled kernel solves them (fewer: eager)
CANDIDATES_BELOW = 0.5  # a block whose candidate keys (candidate_keys) are at most this share: solved on them alone


def block_queries(batch: int, heads: int, queries: int, keys: int, budget: int | None = None,
                  device: torch.device | None = None) -> int:
    """Queries per block: all of them when ``[B, H, q, kv]`` fits ``budget`` (``ATTENTION_BUDGET`` on the CPU,
    ``DEVICE_ATTENTION_BUDGET`` on another ``device``), else equal blocks that fit, but never fewer than
    ``MIN_BLOCK_QUERIES`` queries.

    Each block multiplies its queries with every key and value it sees, so blocks of a few queries re-read
    ``K`` and ``V`` once per handful of queries (at 8192 tokens the budget alone leaves 14 queries a block, 586
    blocks a layer, and the step took 1.6x sdpa's time). Past the point where the budget holds fewer than
    ``MIN_BLOCK_QUERIES`` queries (about 1800 keys for 9 heads), a block holds ``B H 64 kv`` entries: linear
    in the length, as the activations are (18 MiB in float32 at 8192 tokens, 9 heads), never ``q x kv``.

    A GPU runs a small block's dozen kernels faster than it launches them, and each block's live-key scan
    waits for the device: on an H200, SmolLM2's 2048-token prefill took 20x sdpa's time in 4 MiB blocks
    (930 compiled calls, 29k kernel launches; the GPU busy 110 ms of 930), hence the larger budget there."""
    if queries <= MIN_BLOCK_QUERIES:  # what the rule below gives (one block), without its arithmetic: decoding
        return max(1, queries)
    if budget is None:
        budget = ATTENTION_BUDGET if device is None or torch.device(device).type == "cpu" else DEVICE_ATTENTION_BUDGET
    per_query = max(1, batch * heads * keys)
    if per_query * queries <= budget:
        return max(1, queries)
    largest = max(MIN_BLOCK_QUERIES, budget // per_query)
    blocks = -(-queries // largest)
    return -(-queries // blocks)  # equal blocks, each at most `largest`


def causal_mask(start: int, stop: int, keys: slice | torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask ``[stop - start, len(keys)]`` of queries ``[start, stop)`` over the key positions ``keys`` (a
    slice or an index tensor): 0 where key ``j <= i``, else ``finfo(dtype).min`` (upper-left aligned, as sdpa's
    ``is_causal``)."""
    positions = torch.arange(keys.start, keys.stop, device=device) if isinstance(keys, slice) else keys
    future = positions > torch.arange(start, stop, device=device)[:, None]
    return torch.zeros((), dtype=dtype, device=device).masked_fill(future, torch.finfo(dtype).min)


class Block(NamedTuple):
    """Queries ``[start, stop)`` and the keys ``[low, high)`` that some of them see (the others have weight 0);
    after the forward, ``live``: which of those keys some query of the block weighs (bits, :func:`pack_bits`), or
    None for all of them."""

    start: int
    stop: int
    low: int
    high: int
    live: torch.Tensor | None = None

    def keys(self) -> slice | torch.Tensor:
        """The positions of the keys the block's weights are nonzero on (a superset): a slice, or an index tensor
        when :attr:`live` says some of ``[low, high)`` have weight 0 for every query."""
        if self.live is None:
            return slice(self.low, self.high)
        return unpack_bits(self.live, self.high - self.low).nonzero().squeeze(1).add_(self.low)


BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """``[n]`` booleans as ``ceil(n / 8)`` bytes (what the backward keeps of a block's live keys)."""
    padded = torch.nn.functional.pad(flags.to(torch.uint8), (0, -flags.numel() % 8)).view(-1, 8)
    return padded.mul_(BITS.to(flags.device)).sum(-1, dtype=torch.uint8)


def unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` booleans of :func:`pack_bits`."""
    return bits[:, None].bitwise_and(BITS.to(bits.device)).ne(0).flatten()[:n]


def live_keys(p: torch.Tensor) -> torch.Tensor:
    """``[n]``: whether some row of ``p [..., rows, n]`` weighs each key. A NaN weight counts as live, so NaN stays
    NaN."""
    return p.reshape(-1, p.shape[-1]).amax(0).ne(0)


HALF = (torch.float16, torch.bfloat16)


def work_operands(query, key, value, mask):
    """``(query, key, value, mask)`` in the kernels' work dtype: half-precision operands (float16, bfloat16) in
    float32, so the scores, the threshold, the weights and ``P V`` are computed in float32 (as sdpa accumulates
    a half model's attention) and only the output is rounded to the model's dtype. A half mask's masked entries
    (at or below ``finfo(dtype).min``, the value transformers fills) become float32's, so they stay masked.
    Differentiable (casts): gradients come back in the operands' own dtypes. Other dtypes pass unchanged, and so
    does an operand given as None (a decoding step leaves the half cache as it is: :mod:`.decode`)."""
    query, key, value = (t.float() if t is not None and t.dtype in HALF else t for t in (query, key, value))
    if mask is not None and mask.dtype in HALF:
        masked = mask <= torch.finfo(mask.dtype).min
        mask = mask.float().masked_fill(masked, torch.finfo(torch.float32).min)
    return query, key, value, mask


class Problem(NamedTuple):
    """One attention call in grouped layout: ``query [B, Hkv, G, q, D]``, ``key [B, Hkv, kv, D]``,
    ``value [B, Hkv, kv, Dv]`` (``Dv`` any value head size)
    (a decoding step's key and value may stay in a half dtype: the rows it reads are cast, :func:`block_scores`)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None  # additive, [B | 1, Hkv | 1, G | 1, q, kv]
    causal: bool  # a plain causal mask (``mask`` is None): query i sees keys j <= i
    alpha: float | torch.Tensor  # a float, or [1, Hkv, G, 1, 1] (learned per head)
    scaling: float
    threshold: Callable


def grouped(query, key, value, mask, causal, alpha, scaling, threshold) -> Problem:
    """The :class:`Problem` of a call with ``query [B, H, q, D]``, ``key [B, H_kv, kv, D]``,
    ``value [B, H_kv, kv, Dv]``, ``mask`` broadcastable to ``[B, H, q, kv]`` (or None, then ``causal`` says whether
    queries see only keys up to their own position) and ``alpha`` a float or ``[1, H, 1, 1]``."""
    kv_heads = key.shape[1]
    groups = query.shape[1] // kv_heads
    split = lambda t: t.view(t.shape[0], kv_heads, groups, *t.shape[2:])  # noqa: E731 (view: unflatten's cost)
    query = split(query)
    if mask is not None:
        mask = split(mask) if mask.shape[1] != 1 else mask.unsqueeze(2)
    if isinstance(alpha, torch.Tensor):
        alpha = split(alpha)
    return Problem(query, key, value, mask, causal and mask is None, alpha, scaling, threshold)


def blocks(problem: Problem, block: int) -> list[Block]:
    """The query blocks of ``block`` queries and, from the mask, the range of keys each one needs."""
    masked = masked_below(problem.query.dtype)
    queries, keys = problem.query.shape[-2], problem.key.shape[-2]
    found = []
    for start in range(0, queries, block):
        stop = min(start + block, queries)
        if problem.mask is None:
            found.append(Block(start, stop, 0, min(stop, keys) if problem.causal else keys))
            continue
        live = (problem.mask[..., start:stop, :] > masked).flatten(0, -2).any(0).nonzero()
        if live.numel():
            found.append(Block(start, stop, int(live[0]), int(live[-1]) + 1))
        else:
            found.append(Block(start, stop, 0, 0))  # every query of the block is fully masked: weights 0
    return found


def block_alpha(problem: Problem, part: Block, dtype: torch.dtype) -> float | torch.Tensor:
    """The block's alpha: the float, or one per row ``[rows, 1]`` in the order of the block's score rows."""
    alpha = problem.alpha
    if not isinstance(alpha, torch.Tensor):
        return alpha
    batch, kv_heads, groups = problem.query.shape[:3]
    shape = (batch, kv_heads, groups, part.stop - part.start, 1)
    return alpha.detach().to(dtype).expand(shape).reshape(-1, 1)


def block_scores(problem: Problem, part: Block, keys: slice | torch.Tensor):
    """``(scores, q_block, alpha)`` of one block: ``scores [B, Hkv, G * rows, len(keys)]`` over the key positions
    ``keys`` (a slice or an index tensor; the same operations in forward and backward, so the same bits on a
    slice), ``alpha`` a float or one per score row."""
    query, key = problem.query, problem.key
    batch, kv_heads, groups, _, dim = query.shape
    rows = part.stop - part.start
    q_block = query[..., part.start : part.stop, :].reshape(batch, kv_heads, groups * rows, dim)
    key = key[..., keys, :].to(query.dtype)  # a half cache's keys (decoding): exact in float32
    if problem.mask is not None:
        scores = torch.matmul(q_block, key.transpose(-1, -2))
        grouped_scores = scores.view(batch, kv_heads, groups, rows, -1)
        torch.add(problem.mask[..., part.start : part.stop, keys], grouped_scores, alpha=problem.scaling,
                  out=grouped_scores)
        return scores, q_block, block_alpha(problem, part, scores.dtype)
    scores = torch.matmul(q_block * problem.scaling, key.transpose(-1, -2))  # scaled: rows x D
    grouped_scores = scores.view(batch, kv_heads, groups, rows, -1)
    if problem.causal and isinstance(keys, slice) and keys.start <= part.start:  # the past is seen by every query:
        if keys.stop > part.start:  # only keys from the block's first query on can lie in some query's future
            future = grouped_scores[..., part.start - keys.start :]
            future.add_(causal_mask(part.start, part.stop, slice(part.start, keys.stop), scores.dtype, scores.device))
    elif problem.causal:
        grouped_scores.add_(causal_mask(part.start, part.stop, keys, scores.dtype, scores.device))
    return scores, q_block, block_alpha(problem, part, scores.dtype)


def candidate_keys(scores: torch.Tensor, alpha: float | torch.Tensor, masked: float) -> torch.Tensor | None:
    """The keys (indices into the last dimension of ``scores [..., rows, n]``) that some row may weigh, or None
    where they are more than ``CANDIDATES_BELOW`` of them (then the whole block is solved).

    alpha-entmax's largest weight is at most 1, so ``tau >= -1`` and a key with ``s <= max s - 1 / (alpha - 1)``
    gets weight exactly 0 (THEORY.md, "Exact KV skipping"; sparsemax: 1 below the row's maximum). The threshold
    over the candidates is the threshold over the whole row (the others add 0 to every sum the solver forms),
    so solving them alone is exact (:func:`.compiled.candidates`: one compiled kernel from ``MIN_ELEMENTS``
    scores; the bound loosened by 1% for rounding; masked keys add none, a NaN every key: NaN stays NaN)."""
    rows = scores.view(-1, scores.shape[-1])
    wanted = compiled.run(compiled.candidates, rows, masked, alpha=alpha) if compiled.applies(rows) else None
    if wanted is None:
        wanted = compiled.candidates(rows, masked, alpha)
    index = wanted.nonzero().squeeze(1)
    return index if index.numel() <= CANDIDATES_BELOW * rows.shape[-1] else None


def forward_blocks(problem: Problem, block: int, keep: bool = True):
    """Output ``[B, Hkv, G, q, Dv]``, the blocks (with their live keys), and each block's thresholds ``tau``
    (``[rows, 1]``). Without ``keep`` (no backward will run: inference) the live keys are not packed for a
    backward; they still choose how ``P V`` is computed."""
    query, value = problem.query, problem.value
    out = query.new_zeros((*query.shape[:-1], value.shape[-1]))
    parts, states = [], []
    for part in blocks(problem, block):
        if part.high == part.low:
            parts.append(part)
            states.append(None)
            continue
        scores, _, alpha = block_scores(problem, part, part.keys())
        fused = None if keep else block_rows(scores, value, part.keys(), problem.alpha)  # inference, any alpha
        if fused is not None:  # the fused kernel: each row's candidates solved and its support's values summed
            out[..., part.start : part.stop, :] = fused.view(*query.shape[:3], part.stop - part.start, -1)
            parts.append(part)
            states.append(None)
            continue
        index = None if keep else candidate_keys(scores, alpha, masked_below(scores.dtype))  # inference only:
        # in training the extra passes cost more than they save on average (measured on SmolLM2 at 1024 tokens)
        if index is not None:  # solve and map over the candidates alone: the other keys' weights are exactly 0
            scores = scores.index_select(-1, index)
        p, tau = compiled.weights(scores.view(-1, scores.shape[-1]), masked_below(scores.dtype), alpha,
                                  problem.threshold, minimum=None if index is None else COMPACT_MIN_ELEMENTS)
        p = p.view(scores.shape)
        del scores
        states.append(tau)
        live = live_keys(p)  # the others' weights are exactly 0
        if index is not None:
            live, keys = torch.zeros(part.high - part.low, dtype=torch.bool, device=p.device).index_fill_(
                0, index[live], True), index + part.low
        else:
            keys = slice(part.low, part.high)
        used = int(live.sum())
        if keep and used <= GATHER_BELOW * live.numel():
            part = part._replace(live=pack_bits(live))
        if index is None and used <= GATHER_WEIGHTS_BELOW * live.numel():
            index = live.nonzero().squeeze(1)
            p, keys = p.index_select(-1, index), index + part.low
        parts.append(part)
        block_out = torch.matmul(p, value[..., keys, :])
        out[..., part.start : part.stop, :] = block_out.view(*query.shape[:3], part.stop - part.start, -1)
        del p
    return out, parts, states


def backward_blocks(problem: Problem, parts, states, grad_out: torch.Tensor, alpha_grad: bool):
    """``(dQ, dK, dV, dalpha)`` in grouped layout (``dalpha`` ``[1, Hkv, G, 1, 1]`` or None)."""
    query, key, value = problem.query, problem.key, problem.value
    batch, kv_heads, groups, _, dim = query.shape
    value_dim = value.shape[-1]  # may differ from the query / key head size (DeepSeek's MLA: 192 / 128)
    d_query, d_key, d_value = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    d_alpha = torch.zeros(1, kv_heads, groups, 1, 1, dtype=torch.float64) if alpha_grad else None
    for part, tau in zip(parts, states):
        if tau is None:
            continue
        rows = part.stop - part.start
        keys = part.keys()  # the keys some query of the block weighs: the rest have weight 0 and gradient 0
        scores, q_block, alpha = block_scores(problem, part, keys)
        d_out = grad_out[..., part.start : part.stop, :].reshape(batch, kv_heads, groups * rows, value_dim)
        d_weights = torch.matmul(d_out, value[..., keys, :].transpose(-1, -2))
        n = scores.shape[-1]
        p, d_scores, d_a = compiled.weights_vjp(scores.view(-1, n), tau, d_weights.view(-1, n),
                                                masked_below(scores.dtype), alpha, alpha_grad)
        del scores, d_weights
        p, d_scores = p.view(d_out.shape[:-1] + (n,)), d_scores.view(d_out.shape[:-1] + (n,))
        d_value[..., keys, :] += torch.matmul(p.transpose(-1, -2), d_out)
        del p
        d_query[..., part.start : part.stop, :] = (
            torch.matmul(d_scores, key[..., keys, :]).mul_(problem.scaling).view(batch, kv_heads, groups, rows, dim))
        d_key[..., keys, :] += torch.matmul(d_scores.transpose(-1, -2), q_block).mul_(problem.scaling)
        if d_a is not None:
            d_alpha += d_a.view(batch, kv_heads, groups, rows).sum((0, 3)).view(d_alpha.shape).double()
    return d_query, d_key, d_value, d_alpha


class ThresholdAttention(torch.autograd.Function):
    """``softmax``-free attention output ``[B, Hkv, G, q, Dv]`` of a threshold mapping, memory-bounded (module doc)."""

    @staticmethod
    def forward(ctx, query, key, value, mask, causal, alpha, fixed_alpha, scaling, threshold, block, reference):
        problem = grouped(*work_operands(query, key, value, mask), causal,
                          alpha if alpha is not None else fixed_alpha, scaling, threshold)
        out, parts, states = forward_blocks(problem, block)
        ctx.save_for_backward(query, key, value, mask, alpha)  # as given (a half model's in half: no copies kept)
        ctx.parts, ctx.states, ctx.causal = parts, states, problem.causal
        ctx.fixed_alpha, ctx.scaling, ctx.threshold, ctx.reference = fixed_alpha, scaling, threshold, reference
        return out.flatten(1, 2).to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, mask, alpha = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph: through the mapping's differentiable Function (exact 2nd order)
            inputs = [t for t, need in zip((query, key, value, alpha), needs[:3] + needs[5:6]) if need]
            if ctx.causal:
                mask = causal_mask(0, query.shape[-2], slice(0, key.shape[-2]), query.dtype, query.device)
            out = ctx.reference(query, key, value, mask, alpha)
            grads = iter(torch.autograd.grad(out, inputs, grad_out, create_graph=True))
            found = [next(grads) if need else None for need in needs[:3] + needs[5:6]]
            return (*found[:3], None, None, found[3], None, None, None, None, None)
        alpha_grad = alpha is not None and needs[5]
        problem = grouped(*work_operands(query, key, value, mask), ctx.causal,
                          alpha if alpha is not None else ctx.fixed_alpha, ctx.scaling, ctx.threshold)
        grad = grad_out.to(problem.query.dtype).unflatten(1, problem.query.shape[1:3])
        d_query, d_key, d_value, d_alpha = backward_blocks(problem, ctx.parts, ctx.states, grad, alpha_grad)
        if d_alpha is not None:
            d_alpha = d_alpha.flatten(1, 2).to(alpha.dtype)
        return (d_query.flatten(1, 2).to(query.dtype), d_key.to(key.dtype), d_value.to(value.dtype), None, None,
                d_alpha, None, None, None, None, None)


def threshold_attention(query, key, value, mask, *, causal=False, alpha, fixed_alpha, scaling, threshold, block,
                        reference):
    """Attention output ``[B, H, q, Dv]`` of a threshold mapping, memory-bounded (see the module docstring).

    ``query [B, H, q, D]``; ``key [B, H_kv, kv, D]``, ``value [B, H_kv, kv, Dv]`` (not repeated for grouped heads;
    ``Dv`` any value head size); ``mask`` additive, broadcastable to ``[B, H, q, kv]``, or None, then ``causal``
    (query ``i`` sees keys ``j <= i``, built per block) or full attention; ``alpha`` a learned ``[1, H, 1, 1]``
    tensor or None (then ``fixed_alpha``); ``threshold`` the registry entry's row threshold; ``block`` queries per
    block; ``reference(query, key, value, mask, alpha)`` the same output through the differentiable mapping
    (double backward only).
    """
    args = (query, key, value, mask, causal, alpha, fixed_alpha, scaling, threshold, block, reference)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, alpha)):
        return ThresholdAttention.apply(*args)
    problem = grouped(*work_operands(query, key, value, mask), causal, alpha if alpha is not None else fixed_alpha,
                      scaling, threshold)
    return forward_blocks(problem, block, keep=False)[0].flatten(1, 2).to(query.dtype)
