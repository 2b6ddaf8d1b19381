"""Backward attention kernels: delta preprocess, a dK/dV kernel and a dQ kernel.

Both main kernels recompute the probabilities from the saved log-sum-exp, so nothing of size
sq x sk is stored. They own disjoint outputs (a dK/dV program owns one key block of one kv head,
summing over every query head of its GQA group; a dQ program owns one query block of one head),
so no atomics are needed and the gradients are bit-identical run to run.

With S the (softcapped, biased) scores, P = exp(S - lse), Z the dropout keep-mask scaled by
1/(1-p) and delta = rowsum(dO * O):
    dV = (P*Z)^T dO,   dP = (dO V^T) * Z,   dS = P * (dP - delta),
    dX = dS * (1 - tanh^2)   (softcap only; X = scale * q.k is the pre-cap score),
    dQ = scale * dX K,  dK = scale * dX^T Q.
Fully masked rows have lse = +inf, so P = 0 and their gradients are exactly 0.

Beyond FlashAttention 2: v's own head dim (HEAD_DIM_V / BLOCK_DV: dO, dV and the dO V^T contraction
are dv wide) and chunked attention (HAS_CHUNK: the mask and both kernels' block ranges). A learnable
sink needs nothing here: the forward's lse includes it, so P = exp(S - lse) is already the
probability with the sink in the denominator, and delta = rowsum(dO * O) is still sum_j P dP (the sink
has no value); the sink's own gradient is the autograd layer's.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashtile.kernels.attn_fwd import (
    SHORT_SEQLEN,
    _chunk_start,
    _heavy_rows_first,
    _key_block_ranges,
    _sequence_bounds,
    _tanh,
    _tile_coords,
)
from flashtile.kernels.philox import philox_uniform

# Lengths, windows and seeds change every call: specialising on them would only recompile. Strides
# stay specialised: Triton vectorises a load (16-byte cp.async) only when it can prove every term of
# the address 16-byte aligned, and an unspecialised batch stride made all q/k/v/dO loads 2-byte ones
# (about half the backward's speed). At most two variants per stride (divisible by 16 or not).
_BWD_NO_SPECIALIZE = ["seqlen_q", "seqlen_k", "window_left", "window_right", "seed_lo", "seed_hi", "rng_offset",
                      "attention_chunk"]


# --8<-- [start:preprocess]
@triton.jit
def _attn_bwd_preprocess_kernel(O, DO, DELTA, CU_SEQLENS_Q, SEQUSED_Q, seqlen_q, num_heads,
                                stride_ob, stride_om, stride_oh, stride_dob, stride_dom, stride_doh,
                                stride_lse_b, stride_lse_h,
                                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                                IS_VARLEN: tl.constexpr, HAS_SEQUSED_Q: tl.constexpr):
    """delta[b, h, i] = sum_d dO * O, in fp32, laid out like lse."""
    pid_m, b, h, _ = _tile_coords(seqlen_q, num_heads, 1, BLOCK_M)
    row0 = b * 0
    if IS_VARLEN:
        row0 = tl.load(CU_SEQLENS_Q + b)
        seqlen_q = tl.load(CU_SEQLENS_Q + b + 1) - row0
    if HAS_SEQUSED_Q:
        seqlen_q = tl.minimum(seqlen_q, tl.load(SEQUSED_Q + b))
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    rows = (row0 + offs_m).to(tl.int64)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h * stride_doh + rows[:, None] * stride_dom + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    tl.store(DELTA + b.to(tl.int64) * stride_lse_b + h * stride_lse_h + row0 + offs_m, delta,
             mask=offs_m < seqlen_q)
# --8<-- [end:preprocess]


# --8<-- [start:probs]
@triton.jit
def _probs_and_grad_factor(qk, rows, cols, lse2, seqlen_q, seqlen_k, qk_scale, softcap, slope,
                           window_left, window_right, MASK: tl.constexpr, HAS_LEFT: tl.constexpr,
                           HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                           chunk=0, HAS_CHUNK: tl.constexpr = False):
    """P = exp(S - lse) for a tile in either orientation (rows/cols broadcast to the tile's shape),
    and the softcap chain factor (1 - tanh^2), or 1.0 without softcap."""
    factor = 1.0
    if HAS_SOFTCAP:
        t = _tanh(qk * qk_scale)
        s = t * (softcap * 1.4426950408889634)
        factor = 1.0 - t * t
    else:
        s = qk * qk_scale
    if HAS_ALIBI:
        s = s - (slope * 1.4426950408889634) * tl.abs(rows + (seqlen_k - seqlen_q) - cols).to(tl.float32)
    if MASK:
        diag = rows + (seqlen_k - seqlen_q)
        ok = cols < seqlen_k
        if HAS_LEFT:
            ok = ok & (cols >= diag - window_left)
        if HAS_RIGHT:
            ok = ok & (cols <= diag + window_right)
        if HAS_CHUNK:
            start = _chunk_start(diag, chunk)
            ok = ok & (cols >= start) & (cols < start + chunk)
        s = tl.where(ok, s, float("-inf"))
    return tl.math.exp2(s - lse2), factor
# --8<-- [end:probs]


# --8<-- [start:query_block_ranges]
@triton.jit
def _query_block_ranges(start_n, seqlen_q, seqlen_k, window_left, window_right,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
                        HAS_RIGHT: tl.constexpr, chunk=0, HAS_CHUNK: tl.constexpr = False):
    """For the key block at start_n: query blocks [lo, full_lo) masked, [full_lo, full_hi) unmasked,
    [full_hi, hi) masked; query blocks outside [lo, hi) cannot see any of its keys.

    The diagonals that see column j form one interval: from max(j - right, c) to min(j + left, c +
    chunk - 1), c the start of j's own chunk (a diagonal sees j only in j's chunk). Both ends grow with
    j, so the block's first column bounds the left edge and the interior's right edge, its last
    column the others (the forward's _key_block_ranges, transposed)."""
    shift = seqlen_k - seqlen_q
    first_col = start_n
    last_col = start_n + BLOCK_N - 1
    lo = 0
    hi = tl.cdiv(seqlen_q, BLOCK_M)
    full_lo = 0
    full_hi = hi
    if HAS_RIGHT:  # row i sees col j only if i >= j - shift - right
        lo = tl.maximum(first_col - shift - window_right, 0) // BLOCK_M
        full_lo = tl.cdiv(tl.maximum(last_col - shift - window_right, 0), BLOCK_M)
    if HAS_LEFT:  # ... and i <= j - shift + left
        hi = tl.minimum(hi, tl.cdiv(tl.maximum(last_col - shift + window_left + 1, 0), BLOCK_M))
        full_hi = tl.maximum(first_col - shift + window_left + 1, 0) // BLOCK_M
    if HAS_CHUNK:  # columns are >= 0: their chunk starts need no floor correction
        c_first = first_col - first_col % chunk
        c_last = last_col - last_col % chunk
        lo = tl.maximum(lo, tl.maximum(c_first - shift, 0) // BLOCK_M)
        full_lo = tl.maximum(full_lo, tl.cdiv(tl.maximum(c_last - shift, 0), BLOCK_M))
        hi = tl.minimum(hi, tl.cdiv(tl.maximum(c_last + chunk - shift, 0), BLOCK_M))
        full_hi = tl.minimum(full_hi, tl.maximum(c_first + chunk - shift, 0) // BLOCK_M)
    # a ragged key block needs the column mask everywhere
    full_hi = tl.where(last_col >= seqlen_k, full_lo, full_hi)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi
# --8<-- [end:query_block_ranges]


@triton.jit
def _load_rows(base, start, offs, offs_d, n_rows, stride_row, HEAD_DIM: tl.constexpr):
    """A [rows, BLOCK_D] tile of rows start.. of one head, by a masked pointer load from ``base``
    (already offset to the head and the sequence's first row); zeros outside the sequence and past
    the head dim."""
    rows = start + offs
    mask = (rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    return tl.load(base + rows[:, None] * stride_row + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, lse_base, bh, block_lo, block_hi,
                offs_m_base, cols, offs_d, offs_dv, seqlen_q, seqlen_k, stride_qm, stride_dom,
                qk_scale, softcap, slope, window_left, window_right, chunk, dropout_p, seed_lo, seed_hi, rng_offset,
                MASK: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_CHUNK: tl.constexpr,
                PIPELINE_EDGES: tl.constexpr = True):
    """Accumulate dK/dV (transposed orientation: tiles are [BLOCK_N, BLOCK_M]) over query blocks.

    PIPELINE_EDGES = False (backends/triton/attn_bwd.py edge_setting): a masked range loads its few blocks
    directly, without the software pipeline's prologue, which runs even when the range is empty."""
    # --8<-- [start:dkdv_inner]
    for blk in tl.range(block_lo, block_hi, num_stages=1 if (MASK and not PIPELINE_EDGES) else None):
        offs_m = blk * BLOCK_M + offs_m_base
        row_ok = offs_m < seqlen_q
        q = _load_rows(Q, blk * BLOCK_M, offs_m_base, offs_d, seqlen_q, stride_qm, HEAD_DIM)
        do = _load_rows(DO, blk * BLOCK_M, offs_m_base, offs_dv, seqlen_q, stride_dom, HEAD_DIM_V)
        # rows past the sequence get lse = +inf, which zeroes their probabilities
        lse2 = tl.load(LSE + lse_base + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
        delta = tl.load(DELTA + lse_base + offs_m, mask=row_ok, other=0.0)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        p_t, factor = _probs_and_grad_factor(qk_t, offs_m[None, :], cols[:, None], lse2[None, :], seqlen_q,
                                             seqlen_k, qk_scale, softcap, slope, window_left, window_right,
                                             MASK, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, chunk, HAS_CHUNK)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            keep = philox_uniform(seed_lo, seed_hi, rng_offset, bh, offs_m[None, :], cols[:, None]) >= dropout_p
            scale_z = 1.0 / (1.0 - dropout_p)
            dv += tl.dot(tl.where(keep, p_t * scale_z, 0.0).to(do.dtype), do, input_precision=DOT_PRECISION)
            dp_t = tl.where(keep, dp_t * scale_z, 0.0)
        else:
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :]) * factor
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv
    # --8<-- [end:dkdv_inner]


@triton.jit(do_not_specialize=_BWD_NO_SPECIALIZE)
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_Q, SEQUSED_K, ALIBI,
    qk_scale, softcap, dropout_p, seed_lo, seed_hi, rng_offset, window_left, window_right, attention_chunk,
    grad_scale, seqlen_q, seqlen_k, num_heads, num_kv_heads, group,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
    stride_lse_b, stride_lse_h, stride_alibi_b,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_Q: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr = False, PIPELINE_EDGES: tl.constexpr = True,
    # v's head dim and its padded tile width (0: q/k's); attention_chunk is None without HAS_CHUNK
    HEAD_DIM_V: tl.constexpr = 0, BLOCK_DV: tl.constexpr = 0, HAS_CHUNK: tl.constexpr = False,
):
    """dK and dV of one key block of one (batch, kv head), summed over the group's query heads."""
    HDV: tl.constexpr = HEAD_DIM_V if HEAD_DIM_V > 0 else HEAD_DIM
    BDV: tl.constexpr = BLOCK_DV if BLOCK_DV > 0 else BLOCK_D
    # --8<-- [start:dkdv_launch_dependents]
    if LAUNCH_DEPENDENTS:
        # programmatic dependent launch (backends/triton/attn_bwd.py use_bwd_pdl): the dQ kernel,
        # which reads nothing this kernel writes, may be scheduled once every program here started,
        # onto the SMs this grid's last wave leaves idle
        gdc_launch_dependents()
    # --8<-- [end:dkdv_launch_dependents]
    pid_n, b, kv_head, _ = _tile_coords(seqlen_k, num_kv_heads, 1, BLOCK_N)
    q_row0, k_row0, seqlen_q, seqlen_k = _sequence_bounds(b, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_Q, SEQUSED_K,
                                                          seqlen_q, seqlen_k, IS_VARLEN, HAS_SEQUSED_Q,
                                                          HAS_SEQUSED_K)
    start_n = pid_n * BLOCK_N
    if start_n < seqlen_k:  # (a key block past a short varlen sequence has nothing to do)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_m_base = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BDV)
        kv_mask = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
        v_mask = (offs_n[:, None] < seqlen_k) & (offs_dv[None, :] < HDV)
        b64 = b.to(tl.int64)
        k_rows = (k_row0 + offs_n).to(tl.int64)
        k = tl.load(K + b64 * stride_kb + kv_head * stride_kh + k_rows[:, None] * stride_kn + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(V + b64 * stride_vb + kv_head * stride_vh + k_rows[:, None] * stride_vn + offs_dv[None, :],
                    mask=v_mask, other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BDV], dtype=tl.float32)
        # --8<-- [start:dkdv_groups]
        lo, full_lo, full_hi, hi = _query_block_ranges(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                                       BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, attention_chunk,
                                                       HAS_CHUNK)
        for g in range(0, group):
            h = kv_head * group + g
            slope = 0.0
            if HAS_ALIBI:
                slope = tl.load(ALIBI + b * stride_alibi_b + h)
            bh = b * num_heads + h
            q_ptr = Q + b64 * stride_qb + q_row0.to(tl.int64) * stride_qm + h * stride_qh
            do_ptr = DO + b64 * stride_dob + q_row0.to(tl.int64) * stride_dom + h * stride_doh
            lse_base = b64 * stride_lse_b + h * stride_lse_h + q_row0
            # left edge (masked), interior (unmasked), right edge (masked)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE, DELTA, lse_base, bh, lo, full_lo, offs_m_base,
                                 offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, stride_qm, stride_dom, qk_scale, softcap,
                                 slope, window_left, window_right, attention_chunk, dropout_p, seed_lo, seed_hi,
                                 rng_offset, True, HEAD_DIM, HDV, BLOCK_M, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                                 HAS_DROPOUT, DOT_PRECISION, HAS_CHUNK, PIPELINE_EDGES=PIPELINE_EDGES)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE, DELTA, lse_base, bh, full_lo, full_hi, offs_m_base,
                                 offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, stride_qm, stride_dom, qk_scale, softcap,
                                 slope, window_left, window_right, attention_chunk, dropout_p, seed_lo, seed_hi,
                                 rng_offset, False, HEAD_DIM, HDV, BLOCK_M, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                                 HAS_DROPOUT, DOT_PRECISION, HAS_CHUNK, PIPELINE_EDGES=PIPELINE_EDGES)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE, DELTA, lse_base, bh, full_hi, hi, offs_m_base,
                                 offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, stride_qm, stride_dom, qk_scale, softcap,
                                 slope, window_left, window_right, attention_chunk, dropout_p, seed_lo, seed_hi,
                                 rng_offset, True, HEAD_DIM, HDV, BLOCK_M, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                                 HAS_DROPOUT, DOT_PRECISION, HAS_CHUNK, PIPELINE_EDGES=PIPELINE_EDGES)
        dk = dk * grad_scale
        tl.store(DK + b64 * stride_dkb + kv_head * stride_dkh + k_rows[:, None] * stride_dkn + offs_d[None, :],
                 dk.to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + b64 * stride_dvb + kv_head * stride_dvh + k_rows[:, None] * stride_dvn + offs_dv[None, :],
                 dv.to(DV.dtype.element_ty), mask=v_mask)
        # --8<-- [end:dkdv_groups]


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, K, V, bh, block_lo, block_hi, offs_m, offs_n_base, offs_d, offs_dv, seqlen_q,
              seqlen_k, stride_kn, stride_vn, qk_scale, softcap, slope, window_left, window_right, chunk, dropout_p,
              seed_lo, seed_hi, rng_offset,
              MASK: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_CHUNK: tl.constexpr,
              PIPELINE_EDGES: tl.constexpr = True, dq2=None, q2=None, offs_dt=None, HEAD_DIM_TAIL: tl.constexpr = 0):
    """Accumulate dQ over key blocks [block_lo, block_hi) (tiles are [BLOCK_M, BLOCK_N]); PIPELINE_EDGES as
    in _dkdv_inner. HEAD_DIM_TAIL > 0: q / k's columns past HEAD_DIM are a tile of their own (q2, dq2, offs_dt),
    so a head dim such as 192 runs as 128 + 64 instead of padded to 256. Returns (dq, dq2)."""
    # --8<-- [start:dq_inner]
    for blk in tl.range(block_lo, block_hi, num_stages=1 if (MASK and not PIPELINE_EDGES) else None):
        cols = blk * BLOCK_N + offs_n_base
        k = _load_rows(K, blk * BLOCK_N, offs_n_base, offs_d, seqlen_k, stride_kn, HEAD_DIM)
        v = _load_rows(V, blk * BLOCK_N, offs_n_base, offs_dv, seqlen_k, stride_vn, HEAD_DIM_V)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HEAD_DIM_TAIL > 0:
            k2 = _load_rows(K + HEAD_DIM, blk * BLOCK_N, offs_n_base, offs_dt, seqlen_k, stride_kn, HEAD_DIM_TAIL)
            qk += tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION)
        p, factor = _probs_and_grad_factor(qk, offs_m[:, None], cols[None, :], lse2[:, None], seqlen_q, seqlen_k,
                                           qk_scale, softcap, slope, window_left, window_right, MASK,
                                           HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, chunk, HAS_CHUNK)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            keep = philox_uniform(seed_lo, seed_hi, rng_offset, bh, offs_m[:, None], cols[None, :]) >= dropout_p
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None]) * factor
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
        if HEAD_DIM_TAIL > 0:
            dq2 += tl.dot(ds.to(k2.dtype), k2, input_precision=DOT_PRECISION)
    return dq, dq2
    # --8<-- [end:dq_inner]


