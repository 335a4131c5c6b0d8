"""Threshold attention in Triton kernels: forward, backward (d alpha per head included), one threshold kept a row.

For each head (alpha read per head at run time from a float32 tensor: a learned alpha recompiles nothing),

    x = q k^T * scaling (+ mask),   p = relu((alpha - 1)(x - m) - tau) ** (1 / (alpha - 1)),   out = p v,

``m`` the row maximum and ``tau`` in [-1, 0] the row's exact threshold (``sum p = 1``). Per block of query rows
the forward (:func:`._triton_kernels.attention_forward`) makes passes over the key tiles, recomputing ``q k^T``:

1. every tile the rows see: the row maxima, each tile's row maxima (kept for the passes below: ``BLOCK_M``
   floats a tile, unless that would pass ``SKIP_BYTES``) and a histogram a row of ``z = (alpha - 1)(x - m)`` in
   ``HIST_BINS`` bins of width ``1 / (HIST_BINS - 1)`` below the maximum (bins on a grid of the scores, moved down
   as the maximum rises; a tile's counts summed in one reduction as 8-bit fields of an int64). From the counts
   the start: the root of ``L(t) = ||relu(e - t)||_beta - 1``, each score put at its bin's lower edge ``e`` (the
   maximum at 0 exactly), found by Newton in registers. ``L <= f`` (``f(t) = ||relu(z - t)||_beta - 1``, both
   convex and decreasing), so the start is at most the threshold, within about a bin of it;
2. the threshold, certified pass by pass on the tiles that still have a score above the current ``tau``: Newton
   on ``f`` (sparsemax: Michelot's step, exact once the support stops changing or when the step keeps every
   candidate; 1.5-entmax: the closed form on the current candidates, exact when it keeps them all; other
   alphas: Halley's step, kept within twice Newton's and below a known upper bound, until a step moves ``tau`` by
   at most ``TOLERANCE``). A closed form certifies only from below (a start above ``tau`` by rounding takes one
   more step, which lands below by convexity). A row not settled in ``MAX_PASSES`` passes gets NaN (never a
   silent wrong answer; it does not happen for alpha in [1.125, 2]);
3. ``P V`` over the tiles with a score above the final ``tau`` (other alphas: added by the pass that certifies
   the block once its last steps are below ``SPECULATE``, which then saves this pass), the tiles with a nonzero
   weight kept as bits (``LIVE``, one byte a tile) for the backward, and each row's ``sum p`` checked against 1
   (``NORM_TOLERANCE``; NaN if not).

The passes of 2. and 3. loop over a list of the live tiles, rebuilt before each pass from the tile maxima of pass
1 (no product, ``BLOCK_M`` floats a tile): the loop body has no data-dependent branch, so its loads stay
pipelined (a branch around each tile's work stalled them), and a dead tile costs nothing. On captured SmolLM2
scores (counted in torch, with the kernel's per-row arithmetic, when it was written) this takes the forward
from 4.6-6 full passes over the keys to 1.3-2.9 full passes' worth of tile visits; not yet timed on a GPU.

Saved for backward: ``Q, K, V`` and one float32 a row, ``t = m + tau / (alpha - 1)`` (score units; ``+inf`` for
a row that sees no key: weights 0, as the torch path), plus the tile bits; nothing of size ``q x kv``. The
backward recomputes ``p = relu((alpha - 1)(x - t)) ** beta`` on the live tiles only, with ``s = p ** (2 - alpha)``
and ``g = dO v^T``: a row pass for ``delta = <s, g> / <s, 1>`` (and d alpha's row sums), then
``dS = s (g - delta)``, ``dQ = dS K * scaling`` per block of queries and ``dK = dS^T Q * scaling``,
``dV = P^T dO`` per block of keys (a grouped head's query heads summed in registers, no copies of K / V), and
``d alpha = sum_rows beta^2 (<g, p> - delta) - beta (<g, p log p> - delta <p, log p>)`` per head.

Scores, thresholds and sums are float32; bfloat16 / float16 operands feed the products as FlashAttention does
(weights rounded to the operands' dtype for ``P V`` and the backward products, float32 accumulation); float32
operands use IEEE float32 products. ``mask``: None (then ``causal``: query ``i`` sees keys ``j <= i``, upper-left
aligned as :func:`.blocks.causal_mask`), or a bool (True: seen) or additive float mask broadcastable to
``[B, H, q, kv]``, read through its strides (padding, sliding windows, packed sequences); an additive entry at
or below its dtype's ``finfo.min`` excludes the key, as everywhere in the library. Kernels run on CUDA, or on
the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set before the first use; tests).
"""

