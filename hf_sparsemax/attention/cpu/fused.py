"""Decoding steps and a prefill's blocks in one fused CPU kernel (:download:`fused.c`), with exact thresholds.

A decoding call's work is small (``B H q kv`` scores) and, run as torch operations, most of its time went to
the operations themselves: two small matrix products, a compiled threshold kernel behind dynamo's guards, the
search for the support, ~60 operations in all; inside a model, whose weights flush the caches between
attention calls, 1.5 ms a call at 2048 keys against sdpa's 0.6 ms. :func:`decode` does the whole step in one
call: for each batch row and kv head (in parallel), it scores the group's query rows against every key row as it
reads it, finds each row's maximum ``m``, collects the candidates ``z_j = (alpha - 1)(s_j - m) > -1`` (the others
have weight exactly 0, since ``tau >= -1``), keeps those above a floor of ``tau`` from their counts near the top
(``tau >= -c - n_c ** (1 - alpha)``, ``n_c`` the candidates above ``-c``: far above -1 in a flat row, where most
candidates weigh nothing), solves the exact threshold on them in float64 (sparsemax and
1.5-entmax by their closed forms on the sorted candidates where they are at most ``SORT_BELOW``, otherwise
Halley's method in a bisection bracket to 1e-13, Michelot's algorithm for sparsemax: the eager solvers'
stopping rule, :mod:`hf_sparsemax.mappings`; the powers ``u ** (1 / (alpha - 1))`` by the kernel's own
``2^(e log2 u)`` in double arithmetic, proven to a few roundings and vectorised, :func:`kernel_power`), and adds up
``p_j v_j`` over the support, reading only those value rows. :func:`block_rows` does the same from a prefill
block's scores (the products stay with BLAS), for every alpha in (1, 2], fixed or learned per head, in place of
the candidate search, the compiled solve and the gathered ``P V``. The iterates rise from ``tau = -1`` to
the root, and the candidates at or below the bracket's low end are dropped after each pass, so a row with many
candidates (alpha near 1) costs a few passes over a shrinking list (3.5-4 passes a row on SmolLM2 at alpha 1.3).
Outputs equal the general path's to float32 rounding (``tests/test_attention_fused.py`` checks the weights
themselves against the materialised mappings in float64).

The kernel is built on first use (:mod:`.kernel_build`: the system's C compiler, a cache folder only the user
can write, ``hf-sparsemax build-kernels`` ahead of time) and called through ``ctypes`` with one argument, a
:class:`Params` struct (FlashAttention's ``Flash_fwd_params`` style): its C declaration is generated from
:data:`FIELDS` at build time, so the two sides cannot disagree on a field. The solver's constants (tolerance,
iteration cap, the candidates' bound) come from the Python solvers' modules through it. Before a pointer leaves
Python every tensor's device, dtype, shape, strides and extent are checked (:func:`checked`): a mismatch the model
should never produce is a ``ValueError`` naming it; what the kernel does not read (float16, another device, a
layout it does not walk) is left to the general path. It serves float32 queries with float32 or bfloat16 keys
and values, every row (flat rows too: no compiled kernel is ever built for these calls); its output is float32
on the CPU whatever the default dtype and device. No compiler (one warning) or ``HF_SPARSEMAX_COMPILED_SOLVER=0``
leaves every call to the general path.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import sys
from typing import NamedTuple

import torch

from ...mappings._core import masked_below
from ...mappings.compiled import CANDIDATE_MARGIN, ENVIRONMENT  # "0": no compiled kernels (the row kernels' switch)
from ...mappings.entmax import MAX_ITER, TOLERANCE  # the eager solver's stopping rule, shared by the C solver
from .kernel_build import build_library, folder_problem, wanted_folder, warn_once

SORT_BELOW = 128  # sparsemax / 1.5-entmax rows with at most this many candidates: the closed form on them sorted
FLOOR_LEVELS = 32  # levels -k / 32 of the candidates' floor of tau (fused.c tau_floor; a power of two: exact levels)
CODE_ERROR = 1.0  # the factor of the int8 certificate's error bound: 1 (a test sets 0 to show the bound matters)
CERTIFICATE = {  # the int8 certificate's constants (fused.c, its proof): #defines of the generated header
    "CODE_BLOCK": 16,  # keys a block of codes (the codes' slots come in multiples of it)
    "NORM_SLACK": 1e-12,  # relative rounding up of a norm computed in double
    "CODE_NORM_SLACK": 1e-15,  # ... of an integer code's norm (sums exact in double, one sqrt)
    "BOUND_SLACK": 1e-6,  # E's factor (1 + this): the roundings of E, t - E and t + E in float32
    "SUM_SLACK": 1e-5,  # E's allowance this * (|t| + |m|): the float32 roundings of t, the scaling and the mask
    "CUT_SLACK": 1e-9,  # the candidates' cut lowered by this / (alpha - 1): z's rounding in double
}
MIN_PARALLEL_WORK = 1 << 15  # scores of a call (keys x dims to code) from which the kernel runs on several threads
MAX_CODED_DIM = 512  # head sizes whose int16 x int8 code products stay exact in int32 (fused.c)
MASKED = masked_below(torch.float32)  # the kernel's scores are float32: a mask at or below this hides a key
KEY_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # cache dtypes the kernel reads (bfloat16 widened exactly)
_failed: list[str] = []

_I64, _F64, _F32, _I32, _PTR = ctypes.c_int64, ctypes.c_double, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p
C_TYPES = {_I64: "int64_t", _F64: "double", _F32: "float", _I32: "int32_t"}
FIELDS = (  # (name, ctypes type, C type where a pointer): the one declaration of the kernel's argument
    # shapes: query [batch, kv_heads, rows, dim] (rows: the G heads' q_rows rows each), keys, value rows' size
    ("batch", _I64), ("kv_heads", _I64), ("rows", _I64), ("keys", _I64), ("dim", _I64), ("value_dim", _I64),
    ("q_rows", _I64),
    # operands: decode reads query / key / mask, rows() reads scores; both value (and alphas) and write out
    ("query", _PTR, "const float *"), ("scores", _PTR, "const float *"), ("key", _PTR, "const void *"),
    ("value", _PTR, "const void *"), ("mask", _PTR, "const float *"), ("alphas", _PTR, "const float *"),
    ("out", _PTR, "float *"), ("taus", _PTR, "double *"),  # taus: each row's threshold, where not NULL (tests)
    # strides in elements: key and value [batch, kv head, key], mask [batch, kv head, group, row, key]
    ("k_b", _I64), ("k_h", _I64), ("k_n", _I64), ("v_b", _I64), ("v_h", _I64), ("v_n", _I64),
    ("m_b", _I64), ("m_h", _I64), ("m_g", _I64), ("m_r", _I64), ("m_n", _I64),
    # the mapping: alpha (where alphas is NULL), the scores' scale, the masked level (at or below: not seen)
    ("fixed_alpha", _F64), ("scaling", _F32), ("masked", _F32),
    # the solver: Newton's stopping step and cap, the candidates z > -candidate_margin, the closed forms' limit
    ("tolerance", _F64), ("candidate_margin", _F64), ("max_iter", _I64), ("sort_below", _I64),
    ("bf16", _I32), ("threads", _I32),
    # the int8 key certificate (fused.c): codes [B, Hkv, capacity, dim] int8 and code_scales [B, Hkv, capacity]
    # (strides c_b, c_h in keys), code_bounds [B, Hkv, 2] (rho, kappa); keys [coded, length) quantised by the call,
    # the keys certified not read where certify is set; certified[task]: their number (-1: every key scored)
    ("codes", _PTR, "int8_t *"), ("code_scales", _PTR, "float *"), ("code_bounds", _PTR, "double *"),
    ("certified", _PTR, "int64_t *"), ("c_b", _I64), ("c_h", _I64), ("coded", _I64), ("length", _I64),
    ("certify", _I32), ("code_error", _F64),  # code_error: the factor of the bound's E (1; 0 only in a test)
    # a paged cache (or NULL): key / value row j of batch row b is row slots[b * s_b + j] (k_b, v_b unused: 0);
    # its codes per slot: codes [Hkv, S, D], code_scales and code_residuals [Hkv, S] (c_h = S, c_b = 0)
    ("slots", _PTR, "const int64_t *"), ("s_b", _I64), ("code_residuals", _PTR, "float *"),
)


class Params(ctypes.Structure):
    """The kernel's one argument (``hf_sparsemax_params`` in C, generated by :func:`header`)."""

    _fields_ = [(name, kind) for name, kind, *_ in FIELDS]