@triton.jit(do_not_specialize=_BWD_NO_SPECIALIZE)
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_Q, SEQUSED_K, ALIBI,
    qk_scale, softcap, dropout_p, seed_lo, seed_hi, rng_offset, window_left, window_right, attention_chunk,
    grad_scale, seqlen_q, seqlen_k, num_heads, group,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh, stride_dqb, stride_dqm, stride_dqh,
    stride_lse_b, stride_lse_h, stride_alibi_b,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_Q: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HEAVY_FIRST: tl.constexpr = False, WAIT_AT_END: tl.constexpr = False, PIPELINE_EDGES: tl.constexpr = True,
    HEAD_DIM_V: tl.constexpr = 0, BLOCK_DV: tl.constexpr = 0, HAS_CHUNK: tl.constexpr = False,
    HEAD_DIM_TAIL: tl.constexpr = 0, BLOCK_DT: tl.constexpr = 0,
):
    """dQ of one query block of one (batch, head). HEAD_DIM_TAIL > 0: q / k have HEAD_DIM + HEAD_DIM_TAIL columns,
    HEAD_DIM (= BLOCK_D) in one tile and the tail in a BLOCK_DT-wide one: 192 as 128 + 64, where one padded tile
    would be 256 wide, a quarter of it zeros in two of the three products."""
    HDV: tl.constexpr = HEAD_DIM_V if HEAD_DIM_V > 0 else HEAD_DIM
    BDV: tl.constexpr = BLOCK_DV if BLOCK_DV > 0 else BLOCK_D
    pid_m, b, h, kv_head = _tile_coords(seqlen_q, num_heads, group, BLOCK_M)
    pid_m = _heavy_rows_first(pid_m, seqlen_q, BLOCK_M, HAS_RIGHT, HEAVY_FIRST)
    q_row0, k_row0, seqlen_q, seqlen_k = _sequence_bounds(b, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_Q, SEQUSED_K,
                                                          seqlen_q, seqlen_k, IS_VARLEN, HAS_SEQUSED_Q,
                                                          HAS_SEQUSED_K)
    start_m = pid_m * BLOCK_M
    if start_m < seqlen_q:  # (a query block past a short varlen sequence has nothing to do)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n_base = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BDV)
        b64 = b.to(tl.int64)
        rows = (q_row0 + offs_m).to(tl.int64)
        q_mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(Q + b64 * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :],
                    mask=q_mask, other=0.0)
        do = tl.load(DO + b64 * stride_dob + h * stride_doh + rows[:, None] * stride_dom + offs_dv[None, :],
                     mask=(offs_m[:, None] < seqlen_q) & (offs_dv[None, :] < HDV), other=0.0)
        lse_ptr = b64 * stride_lse_b + h * stride_lse_h + q_row0 + offs_m
        lse2 = tl.load(LSE + lse_ptr, mask=offs_m < seqlen_q, other=float("inf")) * 1.4426950408889634
        delta = tl.load(DELTA + lse_ptr, mask=offs_m < seqlen_q, other=0.0)
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(ALIBI + b * stride_alibi_b + h)
        bh = b * num_heads + h
        k_ptr = K + b64 * stride_kb + k_row0.to(tl.int64) * stride_kn + kv_head * stride_kh
        v_ptr = V + b64 * stride_vb + k_row0.to(tl.int64) * stride_vn + kv_head * stride_vh
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        q2, dq2, offs_dt = q, dq, offs_d  # unused without a tail
        if HEAD_DIM_TAIL > 0:
            offs_dt = tl.arange(0, BLOCK_DT)
            q2 = tl.load(Q + b64 * stride_qb + h * stride_qh + rows[:, None] * stride_qm + HEAD_DIM + offs_dt[None, :],
                         mask=(offs_m[:, None] < seqlen_q) & (offs_dt[None, :] < HEAD_DIM_TAIL), other=0.0)
            dq2 = tl.zeros([BLOCK_M, BLOCK_DT], dtype=tl.float32)
        lo, full_lo, full_hi, hi = _key_block_ranges(start_m, start_m + BLOCK_M - 1, seqlen_q, seqlen_k,
                                                     window_left, window_right, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                                                     attention_chunk, HAS_CHUNK)
        # left edge (masked), interior (unmasked), right edge (masked)
        dq, dq2 = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, bh, lo, full_lo, offs_m, offs_n_base, offs_d, offs_dv,
                       seqlen_q, seqlen_k, stride_kn, stride_vn, qk_scale, softcap, slope, window_left,
                       window_right, attention_chunk, dropout_p, seed_lo, seed_hi, rng_offset, True, HEAD_DIM, HDV,
                       BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, HAS_CHUNK,
                       PIPELINE_EDGES=PIPELINE_EDGES, dq2=dq2, q2=q2, offs_dt=offs_dt, HEAD_DIM_TAIL=HEAD_DIM_TAIL)
        dq, dq2 = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, bh, full_lo, full_hi, offs_m, offs_n_base, offs_d, offs_dv,
                       seqlen_q, seqlen_k, stride_kn, stride_vn, qk_scale, softcap, slope, window_left,
                       window_right, attention_chunk, dropout_p, seed_lo, seed_hi, rng_offset, False, HEAD_DIM, HDV,
                       BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, HAS_CHUNK,
                       PIPELINE_EDGES=PIPELINE_EDGES, dq2=dq2, q2=q2, offs_dt=offs_dt, HEAD_DIM_TAIL=HEAD_DIM_TAIL)
        dq, dq2 = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, bh, full_hi, hi, offs_m, offs_n_base, offs_d, offs_dv,
                       seqlen_q, seqlen_k, stride_kn, stride_vn, qk_scale, softcap, slope, window_left,
                       window_right, attention_chunk, dropout_p, seed_lo, seed_hi, rng_offset, True, HEAD_DIM, HDV,
                       BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, HAS_CHUNK,
                       PIPELINE_EDGES=PIPELINE_EDGES, dq2=dq2, q2=q2, offs_dt=offs_dt, HEAD_DIM_TAIL=HEAD_DIM_TAIL)
        dq = dq * grad_scale
        tl.store(DQ + b64 * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqm + offs_d[None, :],
                 dq.to(DQ.dtype.element_ty), mask=q_mask)
        if HEAD_DIM_TAIL > 0:
            tl.store(DQ + b64 * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqm + HEAD_DIM + offs_dt[None, :],
                     (dq2 * grad_scale).to(DQ.dtype.element_ty),
                     mask=(offs_m[:, None] < seqlen_q) & (offs_dt[None, :] < HEAD_DIM_TAIL))
    # --8<-- [start:dq_wait]
    if WAIT_AT_END:
        # launched early (programmatic dependent launch, while the dK/dV kernel drains): its inputs
        # were all written before that kernel started, so no wait before reading. One program
        # waiting at its end makes this grid's completion imply the dK/dV kernel's, so later work
        # in the stream sees both finished; only the last one waits, so the others free their SMs
        # as soon as they are done
        if tl.program_id(0) == tl.num_programs(0) - 1:
            gdc_wait()
    # --8<-- [end:dq_wait]


