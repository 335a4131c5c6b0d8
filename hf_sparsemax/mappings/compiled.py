"""The threshold of a block of rows in one compiled kernel, exact, with the eager solver as fallback.

The eager solvers (:mod:`._core`) run one whole-tensor kernel per Newton pass:
on attention-sized blocks (thousands of rows of thousands of keys) no cache
holds the block, so every pass reads it from memory again. Compiled by
inductor, the fixed Newton passes of :func:`._sync_free.newton_certified`
become one loop over rows that solves each row while it sits in cache.
Rows whose answer the fixed passes do not certify (rare) are solved again by
the mapping's eager solver, so the threshold is the exact one either way.

The compiled function is built on first use per process (one graph per kind of
alpha, shapes dynamic) and inductor caches the generated code on disk, so
later processes load it. Blocks smaller than ``MIN_ELEMENTS`` and
non-float32 rows use the eager solver; so does everything when compiling is
not possible (no C++ compiler: one warning) or when the environment variable
``HF_SPARSEMAX_COMPILED_SOLVER=0`` is set. Callers need not use
``torch.compile`` themselves.

Two callers: the memory-bounded attention (:func:`weights`, :func:`weights_vjp`
on each block of scores, and :func:`candidates`, the keys a block's solve needs) and the mapping functions ``sparsemax``, ``entmax15``
and ``entmax_bisect`` on attention-sized rows (:func:`mapping`,
:func:`mapping_vjp`: the last dimension, at most ``SHORT_ROWS`` wide; wider
rows, such as a vocabulary, are solved faster on their top candidates).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Callable, NamedTuple

import torch

from ._core import entmax_vjp, masked_below, threshold_map
from ._sync_free import SHORT_ROWS, newton_certified, newton_steps, power_map, row_shift, support_log_power
from ._sync_free import threshold_map as sync_free_map

MIN_ELEMENTS = 1 << 16  # rows x keys below this: the eager solver (tiny blocks: compiling would cost more)
BACKEND = "inductor"
ENVIRONMENT = "HF_SPARSEMAX_COMPILED_SOLVER"
# candidates of a row: z = (alpha - 1)(s - max s) > -CANDIDATE_MARGIN (tau >= -1; 1% for rounding); a constant, so
# the compiled graph holds it, and the fused CPU kernel's candidates (attention/cpu/fused.c) take it from here
CANDIDATE_MARGIN = 1.01
_failed: list[str] = []  # the first compile error, once compiling failed in this process


def available() -> bool:
    """Whether the compiled kernels may run: not switched off (:data:`ENVIRONMENT`), compiling has not failed in
    this process, and the caller is eager (not being compiled itself)."""
    return os.environ.get(ENVIRONMENT, "1") != "0" and not _failed and not torch.compiler.is_compiling()


def applies(rows: torch.Tensor, minimum: int | None = None) -> bool:
    """Whether ``rows`` go through the compiled kernels (float32, at least ``minimum`` entries, default
    ``MIN_ELEMENTS``, eager caller, compiling works)."""
    minimum = MIN_ELEMENTS if minimum is None else minimum
    return rows.dtype == torch.float32 and rows.numel() >= minimum and rows.is_contiguous() and available()


CLOSED_FORMS = {"sparsemax": 2.0, "entmax15": 1.5}  # alphas the kernels take by name (closed-form certificates)
CLOSED_FORM_NAMES = {alpha: name for name, alpha in CLOSED_FORMS.items()}


def named(alpha: str | torch.Tensor) -> float | torch.Tensor:
    """The alpha a kernel was given: a name of :data:`CLOSED_FORMS` or a tensor (see :func:`run`)."""
    return CLOSED_FORMS[alpha] if isinstance(alpha, str) else alpha


def map_rows(rows, shift, tau, alpha):
    """``relu((alpha - 1)(x - shift) - tau) ** (1 / (alpha - 1))`` (one fused pass when compiled)."""
    if isinstance(alpha, torch.Tensor):
        return power_map(rows, shift, tau, alpha - 1)[0]
    am1 = alpha - 1
    return sync_free_map(rows, shift, tau, am1, 1 / am1)


def solve_and_map(rows, masked: float, alpha, steps: int | None = None):
    """``(p, shift, tau, done)``: ``steps`` certified Newton passes, then the weights (for general alpha, from the
    last pass)."""
    alpha = named(alpha)
    found = newton_certified(rows, alpha, masked, steps)
    p = map_rows(rows, found.shift, found.tau, alpha) if found.weights is None else found.weights
    return p, found.shift, found.tau, found.done


def candidates(rows, masked: float, alpha):
    """``[n]``: whether some row of ``rows [rows, n]`` may give the key a nonzero weight, ``s > max s -
    CANDIDATE_MARGIN / (alpha - 1)`` (alpha-entmax's largest weight is at most 1, so ``tau >= -1``; 1% for
    rounding; the fused CPU kernel collects its candidates by the same bound); masked keys and rows that see
    nothing give none, a NaN gives every key (one row pass and one column pass when compiled)."""
    alpha = named(alpha)
    floor = (rows.amax(-1, keepdim=True) - CANDIDATE_MARGIN / (alpha - 1)).clamp_min(masked)
    return (rows - floor).amax(0).le(0).logical_not()


@functools.lru_cache(maxsize=None)
def solve_and_map_in(steps: int | None) -> Callable:
    """:func:`solve_and_map` with ``steps`` passes: one function, so one compiled graph, per count."""

    def with_steps(rows, masked: float, alpha):
        return solve_and_map(rows, masked, alpha, steps)

    with_steps.__name__ = with_steps.__qualname__ = solve_and_map.__name__
    return with_steps


def passes(alpha: float | torch.Tensor) -> int | None:
    """The passes :func:`solve_and_map` runs for ``alpha``: the default for sparsemax, else by the
    largest alpha (:func:`._sync_free.newton_steps`; one host read of a learned alpha's few values)."""
    if not isinstance(alpha, torch.Tensor):
        return None if alpha == 2 else newton_steps(alpha)
    return newton_steps(float(alpha.detach().max()))


def map_and_vjp(rows, tau, grad, masked: float, alpha_grad: bool, alpha):
    """``(p, J_x^T grad, J_alpha^T grad or None)`` from the scores and their saved threshold (the shift, each row's
    maximum, found again: :func:`._sync_free.row_shift`)."""
    alpha = named(alpha)
    shift = row_shift(rows, masked)
    if not isinstance(alpha, torch.Tensor):
        p = map_rows(rows, shift, tau, alpha)
        return (p, *entmax_vjp(p, grad, alpha, -1, alpha_grad))
    p, weights, log_u = power_map(rows, shift, tau, alpha - 1)  # log p = log u / (alpha - 1)
    return (p, *entmax_vjp(p, grad, alpha, -1, alpha_grad, weights, log_u / (alpha - 1).to(rows.dtype)))


@functools.lru_cache(maxsize=None)
def compiled(fn: Callable, backend: str) -> Callable:
    """``fn`` compiled with ``backend``, dynamic shapes (one graph for every block size)."""
    return torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)


