"""A decoding step on a GPU in Triton (flash-decoding): few query rows against a KV cache, exact thresholds.

For each query row (``q <= MAX_QUERIES`` rows of each query head; grouped heads share their kv head's cache rows,
read in place through their strides, no copies):

    s_j = scaling <q, k_j> + mask_j,   m = max_j s_j,   z_j = (alpha - 1)(s_j - m),
    p_j = relu(z_j - tau) ** (1 / (alpha - 1)),   out = sum_j p_j v_j,

with ``tau`` the exact threshold (``sum_j p_j = 1``). The largest weight is at most 1, so ``tau >= -1`` and only
the candidates ``z_j > -1`` can weigh (THEORY.md, "Exact KV skipping"). The keys are split over programs
(flash-decoding): the scoring launch writes each row's scores (``[B, H, q, n]`` float32, the only buffer of that
size, as the torch path's) and each split's row maxima; one program a row gathers its candidates (few on real
text) and solves ``tau`` on them in float64 (:mod:`.triton_decode_kernels`: Newton's method from the lower bound
``tau = -1``, Michelot's algorithm for sparsemax, to ``TOLERANCE`` within ``MAX_ITER`` steps, the eager solver's
constants); each split then adds ``P V`` over its key blocks with a nonzero weight (the others' value rows are
never read), and the last split of each row block to finish sums the splits' partial outputs (a count per row
block, zeroed by each call: calls on several streams share nothing). Three launches, temporaries from three
allocations (one of them zeroed); offsets in 64 bits (:mod:`.triton_decode_kernels`). Scores, threshold and
accumulation are float32 (the threshold float64), whatever the inputs' dtype (float32, bfloat16, float16: half
queries and keys are exact in tf32, so their products use tensor cores); the output has the query's dtype.

``alpha`` is a float in (1, 2] (2: sparsemax, 1.5: 1.5-entmax) or a per-head tensor read at run time (a learned
alpha recompiles nothing). A row that sees no key gets zeros, a row with a NaN or ``+inf`` score NaN, as the
torch path (:func:`.decode.decode_attention`). No autograd: inference only.

Triton is imported on first use (the package imports without it); on a machine without a GPU the kernels run under
Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is first imported), slowly, for tests.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from ...mappings.entmax import MAX_ITER, TOLERANCE
from ..blocked.decode import MAX_QUERIES

BLOCK_ROWS = 16  # query rows of a group a program scores at once (tl.dot's smallest tile; fewer rows are padded)
BLOCK_KEYS = 64  # keys a block
SOLVE_BLOCK = 1024  # candidates a solver step loads at once
TARGET_PROGRAMS = 264  # programs of the scoring launch the keys are split to reach (two per H100 multiprocessor)
MAX_SPLITS = 128  # ... in at most this many splits (one tile size for every length: no compile as the cache grows)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INTERPRET_VALUES = ("1", "true", "on", "yes")  # TRITON_INTERPRET values triton reads as on


def interpreting() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET=1``): kernels then run on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in INTERPRET_VALUES


def _next_power(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, (n - 1).bit_length()))


@functools.lru_cache(maxsize=None)
def _constant(alpha: float, device: torch.device) -> torch.Tensor:
    return torch.tensor([alpha], dtype=torch.float64, device=device)


def _workspace(device: torch.device, dtype: torch.dtype, sizes: list[int],
               zeros: bool = False) -> tuple[torch.Tensor, ...]:
    """Flat temporaries of ``sizes`` elements each, carved from one allocation (each 128-byte aligned: the kernels
    see only their addresses); ``zeros``: zeroed (one fill)."""
    step = 128 // dtype.itemsize
    padded = [-(-size // step) * step for size in sizes]
    make = torch.zeros if zeros else torch.empty
    return torch.split_with_sizes(make(sum(padded), dtype=dtype, device=device), padded)


def _kernels():
    import importlib

    return importlib.import_module(f"{__package__}.triton_decode_kernels")  # imports triton


MASK_DTYPES = (torch.bool, torch.float64) + DTYPES  # float64: taken as float32 (its finfo.min becomes -inf)


def reasons(query, key, value, mask, alpha) -> list[str]:
    """Why the decoding kernel cannot serve these operands: an empty list when it can. The kernel's one check:
    :func:`triton_decode` raises on it, and the routing (:func:`.triton_attention.not_supported_reasons` with
    ``decoding``) falls back on it, so ``kernel="auto"`` never routes a call here that the kernel refuses. A mask
    longer than the keys is served (its first ``n`` keys: a static cache's slots), a float64 mask as float32."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return [f"triton_decode takes query [B, H, q, D] and key / value [B, H_kv, n, D]; got shapes "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"]
    found = []
    batch, heads, rows, dim = query.shape
    if rows > MAX_QUERIES:
        found.append(f"triton_decode serves at most {MAX_QUERIES} query rows (a decoding step); got {rows}")
    if key.shape[:3] != value.shape[:3] or key.shape[0] != batch:
        found.append(f"key {tuple(key.shape)} and value {tuple(value.shape)} do not match query "
                     f"{tuple(query.shape)} (key [B, H_kv, n, D], value [B, H_kv, n, Dv])")
    if key.shape[-1] != dim:
        found.append(f"query and key head sizes {dim}/{key.shape[-1]} differ (q k^T needs one)")
    if key.shape[1] == 0 or heads % key.shape[1]:
        found.append(f"{heads} query heads cannot share {key.shape[1]} kv heads (grouped heads: H = G H_kv)")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype not in DTYPES:
            found.append(f"triton_decode takes float32, bfloat16 or float16 tensors; {name} is {t.dtype}")
        if t.device != query.device:
            found.append(f"{name} is on {t.device}, query on {query.device}")
    if query.device.type != "cuda" and not interpreting():
        found.append(f"triton_decode runs on a CUDA device (tensors on {query.device}); on the CPU only under "
                     "Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported)")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (query, key, value, mask, alpha)):
        found.append("triton_decode has no backward (a decoding step): call it under torch.no_grad() or with "
                     "tensors that do not require grad")
    if mask is not None:
        if mask.dtype not in MASK_DTYPES:
            found.append(f"the mask must be boolean (True: seen) or additive float; got {mask.dtype}")
        full = (batch, heads, rows, key.shape[2])
        given = (1,) * (4 - mask.dim()) + tuple(mask.shape)
        if (mask.dim() > 4 or any(m not in (1, n) for m, n in zip(given[:3], full[:3]))
                or not (given[3] == 1 or given[3] >= full[3])):
            found.append(f"mask {tuple(mask.shape)} does not broadcast to [B, H, q, n] = {list(full)} (n: the keys "
                         "or more)")
        if mask.device != query.device:
            found.append(f"mask is on {mask.device}, query on {query.device}")
    if isinstance(alpha, torch.Tensor):
        if alpha.numel() != heads:
            found.append(f"a per-head alpha has one value a query head ({heads}); got shape {tuple(alpha.shape)}")
        elif alpha.device != query.device:
            found.append(f"alpha is on {alpha.device}, query on {query.device}")
        elif not alpha.is_floating_point() or not bool(((alpha > 1) & (alpha <= 2)).all()):  # one host read
            found.append(f"alphas must be floats in (1, 2]; got {alpha.dtype} {alpha.detach().flatten().tolist()}")
    elif isinstance(alpha, bool) or not (isinstance(alpha, (int, float)) and 1.0 < float(alpha) <= 2.0):
        found.append(f"alpha must be a float in (1, 2] or a per-head tensor; got {alpha!r}")
    return found


