"""Triton kernels of threshold attention (imported on first use by :mod:`.triton_attention`, which documents them).

One program per block of ``BLOCK_M`` query rows of one head (forward, the backward's row pass and ``dQ``) or per
block of ``BLOCK_N`` keys of one key/value head (``dK``, ``dV``: the group's query heads summed in registers).
Scores ``x = q k^T * scaling (+ mask)`` in float32, excluded keys ``-inf``; per row, with ``am1 = alpha - 1``,
``beta = 1 / am1``: ``p = relu(am1 (x - m) - tau) ** beta`` (``m`` the row maximum, ``tau`` in [-1, 0]) in the
forward, ``p = relu(am1 (x - t)) ** beta`` with the saved ``t = m + tau / am1`` in the backward. alpha is read
per head from memory: sparsemax (2) and 1.5-entmax take branches chosen at run time, every alpha one compiled
kernel. No inline assembly or library calls: the interpreter (``TRITON_INTERPRET=1``) runs them as they are.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETING = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def device_function(fn):
    """A function the kernels call: ``triton.jit``, or under the interpreter the plain function (the same
    statements: the interpreter patches ``triton.language`` for a whole launch, and again, at ~1 ms, on every
    call of a jit function)."""
    return fn if INTERPRETING else triton.jit(fn)


if INTERPRETING:  # tl.sum / max / min are jit functions (re-patching per call): the same reductions, in NumPy

    def _sum(x, axis=None):
        return tl.reduce(x, axis, tl.standard._sum_combine)

    def _max(x, axis=None):
        return tl.reduce(x, axis, tl.standard._elementwise_max)

    def _min(x, axis=None):
        return tl.reduce(x, axis, tl.standard._elementwise_min)

    def _dot(a, b, precision):  # the interpreter multiplies bfloat16 wrongly: the same products in float32
        if a.dtype == tl.bfloat16:
            a, b = a.to(tl.float32), b.to(tl.float32)
        return tl.dot(a, b, input_precision="ieee" if a.dtype == tl.float32 else precision)

else:
    _sum, _max, _min = tl.sum, tl.max, tl.min

    @triton.jit
    def _dot(a, b, precision: tl.constexpr):
        return tl.dot(a, b, input_precision=precision)


@device_function
def _mask_scores(x, M, b, h, offs_m, offs_n, n_q, n_kv, smb, smh, smm, smn, mask_floor,
                 HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr):
    """Scores ``x [BLOCK_M, BLOCK_N]`` with every key a row does not see at ``-inf``."""
    keep = (offs_m[:, None] < n_q) & (offs_n[None, :] < n_kv)
    if CAUSAL:  # query i sees keys j <= i (upper-left aligned, as blocks.causal_mask)
        keep = keep & (offs_n[None, :] <= offs_m[:, None])
    if HAS_MASK:
        values = tl.load(M + b * smb + h * smh + offs_m[:, None] * smm + offs_n[None, :] * smn, mask=keep, other=0)
        if MASK_BOOL:
            keep = keep & (values != 0)
        else:
            values = values.to(tl.float32)
            keep = keep & (values > mask_floor)
            x = x + values
    return tl.where(keep, x, float("-inf"))


@device_function
def _weights(u, alpha, beta):
    """``(p, s)`` from ``u = relu(am1 (x - t)) >= 0``: ``p = u ** beta``, ``s = p ** (2 - alpha) = u ** (beta - 1)``
    on the support (0 elsewhere)."""
    live = u > 0
    if alpha == 2.0:
        p = u
        s = tl.where(live, 1.0, 0.0)
    elif alpha == 1.5:
        p = u * u
        s = u
    else:
        lg = tl.log2(tl.where(live, u, 1.0))
        s = tl.where(live, tl.exp2((beta - 1.0) * lg), 0.0)
        p = s * u
    return p, s


@device_function
def _scores(q, k_base, M, b, h, offs_m, offs_n, offs_d, n_q, n_kv, skn, skd, smb, smh, smm, smn, scaling, mask_floor,
            HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """The masked scores ``x [BLOCK_M, BLOCK_N]`` of the key tile ``offs_n``."""
    k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=offs_n[:, None] < n_kv, other=0.0)
    x = _dot(q, tl.trans(k), PRECISION) * scaling
    return _mask_scores(x, M, b, h, offs_m, offs_n, n_q, n_kv, smb, smh, smm, smn, mask_floor,
                        HAS_MASK, MASK_BOOL, CAUSAL)


@device_function
def _norm(total, alpha, am1):
    """``total ** (alpha - 1)`` (1 where ``total`` is 0): the beta-norm of the weights from ``sum u ** beta``."""
    if alpha == 2.0:
        norm = total
    elif alpha == 1.5:
        norm = tl.sqrt(total)
    else:
        norm = tl.exp2(am1 * tl.log2(tl.where(total > 0, total, 1.0)))
    return tl.where(total > 0, norm, 1.0)


@device_function
def _histogram(x, grid, anchor, counts, HIST_BINS: tl.constexpr):
    """Adds a tile to each row's histogram of scores: bin ``b`` holds the scores in
    ``(grid (anchor - b - 1), grid (anchor - b)]``, ``anchor`` the grid index ``ceil(x / grid)`` of the row's
    maximum so far. A tile that raises the maximum moves the old counts down by as many bins (those past the last
    bin are dropped: they lie below ``max - 1 / (alpha - 1)``, never in the support). The tile's own counts are
    summed as 8-bit fields of one int64 a row (one reduction for every bin; a tile has at most 255 keys)."""
    c = tl.ceil(x / grid)  # -inf where masked
    top = tl.maximum(anchor, _max(c, 1))
    shift = top - anchor
    bins = tl.arange(0, HIST_BINS)
    moved = (bins[None, :, None].to(tl.float32) + shift[:, None, None]) == bins[None, None, :].to(tl.float32)
    counts = _sum(tl.where(moved, counts[:, :, None], 0.0), 1)
    below = top[:, None] - c  # the bin, +inf or NaN where masked
    inside = below < HIST_BINS
    field = (tl.where(inside, below, 0.0).to(tl.int64) * 8)
    packed = _sum(tl.where(inside, tl.full(field.shape, 1, tl.int64) << field, 0), 1)
    counts += ((packed[:, None] >> (bins[None, :] * 8).to(tl.int64)) & 255).to(tl.float32)
    return top, counts


@device_function
def _start(counts, anchor, m, grid, alpha, am1, beta, HIST_BINS: tl.constexpr, HIST_ITER: tl.constexpr):
    """A start for the threshold from the histogram: the root of ``L(t) = ||relu(e - t)||_beta - 1``, each
    binned score put at its bin's lower edge in ``z`` units (``e``; the maximum at ``z = 0`` exactly). ``L <= f``
    (``f`` of the true scores), both convex and decreasing: the root of ``L`` is at most the threshold, and Newton
    from ``-1`` (a lower bound of both) rises to it from below in registers (no pass over the keys)."""
    width = am1 * grid  # a bin in z units: 1 / (HIST_BINS - 1)
    bins = tl.arange(0, HIST_BINS)
    edges = (am1 * (anchor * grid - m))[:, None] - (bins[None, :] + 1).to(tl.float32) * width
    counts = counts - tl.where(bins[None, :] == 0, 1.0, 0.0)  # the maximum, counted exactly below
    tau = tl.full(m.shape, -1.0, tl.float32)
    for _ in range(HIST_ITER):
        p, s = _weights(tl.maximum(edges - tau[:, None], 0.0), alpha, beta)
        top_p, top_s = _weights(-tau, alpha, beta)
        total = _sum(counts * p, 1) + top_p
        slope = _sum(counts * s, 1) + top_s
        norm = _norm(total, alpha, am1)
        tau = tau + (norm - 1.0) * (total / norm) / tl.where(slope > 0, slope, 1.0)
    return tau


@device_function
def _live_tiles(TMAX, LIST, tiles, n_tiles, m, tau, am1, BLOCK_M: tl.constexpr, SKIP: tl.constexpr):
    """Writes to ``LIST`` the key tiles in which some row of the block has a score with ``z > tau`` (from the tile
    maxima of the first pass: ``BLOCK_M`` floats a tile, no product) and returns their number (every tile
    without ``SKIP``). The passes that follow loop over this list: a loop of live tiles, no branch in its body,
    so their loads stay pipelined (a data-dependent branch around a tile's work stalled them)."""
    tl.debug_barrier()  # the list and the maxima are written by other threads of this program
    n_live = 0
    for j in range(0, n_tiles):
        if SKIP:
            tile_max = tl.load(TMAX + (tiles + j) * BLOCK_M + tl.arange(0, BLOCK_M))
            live = _max(tl.where(am1 * (tile_max - m) > tau, 1, 0), 0)
            tl.store(LIST + tiles + n_live, j, mask=live > 0)
            n_live += live
        else:
            tl.store(LIST + tiles + j, j)
            n_live += 1
    tl.debug_barrier()
    return n_live


@device_function
def _tile_sums(x, m, tau, alpha, am1, beta, general, count, total, slope, lowest, curve):
    """A tile's weights ``p`` at ``tau`` and the threshold pass's sums with it added: candidates, ``sum u ** beta``,
    ``sum u ** (beta - 1)``, the smallest ``u > 0`` and (other alphas) ``sum u ** (beta - 2)``."""
    u = am1 * (x - m[:, None]) - tau[:, None]
    inside = u > 0
    u = tl.where(inside, u, 0.0)
    p, s = _weights(u, alpha, beta)
    count += _sum(inside.to(tl.float32), 1)
    total += _sum(p, 1)
    slope += _sum(s, 1)
    lowest = tl.minimum(lowest, _min(tl.where(inside, u, float("inf")), 1))
    if general:
        curve += _sum(s / tl.where(inside, u, 1.0), 1)
    return p, count, total, slope, lowest, curve


@device_function
def _step(count, total, slope, lowest, curve, previous, tau, upper, alpha, am1, beta, general, tolerance):
    """``(step, settled, upper)`` of a threshold pass from its sums at ``tau``: the step to take, the rows it
    certifies, and the known upper bound of the threshold (other alphas)."""
    norm = _norm(total, alpha, am1)
    step = (norm - 1.0) * (total / norm) / tl.where(slope > 0, slope, 1.0)  # Newton's
    if general:  # Halley: h' = -(norm / total) slope, h'' as below; kept within a factor 2 of Newton's step and
        # below a known upper bound (else halfway to it): Halley's step alone may overshoot; the certificate stays
        # |step| <= tolerance on the step taken
        ratio = norm / tl.where(total > 0, total, 1.0)
        d1 = -ratio * slope
        d2 = ratio * ((am1 - 1.0) * beta * slope * slope / tl.where(total > 0, total, 1.0) + (beta - 1.0) * curve)
        denominator = 1.0 - (norm - 1.0) * d2 / tl.where(d1 != 0, 2.0 * d1 * d1, 1.0)
        halley = tl.where(denominator >= 0.5, step / denominator, step)
        upper = tl.where(norm < 1.0, tl.minimum(upper, tau), upper)
        step = tl.where(tau + halley < upper, halley, 0.5 * (upper - tau))
    settled = tl.abs(step) <= tolerance
    # The start may sit above the threshold by rounding (step < 0): a closed form is exact only from below (step >=
    # 0: every key left out is below the new threshold too); a step from above lands below (convexity)
    if alpha == 2.0:  # Michelot: exact once the support stops changing, or when the step keeps every candidate
        settled = settled | (count == previous) | ((lowest > step) & (step >= 0) & (count > 0))
    elif alpha == 1.5:  # the closed form on the current candidates, exact when it keeps them all
        disc = slope * slope - count * (total - 1.0)
        denominator = slope + tl.sqrt(tl.maximum(disc, 0.0))
        delta = (total - 1.0) / tl.where(denominator > 0, denominator, 1.0)
        exact = (disc >= 0) & (delta <= lowest) & (delta >= 0) & (count > 0)
        step = tl.where(exact, delta, step)
        settled = settled | exact
    return step, settled, upper


@device_function
def _finish(acc, mass, dead, m, tau, am1, norm_tolerance, O, T, b, h, pid_bh, offs_m, offs_d, n_q, sob, soh, som,
            sod):
    """Stores the block's output rows and thresholds ``m + tau / am1`` (``+inf`` for a row that sees no key); a row
    whose ``sum p`` is off 1 by more than ``norm_tolerance`` (or whose tau is NaN) gets NaN in both."""
    wrong = (~dead) & ~(tl.abs(mass - 1.0) <= norm_tolerance)
    acc = tl.where(wrong[:, None], float("nan"), acc)
    t = tl.where(dead, float("inf"), tl.where(wrong, float("nan"), m + tau / am1))
    row = offs_m < n_q
    tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, acc.to(O.dtype.element_ty),
             mask=row[:, None])
    tl.store(T + pid_bh * n_q + offs_m, t, mask=row)


