"""Hopper (sm_90) attention backward, dK/dV half, warp-specialised, in Gluon (a prototype: unused).

The default Gluon dK/dV kernel (kernels/gluon_bwd.py) hides a step's exponentials inside one
warpgroup by keeping the next step's scores in flight, which costs registers: it can only afford
32 query rows per step, so its S^T / dP^T wgmmas are 64 x 32. This kernel gets the overlap from a
second warpgroup instead, FA3's way, and can afford 64-row steps (64 x 64 wgmmas):

    producer (1 warp)        K, V once; then Q / dO of every step into a NUM_BUFFERS-slot TMA ring
    consumer 0 (4 warps)     steps 0, 2, 4, ...   each: S^T, dP^T -> P^T, dS^T -> dV, dK products
    consumer 1 (4 warps)     steps 1, 3, 5, ...

While one consumer runs its exponentials the other's products keep the tensor cores busy. Both
consumers own the same BLOCK_N keys, so each sums a partial dK / dV over its half of the steps;
consumer 1 hands its partials to consumer 0 through the (then idle) Q / dO ring, and consumer 0
(the default partition) adds them and stores dK / dV once: still one writer per output, no atomics.

Per consumer and step s:
    wait ready[s]; issue S^T = K Q_s^T, dP^T = V dO_s^T; wait(0)  (also retires its step s-2 products)
    release slot s-2 to the producer (its last reader, the dV / dK products of s-2, just retired)
    P^T, dS^T into this consumer's shared buffers; issue dV += P^T dO_s, dK += dS^T Q_s (async)

Same scope and masking rules as kernels/gluon_bwd.py (bf16 / fp16, seqlen_q == seqlen_k, plain or
causal); its per-step helpers are reused.

Status (session 6): a prototype that nothing launches; it has never run on a GPU. What the sm_90
compile on CPU shows (tests/aot_gluon_bwd.py, kind "ws", maxnreg = LAUNCH_MAXNREG):
- Gluon's warp_specialize works on sm_90 here: the partitions rebalance registers with setmaxnreg
  (USETMAXREG in the SASS) and issue wgmma.
- 64-row steps, the point of the design, spill 76 bytes per consumer even at 240 registers. The
  column vectors of a 64-row step (lse, delta, indices: 16 registers each) are what tips it over.
  32-row steps compile without spills.
- ptxas reports "wgmma.mma_async instructions are serialized due to non wgmma instructions defining
  accumulator registers" (C7515). The cause is the per-step order, not warp specialisation: a
  plain (unspecialised) probe loop "issue S; wait; exponentials; issue dK += P^T Q" is serialised
  too, while the same loop rotated as the default kernel runs it ("issue S_next; exponentials of
  S; wait; issue dK") is not. The rotated order keeps S_next in registers, which is what made
  64-row steps spill in the default kernel. So the next try is either rotated consumers at 32-row
  steps (then the gain over the default kernel is only the second warpgroup's overlap), or a way
  to issue the next step's score products without holding them (e.g. two warpgroups sharing one
  64-row step, 32 keys each).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from flashtile.kernels.gluon_bwd import LOG2E, _issue_grads, _issue_scores, _load_q_do, operand_smem_layout
from flashtile.kernels.gluon_fwd import mma_layout

CONSUMER_WARPS = gl.constexpr(4)
# Registers per thread after the partitions rebalance (setmaxnreg): a consumer holds dK, dV (128),
# S^T, dP^T (64) and its columns' lse / delta / indices; the producer only addresses. The launch
# needs maxnreg = LAUNCH_MAXNREG so the pool covers 2 x 128 x 240 + 32 x 24 registers.
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
LAUNCH_MAXNREG = 216


@gluon.jit
def _producer(desc_q, desc_do, desc_k, desc_v, k_smem, v_smem, q_smem, do_smem, kv_ready, ready, empty, off_b, off_hk,
              n0, h0, m_start, steps_per_head, n_steps, NUM_BUFFERS: gl.constexpr, BLOCK_M: gl.constexpr):
    mbarrier.expect(kv_ready, desc_k.block_type.nbytes + desc_v.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_k, [off_b, n0, off_hk, 0], kv_ready, k_smem)
    tma.async_copy_global_to_shared(desc_v, [off_b, n0, off_hk, 0], kv_ready, v_smem)
    for t in range(n_steps):
        # slot t % NUM_BUFFERS was last used by step t - NUM_BUFFERS; its release is that slot's
        # ((t // NUM_BUFFERS) - 1)-th completion. On the first round the parity names the phase
        # before the barrier's first, which counts as complete, so the wait passes at once.
        mbarrier.wait(empty.index(t % NUM_BUFFERS), ((t // NUM_BUFFERS) & 1) ^ 1)
        _load_q_do(desc_q, desc_do, q_smem, do_smem, ready, t, off_b, h0, m_start, steps_per_head, NUM_BUFFERS,
                   BLOCK_M)


@gluon.jit
def _grads_of_step_lean(s_t, dp_t, p_buf, ds_buf, LSE, DELTA, step, off_b, h0, m_start, steps_per_head, key_idx,
                        seqlen, stride_lb, stride_lh, qk_scale, col_layout: gl.constexpr, dtype: gl.constexpr,
                        BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """kernels/gluon_bwd.py's _grads_of_step, ordered for fewer live registers at 64-row steps: P^T
    is stored before delta is loaded and dS^T computed."""
    head = h0 + step // steps_per_head
    q_idx = (m_start + step % steps_per_head) * BLOCK_M + gl.arange(0, BLOCK_M, col_layout)
    row_ok = q_idx < seqlen
    base = off_b * stride_lb + head * stride_lh
    lse2 = gl.load(LSE + base + q_idx, mask=row_ok, other=float("inf")) * LOG2E
    p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
    if CAUSAL:
        p_t = gl.where(gl.expand_dims(key_idx, 1) <= gl.expand_dims(q_idx, 0), p_t, 0.0)
    p_buf.store(p_t.to(dtype))
    delta = gl.load(DELTA + base + q_idx, mask=row_ok, other=0.0)
    ds_buf.store((p_t * (dp_t - gl.expand_dims(delta, 0))).to(dtype))
    fence_async_shared()


@gluon.jit
def _consumer_steps(k_smem, v_smem, q_smem, do_smem, p_buf, ds_buf, kv_ready, ready, empty, LSE, DELTA, off_b, h0,
                    m_start, steps_per_head, n_steps, n0, seqlen, stride_lb, stride_lh, qk_scale,
                    FIRST: gl.constexpr, dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr):
    """dK, dV (fp32, unscaled) summed over steps FIRST, FIRST + 2, ... of this CTA's keys."""
    st_layout: gl.constexpr = mma_layout(CONSUMER_WARPS, BLOCK_M, 16)  # S^T, dP^T: [BLOCK_N, BLOCK_M]
    acc_layout: gl.constexpr = mma_layout(CONSUMER_WARPS, HEAD_DIM, 16)  # dK, dV: [BLOCK_N, HEAD_DIM]
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    key_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
    key_idx = n0 + gl.arange(0, BLOCK_N, key_layout)
    k_tile = k_smem.reshape([BLOCK_N, HEAD_DIM])
    v_tile = v_smem.reshape([BLOCK_N, HEAD_DIM])
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
    mbarrier.wait(kv_ready, 0)
    for step in range(FIRST, n_steps, 2):
        s_t, dp_t = _issue_scores(k_tile, v_tile, q_smem, do_smem, ready, step, st_layout, NUM_BUFFERS, BLOCK_M,
                                  BLOCK_N, HEAD_DIM)
        dk, dv, s_t, dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, s_t, dp_t))
        if step >= 2:
            mbarrier.arrive(empty.index((step - 2) % NUM_BUFFERS))
        # this consumer's previous products, the last readers of p_buf / ds_buf, retired just above
        _grads_of_step_lean(s_t, dp_t, p_buf, ds_buf, LSE, DELTA, step, off_b, h0, m_start, steps_per_head, key_idx,
                            seqlen, stride_lb, stride_lh, qk_scale, col_layout, dtype, BLOCK_M, CAUSAL)
        dk, dv = _issue_grads(p_buf, ds_buf, dk, dv, q_smem, do_smem, step, NUM_BUFFERS, BLOCK_M, HEAD_DIM)
    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    return dk, dv


