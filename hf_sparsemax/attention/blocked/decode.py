"""Few query rows against a KV cache (decoding), without autograd: the fewest operations around the solve.

A decoding step hands the attention one query row per sequence (a few with speculative or chunked steps)
against every cached key. The work is small (``B H q kv`` scores) and the general path's cost is overhead: the
per-block mask scan, the live-key bookkeeping a backward needs, and an eager threshold solver (the compiled row
kernels skip blocks this small) that stops on a host test after each Newton pass. Here, for each kv head, its
``G`` query heads' rows are stacked (grouped-query attention without copies of ``K`` or ``V``), and

    S = (q K^T) * scaling + mask,   p = relu((alpha - 1)(S - max S) - tau) ** (1 / (alpha - 1)),   out = p V

is computed by the fused kernel (:mod:`.fused`: one pass over the cache in C, the exact threshold on the
candidate keys, ``P V`` over the support) wherever it serves the call: float32 queries (a half model's are cast),
float32 or bfloat16 caches read in place. Otherwise (float16 or float64, no C compiler) it is one product, the compiled row kernel from ``MIN_SCORES`` scores (9 heads at 456 cached keys;
below, the eager solver) (:func:`hf_sparsemax.mappings.compiled.weights`: the same
graph as the blocked path's, its rows not certified by the fixed Newton passes solved again by the eager exact
solver, so ``tau`` is the exact threshold) and one product. The scores and weights ``[B, Hkv, G q, kv]`` are
the only temporaries of that size. Under a half-precision model the cache is not copied to float32: the keys are
cast where they are scored (each scored key, exact in float32) and only the value rows with weight are read and
cast (:func:`.pages.weighted_values`), so the scores, weights and ``P V`` are float32 computations. Masked keys
(left padding, a window, unfilled slots of a static cache) get weight exactly 0, as everywhere.

It applies where :func:`decoding_step` says: no gradient wanted, at most ``MAX_QUERIES`` query rows, and no causal
mask left to the attention (one query row sees every cached key; transformers passes a mask where a step of
several rows needs one).
"""

from __future__ import annotations

import torch

from ...mappings import compiled
from ...mappings._core import masked_below
from ..cpu.fused import decode as fused_decode
from .blocks import Block, block_alpha, block_scores, grouped, work_operands
from .keycodes import coded_attention
from .pages import skipping_attention, weighted_values

MAX_QUERIES = 16  # query rows per sequence up to which a call counts as a decoding step
MIN_SCORES = 4096  # scores of a call from which the compiled kernel solves them (fewer: the eager solver)


def decoding_step(query: torch.Tensor, key: torch.Tensor, alpha: torch.Tensor | None, causal: bool) -> bool:
    """Whether :func:`decode_attention` serves this call (see the module docstring)."""
    if causal or query.shape[-2] > MAX_QUERIES or key.shape[-2] == 0:
        return False
    operands = (query, key) + ((alpha,) if alpha is not None else ())
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in operands))


def decode_attention(query, key, value, mask, *, scaling: float, alpha, fixed_alpha, threshold,
                     pages=None) -> torch.Tensor:
    """Attention output ``[B, q, H, Dv]`` of a threshold mapping for a decoding call, without autograd.

    ``query [B, H, q, D]``, ``key [B, H_kv, kv, D]``, ``value [B, H_kv, kv, Dv]`` (``Dv`` any size), ``mask``
    additive, broadcastable to ``[B, H, q, kv]``, or None (every key seen); ``alpha`` a learned ``[1, H, 1, 1]``
    tensor or None (then ``fixed_alpha``: 2 is sparsemax, 1.5 entmax15); ``threshold`` the registry entry's eager
    exact row solver; ``pages``: the cache's page summary and filled length (:func:`.pages.page_summary`), or
    None: with it the fused kernel reads only the keys its int8 certificate cannot exclude
    (:func:`.keycodes.coded_attention`; the full step's output bit for bit), or where the kernel does not serve the
    call, the pages that provably weigh nothing are skipped (:func:`.pages.skipping_attention`).
    """
    batch, heads, rows, _ = query.shape
    keys = key.shape[-2]
    query, _, _, mask = work_operands(query, None, None, mask)  # a half cache stays as it is: rows read are cast
    problem = grouped(query, key, value, mask, False, alpha.detach() if alpha is not None else fixed_alpha,
                      scaling, threshold)
    out = None if pages is None else coded_attention(problem, *pages)  # the kernel with the int8 certificate
    if pages is not None and out is None:  # the kernel does not serve the call: page bounds
        row_alpha = block_alpha(problem, Block(0, rows, 0, keys), problem.query.dtype)
        out = skipping_attention(problem, *pages, row_alpha, MIN_SCORES)
        if out is not None:
            return out.to(value.dtype).view(batch, heads, rows, -1).transpose(1, 2).contiguous()
    if out is None:
        out = fused_decode(problem, problem.alpha)  # [B, Hkv, G q, Dv], or None: the steps below
    if out is None:
        scores, _, row_alpha = block_scores(problem, Block(0, rows, 0, keys), slice(0, keys))
        p, _ = compiled.weights(scores.view(-1, keys), masked_below(scores.dtype), row_alpha, threshold,
                                minimum=MIN_SCORES)
        out = weighted_values(p.view(scores.shape), problem.value)
    return out.to(value.dtype).view(batch, heads, rows, -1).transpose(1, 2).contiguous()