def header() -> str:
    """The C declaration of :class:`Params` (same field order and types: the same layout)."""
    lines = [f"    {pointer[0]}{name};" if pointer else f"    {C_TYPES[kind]} {name};"
             for name, kind, *pointer in FIELDS]
    defines = "".join(f"#define {name} {value!r}\n" for name, value in {**CERTIFICATE, "FLOOR_LEVELS": FLOOR_LEVELS}.items())
    return ("/* generated by hf_sparsemax.attention.cpu.fused.header() from FIELDS, CERTIFICATE and FLOOR_LEVELS: "
            "do not edit */\n"
            "#include <stdint.h>\n" + defines + "typedef struct {\n" + "\n".join(lines) + "\n} hf_sparsemax_params;\n")


@functools.lru_cache(maxsize=1)
def library():
    """The loaded kernel, or None where it cannot be built (one warning; the general path from then on)."""
    try:
        path, lost = build_library(header())
        lib = ctypes.CDLL(path)
        lib.hf_sparsemax_params_size.restype = _I64
        if lib.hf_sparsemax_params_size() != ctypes.sizeof(Params):
            raise RuntimeError(f"{path} was built for another argument layout")
    except (OSError, RuntimeError) as error:
        _failed.append(f"{type(error).__name__}: {error}")
        warn_once("failed", f"the fused attention kernel could not be built ({_failed[0][:300]}); "
                                         "decoding steps and prefills take the general path")
        return None
    if lost:
        warn_once("openmp", f"the fused attention kernel was built without OpenMP, so it runs on one "
                                         f"thread ({lost[:200]})")
    for name in ("hf_sparsemax_decode", "hf_sparsemax_rows", "hf_sparsemax_code_slots"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [ctypes.POINTER(Params)]
    lib.hf_sparsemax_power.restype = None
    lib.hf_sparsemax_power.argtypes = [_PTR, _I64, _F64, _PTR]
    return lib


def available() -> bool:
    return os.environ.get(ENVIRONMENT, "1") != "0" and not torch.compiler.is_compiling() and library() is not None


def within_storage(tensor: torch.Tensor) -> bool:
    """Whether every element the sizes and strides reach lies inside the tensor's storage (no negative stride)."""
    if tensor.is_contiguous():  # the common case: elements offset .. offset + numel - 1
        end = tensor.storage_offset() + tensor.numel()
    else:
        end = tensor.storage_offset() + 1
        for size, stride in zip(tensor.shape, tensor.stride()):  # a plain loop: this runs on every decoding call
            if stride < 0:
                return False
            end += (size - 1) * stride
    return end * tensor.element_size() <= tensor.untyped_storage().nbytes()


def checked(name: str, tensor: torch.Tensor, shape: tuple[int | None, ...], device: torch.device) -> torch.Tensor:
    """``tensor`` where its shape matches ``shape`` (None: any size), it lies on ``device`` and inside its
    storage; else a ValueError naming the mismatch (these come from a model's own bug, never from a call the
    kernel merely does not serve)."""
    if tensor.device != device:
        raise ValueError(f"fused attention kernel: {name} is on {tensor.device}, the query on {device}")
    sizes = tensor.shape
    fits = len(sizes) == len(shape)
    for got, want in zip(sizes, shape):  # a plain loop: this runs several times on every decoding call
        fits = fits and (want is None or got == want)
    if not fits:
        wanted = ", ".join("*" if want is None else str(want) for want in shape)
        raise ValueError(f"fused attention kernel: {name} has shape {tuple(tensor.shape)}, expected [{wanted}]")
    if not within_storage(tensor):
        raise ValueError(f"fused attention kernel: {name}'s strides {tensor.stride()} reach outside its storage")
    return tensor


def kernel_threads(work: int) -> int:
    """OpenMP threads for a call of ``work`` scores (or keys to code): torch's thread count from
    ``MIN_PARALLEL_WORK`` on, one thread below. The kernel's OpenMP pool is not torch's (the system's libgomp beside
    the one torch ships), so a parallel region wakes threads that compete with torch's still-spinning ones: on a
    small call (vLLM decoding a batch of short requests: a few thousand scores a layer) that costs more than it
    saves (vLLM, entmax15, batch 8 on 2 cores: 0.81x the softmax twin's tokens/s on two threads, 1.00x on one)."""
    return torch.get_num_threads() if work >= MIN_PARALLEL_WORK else 1


def solver_params(**fields) -> Params:
    """A :class:`Params` with the solver's constants from the Python solvers and the given fields (the threads
    from the call's scores, :func:`kernel_threads`)."""
    work = fields.get("batch", 1) * fields.get("kv_heads", 1) * fields.get("rows", 1) * fields.get("keys", 1)
    return Params(tolerance=TOLERANCE, candidate_margin=CANDIDATE_MARGIN, max_iter=MAX_ITER, sort_below=SORT_BELOW,
                  masked=MASKED, threads=kernel_threads(work), **fields)


def new_output(*shape: int) -> torch.Tensor:
    """The kernel's output: float32 on the CPU, whatever the default dtype and device."""
    return torch.empty(shape, dtype=torch.float32, device="cpu")


def served(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           keys: int) -> bool:
    """Whether the decoding kernel reads these operands: float32 queries on the CPU, float32 or bfloat16 keys and
    values (channels contiguous), a float32 mask or none, some query and ``keys`` > 0, the kernel built."""
    return (query.dtype == torch.float32 and query.device.type == "cpu" and key.dtype in KEY_DTYPES
            and value.dtype == key.dtype and key.stride(-1) == 1 and value.stride(-1) == 1
            and (mask is None or mask.dtype == torch.float32) and query.numel() > 0 and keys > 0 and available())


def mask_strides(mask: torch.Tensor | None, shape: tuple[int, ...], device) -> tuple[torch.Tensor | None, tuple]:
    """``(mask, strides)``: an additive mask broadcast to ``shape`` (``[B, Hkv, G, q, keys]``) and its strides in
    elements (all 0 where ``mask`` is None); a mask that does not broadcast is a ValueError."""
    if mask is None:
        return None, (0,) * len(shape)
    try:
        mask = mask.expand(shape)
    except RuntimeError:
        raise ValueError(f"fused attention kernel: the mask's shape {tuple(mask.shape)} does not broadcast to "
                         f"{shape}") from None
    return mask, checked("mask", mask, shape, device).stride()


def decoding_params(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, alpha,
                    keys: int, scaling: float, **layout) -> tuple[Params, torch.Tensor, torch.Tensor | None] | None:
    """``(params, out, alphas)`` of a decoding kernel call, what :func:`decode` and :func:`paged_decode` share:
    ``query [B, Hkv, G, q, D]`` (checked, contiguous), ``keys`` keys a row, ``key`` / ``value`` the tensors the
    kernel reads (their dtype, pointers and value head size), the alphas by :func:`row_alphas`, the mask broadcast
    by :func:`mask_strides`, the output made; ``layout``: the call's strides of the keys and values (and slots).
    ``alphas``: the float32 alphas the kernel reads (None: the fixed alpha), to be held until it has run. None
    where the kernel does not serve that alpha."""
    batch, kv_heads, groups, rows, dim = query.shape
    per_row = row_alphas(alpha, kv_heads, groups * rows, query.device, groups)
    if per_row is None:
        return None
    alphas = per_row[0]
    mask, strides = mask_strides(mask, (batch, kv_heads, groups, rows, keys), query.device)
    out = query.new_empty(batch, kv_heads, groups * rows, value.shape[-1])  # float32 on the CPU (served)
    params = solver_params(
        batch=batch, kv_heads=kv_heads, rows=groups * rows, keys=keys, dim=dim, value_dim=value.shape[-1],
        q_rows=rows, query=query.data_ptr(), key=key.data_ptr(), value=value.data_ptr(),
        mask=None if mask is None else mask.data_ptr(), alphas=None if alphas is None else alphas.data_ptr(),
        out=out.data_ptr(), m_b=strides[0], m_h=strides[1], m_g=strides[2], m_r=strides[3], m_n=strides[4],
        scaling=scaling, fixed_alpha=0.0 if alphas is not None else float(alpha), bf16=KEY_DTYPES[key.dtype],
        **layout)
    return params, out, alphas


def decode(problem, alpha: float | torch.Tensor, codes=None, length: int = 0,
           certify: bool = False) -> torch.Tensor | None:
    """``out [B, Hkv, G q, D]`` (float32) of a decoding call's :class:`.blocks.Problem` (``alpha`` a float, or
    ``[1, Hkv, G, 1, 1]`` learned per head), or None where the kernel does not serve it (module docstring).

    ``codes`` (a :class:`.keycodes.KeyCodes` of the cache, or None): the call first writes the int8 copies of the
    keys ``[codes.coded, length)`` and, where ``certify``, reads only the keys the int8 certificate does not
    exclude (the same output, bit for bit; ``codes.certified`` gets each task's count). A failed call leaves
    ``codes.coded`` at 0 (rebuilt on the next call)."""
    query, key, value, mask = problem.query, problem.key, problem.value, problem.mask
    if not served(query, key, value, mask, key.numel()):
        return None
    batch, kv_heads, groups, rows, dim = query.shape
    keys, device = key.shape[-2], query.device
    query = checked("query", query.contiguous(), (batch, kv_heads, groups, rows, dim), device)
    checked("key", key, (batch, kv_heads, keys, dim), device)
    checked("value", value, (batch, kv_heads, keys, None), device)
    call = decoding_params(query, key, value, mask, alpha, keys, problem.scaling, k_b=key.stride(0),
                           k_h=key.stride(1), k_n=key.stride(2), v_b=value.stride(0), v_h=value.stride(1),
                           v_n=value.stride(2))
    if call is None:
        return None
    params, out, _alphas = call  # (the alphas' tensor held while the kernel reads it)
    if codes is not None:
        size = codes.codes.shape[2] if codes.codes.dim() == 4 else -1
        if (not (codes.coded <= length <= min(keys, size)) or size % CERTIFICATE["CODE_BLOCK"]
                or dim > MAX_CODED_DIM or dim % 2):
            raise ValueError(f"fused attention kernel: key codes of shape {tuple(codes.codes.shape)} ({codes.coded} "
                             f"keys coded) cannot code {length} keys of {keys}, head size {dim}")
        checked_once(codes, (codes.codes, codes.scales, codes.bounds, codes.certified),
                     ((batch, kv_heads, size, dim), device),
                     lambda: checked_codes((("key codes", codes.codes, (batch, kv_heads, size, dim), torch.int8),
                                            ("key scales", codes.scales, (batch, kv_heads, size), torch.float32),
                                            ("key code bounds", codes.bounds, (batch, kv_heads, 2), torch.float64),
                                            ("certified counts", codes.certified, (batch * kv_heads,), torch.int64)),
                                           device))
        params.codes, params.code_scales = codes.codes.data_ptr(), codes.scales.data_ptr()
        params.code_bounds, params.certified = codes.bounds.data_ptr(), codes.certified.data_ptr()
        params.c_b, params.c_h = codes.scales.stride(0), codes.scales.stride(1)
        params.coded, params.length, params.certify = codes.coded, length, int(certify)
        params.code_error = CODE_ERROR
    stopped = library().hf_sparsemax_decode(ctypes.byref(params))
    if codes is not None:
        codes.coded = 0 if stopped else length
    return None if stopped else out


def check_slots(slots: torch.Tensor, rows: int) -> None:
    """A ValueError where a slot lies outside the cache's ``rows`` rows (one reduction, one host read)."""
    low, high = torch.aminmax(slots)
    if int(low) < 0 or int(high) >= rows:
        raise ValueError(f"fused attention kernel: a slot outside the cache's {rows} rows")


class CheckedSlots(NamedTuple):
    """Slots (int64, contiguous, on the cache's device) that :func:`checked_slots` found inside a cache of ``rows``
    rows: an engine step checks its slots once and hands them to every layer's kernel call (its layers' caches
    have the same rows; a cache of other rows gets them checked again)."""

    slots: torch.Tensor
    rows: int


def checked_slots(slots: torch.Tensor | CheckedSlots, rows: int, device=None) -> CheckedSlots:
    """``slots`` as :class:`CheckedSlots` of a cache of ``rows`` rows (on ``device``: the cache's), checked by
    :func:`check_slots` unless they already were for that many rows (a ValueError where one lies outside)."""
    if isinstance(slots, CheckedSlots):
        if slots.rows == rows and (device is None or slots.slots.device == device):
            return slots
        slots = slots.slots
    slots = slots.to(device=device, dtype=torch.int64).contiguous()
    if slots.numel():
        check_slots(slots, rows)
    return CheckedSlots(slots, rows)


def checked_codes(operands, device: torch.device) -> None:
    """The int8 certificate's tensors, each ``(name, tensor, shape, dtype)``: of that dtype, contiguous (the kernel
    walks them by the layout it writes, not by their strides), of that shape, on ``device``; else a ValueError
    naming it (nothing is read or written)."""
    for name, tensor, shape, dtype in operands:
        if tensor.dtype != dtype:
            raise ValueError(f"fused attention kernel: {name} are {tensor.dtype}, expected {dtype}")
        checked(name, tensor, shape, device)
        if not tensor.is_contiguous():
            raise ValueError(f"fused attention kernel: {name} must be contiguous")


def checked_slot_codes(codes, key_rows: torch.Tensor) -> int:
    """The slots ``S`` of a paged cache's codes (:class:`.keycodes.SlotCodes`) for ``key_rows [slots, Hkv, D]``:
    ``codes [Hkv, S, D]`` int8, ``scales`` / ``residuals [Hkv, S]`` float32 (:func:`checked_codes`), ``S`` a
    multiple of ``CODE_BLOCK`` covering the cache; a mismatch is a ValueError. Checked once for the same code
    tensors (made once, never resized in place) and a cache of the same size and device."""
    return checked_once(codes, (codes.codes, codes.scales, codes.residuals), (key_rows.shape, key_rows.device),
                        lambda: slot_codes_size(codes, key_rows))


def slot_codes_size(codes, key_rows: torch.Tensor) -> int:
    """:func:`checked_slot_codes`' check itself (every time)."""
    slots, kv_heads, dim = key_rows.shape
    size = codes.codes.shape[1] if codes.codes.dim() == 3 else -1
    if size < slots or size % CERTIFICATE["CODE_BLOCK"] or dim % 2 or dim > MAX_CODED_DIM:
        raise ValueError(f"fused attention kernel: slot codes of shape {tuple(codes.codes.shape)} cannot code a "
                         f"cache of {slots} slots, {kv_heads} kv heads, head size {dim}")
    checked_codes((("slot codes", codes.codes, (kv_heads, size, dim), torch.int8),
                   ("slot scales", codes.scales, (kv_heads, size), torch.float32),
                   ("slot residuals", codes.residuals, (kv_heads, size), torch.float32)), key_rows.device)
    return size


def checked_once(codes, tensors: tuple, layout: tuple, check):
    """``check()``'s result, computed again only where ``codes`` (a :class:`.keycodes.KeyCodes` or ``SlotCodes``)
    holds other tensor objects, of other sizes, or the call another ``layout`` than when it last passed (its
    ``checked_as``): a certificate's tensors are replaced (made, grown, reordered), never resized in place, so
    every layer call after the first skips the checks. A check that raises records nothing."""
    sizes = [t.shape for t in tensors]
    held = getattr(codes, "checked_as", None)
    if held is not None and held[1] == (layout, sizes) and all(a is b for a, b in zip(held[0], tensors)):
        return held[2]
    result = check()
    codes.checked_as = (tensors, (layout, sizes), result)
    return result


def code_slots(key_rows: torch.Tensor, slots: torch.Tensor | CheckedSlots, codes) -> bool:
    """Write the int8 codes, scales and residuals of the keys ``key_rows[slots]`` (``[slots, Hkv, D]``, every kv
    head; ``slots [n]``, or :class:`CheckedSlots`) into ``codes`` (:class:`.keycodes.SlotCodes`): one kernel call
    (``fused.c``, ``hf_sparsemax_code_slots``); False where the kernel is not there (nothing written). A slot
    outside the cache is a ValueError."""
    if not available() or key_rows.dtype not in KEY_DTYPES or key_rows.stride(-1) != 1:
        return False
    size = checked_slot_codes(codes, checked("key rows", key_rows, (None, None, None), key_rows.device))
    slots = checked_slots(slots, key_rows.shape[0], key_rows.device).slots
    if slots.numel() == 0:
        return True
    params = Params(kv_heads=key_rows.shape[1], keys=slots.numel(), dim=key_rows.shape[2], key=key_rows.data_ptr(),
                    k_h=key_rows.stride(1), k_n=key_rows.stride(0), bf16=KEY_DTYPES[key_rows.dtype],
                    codes=codes.codes.data_ptr(), code_scales=codes.scales.data_ptr(),
                    code_residuals=codes.residuals.data_ptr(), c_h=size, slots=slots.data_ptr(),
                    threads=kernel_threads(slots.numel() * key_rows.shape[1] * key_rows.shape[2]))
    library().hf_sparsemax_code_slots(ctypes.byref(params))
    return True


def paged_decode(query: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor,
                 slots: torch.Tensor | CheckedSlots, mask: torch.Tensor | None, alpha, scaling: float,
                 codes=None) -> torch.Tensor | None:
    """``out [B, Hkv, G q, Dv]`` (float32) of decoding rows ``query [B, Hkv, G, q, D]`` (float32) over a paged cache
    read in place: key and value ``j`` of batch row ``b`` are ``key_rows[slots[b, j]]`` / ``value_rows[...]``
    (``[slots, Hkv, D]`` views of the engine's cache, float32 or bfloat16); ``mask`` additive, broadcastable to
    ``[B, Hkv, G, q, keys]``, or None; ``alpha`` a float in (1, 2] or ``[1, Hkv, G, 1, 1]``. None where the kernel
    does not serve the call (:func:`decode`'s rules); a slot outside the cache is a ValueError (never read;
    :class:`CheckedSlots`: checked once for all the calls of an engine step).

    ``codes`` (a :class:`.keycodes.SlotCodes` of this cache, its slots coded as their keys were written, or
    None): the keys the int8 certificate excludes are not read (``fused.c``: the certificate per slot), the same
    output bit for bit; ``codes.certified [B Hkv]`` gets each task's count of keys not read (-1: every key
    read)."""
    tensor = slots.slots if isinstance(slots, CheckedSlots) else slots
    if not served(query, key_rows, value_rows, mask, tensor.numel()):
        return None
    batch, kv_heads, groups, rows, dim = query.shape
    keys, device = tensor.shape[-1], query.device
    query = checked("query", query.contiguous(), (batch, kv_heads, groups, rows, dim), device)
    checked("key rows", key_rows, (None, kv_heads, dim), device)
    checked("value rows", value_rows, (key_rows.shape[0], kv_heads, None), device)
    slots = checked("slots", checked_slots(slots, key_rows.shape[0], device).slots, (batch, keys), device)
    call = decoding_params(query, key_rows, value_rows, mask, alpha, keys, scaling, k_h=key_rows.stride(1),
                           k_n=key_rows.stride(0), v_h=value_rows.stride(1), v_n=value_rows.stride(0),
                           slots=slots.data_ptr(), s_b=keys)
    if call is None:
        return None
    params, out, _alphas = call  # (the alphas' tensor held while the kernel reads it)
    if codes is not None:
        params.c_h = checked_slot_codes(codes, key_rows)
        codes.certified = torch.full((batch * kv_heads,), -1, dtype=torch.int64)
        params.codes, params.code_scales = codes.codes.data_ptr(), codes.scales.data_ptr()
        params.code_residuals, params.certified = codes.residuals.data_ptr(), codes.certified.data_ptr()
        params.certify, params.code_error = 1, CODE_ERROR
    stopped = library().hf_sparsemax_decode(ctypes.byref(params))
    return None if stopped else out


def row_alphas(alpha, kv_heads: int, rows: int, device,
               groups: int | None = None) -> tuple[torch.Tensor | None, int] | None:
    """``(alphas, q_rows)`` for the kernel from a call's ``alpha``, the one check of every entry point (decoding
    steps, paged decoding, prefill blocks): a float in (1, 2] (None, ``rows``), or a learned ``[1, Hkv, G, 1, 1]``
    with every alpha in (1, 2] (its float32 alphas, one per query head, and the ``rows // G`` rows of each head);
    None where the kernel does not serve that alpha (beyond (1, 2], Newton's ``h`` is not convex: the general path
    bisects). ``groups``: the call's query heads per kv head where the caller knows them (an alpha per kv head,
    ``[1, Hkv, 1, 1, 1]``, is then broadcast to them: the kernel reads one alpha per query head); any other shape
    is a ValueError naming it."""
    if not isinstance(alpha, torch.Tensor):
        return (None, rows) if 1.0 < float(alpha) <= 2.0 else None
    alphas = alpha.detach().to(device=device, dtype=torch.float32)
    if groups is None:
        groups = alphas.shape[2] if alphas.dim() == 5 else None
    elif alphas.dim() == 5 and alphas.shape[2] == 1 and alphas.shape[:2] == (1, kv_heads):
        alphas = alphas.expand(1, kv_heads, groups, 1, 1)
    alphas = checked("alpha", alphas.contiguous(), (1, kv_heads, groups, 1, 1), device)
    if groups == 0 or rows % groups:
        raise ValueError(f"fused attention kernel: {rows} score rows are not {groups} query heads' rows each")
    if not all(1.0 < value <= 2.0 for value in alphas.view(-1).tolist()):  # one read (NaN: not served)
        return None
    return alphas, rows // groups


def block_rows(scores: torch.Tensor, value: torch.Tensor, keys: slice | torch.Tensor, alpha,
               taus: torch.Tensor | None = None) -> torch.Tensor | None:
    """``P V [B, Hkv, R, Dv]`` (float32) of a prefill block's scores ``[B, Hkv, R, n]`` (masks added; ``R``: the
    group's ``G`` query heads' rows, head after head, as :func:`.blocks.block_scores` lays them out) over the value
    rows ``keys`` of ``value [B, Hkv, kv, Dv]``, for any alpha in (1, 2]: a float, or a learned
    ``[1, Hkv, G, 1, 1]`` (each row solved with its head's alpha); sparsemax and 1.5-entmax rows by their closed
    forms on the sorted candidates, the others by Newton's method on the candidates, or None where the kernel does
    not serve the block (as :func:`decode`). ``taus`` (float64, ``B Hkv R`` elements, or None): where given, each
    row's threshold on ``z = (alpha - 1)(s - max s)`` is written there (the C solver pinned to the Python solvers
    by the tests)."""
    if (scores.dtype != torch.float32 or scores.device.type != "cpu" or not scores.is_contiguous()
            or value.dtype not in KEY_DTYPES or value.stride(-1) != 1 or scores.numel() == 0 or not available()):
        return None
    batch, kv_heads, rows, n = scores.shape
    checked("scores", scores, (batch, kv_heads, rows, n), scores.device)
    per_row = row_alphas(alpha, kv_heads, rows, scores.device)
    if per_row is None:
        return None
    alphas, q_rows = per_row
    values = checked("value rows", value[:, :, keys], (batch, kv_heads, n, None), scores.device)
    out = new_output(batch, kv_heads, rows, value.shape[-1])
    if taus is not None and (taus.dtype != torch.float64 or taus.device.type != "cpu" or not taus.is_contiguous()
                             or taus.numel() != batch * kv_heads * rows):
        raise ValueError(f"fused attention kernel: taus must be {batch * kv_heads * rows} contiguous float64s on "
                         "the CPU")
    params = solver_params(
        taus=None if taus is None else taus.data_ptr(), alphas=None if alphas is None else alphas.data_ptr(),
        batch=batch, kv_heads=kv_heads, rows=rows, q_rows=q_rows, keys=n, value_dim=value.shape[-1],
        scores=scores.data_ptr(), value=values.data_ptr(), v_b=values.stride(0), v_h=values.stride(1),
        v_n=values.stride(2), fixed_alpha=0.0 if alphas is not None else float(alpha), bf16=KEY_DTYPES[value.dtype],
        out=out.data_ptr())
    stopped = library().hf_sparsemax_rows(ctypes.byref(params))
    return None if stopped else out


def kernel_power(u: torch.Tensor, e: float) -> torch.Tensor | None:
    """``u ** e`` (float64) by the kernel's own power function (``power`` in fused.c: ``2^(e log2 u)`` in double
    arithmetic, what the row solver uses in place of libm's ``pow``; relative error below ``(8 |y| + 4) 2^-53``,
    ``y = e log2 u``), for finite ``u >= 2^-1022`` and ``e >= -1`` with ``u ** e <= 2^1000``; None without the
    kernel. For the tests that pin it to libm's ``pow``."""
    lib = library() if available() else None
    if lib is None:
        return None
    u = u.to(torch.float64).contiguous()
    out = torch.empty_like(u)
    lib.hf_sparsemax_power(u.data_ptr(), u.numel(), float(e), out.data_ptr())
    return out


def main(argv: list[str] | None = None) -> int:
    """Build the CPU kernel ahead of time into the cache folder and print its path (``hf-sparsemax
    build-kernels``, ``python -m hf_sparsemax.attention.cpu.fused``); a folder the build could not be kept in fails."""
    argparse.ArgumentParser(
        prog="hf-sparsemax build-kernels",
        description="Build hf_sparsemax's CPU attention kernel now, into $HF_SPARSEMAX_CACHE (default "
                    "~/.cache/hf_sparsemax), for container images and read-only homes.").parse_args(argv)
    problem = folder_problem(wanted_folder())
    if problem:
        print(f"hf-sparsemax: error: {problem}", file=sys.stderr)
        return 1
    try:
        path, lost = build_library(header())
    except (RuntimeError, OSError) as error:
        print(f"hf-sparsemax: error: the CPU kernel could not be built: {error}", file=sys.stderr)
        return 1
    if lost:
        print(f"hf-sparsemax: built without OpenMP (one thread): {lost[:300]}", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
