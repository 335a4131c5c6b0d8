"""Sparse softmax (Su Jianlin, 2020; "Sparse-softmax", arXiv 2112.12433).

``p_i = exp(x_i) / sum_{j in Omega} exp(x_j)`` for ``i`` in the kept set
``Omega``, exactly 0 elsewhere. ``Omega`` is what transformers' decoding keeps
with ``TopKLogitsWarper`` then ``TopPLogitsWarper``, made independent of the
order of the entries:

- ``top_k``: every entry at least the ``top_k``-th largest value (entries tied
  with it are all kept, as ``TopKLogitsWarper`` does);
- ``top_p``: on those, sorted descending, the shortest prefix whose softmax
  mass reaches ``top_p`` (at least one entry), and every entry tied with the
  last one of that prefix (transformers would cut such a tie by position).

Either way ``Omega = {i : x_i >= floor}`` for one value ``floor`` per slice, so
permuting the entries permutes the output. A slice holding NaN or ``+inf``
maps to NaN. Jacobian: ``diag(p) - p p^T`` on ``Omega``, i.e. the shared
support backward with weights ``s = p``.
"""

from __future__ import annotations

import math
import numbers

import torch

from ._core import SupportMapping, check_input
from ._sync_free import special_rows

NUCLEUS_CANDIDATES = 64  # top entries examined first for top_p alone
NUCLEUS_RETRIES = (256, 1024)  # candidates of the next looks; rows whose nucleus is larger go to nucleus_by_histogram
HISTOGRAM_BUCKETS = 4096  # value buckets of nucleus_by_histogram
HISTOGRAM_BLOCK = 1 << 23  # entries bucketed at once (int64 bucket indices: 64 MiB)


def check_top(top_k, top_p) -> tuple[int | None, float | None]:
    """Validate ``top_k`` / ``top_p``; ``top_p == 1`` means no nucleus cut."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be a float in (0, 1] or None, got {top_p!r}")
        top_p = None if top_p == 1 else float(top_p)
    return (None if top_k is None else int(top_k)), top_p


def masked_softmax(values: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """Softmax of each row over the entries not in ``drop``; all dropped gives zeros."""
    values = values.masked_fill(drop, float("-inf"))
    top = values.amax(-1, keepdim=True)
    e = (values - top.masked_fill(top == float("-inf"), 0.0)).exp_()
    total = e.sum(-1, keepdim=True)
    return e.div_(total.masked_fill(total == 0, 1.0))


def nucleus_floor(values: torch.Tensor, log_total: torch.Tensor, top_p: float, masked: float):
    """``(floor, fits)`` of the ``top_p`` nucleus from the top entries ``values`` (sorted descending) of each row.

    ``log_total`` is the log of the softmax normaliser of the candidate set.
    Entry ``j`` is dropped when the mass from it on (ascending order, as
    ``TopPLogitsWarper`` sums) is ``<= 1 - top_p``; the first entry always stays.
    ``floor`` is the value of the last kept entry; ``fits`` says the nucleus
    ended inside ``values``, so nothing beyond them is kept except ties with ``floor``.
    """
    probs = (values.double() - log_total.double()).exp()  # float64: float32 masses misplace a boundary entry
    before = probs.cumsum(-1) - probs
    drop = ((1 - before) <= 1 - top_p) | (values <= masked)
    drop[:, 0] = values[:, 0] <= masked
    floor = values.masked_fill(drop, float("inf")).amin(-1, keepdim=True)
    return floor, drop[:, -1:] | ~torch.isfinite(log_total)


def precise_log_total(rows: torch.Tensor) -> torch.Tensor:
    """``log sum exp`` of each row of float32 ``rows`` to float64 precision (``[rows, 1]``, float64).

    The nucleus rule compares masses summed from the top with ``top_p``: a float32 normaliser (and float32
    ``x - log_total``) is off by up to ~1e-6, enough to keep or drop an entry at the boundary against
    ``TopPLogitsWarper`` in float64 (seen on an AVX-512 CPU). The float32 value is refined by one float64 pass.
    """
    rough = rows.logsumexp(-1, keepdim=True).double()
    finite = torch.isfinite(rough)
    shift = torch.where(finite, rough, 0.0)
    return torch.where(finite, shift + (rows.double() - shift).exp().sum(-1, keepdim=True).log(), rough)


def top_k_log_total(rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Log-normaliser of the top-k set: ``values`` (the ``k`` largest) plus the entries tied with the ``k``-th beyond them."""
    floor = values[:, -1:]
    ties = (rows == floor).sum(-1, keepdim=True) - (values == floor).sum(-1, keepdim=True)
    return torch.cat([values, floor + ties.to(rows.dtype).log()], -1).double().logsumexp(-1, keepdim=True)