from __future__ import annotations

import importlib.util
import types

import torch

from ...mappings._core import DENSE_MAX_ITER, DENSE_TOLERANCE_ULPS
from ...mappings.entmax import precise_in_float32
from .triton_decode import interpreting
from .triton_decode import reasons as decode_reasons

BLOCK_M, BLOCK_N = 64, 64  # query rows and keys a tile on a GPU (tl.dot tiles of BLOCK_M x BLOCK_N x D)
NUM_WARPS, NUM_STAGES = 4, 3  # launch options of every kernel on a GPU (Triton's defaults)
INTERPRET_BLOCK = 16  # rows and keys a tile under the interpreter (the smallest tl.dot tile; small tests stay fast)
MAX_PASSES = DENSE_MAX_ITER  # threshold passes over the keys, as the CPU path's whole-row Newton
TOLERANCE = DENSE_TOLERANCE_ULPS * torch.finfo(torch.float32).eps  # a Newton step this small settles a row
HIST_BINS = 8  # histogram bins of z a row (width 1 / (HIST_BINS - 1)), counted in the max pass: the start
HIST_ITER = 12  # Newton steps in registers on the binned lower bound (the start; no pass over the keys)
SPECULATE = 1e-3  # other alphas: a pass after steps this small adds P V (Halley's next step: far below TOLERANCE)
SKIP_BYTES = 1 << 29  # the tile maxima kept for skipping (4 bytes a query row a key tile) at most this: else none
NORM_TOLERANCE = 1e-3  # |sum p - 1| above this marks a row NaN (a certificate, far above float32 rounding)
HEAD_SIZES = (16, 32, 64, 128)  # head sizes the kernels take (powers of 2 that fit an H100's shared memory): the
# query / key head size and, apart from it, the value head size (DeepSeek's MLA heads differ: 192 / 128)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MASK_DTYPES = (torch.bool, torch.float32, torch.bfloat16, torch.float16, torch.float64)
def triton_available() -> bool:
    """Whether ``triton`` is installed (imported only on first use)."""
    return importlib.util.find_spec("triton") is not None


def not_supported_reasons(query, key, value, mask=None, *, alpha=1.5, mapping: str | None = None,
                          dropout: float = 0.0, softcap=None, position_bias=None, sinks=None,
                          weights: bool = False, decoding: bool = False) -> list[str]:
    """Why the Triton kernels cannot serve this call (xformers' style): an empty list when they can.

    ``mapping``: the attention's mapping name (None: alpha-entmax with ``alpha``); ``dropout`` the dropout
    probability applied (0 outside training); ``weights``: the caller asked for the attention weights;
    ``decoding``: the call goes to the decoding kernel, whose operands are checked by its own predicate
    (:func:`.triton_decode.reasons`, the one :func:`.triton_decode.triton_decode` raises on).
    """
    from ...mappings import registry

    reasons = []
    if not triton_available():
        reasons.append("triton is not installed (pip install triton)")
    if mapping is not None and registry.REGISTRY[mapping].threshold is None:
        reasons.append(f"the {mapping} mapping has no threshold form (the kernels serve sparsemax, entmax15, "
                       "entmax_bisect)")
    if torch.compiler.is_compiling():
        reasons.append("torch.compile is tracing (the kernels are not traced)")
    if weights:
        reasons.append("the attention weights are requested (output_attentions)")
    if dropout:
        reasons.append("attention dropout")
    if softcap is not None:
        reasons.append("logit softcapping")
    if position_bias is not None:
        reasons.append("a position bias")
    if sinks is not None:
        reasons.append("attention sinks")
    if decoding:
        return reasons + decode_reasons(query, key, value, mask, alpha)
    tensors = (query, key, value)
    if any(t.dim() != 4 for t in tensors):
        return reasons + ["query, key and value must be 4-D [B, H, len, D]"]
    if query.dtype not in DTYPES or not query.dtype == key.dtype == value.dtype:
        reasons.append(f"dtypes {query.dtype}/{key.dtype}/{value.dtype} (the kernels take one of float32, "
                       "bfloat16, float16 for all three)")
    reasons.extend(head_size_reasons(query.shape[-1], key.shape[-1], value.shape[-1]))
    if (key.shape[:2] != value.shape[:2] or key.shape[-2] != value.shape[-2] or query.shape[0] != key.shape[0]
            or key.shape[1] == 0 or query.shape[1] % key.shape[1]):
        reasons.append(f"shapes {tuple(query.shape)}/{tuple(key.shape)}/{tuple(value.shape)} are not "
                       "[B, H, q, D] / [B, H_kv, kv, D] / [B, H_kv, kv, Dv] with H a multiple of H_kv")
    devices = {t.device for t in tensors} | ({mask.device} if mask is not None else set())
    if len(devices) > 1:
        reasons.append(f"tensors on several devices {sorted(map(str, devices))}")
    elif query.device.type != "cuda" and not interpreting():
        reasons.append(f"tensors on {query.device.type}: the Triton kernels run on CUDA, or on the CPU only under "
                       "TRITON_INTERPRET=1")
    if mask is not None:
        if mask.dtype not in MASK_DTYPES:
            reasons.append(f"a mask of dtype {mask.dtype} (bool or floating masks only)")
        if mask.requires_grad:
            reasons.append("a mask that requires grad")
        if mask.dim() > 4 or not _broadcasts(mask, query, key):
            reasons.append(f"a mask of shape {tuple(mask.shape)} not broadcastable to [B, H, q, kv]")
    reasons.extend(alpha_reasons(alpha, query.shape[1]))
    return reasons