def _mask_operand(mask, keys: int):
    """The mask as the kernel reads it: its first ``keys`` keys, a float64 mask as float32 (its lowest value, and
    anything below float32's, become -inf: still not seen)."""
    if mask is None:
        return None
    mask = mask[..., :keys] if mask.dim() and mask.shape[-1] > keys else mask
    return mask.float() if mask.dtype == torch.float64 else mask


def splits_for(programs: int, keys: int, target: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """``(splits, keys a split)``: the keys split in whole blocks over enough programs to reach ``target`` in all
    (``programs`` without a split)."""
    blocks = max(1, math.ceil(keys / BLOCK_KEYS))
    wanted = min(blocks, MAX_SPLITS, max(1, math.ceil(target / programs)))
    split_len = math.ceil(blocks / wanted) * BLOCK_KEYS
    return max(1, math.ceil(keys / split_len)), split_len


def triton_decode(query, key, value, mask=None, *, alpha, scaling: float, splits: int | None = None) -> torch.Tensor:
    """Attention output ``[B, H, q, Dv]`` (the query's dtype) of a decoding step (module docstring).

    ``query [B, H, q, D]`` (``q <= MAX_QUERIES``); ``key [B, H_kv, n, D]``, ``value [B, H_kv, n, Dv]`` (views of a
    cache, read through their strides); ``mask`` None (every key seen), boolean (True: seen) or additive (an entry
    at or below its dtype's lowest value: not seen), broadcastable to ``[B, H, q, n]`` (a longer last dimension:
    its first ``n``); ``alpha`` a float in
    (1, 2] or a tensor of one value a query head; ``scaling`` multiplies ``q.k``; ``splits``: programs the keys
    are split over a (kv head, row block), for tests (default: enough to fill the GPU).
    """
    found = reasons(query, key, value, mask, alpha)
    if found:
        raise ValueError("triton_decode cannot serve this call: " + "; ".join(found))
    kernels = _kernels()
    batch, heads, q_rows, dim = query.shape
    kv_heads, keys, value_dim = key.shape[1], key.shape[2], value.shape[3]
    groups = heads // kv_heads
    rows = groups * q_rows  # rows a kv head serves
    device = query.device
    if keys == 0 or query.numel() == 0 or value_dim == 0:
        return torch.zeros(batch, heads, q_rows, value_dim, dtype=query.dtype, device=device)
    out = torch.empty(batch, heads, q_rows, value_dim, dtype=query.dtype, device=device)
    row_blocks = math.ceil(rows / BLOCK_ROWS)
    programs = batch * kv_heads * row_blocks
    if splits is None:
        splits, split_len = splits_for(programs, keys)
    else:
        split_len = math.ceil(math.ceil(keys / BLOCK_KEYS) / min(max(splits, 1), MAX_SPLITS)) * BLOCK_KEYS
        splits = math.ceil(keys / split_len)
    total_rows = batch * heads * q_rows
    scores, top, top_row, partial = _workspace(device, torch.float32, [
        total_rows * keys, total_rows * splits, total_rows, total_rows * splits * value_dim])
    candidates, tau = _workspace(device, torch.float64, [total_rows * keys, total_rows])
    # the splits' counts a row block (zeros: this call's own, so calls on several streams never share them)
    bad, state, counts = _workspace(device, torch.int32, [total_rows * splits, total_rows, programs], zeros=True)
    mask = _mask_operand(mask, keys)
    if mask is None:
        mask_kind, mask_arg, mask_strides, masked = 0, scores, (0, 0, 0, 0), 0.0
    else:  # broadcast dimensions read with stride 0
        mask_strides = [0] * (4 - mask.dim()) + [0 if size == 1 else step for size, step in
                                                 zip(mask.shape, mask.stride())]
        if mask.dtype == torch.bool:
            mask_kind, mask_arg, masked = 1, mask.view(torch.uint8), 0.0
        else:
            mask_kind, mask_arg, masked = 2, mask, float(torch.finfo(mask.dtype).min)
    kernels.scores_kernel[(programs, splits)](
        query, key, mask_arg, scores, top, bad, *query.stride(), *key.stride(), *mask_strides, kv_heads, groups,
        q_rows, rows, keys, dim, row_blocks, splits, split_len, float(scaling), masked,
        BLOCK_R=BLOCK_ROWS, BLOCK_N=BLOCK_KEYS, BLOCK_D=_next_power(dim), MASK_KIND=mask_kind,
        HALF=query.dtype != torch.float32 and key.dtype != torch.float32)
    if isinstance(alpha, torch.Tensor):  # read per head in the kernels, as it is: no copy, no host read
        alphas = alpha.reshape(heads)
        alpha_stride = alphas.stride(0)
    else:
        alphas, alpha_stride = _constant(float(alpha), device), 0
    kernels.solve_kernel[(total_rows,)](
        scores, top, bad, candidates, alphas, alpha_stride, tau, top_row, state, heads, q_rows, keys, splits,
        TOLERANCE, MAX_ITER, BLOCK_S=MAX_SPLITS, BLOCK_C=SOLVE_BLOCK)
    kernels.values_kernel[(programs, splits)](
        scores, value, alphas, alpha_stride, tau, top_row, state, partial, counts, out,
        *value.stride(), kv_heads, groups, q_rows, rows, keys, value_dim, row_blocks, splits, split_len,
        BLOCK_R=BLOCK_ROWS, BLOCK_N=BLOCK_KEYS, BLOCK_DV=_next_power(value_dim), HALF=value.dtype != torch.float32,
        BFLOAT16=query.dtype == torch.bfloat16)
    return out