# (BLOCK_M, BLOCK_N, num_warps, num_stages) for the dK/dV and dQ kernels, keyed like FWD_CONFIGS.
# sm90 rows: scripts/tune_bwd.py's winners on the H200 (bf16, s = 4096; docs/backward.md, "Tuning"):
# dK/dV programs stream small query blocks (32) past 64-128 keys; dQ takes 128-query blocks.
BWD_CONFIGS = {
    ("sm90", 64): ((32, 128, 4, 2), (128, 64, 4, 3)),
    ("sm90", 128): ((32, 64, 4, 2), (128, 64, 8, 3)),
    ("sm90", 256): ((64, 64, 8, 2), (128, 64, 8, 1)),
    ("default", 64): ((64, 64, 4, 2), (64, 64, 4, 2)),
    ("default", 128): ((64, 64, 4, 1), (64, 64, 4, 1)),
    ("default", 256): ((32, 32, 4, 1), (32, 32, 4, 1)),
    ("interpret", 0): ((16, 16, 4, 1), (16, 16, 4, 1)),
}

# dQ pipeline stages where q / k's head dim arrives as a power-of-two tile and a tail (192 = 128 + 64,
# backends/triton/attn_bwd.dq_head_dims), by (arch, v's tile width): the 256 row's single stage is what a padded
# 256-column tile fits; the split tile fits 3 stages beside v's 128 columns and 2 beside 256 (H100, bf16, 16k
# tokens, against 1 stage: 1.12x-1.19x at (192, 128), 1.07x-1.10x at (192, 192); scripts/ab_dq_split.py).
SPLIT_DQ_STAGES = {("sm90", 128): 3, ("sm90", 256): 2}