def head_size_reasons(query: int, key: int, value: int) -> list[str]:
    """Why the kernels cannot take these head sizes: the query's and the key's must agree and be one of
    ``HEAD_SIZES``; the value's is one of ``HEAD_SIZES`` too, equal to theirs or not. (The decoding kernel pads its
    tiles to a power of 2 and masks them: any sizes, :func:`.triton_decode.reasons`.)"""
    reasons = []
    if key != query:
        reasons.append(f"query and key head sizes {query}/{key} differ (q k^T needs one)")
    if query not in HEAD_SIZES:
        reasons.append(f"query / key head size {query} (the kernels take one of {HEAD_SIZES}; the torch path any)")
    if value not in HEAD_SIZES:
        reasons.append(f"value head size {value} (the kernels take one of {HEAD_SIZES}; the torch path any)")
    return reasons


def alpha_reasons(alpha, heads: int) -> list[str]:
    """Why ``alpha`` (a float or a tensor of ``heads`` alphas) is not served: float32 keeps the power precise for
    alpha in [1.125, 2] only (:func:`..mappings.entmax.precise_in_float32`; one host read for a tensor)."""
    if isinstance(alpha, torch.Tensor):
        if alpha.numel() != heads:
            return [f"an alpha tensor of shape {tuple(alpha.shape)} (one alpha a head, {heads})"]
        if not precise_in_float32(alpha.detach()):
            return ["alphas outside [1.125, 2] (float32 too coarse for the power; the torch path uses float64)"]
        return []
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not precise_in_float32(float(alpha)):
        return [f"alpha {alpha!r} outside [1.125, 2] (float32 too coarse for the power; the torch path uses float64)"]
    return []


def _broadcasts(mask, query, key) -> bool:
    given = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    wanted = tuple(query.shape[:3])
    return all(g in (1, w) for g, w in zip(given[:3], wanted)) and (given[3] == 1 or given[3] >= key.shape[2])


def triton_attention(query, key, value, mask=None, *, causal: bool = False, alpha=1.5,
                     scaling: float | None = None) -> torch.Tensor:
    """Attention output ``[B, H, q, Dv]`` of alpha-entmax attention in Triton kernels (module docstring).

    ``query [B, H, q, D]``, ``key [B, H_kv, kv, D]``, ``value [B, H_kv, kv, Dv]`` (``H`` a multiple of ``H_kv``:
    grouped heads share theirs, no copies; ``D`` and ``Dv`` each one of ``HEAD_SIZES``); ``alpha`` a float in
    [1.125, 2] (2: sparsemax, 1.5: 1.5-entmax) or ``H`` alphas (any shape with ``H`` elements, e.g. a learned
    ``[1, H, 1, 1]``; differentiable); ``scaling`` defaults to
    ``D ** -0.5``. Differentiable in query, key, value and a tensor alpha. A ``ValueError`` lists every reason
    a call is not served (:func:`not_supported_reasons`).
    """
    reasons = not_supported_reasons(query, key, value, mask, alpha=alpha)
    if reasons:
        raise ValueError("triton_attention cannot serve this call: " + "; ".join(reasons))
    scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    heads = query.shape[1]
    if isinstance(alpha, torch.Tensor):
        alphas = alpha.reshape(heads).to(device=query.device, dtype=torch.float32)
    else:
        alphas = torch.full((heads,), float(alpha), dtype=torch.float32, device=query.device)
    causal = bool(causal) and mask is None
    if query.shape[-2] == 0 or key.shape[-2] == 0:  # no rows, or no key to see: zeros (differentiable)
        return (query.sum() * 0 + key.sum() * 0 + value.sum() * 0 + alphas.sum() * 0) + query.new_zeros(
            query.shape[:-1] + value.shape[-1:])
    mask, mask_floor = _mask_operand(mask, query, key)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, alphas)):
        return TritonAttention.apply(query, key, value, alphas, mask, mask_floor, causal, scaling)
    return _forward(query, key, value, alphas, mask, mask_floor, causal, scaling)[0]


