"""The Triton kernels of :mod:`.triton_decode` (imported on first use: the package imports without triton).

Three launches, each a few lines of maths (the notation of :mod:`.triton_decode`):

1. :func:`scores_kernel`, one program per (kv head, block of ``BLOCK_R`` of its group's query rows, split of the
   keys): ``s = scaling q.k + mask`` (``-inf`` where a key is not seen) into the scores buffer, each key block
   read once for all the group's rows; the split's row maxima and its count of NaN / ``+inf`` scores.
2. :func:`solve_kernel`, one program per query row: ``m = max s`` over the splits, the candidates
   ``z = (alpha - 1)(s - m) > -1`` gathered in order into a compact buffer (float64), and the exact threshold on
   them: Newton's method on ``h(tau) = (sum relu(z - tau) ** beta) ** (alpha - 1) - 1`` (convex, decreasing;
   ``h(-1) >= 0``, so steps from ``tau = -1`` rise monotonically to the root; a bisection step in the bracket
   where a rounded step leaves it) until a step moves ``tau`` by at most ``tolerance``. For sparsemax
   (``beta = 1``) this is Michelot's algorithm: support sums, closed form ``(sum z - 1) / k``, recount.
3. :func:`values_kernel`, one program per (kv head, row block, split): ``p = relu(z - tau) ** beta`` and
   ``P V`` over the key blocks where some row's weight is nonzero (the other value blocks are never read); the
   last split of a row block to finish (an atomic count, zeroed by each call) sums the splits' partial outputs
   into the output.

A row that sees no key gets 0 and a row with a NaN or ``+inf`` score NaN, as the CPU kernel (:mod:`.fused`).

Offsets are 64-bit: each kernel takes its program ids as int64 (:func:`program`), and every row, head and key
index is computed from them, so the products of sizes (a row's scores at ``row * keys``: ``B H q n`` scores pass
2^31 at 8 GiB; a key at ``n * stride`` in a long cache) do not wrap as int32 products would.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def program(axis: tl.constexpr):
    """This program's index on ``axis``, as int64 (the module docstring: offsets computed from it are 64-bit)."""
    return tl.program_id(axis).to(tl.int64)


@triton.jit
def scores_kernel(q_ptr, k_ptr, m_ptr, s_ptr, top_ptr, bad_ptr,
                  sq_b, sq_h, sq_r, sq_d, sk_b, sk_h, sk_n, sk_d, sm_b, sm_h, sm_r, sm_n,
                  kv_heads, groups, q_rows, rows, keys, dim, row_blocks, splits, split_len, scaling, masked,
                  BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK_KIND: tl.constexpr,
                  HALF: tl.constexpr):
    pid = program(0)
    split = program(1)
    task = pid // row_blocks  # b * kv_heads + h
    b = task // kv_heads
    h = task % kv_heads
    r = (pid % row_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)  # rows of the group: query head h G + r // q
    row_ok = r < rows
    head = h * groups + r // q_rows
    qi = r % q_rows
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + qi[:, None] * sq_r + d[None, :] * sq_d,
                mask=row_ok[:, None] & (d[None, :] < dim), other=0.0).to(tl.float32)
    out_row = task * rows + r  # the row's index in [B, H, q]
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    bad = tl.zeros([BLOCK_R], tl.int32)
    start = split * split_len
    stop = tl.minimum(start + split_len, keys)
    for low in range(start, stop, BLOCK_N):
        n = low + tl.arange(0, BLOCK_N)
        n_ok = n < stop
        k = tl.load(k_ptr + b * sk_b + h * sk_h + n[:, None] * sk_n + d[None, :] * sk_d,
                    mask=n_ok[:, None] & (d[None, :] < dim), other=0.0)
        if HALF:  # half queries and keys are exact in tf32: tensor cores, float32 products and sums
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="tf32")
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        s = s * scaling
        valid = row_ok[:, None] & n_ok[None, :]
        seen = valid
        if MASK_KIND == 1:  # boolean (as uint8): True where the key is seen
            flag = tl.load(m_ptr + b * sm_b + head[:, None] * sm_h + qi[:, None] * sm_r + n[None, :] * sm_n,
                           mask=valid, other=0)
            seen = valid & (flag != 0)
        if MASK_KIND == 2:  # additive: a key at or below `masked` is not seen (a NaN entry is, and makes NaN)
            add = tl.load(m_ptr + b * sm_b + head[:, None] * sm_h + qi[:, None] * sm_r + n[None, :] * sm_n,
                          mask=valid, other=0.0).to(tl.float32)
            seen = valid & ~(add <= masked)
            s = s + add
        s = tl.where(seen, s, float("-inf"))
        tl.store(s_ptr + out_row[:, None] * keys + n[None, :], s, mask=valid)
        bad += tl.sum(((s != s) | (s == float("inf"))).to(tl.int32), axis=1)
        top = tl.maximum(top, tl.max(tl.where(s == s, s, float("-inf")), axis=1))
    tl.store(top_ptr + out_row * splits + split, top, mask=row_ok)
    tl.store(bad_ptr + out_row * splits + split, bad, mask=row_ok)