def split_dq_stages(arch: str, block_dv: int, stages: int, elem_bytes: int = 2) -> int:
    """The dQ kernel's stages for a split q / k head dim: SPLIT_DQ_STAGES' entry for (arch, v's tile width) with
    16-bit inputs (measured so; fp32 tiles are twice the bytes), else ``stages`` (the table row's)."""
    if elem_bytes != 2:
        return stages
    return SPLIT_DQ_STAGES.get((arch, 128 if block_dv <= 128 else 256), stages)


def bwd_configs(arch: str, block_d: int, overrides=None, causal: bool = False, max_seqlen: int = 0):
    """((dkdv BLOCK_M, BLOCK_N, warps, stages), (dq ...)) for a head-dim bucket; ``overrides`` wins.

    Rows are keyed (arch, bucket); a more specific row (arch, bucket, causal) and, for sequences of
    at most SHORT_SEQLEN (max of sq, sk), (arch, bucket, causal, "short") take precedence when
    present (the forward table's scheme).
    """
    if arch == "interpret":
        return BWD_CONFIGS[("interpret", 0)]
    keys = bwd_config_keys(arch, block_d, causal, max_seqlen)
    for table in (overrides or {}, BWD_CONFIGS):
        for key in keys:
            if key in table:
                return table[key]
    return BWD_CONFIGS[("default", keys[-1][1])]


def bwd_config_keys(arch: str, block_d: int, causal: bool = False, max_seqlen: int = 0) -> list:
    """The table keys ``bwd_configs`` looks up for this call, most specific first."""
    bucket = 64 if block_d <= 64 else 128 if block_d <= 128 else 256
    keys = [(arch, bucket, causal), (arch, bucket)]
    if 0 < max_seqlen <= SHORT_SEQLEN:
        keys.insert(0, (arch, bucket, causal, "short"))
    return keys
