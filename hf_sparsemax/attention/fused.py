"""Decoding steps and a prefill's blocks in one fused CPU kernel (:download:`fused.c`), with exact thresholds.

A decoding call's work is small (``B H q kv`` scores) and, run as torch operations, most of its time went to
the operations themselves: two small matrix products, a compiled threshold kernel behind dynamo's guards, the
search for the support, ~60 operations in all; inside a model, whose weights flush the caches between
attention calls, 1.5 ms a call at 2048 keys against sdpa's 0.6 ms. :func:`decode` does the whole step in one
call: for each batch row and kv head (in parallel), it scores the group's query rows against every key row as it
reads it, finds each row's maximum ``m``, collects the candidates ``z_j = (alpha - 1)(s_j - m) > -1`` (the others
have weight exactly 0, since ``tau >= -1``), solves the exact threshold on them in float64 (sparsemax and
1.5-entmax by their closed forms on the sorted candidates where they are at most ``SORT_BELOW``, otherwise
Newton's method in a bisection bracket to 1e-13, Michelot's algorithm for sparsemax: the eager solvers'
algorithms and stopping rule, :mod:`hf_sparsemax.mappings`), and adds up
``p_j v_j`` over the support, reading only those value rows. :func:`block_rows` does the same from a prefill
block's scores (the products stay with BLAS), for sparsemax and 1.5-entmax, in place of the candidate search,
the compiled solve and the gathered ``P V``. Outputs equal the general path's to float32 rounding
(``tests/test_attention_fused.py`` checks the weights themselves against the materialised mappings in float64).

The kernel is compiled on first use with the system's C compiler (``$CC``, default ``cc``; ``-O3
-march=native``, OpenMP where the compiler has it) into a cache folder (``$HF_SPARSEMAX_CACHE``, default
``~/.cache/hf_sparsemax``), named by a hash of the source, the flags and the CPU, so later processes load it; it
is called through ``ctypes`` (no guards, no wrappers: a few microseconds). It serves float32 queries with
float32 or bfloat16 keys and values, every row (flat rows too: no compiled kernel is ever built for these calls);
anything else, no compiler (one warning) or ``HF_SPARSEMAX_COMPILED_SOLVER=0`` leaves the call to the general
path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings

import torch

from ..mappings._core import masked_below
from ..mappings.compiled import ENVIRONMENT  # "0": no compiled kernels (the row kernels' switch, shared)

SOURCE = os.path.join(os.path.dirname(__file__), "fused.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11")
PLAIN_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11")
SORT_BELOW = 128  # sparsemax / 1.5-entmax rows with at most this many candidates: the closed form on them sorted
KEY_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # cache dtypes the kernel reads (bfloat16 widened exactly)
_failed: list[str] = []


def cache_folder() -> str:
    folder = os.environ.get("HF_SPARSEMAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hf_sparsemax")
    os.makedirs(folder, exist_ok=True)
    return folder


def cpu_signature() -> str:
    """What ``-march=native`` compiles for: the CPU's model and flags (Linux), else the machine's name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


def compile_library(compiler: str, flags: tuple[str, ...]) -> str:
    """The path of the built library (built now unless the cache has it); raises where the compiler fails."""
    with open(SOURCE, "rb") as handle:
        source = handle.read()
    digest = hashlib.sha256(source + repr((compiler, flags)).encode() + cpu_signature().encode()).hexdigest()[:16]
    path = os.path.join(cache_folder(), f"fused-{digest}.so")
    if not os.path.exists(path):
        handle, partial = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
        os.close(handle)
        try:
            subprocess.run([compiler, *flags, SOURCE, "-o", partial, "-lm"], check=True, capture_output=True,
                           text=True, timeout=300)
            os.replace(partial, path)  # atomic: processes building at once each leave a whole library
        except subprocess.CalledProcessError as error:
            raise RuntimeError(f"{compiler} failed: {error.stderr.strip()[-500:]}") from None
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    return path