def kept_floor(rows: torch.Tensor, top_k: int | None, top_p: float | None, masked: float) -> torch.Tensor:
    """The value ``floor`` of each row (``[rows, 1]``) with ``Omega = {x >= floor}`` (``-inf`` keeps all).

    ``top_p`` alone looks at the top ``NUCLEUS_CANDIDATES`` entries; only rows
    whose nucleus is larger look again (:func:`nucleus_whole_rows_eager`;
    eagerly with host syncs, compiled inside an opaque op).
    """
    n = rows.shape[-1]
    if top_k is not None and top_k < n:
        values = rows.topk(top_k, dim=-1).values
        if top_p is None:
            return values[:, -1:]
        return nucleus_floor(values, top_k_log_total(rows, values), top_p, masked)[0]
    if top_p is None:
        return torch.full_like(rows[:, :1], float("-inf"))
    log_total = precise_log_total(rows)
    values = rows.topk(min(NUCLEUS_CANDIDATES, n), dim=-1).values
    floor, fits = nucleus_floor(values, log_total, top_p, masked)
    if values.shape[-1] == n:
        return floor

    refine = nucleus_whole_rows if torch.compiler.is_compiling() else nucleus_whole_rows_eager
    return refine(rows, floor, fits, log_total, top_p, masked)


def nucleus_whole_rows_eager(rows, floor, fits, log_total, top_p: float, masked: float) -> torch.Tensor:
    """``floor`` with the rows whose nucleus does not ``fit`` in the first candidates found again: among the top
    ``NUCLEUS_RETRIES``, then, for rows whose nucleus is larger still, by :func:`nucleus_by_histogram` (no sort)."""
    floor = floor.clone()
    todo = (~fits).squeeze(1).nonzero().squeeze(1)
    for candidates in NUCLEUS_RETRIES:
        if not todo.numel() or candidates >= rows.shape[-1]:
            break
        sub = rows.index_select(0, todo)
        found, fit = nucleus_floor(sub.topk(candidates, dim=-1).values, log_total[todo], top_p, masked)
        fit = fit.squeeze(1)
        floor[todo[fit]] = found[fit]
        todo = todo[~fit]
        floor[todo] = found[~fit]  # the last candidate is kept: an upper bound of the floor
    if todo.numel():
        floor[todo] = nucleus_by_histogram(rows.index_select(0, todo), floor[todo], log_total[todo], top_p, masked)
    return floor


