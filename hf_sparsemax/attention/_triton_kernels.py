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


@triton.jit
def attention_forward(
    Q, K, V, M, ALPHA, O, T, LIVE,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, smb, smh, smm, smn, sob, soh, som, sod,
    H, G, n_q, n_kv, n_mblocks, n_nblocks, scaling, mask_floor, tolerance, norm_tolerance, max_passes,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """Output ``O``, thresholds ``T`` (``m + tau / am1``, score units; ``+inf`` for a row that sees no key, NaN for a
    row not settled) and the live tiles ``LIVE`` (some weight nonzero) of one block of query rows. Every pass visits
    every tile its rows may see (no data-dependent branch: the loads stay pipelined)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    alpha = tl.load(ALPHA + h).to(tl.float32)
    am1 = alpha - 1.0
    beta = 1.0 / am1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    offs_b = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=offs_m[:, None] < n_q,
                other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    hi = n_kv
    if CAUSAL:
        hi = tl.minimum(n_kv, (pid_m + 1) * BLOCK_M)
    tiles = (pid_bh * n_mblocks + pid_m) * n_nblocks

    # pass 1: each row's maximum
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_b
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=offs_n[:, None] < n_kv, other=0.0)
        x = _dot(q, tl.trans(k), PRECISION) * scaling
        x = _mask_scores(x, M, b, h, offs_m, offs_n, n_q, n_kv, smb, smh, smm, smn, mask_floor,
                         HAS_MASK, MASK_BOOL, CAUSAL)
        m = tl.maximum(m, _max(x, 1))
    dead = m == float("-inf")  # every key masked (or a row past the end): weights 0
    m = tl.where(dead, 0.0, m)

    # the threshold: Newton from the lower bound tau = -1 on h(tau) = ||relu(z - tau)||_beta - 1, z = am1 (x - m)
    tau = tl.full([BLOCK_M], -1.0, tl.float32)
    done = dead
    previous = tl.full([BLOCK_M], -1.0, tl.float32)
    passes = 0
    pending = _sum(tl.where(done, 0, 1))
    while (pending > 0) & (passes < max_passes):
        count = tl.full([BLOCK_M], 0.0, tl.float32)
        total = tl.full([BLOCK_M], 0.0, tl.float32)  # sum u ** beta
        slope = tl.full([BLOCK_M], 0.0, tl.float32)  # sum u ** (beta - 1)
        lowest = tl.full([BLOCK_M], float("inf"), tl.float32)  # smallest u > 0 (1.5-entmax's closed form)
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + offs_b
            k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=offs_n[:, None] < n_kv,
                        other=0.0)
            x = _dot(q, tl.trans(k), PRECISION) * scaling
            x = _mask_scores(x, M, b, h, offs_m, offs_n, n_q, n_kv, smb, smh, smm, smn, mask_floor,
                             HAS_MASK, MASK_BOOL, CAUSAL)
            u = am1 * (x - m[:, None]) - tau[:, None]
            inside = u > 0
            u = tl.where(inside, u, 0.0)
            p, s = _weights(u, alpha, beta)
            count += _sum(inside.to(tl.float32), 1)
            total += _sum(p, 1)
            slope += _sum(s, 1)
            lowest = tl.minimum(lowest, _min(tl.where(inside, u, float("inf")), 1))
        if alpha == 2.0:  # norm = total ** (alpha - 1)
            norm = total
        elif alpha == 1.5:
            norm = tl.sqrt(total)
        else:
            norm = tl.where(total > 0, tl.exp2(am1 * tl.log2(tl.where(total > 0, total, 1.0))), 1.0)
        norm = tl.where(total > 0, norm, 1.0)
        step = (norm - 1.0) * (total / norm) / tl.where(slope > 0, slope, 1.0)
        settled = tl.abs(step) <= tolerance
        if alpha == 2.0:  # Michelot: exact once the support stops changing; the step keeps every candidate (each
            settled = settled | (count == previous) | ((lowest > step) & (count > 0))  # u > step): it has stopped
        elif alpha == 1.5:  # the closed form on the current candidates, exact when it keeps them all
            disc = slope * slope - count * (total - 1.0)
            denominator = slope + tl.sqrt(tl.maximum(disc, 0.0))
            delta = (total - 1.0) / tl.where(denominator > 0, denominator, 1.0)
            exact = (disc >= 0) & (delta <= lowest) & (count > 0)
            step = tl.where(exact, delta, step)
            settled = settled | exact
        tau = tl.where(done, tau, tau + step)
        done = done | settled
        previous = count
        passes += 1
        pending = _sum(tl.where(done, 0, 1))
    tau = tl.where(done, tau, float("nan"))  # not settled within max_passes: NaN, never a silent wrong answer

    # output over the live tiles; each row's normalisation checked
    acc = tl.full([BLOCK_M, HEAD_D], 0.0, tl.float32)
    mass = tl.full([BLOCK_M], 0.0, tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_b
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=offs_n[:, None] < n_kv, other=0.0)
        x = _dot(q, tl.trans(k), PRECISION) * scaling
        x = _mask_scores(x, M, b, h, offs_m, offs_n, n_q, n_kv, smb, smh, smm, smn, mask_floor,
                         HAS_MASK, MASK_BOOL, CAUSAL)
        u = tl.maximum(am1 * (x - m[:, None]) - tau[:, None], 0.0)
        p, s = _weights(u, alpha, beta)
        mass += _sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=offs_n[:, None] < n_kv, other=0.0)
        acc += _dot(p.to(v.dtype), v, PRECISION)
        tl.store(LIVE + tiles + start_n // BLOCK_N, tl.where(_max(p) > 0, 1, 0))
    wrong = (~dead) & ~(tl.abs(mass - 1.0) <= norm_tolerance)
    acc = tl.where(wrong[:, None], float("nan"), acc)
    t = tl.where(dead, float("inf"), tl.where(wrong, float("nan"), m + tau / am1))
    row = offs_m < n_q
    tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, acc.to(O.dtype.element_ty),
             mask=row[:, None])
    tl.store(T + pid_bh * n_q + offs_m, t, mask=row)


@device_function
def _tile(q, do, k_base, v_base, M, b, h, offs_m, start_n, offs_b, offs_d, t, alpha, am1, beta, n_q, n_kv,
          skn, skd, svn, svd, smb, smh, smm, smn, scaling, mask_floor,
          HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of the backward: ``(k, p, s, g)`` with ``g = dO v^T``."""
    offs_n = start_n + offs_b
    k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=offs_n[:, None] < n_kv, other=0.0)
    v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=offs_n[:, None] < n_kv, other=0.0)
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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """Per row: ``DELTA = <s, g> / <s, 1>`` and, for a learned alpha, the row's ``d alpha``:
    ``beta^2 (<g, p> - DELTA) - beta (<g, p log p> - DELTA <p, log p>)``."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    alpha = tl.load(ALPHA + h).to(tl.float32)
    am1 = alpha - 1.0
    beta = 1.0 / am1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    offs_b = tl.arange(0, BLOCK_N)
    row = offs_m < n_q
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=row[:, None], other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd, mask=row[:, None], other=0.0)
    t = tl.load(T + pid_bh * n_q + offs_m, mask=row, other=float("inf"))
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    hi = n_kv
    if CAUSAL:
        hi = tl.minimum(n_kv, (pid_m + 1) * BLOCK_M)
    tiles = (pid_bh * n_mblocks + pid_m) * n_nblocks
    s_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    sg_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    gp_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    plogp_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    gplogp_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    flag = tl.load(LIVE + tiles, mask=hi > 0, other=0)
    for start_n in range(0, hi, BLOCK_N):  # the next tile's bit read ahead: its latency overlaps this tile's work
        upcoming = tl.load(LIVE + tiles + start_n // BLOCK_N + 1, mask=start_n + BLOCK_N < hi, other=0)
        if flag != 0:
            k, v, p, s, g, u = _tile(q, do, k_base, v_base, M, b, h, offs_m, start_n, offs_b, offs_d, t, alpha, am1,
                                     beta, n_q, n_kv, skn, skd, svn, svd, smb, smh, smm, smn, scaling, mask_floor,
                                     HAS_MASK, MASK_BOOL, CAUSAL, PRECISION)
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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """``dQ = dS K * scaling`` over the live tiles, ``dS = s (g - DELTA)`` (``DQ`` laid out as ``Q``, contiguous)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    alpha = tl.load(ALPHA + h).to(tl.float32)
    am1 = alpha - 1.0
    beta = 1.0 / am1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    offs_b = tl.arange(0, BLOCK_N)
    row = offs_m < n_q
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=row[:, None], other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd, mask=row[:, None], other=0.0)
    t = tl.load(T + pid_bh * n_q + offs_m, mask=row, other=float("inf"))
    delta = tl.load(DELTA + pid_bh * n_q + offs_m, mask=row, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    hi = n_kv
    if CAUSAL:
        hi = tl.minimum(n_kv, (pid_m + 1) * BLOCK_M)
    tiles = (pid_bh * n_mblocks + pid_m) * n_nblocks
    dq = tl.full([BLOCK_M, HEAD_D], 0.0, tl.float32)
    flag = tl.load(LIVE + tiles, mask=hi > 0, other=0)
    for start_n in range(0, hi, BLOCK_N):  # the next tile's bit read ahead: its latency overlaps this tile's work
        upcoming = tl.load(LIVE + tiles + start_n // BLOCK_N + 1, mask=start_n + BLOCK_N < hi, other=0)
        if flag != 0:
            k, v, p, s, g, u = _tile(q, do, k_base, v_base, M, b, h, offs_m, start_n, offs_b, offs_d, t, alpha, am1,
                                     beta, n_q, n_kv, skn, skd, svn, svd, smb, smh, smm, smn, scaling, mask_floor,
                                     HAS_MASK, MASK_BOOL, CAUSAL, PRECISION)
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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, PRECISION: tl.constexpr,
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
    offs_b = tl.arange(0, BLOCK_M)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dk = tl.full([BLOCK_N, HEAD_D], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, HEAD_D], 0.0, tl.float32)
    lo = 0
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
    for group in range(0, G):
        h = hk * G + group
        alpha = tl.load(ALPHA + h).to(tl.float32)
        am1 = alpha - 1.0
        beta = 1.0 / am1
        bh = b * H + h
        column = LIVE + bh * n_mblocks * n_nblocks + pid_n  # this key block's bits, one a block of queries
        flag = tl.load(column + (lo // BLOCK_M) * n_nblocks, mask=lo < n_q, other=0)
        for start_m in range(lo, n_q, BLOCK_M):
            upcoming = tl.load(column + (start_m // BLOCK_M + 1) * n_nblocks, mask=start_m + BLOCK_M < n_q, other=0)
            if flag != 0:
                offs_m = start_m + offs_b
                row = offs_m < n_q
                q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=row[:, None],
                            other=0.0)
                do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd,
                             mask=row[:, None], other=0.0)
                t = tl.load(T + bh * n_q + offs_m, mask=row, other=float("inf"))
                delta = tl.load(DELTA + bh * n_q + offs_m, mask=row, other=0.0)
                k, v, p, s, g, u = _tile(q, do, k_base, v_base, M, b, h, offs_m, start_n, tl.arange(0, BLOCK_N),
                                         offs_d, t, alpha, am1, beta, n_q, n_kv, skn, skd, svn, svd, smb, smh, smm,
                                         smn, scaling, mask_floor, HAS_MASK, MASK_BOOL, CAUSAL, PRECISION)
                ds = s * (g - delta[:, None])
                dv += _dot(tl.trans(p.to(do.dtype)), do, PRECISION)
                dk += _dot(tl.trans(ds.to(q.dtype)), q, PRECISION)
            flag = upcoming
    dk = dk * scaling
    out = pid_bh * n_kv * HEAD_D + offs_n[:, None] * HEAD_D + offs_d[None, :]
    keys = offs_n[:, None] < n_kv
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=keys)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=keys)