@functools.lru_cache(maxsize=1)
def library():
    """The loaded kernel, or None where it cannot be built (one warning; the general path from then on)."""
    compiler = os.environ.get("CC", "cc")
    error = None
    for flags in (FLAGS + ("-fopenmp",), PLAIN_FLAGS):  # then plainer: a compiler without OpenMP (one thread)
        try:
            lib = ctypes.CDLL(compile_library(compiler, flags))
            break
        except (OSError, RuntimeError, subprocess.SubprocessError) as found:
            error = found
    else:
        _failed.append(f"{type(error).__name__}: {error}")
        warnings.warn(f"hf_sparsemax: the fused attention kernel could not be built ({_failed[0][:300]}); decoding "
                      "steps and prefills take the general path", RuntimeWarning, stacklevel=3)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.hf_sparsemax_decode.restype = ctypes.c_int
    lib.hf_sparsemax_decode.argtypes = [i64] * 7 + [ptr] * 3 + [ctypes.c_int] + [i64] * 6 + [ptr] + [i64] * 5 + [
        ctypes.c_float, ptr, ctypes.c_double, ctypes.c_float, i64, ptr, ctypes.c_int]
    lib.hf_sparsemax_rows.restype = ctypes.c_int
    lib.hf_sparsemax_rows.argtypes = [i64] * 5 + [ptr, ptr, ctypes.c_int] + [i64] * 3 + [
        ctypes.c_double, ctypes.c_float, i64, ptr, ctypes.c_int]
    return lib


def available() -> bool:
    return os.environ.get(ENVIRONMENT, "1") != "0" and not torch.compiler.is_compiling() and library() is not None


def decode(problem, alpha: float | torch.Tensor) -> torch.Tensor | None:
    """``out [B, Hkv, G q, D]`` (float32) of a decoding call's :class:`.blocks.Problem` (``alpha`` a float, or
    ``[1, Hkv, G, 1, 1]`` learned per head), or None where the kernel does not serve it (module docstring)."""
    query, key, value, mask = problem.query, problem.key, problem.value, problem.mask
    batch, kv_heads, groups, rows, dim = query.shape
    if (query.dtype != torch.float32 or query.device.type != "cpu" or key.dtype not in KEY_DTYPES
            or value.dtype != key.dtype or key.stride(-1) != 1 or value.stride(-1) != 1
            or (mask is not None and mask.dtype != torch.float32) or not available()):
        return None
    query = query.contiguous()
    alphas = None
    if isinstance(alpha, torch.Tensor):
        alphas = alpha.detach().to(torch.float32).reshape(kv_heads * groups).contiguous()
    strides = (0,) * 5
    if mask is not None:
        mask = mask.expand(batch, kv_heads, groups, rows, key.shape[-2])
        strides = mask.stride()
    out = torch.empty(batch, kv_heads, groups * rows, value.shape[-1])
    pointer = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    stopped = library().hf_sparsemax_decode(
        batch, kv_heads, groups * rows, key.shape[-2], dim, value.shape[-1], rows, pointer(query), pointer(key),
        pointer(value), KEY_DTYPES[key.dtype], key.stride(0), key.stride(1), key.stride(2), value.stride(0),
        value.stride(1), value.stride(2), pointer(mask), *strides, problem.scaling, pointer(alphas),
        float(alpha) if alphas is None else 0.0, masked_below(torch.float32), SORT_BELOW, out.data_ptr(),
        torch.get_num_threads())
    return None if stopped else out


CLOSED_FORMS = (2.0, 1.5)  # the alphas whose rows the kernel solves for a prefill (sparsemax, 1.5-entmax)


def block_rows(scores: torch.Tensor, value: torch.Tensor, keys: slice, alpha) -> torch.Tensor | None:
    """``P V [B, Hkv, R, Dv]`` (float32) of a prefill block's scores ``[B, Hkv, R, n]`` (masks added) over the value
    rows ``keys`` of ``value [B, Hkv, kv, Dv]``, for sparsemax and 1.5-entmax (their closed forms on each row's
    candidates; other alphas' candidates are many and their Newton passes suit the compiled row kernel), or None
    where the kernel does not serve the block (as :func:`decode`)."""
    if (isinstance(alpha, torch.Tensor) or alpha not in CLOSED_FORMS or scores.dtype != torch.float32
            or scores.device.type != "cpu" or not scores.is_contiguous() or value.dtype not in KEY_DTYPES
            or value.stride(-1) != 1 or not available()):
        return None
    batch, kv_heads, rows, n = scores.shape
    values = value[:, :, keys]
    out = torch.empty(batch, kv_heads, rows, value.shape[-1])
    stopped = library().hf_sparsemax_rows(
        batch * kv_heads, kv_heads, rows, n, value.shape[-1], scores.data_ptr(), values.data_ptr(),
        KEY_DTYPES[value.dtype], values.stride(0), values.stride(1), values.stride(2), float(alpha),
        masked_below(torch.float32), SORT_BELOW, out.data_ptr(), torch.get_num_threads())
    return None if stopped else out