@triton.jit
def solve_kernel(s_ptr, top_ptr, bad_ptr, c_ptr, alpha_ptr, alpha_stride, tau_ptr, m_ptr, state_ptr,
                 heads, q_rows, keys, splits, tolerance, max_iter,
                 BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    row = program(0)
    part = tl.arange(0, BLOCK_S)
    m = tl.max(tl.load(top_ptr + row * splits + part, mask=part < splits, other=float("-inf")), axis=0)
    bad = tl.sum(tl.load(bad_ptr + row * splits + part, mask=part < splits, other=0), axis=0)
    alpha = tl.load(alpha_ptr + ((row // q_rows) % heads) * alpha_stride).to(tl.float64)
    am1 = alpha - 1.0
    beta = 1.0 / am1
    state = tl.where(bad > 0, 2, tl.where(m == float("-inf"), 1, 0))  # 0 solved, 1 sees no key, 2 NaN
    m64 = m.to(tl.float64)
    c = tl.arange(0, BLOCK_C)
    count = tl.zeros([], tl.int32)
    for low in range(0, keys, BLOCK_C):  # gather the candidates z > -1, in key order
        s = tl.load(s_ptr + row * keys + low + c, mask=low + c < keys, other=float("-inf"))
        z = (s.to(tl.float64) - m64) * am1
        chosen = tl.where(state == 0, z, -2.0) > -1.0
        at = count + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        tl.store(c_ptr + row * keys + at, z, mask=chosen)
        count += tl.sum(chosen.to(tl.int32), axis=0)
    tau = tl.full([], -1.0, tl.float64)
    lo = tl.full([], -1.0, tl.float64)
    hi = tl.full([], 0.0, tl.float64)
    steps = tl.where(state == 0, max_iter, 0)
    it = tl.zeros([], tl.int32)
    while it < steps:
        total = tl.zeros([], tl.float64)
        slope = tl.zeros([], tl.float64)
        for low in range(0, count, BLOCK_C):
            z = tl.load(c_ptr + row * keys + low + c, mask=low + c < count, other=-2.0)
            u = z - tau
            live = u > 0.0
            if beta == 1.0:
                power = live.to(tl.float64)
            elif beta == 2.0:
                power = tl.where(live, u, 0.0)
            else:  # u ** (beta - 1)
                power = tl.where(live, tl.exp2(tl.log2(tl.where(live, u, 1.0)) * (beta - 1.0)), 0.0)
            total += tl.sum(power * tl.where(live, u, 0.0), axis=0)
            slope += tl.sum(power, axis=0)
        if am1 == 1.0:
            norm = total
        elif am1 == 0.5:
            norm = tl.sqrt(total)
        else:
            norm = tl.where(total > 0.0, tl.exp2(tl.log2(tl.where(total > 0.0, total, 1.0)) * am1), 0.0)
        h = norm - 1.0
        lo = tl.where(h > 0.0, tau, lo)
        hi = tl.where(h > 0.0, hi, tau)
        step = (lo + hi) * 0.5
        proposal = tau + h * (total / tl.where(norm > 0.0, norm, 1.0)) / tl.where(slope > 0.0, slope, 1.0)
        step = tl.where((slope > 0.0) & (proposal >= lo) & (proposal <= hi), proposal, step)
        it = tl.where(tl.abs(step - tau) <= tolerance, steps, it + 1)
        tau = step
    tl.store(tau_ptr + row, tau)
    tl.store(m_ptr + row, m)
    tl.store(state_ptr + row, state)


@triton.jit
def values_kernel(s_ptr, v_ptr, alpha_ptr, alpha_stride, tau_ptr, m_ptr, state_ptr, o_ptr, count_ptr, out_ptr,
                  sv_b, sv_h, sv_n, sv_d, kv_heads, groups, q_rows, rows, keys, value_dim, row_blocks, splits,
                  split_len,
                  BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, HALF: tl.constexpr,
                  BFLOAT16: tl.constexpr):
    pid = program(0)
    split = program(1)
    task = pid // row_blocks
    b = task // kv_heads
    h = task % kv_heads
    r = (pid % row_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < rows
    out_row = task * rows + r
    alpha = tl.load(alpha_ptr + (h * groups + r // q_rows) * alpha_stride, mask=row_ok, other=2.0).to(tl.float64)
    am1 = alpha - 1.0
    beta = (1.0 / am1).to(tl.float32)
    tau = tl.load(tau_ptr + out_row, mask=row_ok, other=0.0)
    m = tl.load(m_ptr + out_row, mask=row_ok, other=0.0).to(tl.float64)
    state = tl.load(state_ptr + out_row, mask=row_ok, other=1)
    solved = row_ok & (state == 0)
    dv = tl.arange(0, BLOCK_DV)
    out_ok = row_ok[:, None] & (dv[None, :] < value_dim)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    start = split * split_len
    stop = tl.minimum(start + split_len, keys)
    for low in range(start, stop, BLOCK_N):
        n = low + tl.arange(0, BLOCK_N)
        n_ok = n < stop
        s = tl.load(s_ptr + out_row[:, None] * keys + n[None, :], mask=solved[:, None] & n_ok[None, :],
                    other=float("-inf"))
        u = (s.to(tl.float64) - m[:, None]) * am1[:, None] - tau[:, None]
        live = (u > 0.0) & solved[:, None]
        if tl.max(live.to(tl.int32)) > 0:  # a block where every weight is 0: its values are not read
            x = tl.where(live, u, 1.0).to(tl.float32)
            p = tl.where(beta[:, None] == 1.0, x, tl.where(beta[:, None] == 2.0, x * x,
                                                           tl.exp2(tl.log2(x) * beta[:, None])))
            p = tl.where(live, p, 0.0)
            v = tl.load(v_ptr + b * sv_b + h * sv_h + n[:, None] * sv_n + dv[None, :] * sv_d,
                        mask=n_ok[:, None] & (dv[None, :] < value_dim), other=0.0).to(tl.float32)
            if HALF:  # v exact in tf32, p = its tf32 head + the rest: two tensor-core products, float32 accuracy
                head = (p.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
                acc += tl.dot(head, v, input_precision="tf32")
                acc += tl.dot(p - head, v, input_precision="tf32")
            else:
                acc += tl.dot(p, v, input_precision="ieee")
    tl.store(o_ptr + (out_row[:, None] * splits + split) * value_dim + dv[None, :], acc, mask=out_ok)
    # The last split of this row block to finish sums the splits' partial outputs (the counts: zeros of this call).
    tl.debug_barrier()
    finished = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
    if finished == splits - 1:
        total = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
        for part in range(0, splits):
            total += tl.load(o_ptr + (out_row[:, None] * splits + part) * value_dim + dv[None, :], mask=out_ok,
                             other=0.0, cache_modifier=".cg")
        total = tl.where((state == 2)[:, None], float("nan"), total)  # a NaN or +inf score: NaN
        if BFLOAT16:  # rounded to nearest (even) by hand: Triton's interpreter truncates float32 to bfloat16
            bits = total.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            total = bits.to(tl.float32, bitcast=True)
        tl.store(out_ptr + out_row[:, None] * value_dim + dv[None, :], total.to(out_ptr.dtype.element_ty),
                 mask=out_ok)