def nucleus_by_histogram(rows, upper, log_total, top_p: float, masked: float) -> torch.Tensor:
    """The nucleus floor of rows whose nucleus is large, exactly, without sorting them.

    ``upper`` is a kept entry of each row, so the floor is at most ``upper``;
    every entry below ``lower = log_total + log((1 - top_p) / n)`` is dropped
    (all of them together hold less than ``1 - top_p``). The values are cut
    into ``HISTOGRAM_BUCKETS`` equal buckets between the two (plus one below,
    one at or above ``upper``); the softmax mass of each bucket (one
    ``scatter_add``) locates the bucket where the mass from the top reaches
    ``top_p``. Every entry of the buckets above it is kept (together they hold
    less than ``top_p``), and only that bucket's entries are sorted, starting
    from the mass above it (:func:`nucleus_floor`'s rule). So the answer is
    exact for any bucketing monotone in ``x``; ``lower`` and ``upper`` only make
    the crossing bucket small. Masses are computed, summed and normalised in float64 (``exp(x - total)`` of float32
    operands rounds each mass by up to ~1e-6, which moved a boundary entry on an AVX-512 CPU); a
    row where no bucket reaches ``top_p`` (rounding) keeps everything.
    """
    n, bins = rows.shape[-1], HISTOGRAM_BUCKETS + 2
    lower = log_total + math.log((1 - top_p) / n)
    width = ((upper - lower) / HISTOGRAM_BUCKETS).clamp_min(torch.finfo(rows.dtype).tiny)
    floors = []
    for start in range(0, rows.shape[0], max(1, HISTOGRAM_BLOCK // n)):
        block = slice(start, start + max(1, HISTOGRAM_BLOCK // n))
        x, total = rows[block], log_total[block]
        bucket = (x - lower[block]).div_(width[block]).floor_().clamp_(-1, HISTOGRAM_BUCKETS).add_(1)  # monotone in x
        flat = bucket.long().add_(torch.arange(x.shape[0], device=x.device).unsqueeze(1) * bins)
        mass = torch.zeros(x.shape[0] * bins, dtype=torch.float64, device=x.device)  # sums in float64
        shifted = x.double() - total.double()  # in float64: a float32 x - total rounds by ~1e-6 of each mass
        mass = mass.scatter_add_(0, flat.view(-1), shifted.exp_().view(-1)).view(-1, bins)
        del shifted
        scale = mass.sum(-1, keepdim=True)  # 1 up to the rounding of log_total: divided out
        from_top = mass.flip(-1).cumsum(-1).flip(-1).div_(scale)  # mass of each bucket and every bucket above it
        crossing = (from_top >= top_p).sum(-1, keepdim=True) - 1  # -1: no bucket reaches top_p
        above = torch.cat([from_top, torch.zeros_like(from_top[:, :1])], -1).gather(-1, crossing + 1)
        inside = bucket == crossing
        count = inside.sum(-1, keepdim=True)
        values = torch.where(inside, x, float("-inf")).topk(max(1, int(count.max())), dim=-1).values
        probs = (values.double() - total.double()).exp_().div_(scale)
        before = above + probs.cumsum(-1) - probs
        kept = (before < top_p) & (values > masked)
        kept &= torch.arange(values.shape[-1], device=x.device) < count
        floor = values.masked_fill(~kept, float("inf")).amin(-1, keepdim=True)
        floors.append(torch.where((crossing < 0) | (floor == float("inf")), float("-inf"), floor))
    return torch.cat(floors)


@torch.library.custom_op("hf_sparsemax::nucleus_whole_rows", mutates_args=())
def nucleus_whole_rows(
    rows: torch.Tensor, floor: torch.Tensor, fits: torch.Tensor, log_total: torch.Tensor, top_p: float, masked: float
) -> torch.Tensor:
    """:func:`nucleus_whole_rows_eager` as an opaque op of the compiled graph (fixed output shape, no graph break)."""
    return nucleus_whole_rows_eager(rows, floor, fits, log_total, top_p, masked)


@nucleus_whole_rows.register_fake
def _(rows, floor, fits, log_total, top_p, masked):
    return torch.empty_like(floor)


def floor_softmax(rows: torch.Tensor, floor: torch.Tensor, masked: float) -> torch.Tensor:
    """Softmax of each row over ``{x >= floor}`` minus masked entries; all masked: zeros; NaN / ``+inf``: NaN."""
    top1 = rows.amax(-1, keepdim=True)
    special = special_rows(top1, masked)
    above_masked = torch.nextafter(rows.new_tensor(masked), rows.new_tensor(float("inf")))  # x > masked: x >= this
    keep = rows >= floor.clamp_min(above_masked)
    e = torch.where(keep, rows - top1.masked_fill(special, 0.0), float("-inf")).exp_()
    total = e.sum(-1, keepdim=True)
    out = e.div_(total.masked_fill(total == 0, 1.0))
    if not torch.compiler.is_compiling() and not bool(special.any()):  # eagerly: one host test saves a pass
        return out
    return torch.where(special, torch.where(top1 <= masked, 0.0, float("nan")), out)


def sparse_softmax_rows(rows: torch.Tensor, top_k: int | None, top_p: float | None, masked: float) -> torch.Tensor:
    """Sparse softmax of each row of a ``[rows, n]`` tensor (options already validated).

    Eagerly, a top-k cut without ties beyond the ``k``-th entry (checked with
    one host sync) writes the softmax of the ``k`` candidates into zeros; the
    general rule (:func:`floor_softmax`) runs otherwise and when compiled.
    """
    n = rows.shape[-1]
    if (top_k is None or top_k >= n) and top_p is None:  # plain softmax: masked rows to 0, NaN / +inf rows NaN
        top1 = rows.amax(-1, keepdim=True)
        out = torch.softmax(rows, -1)
        special = special_rows(top1, masked)
        if torch.compiler.is_compiling() or bool(special.any()):
            out = torch.where(special, torch.where(top1 <= masked, 0.0, float("nan")), out)
        return out
    if top_k is not None and top_k < n and not torch.compiler.is_compiling():
        index, p, exact = top_k_support(rows, top_k, top_p, masked)
        if exact:
            return torch.zeros_like(rows).scatter_(-1, index, p)
    return floor_softmax(rows, kept_floor(rows, top_k, top_p, masked), masked)


def top_k_support(rows: torch.Tensor, top_k: int, top_p: float | None, masked: float):
    """``(index, p, exact)``: the softmax over the top ``top_k`` (then ``top_p``) candidates, ``[rows, top_k]``.

    ``exact`` (a host sync) says no row has entries tied with its ``k``-th
    beyond the candidates and none holds NaN / ``+inf``: then ``index, p`` hold the whole kept set.
    """
    values, index = rows.topk(top_k, dim=-1)
    floor = values[:, -1:]
    first = values[:, :1]
    ties = (rows == floor).sum(-1, keepdim=True) > (values == floor).sum(-1, keepdim=True)
    if bool((ties | torch.isnan(first) | (first == float("inf"))).any()):
        return index, values, False
    drop = values <= masked
    if top_p is not None:
        p_floor = nucleus_floor(values, values.logsumexp(-1, keepdim=True), top_p, masked)[0]
        drop |= values < p_floor
    return index, masked_softmax(values, drop), True


def sparse_softmax_support(
    rows: torch.Tensor, top_k: int, top_p: float | None, masked: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, p)`` of shape ``[rows, K]`` holding the kept set of :func:`sparse_softmax_rows` (``top_k`` given).

    ``K`` is ``top_k``, or the largest kept set when entries tie with the
    ``top_k``-th (one more host sync); entries among the ``K`` outside a row's kept set get ``p = 0``.
    """
    top_k = min(top_k, rows.shape[-1])
    index, p, exact = top_k_support(rows, top_k, top_p, masked)
    if exact:
        return index, p
    floor = kept_floor(rows, top_k, top_p, masked)
    width = int(((rows >= floor) & (rows > masked)).sum(-1).max()) if rows.numel() else 1
    values, index = rows.topk(min(max(width, top_k, 1), rows.shape[-1]), dim=-1)
    return index, floor_softmax(values, floor, masked)


def sparse_softmax(
    x: torch.Tensor, dim: int = -1, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Softmax over the kept set ``Omega`` (top ``top_k``, then the ``top_p`` nucleus), 0 elsewhere.

    ``top_k`` larger than the size of ``dim`` keeps everything; neither option
    given is plain softmax. Same masking and dtype conventions as the other
    mappings. Backward: ``dx = p * (g - sum(p * g))``.
    """
    dim = check_input(x, dim)
    top_k, top_p = check_top(top_k, top_p)
    return SupportMapping.apply(x, dim, lambda rows, masked: sparse_softmax_rows(rows, top_k, top_p, masked), lambda p: p)