@device_function
def _head_alpha(ALPHA, h):
    """``(alpha, am1, beta)`` of query head ``h``: its alpha, ``alpha - 1`` and ``1 / (alpha - 1)``."""
    alpha = tl.load(ALPHA + h).to(tl.float32)
    am1 = alpha - 1.0
    return alpha, am1, 1.0 / am1


@triton.jit
def attention_forward(
    Q, K, V, M, ALPHA, O, T, LIVE, TMAX, LIST, WORK,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, smb, smh, smm, smn, sob, soh, som, sod,
    H, G, n_q, n_kv, n_mblocks, n_nblocks, scaling, mask_floor, tolerance, norm_tolerance, max_passes, speculate,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr, SKIP: tl.constexpr,
    HIST_BINS: tl.constexpr, HIST_ITER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Output ``O`` (``HEAD_DV`` columns: the value head size, any power of 2 beside the query / key ``HEAD_D``),
    thresholds ``T`` (``m + tau / am1``, score units; ``+inf`` for a row that sees no key, NaN for a
    row not settled), the live tiles ``LIVE`` (some weight nonzero) of one block of query rows, and its work
    ``WORK``: passes over the keys and key tiles visited (two int32, a counter for benchmarks and tests).

    Pass 1 visits every tile the rows may see: row maxima, a histogram of the top scores (the threshold's start)
    and, with ``SKIP``, each tile's row maxima (``TMAX``). Each threshold pass and the output pass visit only the
    tiles with a score above the current threshold (``_live_tiles``)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    alpha, am1, beta = _head_alpha(ALPHA, h)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    offs_dv = tl.arange(0, HEAD_DV)
    offs_b = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=offs_m[:, None] < n_q,
                other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    hi = n_kv
    if CAUSAL:
        hi = tl.minimum(n_kv, (pid_m + 1) * BLOCK_M)
    n_tiles = (hi + BLOCK_N - 1) // BLOCK_N
    tiles = (pid_bh * n_mblocks + pid_m) * n_nblocks
    grid = 1.0 / ((HIST_BINS - 1) * am1)  # a histogram bin in score units (1 / (HIST_BINS - 1) in z units)

    # pass 1: each row's maximum and histogram, each tile's row maxima
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    anchor = tl.full([BLOCK_M], -3.0e38, tl.float32)  # a grid index below every score's: no inf - inf
    counts = tl.full([BLOCK_M, HIST_BINS], 0.0, tl.float32)
    for j in range(0, n_tiles):
        x = _scores(q, k_base, M, b, h, offs_m, j * BLOCK_N + offs_b, offs_d, n_q, n_kv, skn, skd, smb, smh, smm,
                    smn, scaling, mask_floor, HAS_MASK, MASK_BOOL, CAUSAL, PRECISION)
        tile_max = _max(x, 1)
        m = tl.maximum(m, tile_max)
        anchor, counts = _histogram(x, grid, anchor, counts, HIST_BINS)
        if SKIP:
            tl.store(TMAX + (tiles + j) * BLOCK_M + tl.arange(0, BLOCK_M), tile_max)
    dead = m == float("-inf")  # every key masked (or a row past the end): weights 0
    m = tl.where(dead, 0.0, m)

    # the threshold: Newton on h(tau) = ||relu(z - tau)||_beta - 1, z = am1 (x - m), from the histogram's start
    tau = tl.where(dead, -1.0, _start(counts, anchor, m, grid, alpha, am1, beta, HIST_BINS, HIST_ITER))
    done = dead
    previous = tl.full([BLOCK_M], -1.0, tl.float32)
    upper = tl.full([BLOCK_M], 0.0, tl.float32)  # above the threshold: 0 (h(0) = -1), then any tau with h < 0
    passes = 0
    pending = _sum(tl.where(done, 0, 1))
    # Other alphas: once every pending row's last step is below ``speculate`` (Halley's next is then far below the
    # tolerance), the pass that certifies them also adds P V at the current tau and writes the output: the output
    # pass is saved; the rows it certifies keep that tau (within the tolerance of the next), and if any row is not
    # certified the pass's P V is dropped and the passes go on. (The sums of P V live inside that branch only: no
    # [BLOCK_M, HEAD_DV] accumulator held through the other passes.)
    general = (alpha != 2.0) & (alpha != 1.5)
    last = tl.full([BLOCK_M], float("inf"), tl.float32)  # each row's last step
    finished = 0
    visits = n_tiles
    while (pending > 0) & (passes < max_passes):
        spec = general & (_max(tl.where(done, 0.0, last), 0) <= speculate)
        n_live = _live_tiles(TMAX, LIST, tiles, n_tiles, m, tau, am1, BLOCK_M, SKIP)
        visits += n_live
        count = tl.full([BLOCK_M], 0.0, tl.float32)
        total = tl.full([BLOCK_M], 0.0, tl.float32)  # sum u ** beta
        slope = tl.full([BLOCK_M], 0.0, tl.float32)  # sum u ** (beta - 1)
        lowest = tl.full([BLOCK_M], float("inf"), tl.float32)  # smallest u > 0 (the closed forms' certificates)
        curve = tl.full([BLOCK_M], 0.0, tl.float32)  # sum u ** (beta - 2) (Halley's step, other alphas)
        hold = done  # rows whose tau stays
        if spec:  # two loops, each without a branch in its body (pipelined loads)
            acc = tl.full([BLOCK_M, HEAD_DV], 0.0, tl.float32)
            for i in range(0, n_live):
                j = tl.load(LIST + tiles + i)
                offs_n = j * BLOCK_N + offs_b
                x = _scores(q, k_base, M, b, h, offs_m, offs_n, offs_d, n_q, n_kv, skn, skd, smb, smh, smm, smn,
                            scaling, mask_floor, HAS_MASK, MASK_BOOL, CAUSAL, PRECISION)
                p, count, total, slope, lowest, curve = _tile_sums(x, m, tau, alpha, am1, beta, general, count,
                                                                   total, slope, lowest, curve)
                v = tl.load(v_base + offs_n[:, None] * svn + offs_dv[None, :] * svd, mask=offs_n[:, None] < n_kv,
                            other=0.0)
                acc += _dot(p.to(v.dtype), v, PRECISION)
                tl.store(LIVE + tiles + j, tl.where(_max(p) > 0, 1, 0))
            step, settled, upper = _step(count, total, slope, lowest, curve, previous, tau, upper, alpha, am1, beta,
                                         general, tolerance)
            hold = done | settled
            finished = tl.where(_sum(tl.where(hold, 0, 1)) == 0, 1, 0)
            if finished != 0:
                _finish(acc, total, dead, m, tau, am1, norm_tolerance, O, T, b, h, pid_bh, offs_m, offs_dv, n_q,
                        sob, soh, som, sod)
        else:
            for i in range(0, n_live):
                j = tl.load(LIST + tiles + i)
                x = _scores(q, k_base, M, b, h, offs_m, j * BLOCK_N + offs_b, offs_d, n_q, n_kv, skn, skd, smb, smh,
                            smm, smn, scaling, mask_floor, HAS_MASK, MASK_BOOL, CAUSAL, PRECISION)
                p, count, total, slope, lowest, curve = _tile_sums(x, m, tau, alpha, am1, beta, general, count,
                                                                   total, slope, lowest, curve)
            step, settled, upper = _step(count, total, slope, lowest, curve, previous, tau, upper, alpha, am1, beta,
                                         general, tolerance)
        tau = tl.where(hold, tau, tau + step)
        done = done | settled
        last = tl.abs(step)
        previous = count
        passes += 1
        pending = _sum(tl.where(done, 0, 1))
    tau = tl.where(done, tau, float("nan"))  # not settled within max_passes: NaN, never a silent wrong answer

    # output over the live tiles (unless a certifying pass wrote it); each row's normalisation checked
    if finished == 0:
        n_live = _live_tiles(TMAX, LIST, tiles, n_tiles, m, tl.where(done, tau, -1.0), am1, BLOCK_M, SKIP)
        visits += n_live
        acc = tl.full([BLOCK_M, HEAD_DV], 0.0, tl.float32)
        mass = tl.full([BLOCK_M], 0.0, tl.float32)
        for i in range(0, n_live):
            j = tl.load(LIST + tiles + i)
            offs_n = j * BLOCK_N + offs_b
            x = _scores(q, k_base, M, b, h, offs_m, offs_n, offs_d, n_q, n_kv, skn, skd, smb, smh, smm, smn, scaling,
                        mask_floor, HAS_MASK, MASK_BOOL, CAUSAL, PRECISION)
            u = tl.maximum(am1 * (x - m[:, None]) - tau[:, None], 0.0)
            p, s = _weights(u, alpha, beta)
            mass += _sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * svn + offs_dv[None, :] * svd, mask=offs_n[:, None] < n_kv,
                        other=0.0)
            acc += _dot(p.to(v.dtype), v, PRECISION)
            tl.store(LIVE + tiles + j, tl.where(_max(p) > 0, 1, 0))
        _finish(acc, mass, dead, m, tau, am1, norm_tolerance, O, T, b, h, pid_bh, offs_m, offs_dv, n_q, sob, soh,
                som, sod)
    tl.store(WORK + (pid_bh * n_mblocks + pid_m) * 2, 2 + passes - finished)
    tl.store(WORK + (pid_bh * n_mblocks + pid_m) * 2 + 1, visits)


@device_function
def _program_rows(pid_m, pid_bh, H, G, n_q, BLOCK_M: tl.constexpr):
    """``(b, h, hk, offs_m, row)`` of a program over one block of query rows: its batch, query head, kv head, row
    indices and which of them exist."""
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return b, h, h // G, offs_m, offs_m < n_q


@device_function
def _key_span(pid_m, pid_bh, n_kv, n_mblocks, n_nblocks, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """``(hi, tiles)`` of a backward program over one block of query rows: the keys it may see (``[0, hi)``) and
    the offset of its row of live-tile bits in ``LIVE``."""
    hi = n_kv
    if CAUSAL:
        hi = tl.minimum(n_kv, (pid_m + 1) * BLOCK_M)
    return hi, (pid_bh * n_mblocks + pid_m) * n_nblocks


@device_function
def _query_rows(Q, DO, T, b, h, bh, offs_m, offs_d, offs_dv, row, n_q, sqb, sqh, sqm, sqd, sdb, sdh, sdm, sdd):
    """The backward's ``(q, dO, t)`` of one block of query rows of head ``h`` (``bh`` its row of ``T``): rows past
    ``n_q`` read as zeros, their ``t`` as ``+inf`` (no weight)."""
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=row[:, None], other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_dv[None, :] * sdd, mask=row[:, None],
                 other=0.0)
    t = tl.load(T + bh * n_q + offs_m, mask=row, other=float("inf"))
    return q, do, t


@device_function
def _tile(q, do, k_base, v_base, M, b, h, offs_m, start_n, offs_b, offs_d, offs_dv, t, alpha, am1, beta, n_q, n_kv,
          skn, skd, svn, svd, smb, smh, smm, smn, scaling, mask_floor,
          HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of the backward: ``(k, p, s, g)`` with ``g = dO v^T``."""
    offs_n = start_n + offs_b
    k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=offs_n[:, None] < n_kv, other=0.0)
    v = tl.load(v_base + offs_n[:, None] * svn + offs_dv[None, :] * svd, mask=offs_n[:, None] < n_kv, other=0.0)
    x = _dot(q, tl.trans(k), PRECISION) * scaling
    x = _mask_scores(x, M, b, h, offs_m, offs_n, n_q, n_kv, smb, smh, smm, smn, mask_floor,
                     HAS_MASK, MASK_BOOL, CAUSAL)
    u = tl.maximum(am1 * (x - t[:, None]), 0.0)
    p, s = _weights(u, alpha, beta)
    g = _dot(do, tl.trans(v), PRECISION)
    return k, v, p, s, g, u


@triton.jit
def attention_backward_rows(
    Q, K, V, M, ALPHA, DO, T, LIVE, DELTA, DALPHA,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, smb, smh, smm, smn, sdb, sdh, sdm, sdd,
    H, G, n_q, n_kv, n_mblocks, n_nblocks, scaling, mask_floor,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr, ALPHA_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Per row: ``DELTA = <s, g> / <s, 1>`` and, for a learned alpha, the row's ``d alpha``:
    ``beta^2 (<g, p> - DELTA) - beta (<g, p log p> - DELTA <p, log p>)``."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h, hk, offs_m, row = _program_rows(pid_m, pid_bh, H, G, n_q, BLOCK_M)
    alpha, am1, beta = _head_alpha(ALPHA, h)
    offs_d = tl.arange(0, HEAD_D)
    offs_dv = tl.arange(0, HEAD_DV)
    offs_b = tl.arange(0, BLOCK_N)
    q, do, t = _query_rows(Q, DO, T, b, h, pid_bh, offs_m, offs_d, offs_dv, row, n_q, sqb, sqh, sqm, sqd, sdb, sdh,
                           sdm, sdd)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    hi, tiles = _key_span(pid_m, pid_bh, n_kv, n_mblocks, n_nblocks, BLOCK_M, CAUSAL)
    s_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    sg_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    gp_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    plogp_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    gplogp_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    flag = tl.load(LIVE + tiles, mask=hi > 0, other=0)
    for start_n in range(0, hi, BLOCK_N):  # the next tile's bit read ahead: its latency overlaps this tile's work
        upcoming = tl.load(LIVE + tiles + start_n // BLOCK_N + 1, mask=start_n + BLOCK_N < hi, other=0)
        if flag != 0:
            k, v, p, s, g, u = _tile(q, do, k_base, v_base, M, b, h, offs_m, start_n, offs_b, offs_d, offs_dv, t,
                                     alpha, am1, beta, n_q, n_kv, skn, skd, svn, svd, smb, smh, smm, smn, scaling,
                                     mask_floor, HAS_MASK, MASK_BOOL, CAUSAL, PRECISION)
            s_sum += _sum(s, 1)
            sg_sum += _sum(s * g, 1)
            if ALPHA_GRAD:
                plogp = tl.where(u > 0, p * beta * tl.log(tl.where(u > 0, u, 1.0)), 0.0)
                gp_sum += _sum(g * p, 1)
                plogp_sum += _sum(plogp, 1)
                gplogp_sum += _sum(g * plogp, 1)
        flag = upcoming
    delta = tl.where(s_sum > 0, sg_sum / tl.where(s_sum > 0, s_sum, 1.0), 0.0)
    tl.store(DELTA + pid_bh * n_q + offs_m, delta, mask=row)
    if ALPHA_GRAD:
        d_alpha = beta * beta * (gp_sum - delta) - beta * (gplogp_sum - delta * plogp_sum)
        tl.store(DALPHA + pid_bh * n_q + offs_m, d_alpha, mask=row)


@triton.jit
def attention_backward_q(
    Q, K, V, M, ALPHA, DO, T, LIVE, DELTA, DQ,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, smb, smh, smm, smn, sdb, sdh, sdm, sdd,
    H, G, n_q, n_kv, n_mblocks, n_nblocks, scaling, mask_floor,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``dQ = dS K * scaling`` over the live tiles, ``dS = s (g - DELTA)`` (``DQ`` laid out as ``Q``, contiguous)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h, hk, offs_m, row = _program_rows(pid_m, pid_bh, H, G, n_q, BLOCK_M)
    alpha, am1, beta = _head_alpha(ALPHA, h)
    offs_d = tl.arange(0, HEAD_D)
    offs_dv = tl.arange(0, HEAD_DV)
    offs_b = tl.arange(0, BLOCK_N)
    q, do, t = _query_rows(Q, DO, T, b, h, pid_bh, offs_m, offs_d, offs_dv, row, n_q, sqb, sqh, sqm, sqd, sdb, sdh,
                           sdm, sdd)
    delta = tl.load(DELTA + pid_bh * n_q + offs_m, mask=row, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    hi, tiles = _key_span(pid_m, pid_bh, n_kv, n_mblocks, n_nblocks, BLOCK_M, CAUSAL)
    dq = tl.full([BLOCK_M, HEAD_D], 0.0, tl.float32)
    flag = tl.load(LIVE + tiles, mask=hi > 0, other=0)
    for start_n in range(0, hi, BLOCK_N):  # the next tile's bit read ahead: its latency overlaps this tile's work
        upcoming = tl.load(LIVE + tiles + start_n // BLOCK_N + 1, mask=start_n + BLOCK_N < hi, other=0)
        if flag != 0:
            k, v, p, s, g, u = _tile(q, do, k_base, v_base, M, b, h, offs_m, start_n, offs_b, offs_d, offs_dv, t,
                                     alpha, am1, beta, n_q, n_kv, skn, skd, svn, svd, smb, smh, smm, smn, scaling,
                                     mask_floor, HAS_MASK, MASK_BOOL, CAUSAL, PRECISION)
            ds = s * (g - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, PRECISION)
        flag = upcoming
    dq = dq * scaling
    tl.store(DQ + pid_bh * n_q * HEAD_D + offs_m[:, None] * HEAD_D + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=row[:, None])


@triton.jit
def attention_backward_kv(
    Q, K, V, M, ALPHA, DO, T, LIVE, DELTA, DK, DV,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, smb, smh, smm, smn, sdb, sdh, sdm, sdd,
    H, G, n_q, n_kv, n_mblocks, n_nblocks, scaling, mask_floor,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``dV = P^T dO``, ``dK = dS^T Q * scaling`` of one block of keys, summed over the group's query heads
    (``DK``, ``DV`` laid out ``[B, Hkv, kv, D]``, contiguous)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    h_kv = H // G
    b = pid_bh // h_kv
    hk = pid_bh % h_kv
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    offs_dv = tl.arange(0, HEAD_DV)
    offs_b = tl.arange(0, BLOCK_M)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dk = tl.full([BLOCK_N, HEAD_D], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, HEAD_DV], 0.0, tl.float32)
    lo = 0
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
    for group in range(0, G):
        h = hk * G + group
        alpha, am1, beta = _head_alpha(ALPHA, h)
        bh = b * H + h
        column = LIVE + bh * n_mblocks * n_nblocks + pid_n  # this key block's bits, one a block of queries
        flag = tl.load(column + (lo // BLOCK_M) * n_nblocks, mask=lo < n_q, other=0)
        for start_m in range(lo, n_q, BLOCK_M):
            upcoming = tl.load(column + (start_m // BLOCK_M + 1) * n_nblocks, mask=start_m + BLOCK_M < n_q, other=0)
            if flag != 0:
                offs_m = start_m + offs_b
                row = offs_m < n_q
                q, do, t = _query_rows(Q, DO, T, b, h, bh, offs_m, offs_d, offs_dv, row, n_q, sqb, sqh, sqm, sqd, sdb,
                                       sdh, sdm, sdd)
                delta = tl.load(DELTA + bh * n_q + offs_m, mask=row, other=0.0)
                k, v, p, s, g, u = _tile(q, do, k_base, v_base, M, b, h, offs_m, start_n, tl.arange(0, BLOCK_N),
                                         offs_d, offs_dv, t, alpha, am1, beta, n_q, n_kv, skn, skd, svn, svd, smb,
                                         smh, smm, smn, scaling, mask_floor, HAS_MASK, MASK_BOOL, CAUSAL, PRECISION)
                ds = s * (g - delta[:, None])
                dv += _dot(tl.trans(p.to(do.dtype)), do, PRECISION)
                dk += _dot(tl.trans(ds.to(q.dtype)), q, PRECISION)
            flag = upcoming
    dk = dk * scaling
    keys = offs_n[:, None] < n_kv
    tl.store(DK + pid_bh * n_kv * HEAD_D + offs_n[:, None] * HEAD_D + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=keys)
    tl.store(DV + pid_bh * n_kv * HEAD_DV + offs_n[:, None] * HEAD_DV + offs_dv[None, :], dv.to(DV.dtype.element_ty),
             mask=keys)