def _mask_operand(mask, query, key):
    """``(mask expanded to [B, H, q, kv] (a view: strides 0 where broadcast; bool as uint8), floor)``: an
    additive entry at or below ``floor`` excludes its key."""
    if mask is None:
        return None, 0.0
    if mask.dtype == torch.float64:
        mask = mask.float()  # its finfo.min becomes -inf: still excluded
    mask = mask[..., : key.shape[-2]]
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(
        query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), 0.0
    return mask, float(torch.finfo(mask.dtype).min)


def _kernels():
    """The kernels module (it imports triton: on first use only)."""
    from ._triton_kernels import (attention_backward_kv, attention_backward_q, attention_backward_rows,
                                  attention_forward)

    return types.SimpleNamespace(attention_forward=attention_forward, attention_backward_rows=attention_backward_rows,
                                 attention_backward_q=attention_backward_q, attention_backward_kv=attention_backward_kv)


def _layout(query, key):
    """``(launch options, tile counts, dot precision)``: the tile sizes and warps, the query and key blocks, and
    IEEE float32 products for float32 operands."""
    block_m, block_n = (INTERPRET_BLOCK, INTERPRET_BLOCK) if interpreting() else (BLOCK_M, BLOCK_N)
    launch = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    n_m, n_n = -(-query.shape[2] // block_m), -(-key.shape[2] // block_n)
    return launch, n_m, n_n, "ieee" if query.dtype == torch.float32 else "tf32"


def _mask_args(mask):
    return (mask, *mask.stride()) if mask is not None else (None, 0, 0, 0, 0)


def _forward(query, key, value, alphas, mask, mask_floor, causal, scaling):
    batch, heads, n_q, dim = query.shape
    launch, n_m, n_n, precision = _layout(query, key)
    out = query.new_empty(batch, heads, n_q, value.shape[-1])
    t = torch.empty(batch, heads, n_q, dtype=torch.float32, device=query.device)
    live = torch.zeros(batch, heads, n_m, n_n, dtype=torch.int8, device=query.device)
    tiles = batch * heads * n_m * n_n
    skip = tiles * launch["BLOCK_M"] * 4 <= SKIP_BYTES
    tile_max = torch.empty(tiles * launch["BLOCK_M"] if skip else 1, dtype=torch.float32, device=query.device)
    tile_list = torch.empty(tiles, dtype=torch.int32, device=query.device)
    work = torch.empty(batch, heads, n_m, 2, dtype=torch.int32, device=query.device)
    mask_ptr, *mask_strides = _mask_args(mask)
    _kernels().attention_forward[(n_m, batch * heads)](
        query, key, value, mask_ptr, alphas, out, t, live, tile_max, tile_list, work,
        *query.stride(), *key.stride(), *value.stride(), *mask_strides, *out.stride(),
        heads, heads // key.shape[1], n_q, key.shape[2], n_m, n_n, scaling, mask_floor, TOLERANCE, NORM_TOLERANCE,
        MAX_PASSES, SPECULATE, HAS_MASK=mask is not None, MASK_BOOL=mask is not None and mask.dtype == torch.uint8,
        CAUSAL=causal, SKIP=skip, HIST_BINS=HIST_BINS, HIST_ITER=HIST_ITER, HEAD_D=dim, HEAD_DV=value.shape[-1],
        PRECISION=precision, **launch)
    return out, t, live, work


def _backward(query, key, value, alphas, mask, mask_floor, causal, scaling, t, live, grad_out, alpha_grad):
    batch, heads, n_q, dim = query.shape
    kv_heads, n_kv = key.shape[1], key.shape[2]
    launch, n_m, n_n, precision = _layout(query, key)
    kernels = _kernels()
    mask_ptr, *mask_strides = _mask_args(mask)
    common = dict(HAS_MASK=mask is not None, MASK_BOOL=mask is not None and mask.dtype == torch.uint8,
                  CAUSAL=causal, HEAD_D=dim, HEAD_DV=value.shape[-1], PRECISION=precision, **launch)
    sizes = (heads, heads // kv_heads, n_q, n_kv, n_m, n_n, scaling, mask_floor)
    strides = (*query.stride(), *key.stride(), *value.stride(), *mask_strides, *grad_out.stride())
    delta = torch.empty(batch, heads, n_q, dtype=torch.float32, device=query.device)
    d_alpha_rows = torch.empty_like(delta) if alpha_grad else delta
    kernels.attention_backward_rows[(n_m, batch * heads)](
        query, key, value, mask_ptr, alphas, grad_out, t, live, delta, d_alpha_rows, *strides, *sizes,
        ALPHA_GRAD=alpha_grad, **common)
    d_query = torch.empty(batch, heads, n_q, dim, dtype=query.dtype, device=query.device)
    kernels.attention_backward_q[(n_m, batch * heads)](
        query, key, value, mask_ptr, alphas, grad_out, t, live, delta, d_query, *strides, *sizes, **common)
    d_key = torch.empty(batch, kv_heads, n_kv, dim, dtype=key.dtype, device=key.device)
    d_value = torch.empty(batch, kv_heads, n_kv, value.shape[-1], dtype=value.dtype, device=value.device)
    kernels.attention_backward_kv[(n_n, batch * kv_heads)](
        query, key, value, mask_ptr, alphas, grad_out, t, live, delta, d_key, d_value, *strides, *sizes, **common)
    d_alpha = d_alpha_rows.sum((0, 2)) if alpha_grad else None
    return d_query, d_key, d_value, d_alpha


class TritonAttention(torch.autograd.Function):
    """:func:`triton_attention` with a gradient: the saved threshold recomputes the weights blockwise."""

    @staticmethod
    def forward(ctx, query, key, value, alphas, mask, mask_floor, causal, scaling):
        out, t, live, _ = _forward(query, key, value, alphas, mask, mask_floor, causal, scaling)
        ctx.save_for_backward(query, key, value, alphas, mask, t, live)
        ctx.mask_floor, ctx.causal, ctx.scaling = mask_floor, causal, scaling
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, alphas, mask, t, live = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph: through the differentiable materialised formula
            inputs = [x for x, need in zip((query, key, value, alphas), needs[:4]) if need]
            out = reference_attention(query, key, value, mask, causal=ctx.causal, alpha=alphas, scaling=ctx.scaling,
                                      mask_floor=ctx.mask_floor)
            grads = iter(torch.autograd.grad(out, inputs, grad_out, create_graph=True))
            found = [next(grads) if need else None for need in needs[:4]]
            return (*found, None, None, None, None)
        grad_out = grad_out.to(query.dtype)
        d_query, d_key, d_value, d_alpha = _backward(query, key, value, alphas, mask, ctx.mask_floor, ctx.causal,
                                                     ctx.scaling, t, live, grad_out, bool(needs[3]))
        return d_query, d_key, d_value, d_alpha, None, None, None, None


def reference_attention(query, key, value, mask=None, *, causal=False, alpha=1.5, scaling=None, mask_floor=None):
    """The same output through the materialised ``[B, H, q, kv]`` weights and the library's differentiable
    mappings (half operands in float32): the double backward's path, and a readable statement of the math."""
    from ...mappings import entmax15, entmax_bisect, sparsemax
    from ..blocked.blocks import causal_mask, work_operands

    dtype, heads = query.dtype, query.shape[1]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    query, key, value, _ = work_operands(query, key, value, None)
    groups = heads // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    masked = torch.finfo(scores.dtype).min
    if mask is not None:
        mask = mask[..., : key.shape[-2]]
        if mask.dtype in (torch.bool, torch.uint8):
            scores = scores.masked_fill(mask == 0, masked)
        else:
            floor = torch.finfo(mask.dtype).min if mask_floor is None else mask_floor
            scores = torch.where(mask > floor, scores + mask.to(scores.dtype), masked)
    elif causal:
        scores = scores + causal_mask(0, scores.shape[-2], slice(0, scores.shape[-1]), scores.dtype, scores.device)
    if isinstance(alpha, torch.Tensor):
        weights = entmax_bisect(scores, alpha=alpha.reshape(1, heads, 1, 1).to(scores.dtype), dim=-1)
    elif alpha == 2:
        weights = sparsemax(scores, dim=-1)
    elif alpha == 1.5:
        weights = entmax15(scores, dim=-1)
    else:
        weights = entmax_bisect(scores, alpha=alpha, dim=-1)
    return torch.matmul(weights, value).to(dtype)
