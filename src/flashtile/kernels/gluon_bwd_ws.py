"""Hopper (sm_90) attention backward, dK/dV half, warp-specialised, in Gluon (experimental, opt-in).

The default Gluon dK/dV kernel (kernels/gluon_bwd.py) hides a step's exponentials inside one
warpgroup by keeping the next step's scores in flight. This kernel adds FA3's roles: a producer
warp issues every TMA load, and two consumer warpgroups share one CTA's keys, so one's
exponentials can also run under the other's products:

    producer (1 warp)        K, V once; then Q / dO of every step into a NUM_BUFFERS-slot TMA ring
    consumer 0 (4 warps)     steps 0, 2, 4, ...   each: S^T, dP^T -> P^T, dS^T -> dV, dK products
    consumer 1 (4 warps)     steps 1, 3, 5, ...

While one consumer runs its exponentials the other's products keep the tensor cores busy. Both
consumers own the same BLOCK_N keys, so each sums a partial dK / dV over its half of the steps;
consumer 1 hands its partials to consumer 0 through the (then idle) Q / dO ring, and consumer 0
(the default partition) adds them and stores dK / dV once: still one writer per output, no atomics.

Per consumer, at its step s (the default kernel's rotated order):
    issue S^T, dP^T of its step s + 2; P^T, dS^T of step s into its buffers (s / 2) % 2
    wait(0) (its step s - 2 products and the step s + 2 scores); release slot s - 2 to the producer
    issue dV += P^T dO_s, dK += dS^T Q_s (async, retired at its next wait)

Same scope and masking rules as kernels/gluon_bwd.py (bf16 / fp16, seqlen_q == seqlen_k, plain or
causal); its per-step helpers are reused.

Status (session 6): compiled for sm_90 on the CPU only; never run on a GPU. The route never picks
it: a caller (tests, scripts/tune_gluon_bwd.py) asks for it with the config key WARP_SPECIALIZED.
What the compile shows (tests/test_gluon_bwd_compile.py checks it like the default kernel):
- Gluon's warp_specialize works on sm_90 here: the partitions rebalance registers with setmaxnreg
  (USETMAXREG in the SASS) and issue wgmma. With 32-row steps and an 8-slot ring: no spills, no
  serialised wgmma, a step's exponentials under in-flight wgmmas, 193 KiB of shared memory.
- 64-row steps in the unrotated order ("issue S; wait; exponentials; issue dK") spilled (76 bytes at
  240 registers) and ptxas serialised the wgmmas (C7515). A plain, unspecialised probe loop in that
  order is serialised too, while the rotated order below is not; the rotated order keeps the next
  scores in registers, so steps stay at 32 rows. The gain over the default kernel to measure is
  the producer warp and the second warpgroup's overlap, not wider steps.
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
# needs maxnreg = LAUNCH_MAXNREG so the pool (288 threads x 224) covers 2 x 128 x 248 + 32 x 24.
CONSUMER_REGS = gl.constexpr(248)
PRODUCER_REGS = gl.constexpr(24)
LAUNCH_MAXNREG = 224


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
def _consumer_steps(k_smem, v_smem, q_smem, do_smem, p_bufs, ds_bufs, kv_ready, ready, empty, LSE, DELTA, off_b, h0,
                    m_start, steps_per_head, n_steps, n0, seqlen, stride_lb, stride_lh, qk_scale,
                    FIRST: gl.constexpr, dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr):
    """dK, dV (fp32, unscaled) summed over steps FIRST, FIRST + 2, ... of this CTA's keys, in the
    default kernel's rotated order (its next step's scores in flight under this step's
    exponentials; the unrotated order made ptxas serialise the wgmmas)."""
    st_layout: gl.constexpr = mma_layout(CONSUMER_WARPS, BLOCK_M, 16)  # S^T, dP^T: [BLOCK_N, BLOCK_M]
    acc_layout: gl.constexpr = mma_layout(CONSUMER_WARPS, HEAD_DIM, 16)  # dK, dV: [BLOCK_N, HEAD_DIM]
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    key_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
    key_idx = n0 + gl.arange(0, BLOCK_N, key_layout)
    k_tile = k_smem.reshape([BLOCK_N, HEAD_DIM])
    v_tile = v_smem.reshape([BLOCK_N, HEAD_DIM])
    n_own = (n_steps - FIRST + 1) // 2  # this consumer's steps: FIRST + 2 i for i < n_own
    mbarrier.wait(kv_ready, 0)
    if n_own > 0:
        dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
        dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
        s_t, dp_t = _issue_scores(k_tile, v_tile, q_smem, do_smem, ready, FIRST, st_layout, NUM_BUFFERS, BLOCK_M,
                                  BLOCK_N, HEAD_DIM)
        s_t, dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, dp_t))
        for i in range(0, n_own - 1):
            step = FIRST + 2 * i
            s_next, dp_next = _issue_scores(k_tile, v_tile, q_smem, do_smem, ready, step + 2, st_layout, NUM_BUFFERS,
                                            BLOCK_M, BLOCK_N, HEAD_DIM)
            # buffers i % 2 were last read by step - 4's products, retired by the previous wait
            _grads_of_step_lean(s_t, dp_t, p_bufs.index(i % 2), ds_bufs.index(i % 2), LSE, DELTA, step, off_b, h0,
                                m_start, steps_per_head, key_idx, seqlen, stride_lb, stride_lh, qk_scale, col_layout,
                                dtype, BLOCK_M, CAUSAL)
            dk, dv, s_t, dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, s_next, dp_next))
            if i > 0:  # step - 2's products, the last readers of its slot, just retired
                mbarrier.arrive(empty.index((step - 2) % NUM_BUFFERS))
            dk, dv = _issue_grads(p_bufs.index(i % 2), ds_bufs.index(i % 2), dk, dv, q_smem, do_smem, step,
                                  NUM_BUFFERS, BLOCK_M, HEAD_DIM)
        last_i = n_own - 1
        last = FIRST + 2 * last_i
        _grads_of_step_lean(s_t, dp_t, p_bufs.index(last_i % 2), ds_bufs.index(last_i % 2), LSE, DELTA, last, off_b,
                            h0, m_start, steps_per_head, key_idx, seqlen, stride_lb, stride_lh, qk_scale, col_layout,
                            dtype, BLOCK_M, CAUSAL)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        dk, dv = _issue_grads(p_bufs.index(last_i % 2), ds_bufs.index(last_i % 2), dk, dv, q_smem, do_smem, last,
                              NUM_BUFFERS, BLOCK_M, HEAD_DIM)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    else:  # a one-step CTA leaves consumer 1 nothing to do
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    return dk, dv


@gluon.jit
def _consumer0(k_smem, v_smem, q_smem, do_smem, p_bufs, ds_bufs, kv_ready, ready, empty, c0_done, LSE, DELTA, off_b,
               h0, m_start, steps_per_head, n_steps, n0, seqlen, stride_lb, stride_lh, qk_scale, dtype: gl.constexpr,
               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr,
               CAUSAL: gl.constexpr):
    dk, dv = _consumer_steps(k_smem, v_smem, q_smem, do_smem, p_bufs, ds_bufs, kv_ready, ready, empty, LSE, DELTA,
                             off_b, h0, m_start, steps_per_head, n_steps, n0, seqlen, stride_lb, stride_lh, qk_scale,
                             0, dtype, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL)
    # every product of this consumer has retired: the ring may now hold consumer 1's partials
    mbarrier.arrive(c0_done)
    return dk, dv


@gluon.jit
def _consumer1(k_smem, v_smem, q_smem, do_smem, p_bufs, ds_bufs, kv_ready, ready, empty, c0_done, c1_done, part_dk,
               part_dv,
               LSE, DELTA, off_b, h0, m_start, steps_per_head, n_steps, n0, seqlen, stride_lb, stride_lh, qk_scale,
               dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr):
    dk, dv = _consumer_steps(k_smem, v_smem, q_smem, do_smem, p_bufs, ds_bufs, kv_ready, ready, empty, LSE, DELTA,
                             off_b, h0, m_start, steps_per_head, n_steps, n0, seqlen, stride_lb, stride_lh, qk_scale,
                             1, dtype, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL)
    # the ring is free once consumer 0 is done too (every load was consumed, so none is in flight)
    mbarrier.wait(c0_done, 0)
    part_dk.store(dk)
    part_dv.store(dv)
    # the arrive releases these stores to consumer 0, which waits on c1_done before reading them
    mbarrier.arrive(c1_done)


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
    # a consumer issues step s + 2's scores before releasing step s - 2's slot: the slot step s + 2
    # reuses must not wait on that release (NUM_BUFFERS = 4 would deadlock)
    gl.static_assert(NUM_BUFFERS >= 5)
    # (and a power of two: shared-memory shapes must be, and the ring is reinterpreted as a whole)
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
    # two P^T and two dS^T buffers per consumer, alternating by its steps
    p_smem0 = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ps_layout)
    ds_smem0 = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ps_layout)
    p_smem1 = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ps_layout)
    ds_smem1 = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ps_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    c0_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    c1_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(c0_done, count=1)
    mbarrier.init(c1_done, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()

    partial_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    rows: gl.constexpr = NUM_BUFFERS * BLOCK_M // 2  # the ring seen as fp32 rows of d values
    part_dk = q_smem._reinterpret(gl.float32, [rows, HEAD_DIM], partial_layout).slice(0, BLOCK_N)
    part_dv = do_smem._reinterpret(gl.float32, [rows, HEAD_DIM], partial_layout).slice(0, BLOCK_N)

    dk, dv = gl.warp_specialize([
        (_consumer0, (k_smem, v_smem, q_smem, do_smem, p_smem0, ds_smem0, kv_ready, ready, empty,
                      c0_done, LSE, DELTA, off_b, h0, m_start, steps_per_head, n_steps, n0, seqlen, stride_lb,
                      stride_lh, qk_scale, dtype, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL)),
        (_consumer1, (k_smem, v_smem, q_smem, do_smem, p_smem1, ds_smem1, kv_ready, ready, empty,
                      c0_done, c1_done, part_dk, part_dv, LSE, DELTA, off_b, h0, m_start, steps_per_head, n_steps, n0, seqlen,
                      stride_lb, stride_lh, qk_scale, dtype, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL)),
        (_producer, (desc_q, desc_do, desc_k, desc_v, k_smem, v_smem, q_smem, do_smem, kv_ready, ready, empty, off_b,
                     off_hk, n0, h0, m_start, steps_per_head, n_steps, NUM_BUFFERS, BLOCK_M)),
    ], [CONSUMER_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])
    # consumer 1's partials are in shared memory once it has arrived (no reliance on the join's sync)
    mbarrier.wait(c1_done, 0)
    dk += part_dk.load(acc_layout)
    dv += part_dv.load(acc_layout)

    mbarrier.invalidate(kv_ready)
    mbarrier.invalidate(c0_done)
    mbarrier.invalidate(c1_done)
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


# (BLOCK_M, BLOCK_N, NUM_BUFFERS, num_warps) per head dim, num_warps being consumer 0's (the launch's)
WS_CONFIGS = {
    64: dict(BLOCK_M=32, BLOCK_N=64, NUM_BUFFERS=8, num_warps=4),
    128: dict(BLOCK_M=32, BLOCK_N=64, NUM_BUFFERS=8, num_warps=4),
}
