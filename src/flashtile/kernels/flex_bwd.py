"""Backward of programmable attention (flashtile.flex): a dK/dV kernel and a dQ kernel.

Both recompute S = score_mod(scale * q.k) and P = exp(S - lse) from the saved lse. With
delta = rowsum(dO * O) - dlse (the plain backward's preprocess kernel, less the gradient of the lse output,
since d lse_i / d S_ij = P_ij), dS = P * (dP - delta) is the gradient of the mod's output; SCORE_GRAD (generated: reverse-mode through the traced mod) turns it into the
gradient of the mod's input X = scale * q.k, and dQ = scale * dX K, dK = scale * dX^T Q.

The dK/dV program owns one key tile of one (batch, kv head) and walks, for each query head of its
group, the query blocks the block mask's transposed lists give (Q_NUM / Q_IDX partial, FULL_Q_* full).
Every (query, key) pair is visited by exactly one dK/dV program, so gradients into captured tensors
(a learnable bias table) are added there, atomically (HAS_BUFFER_GRADS), and the dQ kernel skips them.
"""

import triton
import triton.language as tl

from flashtile.kernels.flex_common import (
    _block_list,
    _bounded,
    _flex_coords,
    _flex_scores,
    _list_offsets,
    _listed_start,
    _load_rows,
    _q_rows,
    _row_stats,
)


@triton.jit
def _flex_dscore(p, dp, delta, x, b, h, q_idx, kv_idx, valid, BUFS, GRADS, SCORE_GRAD: tl.constexpr,
                 HAS_SCORE_MOD: tl.constexpr, ACCUMULATE: tl.constexpr):
    """The gradient of the score_mod's input x from dP: dS = P * (dP - delta) is the gradient of its output
    (delta = rowsum(dO * O) - dlse carries the lse output's gradient), and SCORE_GRAD carries it through the
    mod (ACCUMULATE: adding the captured tensors' gradients)."""
    ds = p * (dp - delta)
    if HAS_SCORE_MOD:
        ds = SCORE_GRAD(x, b, h, q_idx, kv_idx, ds, valid, BUFS, GRADS, ACCUMULATE)
    return ds


