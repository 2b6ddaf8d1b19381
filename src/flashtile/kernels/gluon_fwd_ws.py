"""Hopper (sm_90) attention forward in Gluon with warp specialisation (an experiment, session 22; launcher:
``gluon_attn_fwd(..., warp_specialized=True)`` in backends/triton/gluon_fwd.py, not routed by default).

The default Gluon kernel (kernels/gluon_fwd.py) has its two warpgroups do everything: each issues its own
wgmmas, and one thread issues the TMA refills. Triton then puts a CTA-wide barrier before every refill and every
mbarrier wait, so the two warpgroups march in lockstep: both run their softmax at the same time, and the tensor
cores idle while they do. FlashAttention-3 splits the CTA by role instead. Here:

- a loader partition (one warp, 24 registers) issues every TMA copy: the two 64-row Q halves, then the K / V
  ring, refilling a slot once both consumers have released it (an "empty" mbarrier per slot and consumer);
- two consumer partitions (a warpgroup each, 240 registers) each own 64 query rows of the CTA's 128. Each runs
  the default kernel's pipeline (S_{j+1} issued before the softmax of S_j, PV_j in flight across the loop's back
  edge), and releases a block's slot after the wgmma wait that retires both of its products.

A consumer syncs only its own warps, never the other warpgroup's. So one consumer's softmax can run under the
other's wgmmas, as the warp schedulers interleave them. There is no explicit ping-pong ordering: FA3's named
barriers would force it.

Coverage as the default kernel's 16-bit path: bf16 / fp16, d = 64 / 128, plain or causal, seqlen_q == seqlen_k,
128 query rows a CTA.
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

from flashtile.kernels.gluon_fwd import (
    _issue_qk,
    _load_kv,
    _rescale_and_issue_pv,
    _softmax_step,
    mma_layout,
)


@gluon.jit
def _tile(seqlen, n_heads, heads_per_kv, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """This CTA's (batch, head, kv head, first query row); causal grids start with the longest tiles."""
    n_m_blocks = gl.cdiv(seqlen, BLOCK_M)
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = n_m_blocks - 1 - pid_m
    pid_bh = gl.program_id(1)
    off_h = pid_bh % n_heads
    return pid_bh // n_heads, off_h, off_h // heads_per_kv, pid_m * BLOCK_M