def run(fn: Callable, *args, alpha: float | torch.Tensor):
    """``fn(*args, alpha=...)`` compiled, or None once compiling failed (one warning; eager from then on).

    ``alpha`` never reaches the compiler as a Python float: dynamo would make a float that changes between calls
    symbolic, which torch 2.13's inductor miscompiles (the weights of ``alpha = 1.2`` after a call at 1.3 were off
    by 0.17). 2 and 1.5 go by name (:data:`CLOSED_FORMS`: a constant of the graph, one graph each), any other
    float as a ``[1, 1]`` float32 tensor (one graph for all of them), as a learned alpha per row does.
    """
    if not isinstance(alpha, torch.Tensor):
        alpha = CLOSED_FORM_NAMES.get(alpha) or torch.full((1, 1), alpha, dtype=torch.float32, device=args[0].device)
    try:
        return compiled(fn, BACKEND)(*args, alpha=alpha)
    except Exception as error:  # no compiler, or a backend that cannot build this graph
        _failed.append(f"{type(error).__name__}: {error}")
        warnings.warn(f"hf_sparsemax: the compiled threshold kernels are not available here ({_failed[0][:200]}); "
                      "using the eager solver", RuntimeWarning, stacklevel=3)
        return None


def settle(rows, masked, alpha, threshold, found):
    """``(p, tau)`` from the compiled kernel's answer, the rows it did not certify solved again by the eager
    exact ``threshold`` (rare); ``tau`` in the rows' dtype, as the map reads it."""
    p, shift, tau, done = found
    todo = (~done).squeeze(1).nonzero().squeeze(1)
    if todo.numel():
        row_alpha = alpha.index_select(0, todo) if isinstance(alpha, torch.Tensor) else alpha
        sub = rows.index_select(0, todo)
        shift[todo], tau[todo] = threshold(sub, masked, row_alpha)
        p[todo] = threshold_map(sub, shift[todo], tau[todo], row_alpha - 1, 1 / (row_alpha - 1))
    return p, tau.to(rows.dtype)


def weights(rows: torch.Tensor, masked: float, alpha: float | torch.Tensor, threshold: Callable,
            minimum: int | None = None):
    """``(p, tau)`` of ``[rows, n]`` scores; ``threshold(rows, masked, alpha)`` is the eager exact solver.

    ``alpha`` is the mapping's alpha (2 for sparsemax, 1.5 for entmax15), a float or ``[rows, 1]``. The weights
    are written over ``rows`` on the eager path. ``tau`` (``[rows, 1]`` in the rows' dtype, the precision the map
    reads it in) is all :func:`weights_vjp` needs besides the rows: 4 bytes a row in float32, as a flash
    kernel's log-sum-exp. The other number of a row, its shift, is the row's maximum, found again from the rows.
    ``minimum``: the fewest entries the compiled kernel takes (default ``MIN_ELEMENTS``; a decoding step asks for
    less: one call to the compiled graph costs less than the eager solver's passes, each with a host test).
    """
    found = run(solve_and_map_in(passes(alpha)), rows, masked, alpha=alpha) if applies(rows, minimum) else None
    if found is None:
        shift, tau = threshold(rows, masked, alpha)
        return threshold_map(rows, shift, tau, alpha - 1, 1 / (alpha - 1), out=rows), tau.to(rows.dtype)
    return settle(rows, masked, alpha, threshold, found)


