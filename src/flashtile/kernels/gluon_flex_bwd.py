"""Hopper (sm_90) dK/dV of programmable attention (flashtile.flex) in Gluon: the plain order of the Gluon dK/dV
kernel (kernels/gluon_bwd.py) walking a block mask's query lists, with the generated mods in the score tile.

One CTA (one warpgroup) owns BLOCK_N keys of one (batch, kv head). For each query head of the group it walks the
key block's transposed lists (partly visible query blocks, mask_mod per element; then fully visible ones), each
sparse block in SPARSE_Q // BLOCK_M steps of BLOCK_M query rows whose Q and dO tiles stream through a TMA ring.
A step, every product waited for inside it (the overlap comes from the SM's second CTA, as the plain Gluon
kernel's d = 128 config):

    issue S^T = K Q^T, dP^T = V dO^T; wait
    x = scale * S^T; s = score_mod(x) (mask_mod, sequence ends); P^T = exp2(s - lse); dS^T = P^T (dP^T - delta)
      carried through score_mod's derivative (SCORE_GRAD, which also adds captured tensors' gradients)
    P^T, dS^T -> shared memory; issue dV += P^T dO, dK += dS^T Q; wait; TMA Q / dO of a later step

The score helpers are the Triton flex kernels' own (kernels/flex_common.py, kernels/flex_bwd.py): ``tl``
element-wise code runs on the wgmma-layout tiles unchanged. The dQ half stays the Triton flex kernel, except in the
FUSED_DQ build, which adds each step's dQ^T = K^T dS^T into an fp32 buffer by TMA reduce-add as the plain Gluon
kernel's fused build does (kernels/gluon_bwd.py, docs/backward.md).

Layout: q, k, v, dout, dk, dv (b, h, s, d) with a unit last stride, through tensor descriptors whose boxes are one
(batch, head)'s rows; lse and delta (b, h, sq) fp32 (lse natural log, +inf on rows that see no key).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma_wait,
)

from flashtile.kernels.flex_bwd import _flex_dscore
from flashtile.kernels.flex_common import _bounded, _flex_scores
from flashtile.kernels.gluon_bwd import (
    _barriers,
    _invalidate,
    _issue_grads,
    _issue_scores,
    _load_pair,
    _reduce_dq,
    operand_smem_layout,
)
from flashtile.kernels.gluon_flex_fwd import _tile_start
from flashtile.kernels.gluon_fwd import mma_layout

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _load_q_do(desc_q, desc_do, q_smem, do_smem, ready, t, b, h, m0, NUM_BUFFERS: gl.constexpr):
    slot = t % NUM_BUFFERS
    _load_pair(desc_q, desc_do, q_smem.index(slot), do_smem.index(slot), ready.index(slot), b, h, m0)


@gluon.jit
def _flex_dkdv_step(t, m0, dk, dv, k_tile, v_tile, q_smem, do_smem, p_smem, ds_smem, ready, LSE, DELTA, b, h,
                    kv_idx, kv_in, seqlen_q, sm_scale, BUFS, GRADS, st_layout: gl.constexpr,
                    SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr,
                    HAS_SCORE_MOD: gl.constexpr, HAS_BUFFER_GRADS: gl.constexpr, APPLY_MASK: gl.constexpr,
                    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    NUM_BUFFERS: gl.constexpr, EVEN_M: gl.constexpr, EVEN_N: gl.constexpr, k_rows=None,
                    desc_dq=None, dq_smem=None, FUSED_DQ: gl.constexpr = False):
    """One step over the query rows [m0, m0 + BLOCK_M) of head h, whose tiles sit in ring slot t % NUM_BUFFERS.
    Returns dK and dV with the step's products added (waited for). FUSED_DQ: the step's dQ rows, sm_scale * dS K,
    are added into desc_dq (k_rows: K^T in shared memory; dq_smem: the reduce-add's staging tile)."""
    s_t, dp_t = _issue_scores(k_tile, v_tile, q_smem, do_smem, ready, t, st_layout, NUM_BUFFERS, BLOCK_N, BLOCK_M,
                              HEAD_DIM, HEAD_DIM)
    # the rows' lse loads while the products run; delta after P is stored (fewer live registers: every column
    # vector of the transposed tile is spread over a thread's columns)
    rows = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(0, st_layout))
    row_ok = rows < seqlen_q
    lse2 = gl.load(LSE + rows, mask=row_ok, other=float("inf")) * LOG2E
    q_idx = gl.expand_dims(_bounded(rows, seqlen_q, EVEN_M), 0)
    s_t, dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, dp_t))
    x, s, valid = _flex_scores(s_t, sm_scale, b, h, q_idx, kv_idx, gl.expand_dims(row_ok, 0), kv_in, BUFS,
                               SCORE_MOD, MASK_MOD, HAS_SCORE_MOD, APPLY_MASK, not EVEN_M, not EVEN_N)
    p_t = gl.exp2(s - gl.expand_dims(lse2, 0))
    p_smem.store(p_t.to(p_smem.dtype))
    delta = gl.load(DELTA + rows, mask=row_ok, other=0.0)
    ds_t = _flex_dscore(p_t, dp_t, gl.expand_dims(delta, 0), x, b, h, q_idx, kv_idx, valid, BUFS, GRADS,
                        SCORE_GRAD, HAS_SCORE_MOD, HAS_BUFFER_GRADS)
    ds_smem.store(ds_t.to(ds_smem.dtype))
    # generic-proxy writes must be visible to wgmma (async proxy) before it reads them
    fence_async_shared()
    if FUSED_DQ:
        dk, dv = _reduce_dq(k_rows, ds_smem, p_smem, dk, dv, q_smem, do_smem, t, desc_dq, dq_smem, [b, h, m0, 0],
                            sm_scale, st_layout, NUM_BUFFERS, BLOCK_M, HEAD_DIM, HEAD_DIM)
    else:
        dk, dv = _issue_grads(p_smem, ds_smem, dk, dv, q_smem, do_smem, t, NUM_BUFFERS, BLOCK_M, HEAD_DIM, HEAD_DIM)
    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    return dk, dv