@gluon.jit
def _consumer0(k_smem, v_smem, q_smem, do_smem, p_buf, ds_buf, kv_ready, ready, empty, c0_done, LSE, DELTA, off_b,
               h0, m_start, steps_per_head, n_steps, n0, seqlen, stride_lb, stride_lh, qk_scale, dtype: gl.constexpr,
               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr,
               CAUSAL: gl.constexpr):
    dk, dv = _consumer_steps(k_smem, v_smem, q_smem, do_smem, p_buf, ds_buf, kv_ready, ready, empty, LSE, DELTA,
                             off_b, h0, m_start, steps_per_head, n_steps, n0, seqlen, stride_lb, stride_lh, qk_scale,
                             0, dtype, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL)
    # every product of this consumer has retired: the ring may now hold consumer 1's partials
    mbarrier.arrive(c0_done)
    return dk, dv


@gluon.jit
def _consumer1(k_smem, v_smem, q_smem, do_smem, p_buf, ds_buf, kv_ready, ready, empty, c0_done, part_dk, part_dv,
               LSE, DELTA, off_b, h0, m_start, steps_per_head, n_steps, n0, seqlen, stride_lb, stride_lh, qk_scale,
               dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr):
    dk, dv = _consumer_steps(k_smem, v_smem, q_smem, do_smem, p_buf, ds_buf, kv_ready, ready, empty, LSE, DELTA,
                             off_b, h0, m_start, steps_per_head, n_steps, n0, seqlen, stride_lb, stride_lh, qk_scale,
                             1, dtype, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL)
    # the ring is free once consumer 0 is done too (every load was consumed, so none is in flight)
    mbarrier.wait(c0_done, 0)
    part_dk.store(dk)
    part_dv.store(dv)