def weights_vjp(rows: torch.Tensor, tau: torch.Tensor, grad: torch.Tensor, masked: float, alpha, alpha_grad: bool):
    """``(p, J_x^T grad, J_alpha^T grad or None)`` of the weights of ``rows`` given their threshold ``tau`` (from
    :func:`weights`; the shift is each row's maximum, :func:`._sync_free.row_shift`, the same bits as the
    solver's).

    The same path as :func:`weights` took for these rows (compiled or eager), so ``p`` is the forward's weights
    (to the rounding of the fused pass on the rare rows the eager solver settled).
    """
    found = run(map_and_vjp, rows, tau, grad, masked, alpha_grad, alpha=alpha) if applies(rows) else None
    if found is not None:
        return found
    p = threshold_map(rows, row_shift(rows, masked), tau, alpha - 1, 1 / (alpha - 1), out=rows)
    return (p, *entmax_vjp(p, grad, alpha, -1, alpha_grad))


def last_dim_rows(x: torch.Tensor, dim: int) -> torch.Tensor | None:
    """The ``[rows, n]`` view of ``x`` for the mapping functions' compiled path, or None where that path does not
    apply: ``dim`` last, attention-sized rows (``n <= SHORT_ROWS``; wider rows, such as a vocabulary, are solved
    faster on their top candidates by the eager solver), and :func:`applies`."""
    if (torch.compiler.is_compiling() or x.numel() == 0 or dim % x.dim() != x.dim() - 1
            or x.shape[-1] > SHORT_ROWS):
        return None
    rows = x.reshape(-1, x.shape[-1])
    return rows if applies(rows) else None


def mapping(x: torch.Tensor, dim: int, alpha: float | torch.Tensor, threshold: Callable) -> torch.Tensor | None:
    """alpha-entmax of ``x`` along ``dim`` (``alpha`` a float or ``[rows, 1]``) in one compiled kernel, or None
    where that path does not apply (the caller's eager solver then): the exact threshold as :func:`weights`."""
    rows = last_dim_rows(x, dim)
    found = None if rows is None else run(solve_and_map_in(passes(alpha)), rows.detach(), masked_below(x.dtype),
                                          alpha=alpha)
    if found is None:
        return None
    return settle(rows, masked_below(x.dtype), alpha, threshold, found)[0].view(x.shape)


def output_vjp(p, grad, alpha_grad: bool, alpha):
    """``entmax_vjp`` at the output ``p``; for a tensor alpha, ``s = p ** (2 - alpha)`` from ``log p`` (one log and
    one exp: cheaper than ``pow``, and ``log p`` serves the alpha derivative too)."""
    alpha = named(alpha)
    if not isinstance(alpha, torch.Tensor):
        return entmax_vjp(p, grad, alpha, -1, alpha_grad)
    weights, log_p = support_log_power(p, 2 - alpha.to(p.dtype))
    return entmax_vjp(p, grad, alpha, -1, alpha_grad, weights, log_p)


def mapping_vjp(p: torch.Tensor, grad: torch.Tensor, dim: int, alpha: float | torch.Tensor, alpha_grad: bool):
    """``(J_x^T grad, J_alpha^T grad per row [rows, 1] or None)`` of alpha-entmax at its output ``p`` in one compiled
    kernel, or None where that path does not apply (or a graph of the backward is asked for: double backward)."""
    rows = None if torch.is_grad_enabled() or grad.dtype != p.dtype else last_dim_rows(p, dim)
    if rows is None or not grad.is_contiguous():
        return None
    found = run(output_vjp, rows, grad.reshape(rows.shape), alpha_grad, alpha=alpha)
    return None if found is None else (found[0].view(p.shape), found[1])


class RowKernels(NamedTuple):
    """The compiled path of a :class:`._core.SupportMapping` that is alpha-entmax at ``alpha`` (2: sparsemax, 1.5:
    1.5-entmax), with its eager exact ``threshold(rows, masked, alpha)`` for the rows the kernel does not certify."""

    alpha: float
    threshold: Callable

    def forward(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        return mapping(x, dim, self.alpha, self.threshold)

    def vjp(self, p: torch.Tensor, grad: torch.Tensor, dim: int) -> torch.Tensor | None:
        found = mapping_vjp(p, grad, dim, self.alpha, False)
        return None if found is None else found[0]