@gluon.jit
def _blocks(seqlen, m0, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Key blocks rows [m0, m0 + BLOCK_M) attend, and how many of them need no mask."""
    if CAUSAL:
        n_blocks = gl.cdiv(gl.minimum(seqlen, m0 + BLOCK_M), BLOCK_N)
        n_unmasked = gl.minimum((m0 + 1) // BLOCK_N, seqlen // BLOCK_N)
    else:
        n_blocks = gl.cdiv(seqlen, BLOCK_N)
        n_unmasked = seqlen // BLOCK_N
    return n_blocks, n_unmasked


@gluon.jit
def _loader(desc_q, desc_k, desc_v, desc_o, LSE, stride_lb, stride_lh, seqlen, n_heads, heads_per_kv, qk_scale,
            q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, empty, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
            NUM_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr):
    """Every TMA load of the CTA: Q, then the K / V ring. Block i reuses block i - NUM_BUFFERS's slot once the
    consumer released it."""
    BLOCK_M: gl.constexpr = desc_q.block_type.shape[1]
    off_b, off_h, off_hk, m0 = _tile(seqlen, n_heads, heads_per_kv, BLOCK_M, CAUSAL)
    mbarrier.expect(q_ready, desc_q.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_q, [off_b, m0, off_h, 0], q_ready, q_smem)
    n_blocks, _ = _blocks(seqlen, m0, BLOCK_M, BLOCK_N, CAUSAL)
    for i in range(0, n_blocks):
        if i >= NUM_BUFFERS:
            # the release of block i - NUM_BUFFERS: the slot's (i // NUM_BUFFERS - 1)-th
            mbarrier.wait(empty.index(i % NUM_BUFFERS), (i // NUM_BUFFERS - 1) & 1)
        _load_kv(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, i, off_b, off_hk, NUM_BUFFERS, BLOCK_N, False)


@gluon.jit
def _consumer(desc_q, desc_k, desc_v, desc_o, LSE, stride_lb, stride_lh, seqlen, n_heads, heads_per_kv, qk_scale,
              q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, empty, HEAD_DIM: gl.constexpr,
              BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr):
    """The CTA's 64 query rows: the default kernel's pipeline on one warpgroup, with each block's slot released
    (``empty``) instead of refilled."""
    gl.static_assert(NUM_BUFFERS >= 3)
    BLOCK_M: gl.constexpr = desc_q.block_type.shape[1]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_N, 16)
    o_layout: gl.constexpr = mma_layout(NUM_WARPS, HEAD_DIM, 16)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    off_b, off_h, off_hk, m0 = _tile(seqlen, n_heads, heads_per_kv, BLOCK_M, CAUSAL)
    n_blocks, n_unmasked = _blocks(seqlen, m0, BLOCK_M, BLOCK_N, CAUSAL)

    q_tile = q_smem.reshape([BLOCK_M, HEAD_DIM])
    mbarrier.wait(q_ready, 0)
    row_idx = m0 + gl.arange(0, BLOCK_M, row_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    o = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout))
    p = gl.zeros([BLOCK_M, BLOCK_N], desc_v.dtype, p_layout)

    s = _issue_qk(q_tile, k_smem, k_ready, 0, s_layout, NUM_BUFFERS, BLOCK_M, BLOCK_N, HEAD_DIM)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    n_steady = n_blocks - 1
    n_fast = gl.minimum(n_unmasked, n_steady)
    for j in range(0, n_fast):
        s, o, p, m_i, l_i = _step(j, s, o, p, m_i, l_i, q_tile, k_smem, v_smem, k_ready, v_ready, empty, n_blocks,
                                  row_idx, seqlen, qk_scale, s_layout, o_layout, p_layout, HEAD_DIM, BLOCK_N,
                                  NUM_BUFFERS, CAUSAL, False)
    for j in range(n_fast, n_steady):
        s, o, p, m_i, l_i = _step(j, s, o, p, m_i, l_i, q_tile, k_smem, v_smem, k_ready, v_ready, empty, n_blocks,
                                  row_idx, seqlen, qk_scale, s_layout, o_layout, p_layout, HEAD_DIM, BLOCK_N,
                                  NUM_BUFFERS, CAUSAL, True)
    last = n_blocks - 1
    p_last, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, last, row_idx, seqlen, qk_scale, s_layout, BLOCK_N, CAUSAL,
                                            True, 0.0)
    o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
    o, p_last = _rescale_and_issue_pv(o, p_last, alpha, v_smem, v_ready, last, o_layout, p_layout, NUM_BUFFERS,
                                      BLOCK_N, HEAD_DIM, False)
    o, p_last = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_last))

    inv_l = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout))
    o = o * gl.expand_dims(inv_l, 1)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(LSE + off_b * stride_lb + off_h * stride_lh + row_idx, lse, mask=row_idx < seqlen)
    # this half's Q tile is dead (every wgmma reading it retired): stage O there for one TMA store
    q_tile.store(o.to(desc_o.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_o, [off_b, m0, off_h, 0], q_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _step(j, s, o, p_prev, m_i, l_i, q_tile, k_smem, v_smem, k_ready, v_ready, empty, n_loaded, row_idx, seqlen,
          qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr, HEAD_DIM: gl.constexpr,
          BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr, MASK: gl.constexpr):
    """One steady-state iteration (the default kernel's ``_key_block``), releasing block j - 1's slot."""
    BLOCK_M: gl.constexpr = q_tile.shape[0]
    s_next = _issue_qk(q_tile, k_smem, k_ready, j + 1, s_layout, NUM_BUFFERS, BLOCK_M, BLOCK_N, HEAD_DIM)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, j, row_idx, seqlen, qk_scale, s_layout, BLOCK_N, CAUSAL, MASK,
                                       0.0)
    o, p_prev, s_next = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_prev, s_next))
    # block j - 1 is retired in this warpgroup (K with S_{j-1}, V with PV_{j-1}); the loader refills its slot
    # only for a block it still has to bring in
    if (j >= 1) & (j - 1 + NUM_BUFFERS < n_loaded):
        mbarrier.arrive(empty.index((j - 1) % NUM_BUFFERS), count=1)
    o, p = _rescale_and_issue_pv(o, p, alpha, v_smem, v_ready, j, o_layout, p_layout, NUM_BUFFERS, BLOCK_N,
                                 HEAD_DIM, False)
    return s_next, o, p, m_i, l_i


@gluon.jit
def _gluon_attn_fwd_ws_kernel(desc_q, desc_k, desc_v, desc_o, LSE, stride_lb, stride_lh, seqlen, n_heads,
                              heads_per_kv, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                              NUM_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr, LOADER_REGS: gl.constexpr = 24):
    """bf16 / fp16 forward: q, k, v, out (b, s, h, d) behind descriptors with [1, 64, 1, d] (q, out) and
    [1, BLOCK_N, 1, d] (k, v) blocks; lse (b, h, s). Grid (cdiv(s, 64), b * h), 4 warps (the consumer); the
    launch adds the loader's warp (in a warpgroup of its own)."""
    gl.static_assert(gl.num_warps() * 16 == desc_q.block_type.shape[1], "a consumer warp a 16 query rows")
    q_smem = gl.allocate_shared_memory(desc_q.dtype, desc_q.block_type.shape, desc_q.layout)
    k_smem = gl.allocate_shared_memory(desc_k.dtype, [NUM_BUFFERS] + desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [NUM_BUFFERS] + desc_v.block_type.shape, desc_v.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()  # the barriers' initialisation is visible to the TMA unit before it signals them
    # the consumer must be the default partition: with its wgmmas in a worker partition ptxas serialised every
    # wgmma (C7512, "insufficient register resources"), whatever the register split
    gl.warp_specialize([
        (_consumer, (desc_q, desc_k, desc_v, desc_o, LSE, stride_lb, stride_lh, seqlen, n_heads, heads_per_kv,
                     qk_scale, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, empty, HEAD_DIM, BLOCK_N,
                     NUM_BUFFERS, CAUSAL)),
        (_loader, (desc_q, desc_k, desc_v, desc_o, LSE, stride_lb, stride_lh, seqlen, n_heads, heads_per_kv,
                   qk_scale, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, empty, HEAD_DIM, BLOCK_N,
                   NUM_BUFFERS, CAUSAL)),
    ], [1], [LOADER_REGS])