@gluon.jit
def _gluon_attn_bwd_dkdv_ws_kernel(desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv, LSE, DELTA, stride_lb,
                                   stride_lh, seqlen, n_kv_heads, heads_per_kv, qk_scale, grad_scale,
                                   HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                   NUM_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr):
    """dK, dV (b, s, h_k, d): the arguments of kernels/gluon_bwd.py's kernel, launched with
    num_warps = 4 (consumer 0); consumer 1 and the producer run in extra warps."""
    gl.static_assert(gl.num_warps() == CONSUMER_WARPS)
    # consumer 1's fp32 partials go where its Q / dO slots were: each ring must hold one [BLOCK_N, d]
    gl.static_assert(NUM_BUFFERS * BLOCK_M >= 2 * BLOCK_N)
    acc_layout: gl.constexpr = mma_layout(CONSUMER_WARPS, HEAD_DIM, 16)
    dtype: gl.constexpr = desc_q.dtype

    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    off_b = pid_bh // n_kv_heads
    off_hk = pid_bh % n_kv_heads
    n0 = pid_n * BLOCK_N
    h0 = off_hk * heads_per_kv
    m_start = 0
    if CAUSAL:
        m_start = n0 // BLOCK_M
    steps_per_head = gl.cdiv(seqlen, BLOCK_M) - m_start
    n_steps = steps_per_head * heads_per_kv

    k_smem = gl.allocate_shared_memory(dtype, desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, desc_v.block_type.shape, desc_v.layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + desc_q.block_type.shape, desc_q.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + desc_do.block_type.shape, desc_do.layout)
    ps_layout: gl.constexpr = operand_smem_layout(BLOCK_N, BLOCK_M, dtype)
    # one P^T and one dS^T buffer per consumer (index 0: consumer 0)
    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ps_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ps_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    c0_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(c0_done, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()

    partial_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    rows: gl.constexpr = NUM_BUFFERS * BLOCK_M // 2  # fp32 rows of d values in one ring
    part_dk = q_smem._reinterpret(gl.float32, [rows, HEAD_DIM], partial_layout).slice(0, BLOCK_N)
    part_dv = do_smem._reinterpret(gl.float32, [rows, HEAD_DIM], partial_layout).slice(0, BLOCK_N)

    dk, dv = gl.warp_specialize([
        (_consumer0, (k_smem, v_smem, q_smem, do_smem, p_smem.index(0), ds_smem.index(0), kv_ready, ready, empty,
                      c0_done, LSE, DELTA, off_b, h0, m_start, steps_per_head, n_steps, n0, seqlen, stride_lb,
                      stride_lh, qk_scale, dtype, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL)),
        (_consumer1, (k_smem, v_smem, q_smem, do_smem, p_smem.index(1), ds_smem.index(1), kv_ready, ready, empty,
                      c0_done, part_dk, part_dv, LSE, DELTA, off_b, h0, m_start, steps_per_head, n_steps, n0, seqlen,
                      stride_lb, stride_lh, qk_scale, dtype, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL)),
        (_producer, (desc_q, desc_do, desc_k, desc_v, k_smem, v_smem, q_smem, do_smem, kv_ready, ready, empty, off_b,
                     off_hk, n0, h0, m_start, steps_per_head, n_steps, NUM_BUFFERS, BLOCK_M)),
    ], [CONSUMER_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])
    # the partitions have joined: consumer 1's partials are in shared memory
    dk += part_dk.load(acc_layout)
    dv += part_dv.load(acc_layout)

    mbarrier.invalidate(kv_ready)
    mbarrier.invalidate(c0_done)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    k_tile = k_smem.reshape([BLOCK_N, HEAD_DIM])
    v_tile = v_smem.reshape([BLOCK_N, HEAD_DIM])
    k_tile.store((dk * grad_scale).to(dtype))
    v_tile.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_dk, [off_b, n0, off_hk, 0], k_smem)
    tma.async_copy_shared_to_global(desc_dv, [off_b, n0, off_hk, 0], v_smem)
    tma.store_wait(pendings=0)