@gluon.jit
def _gluon_flex_bwd_dkdv_kernel(desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv, LSE, DELTA, Q_NUM, Q_IDX,
                                FULL_Q_NUM, FULL_Q_IDX, BUFS, GRADS, sm_scale, seqlen_q, seqlen_k, num_kv_heads, group,
                                stride_lse_b, stride_lse_h, stride_nb, stride_nh, stride_nn, stride_ib, stride_ih,
                                stride_in, desc_dq, SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr,
                                MASK_MOD: gl.constexpr, HAS_SCORE_MOD: gl.constexpr,
                                HAS_BUFFER_GRADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                                BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, SPARSE_Q: gl.constexpr,
                                SPARSE_KV: gl.constexpr, EVEN_M: gl.constexpr, EVEN_N: gl.constexpr,
                                FUSED_DQ: gl.constexpr = False):
    """dK (times sm_scale) and dV of BLOCK_N keys of one (batch, kv head), summed over the group's query heads:
    grid (cdiv(seqlen_k, BLOCK_N), batch * kv heads). q / k / v / dout share HEAD_DIM (a power of two). The
    transposed block-mask tensors (Q_NUM (b, h, nk), Q_IDX (b, h, nk, nq), FULL_Q_*) come expanded to (b, h);
    BLOCK_M divides SPARSE_Q, BLOCK_N divides SPARSE_KV. EVEN_M: the queries a multiple of SPARSE_Q; EVEN_N: the
    keys a multiple of BLOCK_N. GRADS: fp32 tensors the captured ones' gradients are added to (HAS_BUFFER_GRADS).
    FUSED_DQ: dQ (sm_scale * dS K, fp32) is added into desc_dq, a (b, h, sq, d) buffer of zeros, by TMA reduce-add
    (no dQ kernel follows; the adds' order varies run to run); else desc_dq goes unread."""
    gl.static_assert(NUM_BUFFERS >= 2)
    gl.static_assert(SPARSE_Q % BLOCK_M == 0)
    gl.static_assert(SPARSE_KV % BLOCK_N == 0)
    SUBS: gl.constexpr = SPARSE_Q // BLOCK_M
    NUM_WARPS: gl.constexpr = gl.num_warps()
    st_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_M, 16)  # S^T, dP^T: [BLOCK_N, BLOCK_M]
    acc_layout: gl.constexpr = mma_layout(NUM_WARPS, HEAD_DIM, 16)  # dK, dV: [BLOCK_N, HEAD_DIM]
    dtype: gl.constexpr = desc_q.dtype

    pid_n = gl.program_id(0)
    bkv = gl.program_id(1)
    b = bkv // num_kv_heads
    kv_head = bkv % num_kv_heads
    n0 = pid_n * BLOCK_N
    kv_block = n0 // SPARSE_KV

    k_smem = gl.allocate_shared_memory(dtype, desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, desc_v.block_type.shape, desc_v.layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + desc_q.block_type.shape, desc_q.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + desc_do.block_type.shape, desc_do.layout)
    ps_layout: gl.constexpr = operand_smem_layout(BLOCK_N, BLOCK_M, dtype)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ps_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ps_layout)
    kv_ready, ready = _barriers(NUM_BUFFERS)
    # _load_pair's coordinate is (batch, row, head, 0): here (b, kv_head, n0, 0) on (b, h, s, d) tensors
    _load_pair(desc_k, desc_v, k_smem, v_smem, kv_ready, b, kv_head, n0)
    k_tile = k_smem.reshape([BLOCK_N, HEAD_DIM])
    v_tile = v_smem.reshape([BLOCK_N, HEAD_DIM])
    k_rows = k_tile
    dq_smem = k_smem
    if FUSED_DQ:
        dq_smem = gl.allocate_shared_memory(gl.float32, desc_dq.block_type.shape, desc_dq.layout)
        k_rows = k_tile.permute((1, 0))

    cols = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, st_layout))
    kv_idx = gl.expand_dims(_bounded(cols, seqlen_k, EVEN_N), 1)
    kv_in = gl.expand_dims(cols < seqlen_k, 1)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_ready, 0)

    # t0: the steps of the heads before this one (ring slots and phases count on across heads)
    t0 = 0
    for g in range(0, group):
        h = kv_head * group + g
        count = b * stride_nb + h * stride_nh + kv_block * stride_nn
        lists = b * stride_ib + h * stride_ih + kv_block * stride_in
        IDX = Q_IDX + lists
        FULL = FULL_Q_IDX + lists
        n_part = gl.load(Q_NUM + count) * SUBS
        n_steps = n_part + gl.load(FULL_Q_NUM + count) * SUBS
        stats = b * stride_lse_b + h * stride_lse_h
        # the head's first steps into the ring (every slot is free: each earlier step waited for its products)
        for first in gl.static_range(NUM_BUFFERS):
            if first < n_steps:
                m = _tile_start(IDX, FULL, n_part, n_steps, first, SUBS, BLOCK_M, SPARSE_Q)
                _load_q_do(desc_q, desc_do, q_smem, do_smem, ready, t0 + first, b, h, m, NUM_BUFFERS)
        m0 = _tile_start(IDX, FULL, n_part, n_steps, 0, SUBS, BLOCK_M, SPARSE_Q)
        for j in range(0, n_steps):
            # the next row starts and the refill's, read while this step's products run
            m_next = _tile_start(IDX, FULL, n_part, n_steps, j + 1, SUBS, BLOCK_M, SPARSE_Q)
            m_ahead = _tile_start(IDX, FULL, n_part, n_steps, j + NUM_BUFFERS, SUBS, BLOCK_M, SPARSE_Q)
            if j < n_part:
                dk, dv = _flex_dkdv_step(t0 + j, m0, dk, dv, k_tile, v_tile, q_smem, do_smem, p_smem, ds_smem, ready,
                                         LSE + stats, DELTA + stats, b, h, kv_idx, kv_in, seqlen_q, sm_scale, BUFS,
                                         GRADS, st_layout, SCORE_MOD, SCORE_GRAD, MASK_MOD, HAS_SCORE_MOD,
                                         HAS_BUFFER_GRADS, True, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUFFERS, EVEN_M,
                                         EVEN_N, k_rows, desc_dq, dq_smem, FUSED_DQ)
            else:
                dk, dv = _flex_dkdv_step(t0 + j, m0, dk, dv, k_tile, v_tile, q_smem, do_smem, p_smem, ds_smem, ready,
                                         LSE + stats, DELTA + stats, b, h, kv_idx, kv_in, seqlen_q, sm_scale, BUFS,
                                         GRADS, st_layout, SCORE_MOD, SCORE_GRAD, MASK_MOD, HAS_SCORE_MOD,
                                         HAS_BUFFER_GRADS, False, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUFFERS, EVEN_M,
                                         EVEN_N, k_rows, desc_dq, dq_smem, FUSED_DQ)
            # the step's slot is free (its four products retired): the step NUM_BUFFERS ahead takes it
            if j + NUM_BUFFERS < n_steps:
                _load_q_do(desc_q, desc_do, q_smem, do_smem, ready, t0 + j + NUM_BUFFERS, b, h, m_ahead,
                           NUM_BUFFERS)
            m0 = m_next
        t0 = t0 + n_steps

    _invalidate(kv_ready, ready, NUM_BUFFERS)
    if FUSED_DQ:
        tma.store_wait(pendings=0)  # the last reduce-add has read its staging tile
    # K and V are dead (every wgmma reading them retired): stage dK and dV there for the TMA stores, which also
    # clip the key rows past the sequence
    k_tile.store((dk * sm_scale).to(dtype))
    v_tile.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_dk, [b, kv_head, n0, 0], k_smem)
    tma.async_copy_shared_to_global(desc_dv, [b, kv_head, n0, 0], v_smem)
    tma.store_wait(pendings=0)


# (BLOCK_M, BLOCK_N, NUM_BUFFERS, num_warps) by head dim: 32 query rows a step beside 64 keys on one warpgroup (two
# CTAs an SM by registers). 64-row steps spill 200-860 bytes with the tests' mods (every column vector of the
# transposed tile is spread over a thread's columns); 32-row ones spill none with a mask, 16-64 bytes with a softcap
# or the learned table (tests/test_gluon_flex_compile.py bounds them). Not yet timed.
GLUON_FLEX_BWD_CONFIGS = {
    128: (32, 64, 3, 4),
}