@triton.jit
def _flex_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, NUM, IDX, FULL_NUM, FULL_IDX, b, h, offs_m_base, cols, kv_idx,
                     offs_d, offs_dv, seqlen_q, seqlen_k, stride_qm, stride_dom, sm_scale, BUFS, GRADS,
                     SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
                     HAS_SCORE_MOD: tl.constexpr, HAS_BUFFER_GRADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, SPARSE_Q: tl.constexpr, EVEN_M: tl.constexpr,
                     EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dK/dV over the key block's two query-block lists (partly visible: IDX[0 : NUM], mask_mod per element;
    fully visible: FULL_IDX[0 : FULL_NUM]); tiles are transposed, [BLOCK_N keys, BLOCK_M queries]."""
    for phase in tl.static_range(2):
        LIST, n_tiles = _block_list(phase, NUM, IDX, FULL_NUM, FULL_IDX, SPARSE_Q, BLOCK_M)
        for j in tl.range(0, n_tiles):
            offs_m = _listed_start(LIST, j, SPARSE_Q, BLOCK_M) + offs_m_base
            q = _load_rows(Q, offs_m, stride_qm, offs_d, seqlen_q, HEAD_DIM, not EVEN_M)
            do = _load_rows(DO, offs_m, stride_dom, offs_dv, seqlen_q, HEAD_DIM_V, not EVEN_M)
            lse2, delta = _row_stats(LSE, DELTA, offs_m, seqlen_q)
            q_idx = _bounded(offs_m, seqlen_q, EVEN_M)[None, :]
            x, s, valid = _flex_scores(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION), sm_scale, b, h, q_idx,
                                       kv_idx, offs_m[None, :] < seqlen_q, cols[:, None] < seqlen_k, BUFS, SCORE_MOD,
                                       MASK_MOD, HAS_SCORE_MOD, phase == 0, not EVEN_M, not EVEN_N)
            p = tl.math.exp2(s - lse2[None, :])
            dv += tl.dot(p.to(do.dtype), do, input_precision=DOT_PRECISION)
            dp = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds = _flex_dscore(p, dp, delta[None, :], x, b, h, q_idx, kv_idx, valid, BUFS, GRADS, SCORE_GRAD,
                              HAS_SCORE_MOD, HAS_BUFFER_GRADS)
            dk += tl.dot(ds.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def _flex_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX, BUFS, GRADS,
    sm_scale, seqlen_q, seqlen_k, num_heads, num_kv_heads, group,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_lse_b, stride_lse_h, stride_nb, stride_nh, stride_nn, stride_ib, stride_ih, stride_in,
    SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr, HAS_SCORE_MOD: tl.constexpr,
    HAS_BUFFER_GRADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SPARSE_Q: tl.constexpr,
    SPARSE_KV: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dK and dV of BLOCK_N keys of one (batch, kv head), summed over the group's query heads."""
    pid_n, b, kv_head = _flex_coords(seqlen_k, num_kv_heads, BLOCK_N)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m_base = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    k = _load_rows(K + b64 * stride_kb + kv_head * stride_kh, offs_n, stride_kn, offs_d, seqlen_k, HEAD_DIM, True)
    v = _load_rows(V + b64 * stride_vb + kv_head * stride_vh, offs_n, stride_vn, offs_dv, seqlen_k, HEAD_DIM_V, True)
    kv_idx = _bounded(offs_n, seqlen_k, EVEN_N)[:, None]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    kv_block = start_n // SPARSE_KV
    for g in range(0, group):
        h = kv_head * group + g
        lse_off = b64 * stride_lse_b + h * stride_lse_h
        row, idx_row = _list_offsets(b, h, kv_block, stride_nb, stride_nh, stride_nn, stride_ib, stride_ih, stride_in)
        dk, dv = _flex_dkdv_inner(dk, dv, k, v, Q + b64 * stride_qb + h * stride_qh, DO + b64 * stride_dob
                                  + h * stride_doh, LSE + lse_off, DELTA + lse_off, Q_NUM + row, Q_IDX + idx_row,
                                  FULL_Q_NUM + row, FULL_Q_IDX + idx_row, b, h, offs_m_base, offs_n, kv_idx, offs_d,
                                  offs_dv, seqlen_q, seqlen_k, stride_qm, stride_dom, sm_scale, BUFS, GRADS,
                                  SCORE_MOD, SCORE_GRAD, MASK_MOD, HAS_SCORE_MOD, HAS_BUFFER_GRADS, HEAD_DIM,
                                  HEAD_DIM_V, BLOCK_M, SPARSE_Q, EVEN_M, EVEN_N, DOT_PRECISION)
    kv_ok = offs_n[:, None] < seqlen_k
    tl.store(DK + b64 * stride_dkb + kv_head * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_ok & (offs_d[None, :] < HEAD_DIM))
    tl.store(DV + b64 * stride_dvb + kv_head * stride_dvh + offs_n[:, None] * stride_dvn + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_ok & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _flex_dq_inner(dq, q, do, lse2, delta, K, V, NUM, IDX, FULL_NUM, FULL_IDX, b, h, offs_m, q_idx, offs_d,
                   offs_dv, seqlen_q, seqlen_k, stride_kn, stride_vn, sm_scale, BUFS,
                   SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
                   HAS_SCORE_MOD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPARSE_KV: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """dQ over the query block's two key-block lists (as the forward walks them); tiles are [BLOCK_M, BLOCK_N]."""
    offs_n = tl.arange(0, BLOCK_N)
    for phase in tl.static_range(2):
        LIST, n_tiles = _block_list(phase, NUM, IDX, FULL_NUM, FULL_IDX, SPARSE_KV, BLOCK_N)
        for j in tl.range(0, n_tiles):
            cols = _listed_start(LIST, j, SPARSE_KV, BLOCK_N) + offs_n
            k = _load_rows(K, cols, stride_kn, offs_d, seqlen_k, HEAD_DIM, not EVEN_N)
            v = _load_rows(V, cols, stride_vn, offs_dv, seqlen_k, HEAD_DIM_V, not EVEN_N)
            kv_idx = _bounded(cols, seqlen_k, EVEN_N)[None, :]
            x, s, valid = _flex_scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), sm_scale, b, h, q_idx,
                                       kv_idx, offs_m[:, None] < seqlen_q, cols[None, :] < seqlen_k, BUFS, SCORE_MOD,
                                       MASK_MOD, HAS_SCORE_MOD, phase == 0, not EVEN_M, not EVEN_N)
            p = tl.math.exp2(s - lse2[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            # the dK/dV kernel adds the captured tensors' gradients: every pair is visited once there
            ds = _flex_dscore(p, dp, delta[:, None], x, b, h, q_idx, kv_idx, valid, BUFS, BUFS, SCORE_GRAD,
                              HAS_SCORE_MOD, False)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def _flex_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, BUFS,
    sm_scale, seqlen_q, seqlen_k, num_heads, group,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm, stride_lse_b, stride_lse_h,
    stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im,
    SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr, HAS_SCORE_MOD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SPARSE_Q: tl.constexpr, SPARSE_KV: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dQ of BLOCK_M query rows of one (batch, head)."""
    b, h, kv_head, start_m, offs_m = _q_rows(seqlen_q, num_heads, group, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    q = _load_rows(Q + b64 * stride_qb + h * stride_qh, offs_m, stride_qm, offs_d, seqlen_q, HEAD_DIM, True)
    do = _load_rows(DO + b64 * stride_dob + h * stride_doh, offs_m, stride_dom, offs_dv, seqlen_q, HEAD_DIM_V, True)
    lse_off = b64 * stride_lse_b + h * stride_lse_h
    lse2, delta = _row_stats(LSE + lse_off, DELTA + lse_off, offs_m, seqlen_q)
    q_idx = _bounded(offs_m, seqlen_q, EVEN_M)[:, None]
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row, idx_row = _list_offsets(b, h, start_m // SPARSE_Q, stride_nb, stride_nh, stride_nm, stride_ib, stride_ih,
                                 stride_im)
    dq = _flex_dq_inner(dq, q, do, lse2, delta, K + b64 * stride_kb + kv_head * stride_kh,
                        V + b64 * stride_vb + kv_head * stride_vh, KV_NUM + row, KV_IDX + idx_row, FULL_NUM + row,
                        FULL_IDX + idx_row, b, h, offs_m, q_idx, offs_d, offs_dv, seqlen_q, seqlen_k,
                        stride_kn, stride_vn, sm_scale, BUFS, SCORE_MOD, SCORE_GRAD, MASK_MOD, HAS_SCORE_MOD,
                        HEAD_DIM, HEAD_DIM_V, BLOCK_N, SPARSE_KV, EVEN_M, EVEN_N, DOT_PRECISION)
    tl.store(DQ + b64 * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM))


# ((dK/dV BLOCK_M, BLOCK_N, warps, stages), (dQ BLOCK_M, BLOCK_N, warps, stages)) by (arch, head-dim
# bucket). The sm90 d = 128 row is scripts/tune_flex.py's winner on an H100 (summed over causal / document /
# softcap: 6.6 ms against 14.4 ms for 8-warp 32 x 64 dK/dV and 64 x 64 dQ). With a
# table-reading mod and its atomic gradient ptxas spills a few hundred bytes (tests/test_flex_sm90_compile.py
# bounds it); the measured time includes that.
FLEX_BWD_CONFIGS = {
    ("sm90", 64): ((32, 128, 4, 2), (128, 64, 4, 3)),
    ("sm90", 128): ((32, 64, 4, 3), (128, 64, 8, 3)),
    ("sm90", 256): ((32, 32, 4, 1), (64, 32, 4, 1)),
    ("default", 64): ((64, 64, 4, 2), (64, 64, 4, 2)),
    ("default", 128): ((64, 64, 4, 1), (64, 64, 4, 1)),
    ("default", 256): ((32, 32, 4, 1), (32, 32, 4, 1)),
    ("interpret", 0): ((16, 16, 4, 1), (16, 16, 4, 1)),
}


def flex_bwd_configs(arch: str, block_d: int) -> tuple:
    if arch == "interpret":
        return FLEX_BWD_CONFIGS[("interpret", 0)]
    bucket = 64 if block_d <= 64 else 128 if block_d <= 128 else 256
    return FLEX_BWD_CONFIGS.get((arch, bucket), FLEX_BWD_CONFIGS[("default", bucket)])
