"""Hopper (sm_90) attention forward in Gluon, with FlashAttention-3's intra-warpgroup overlap.

Plain Triton lowers ``tl.dot`` to an async wgmma but waits for QK^T right after issuing it, so the
softmax of a key block runs while the tensor cores sit idle. Gluon exposes the wgmma issue and the
``wgmma.wait_group`` count directly, so this kernel keeps two MMAs in flight across each softmax:

    iteration j (S_j = Q K_j^T is in registers; O += P_{j-1} V_{j-1} is still running)
      issue  S_{j+1} = Q K_{j+1}^T            in flight: PV_{j-1}, S_{j+1}
      softmax(S_j) -> P_j, alpha_j            <- runs under both MMAs
      wait(0)                                 PV_{j-1} and S_{j+1} retired
      refill the ring slot of block j-1; O *= alpha_j
      issue  O += P_j V_j                     in flight into iteration j+1

One CTA owns BLOCK_M query rows of one (batch, head); all its warps compute (no producer warp):
the TMA loads are issued by the same warps, ahead of use, into a NUM_BUFFERS-deep ring of K/V
tiles. See docs/gluon.md for the full picture, the ptxas constraints that shaped it, and what is
not done.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)


@gluon.constexpr_function
def mma_layout(num_warps, n):
    # every warp takes 16 rows; a warpgroup (4 warps) issues one wgmma over its 64 rows, and
    # several warpgroups split BLOCK_M rather than N so that row reductions stay inside one warp
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _load_kv(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, block, off_b, off_hk, NUM_BUFFERS: gl.constexpr,
             BLOCK_N: gl.constexpr):
    # K and V get a barrier each, so QK^T of a block never waits for that block's V
    slot = block % NUM_BUFFERS
    mbarrier.expect(k_ready.index(slot), desc_k.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_k, [off_b, block * BLOCK_N, off_hk, 0], k_ready.index(slot),
                                    k_smem.index(slot))
    mbarrier.expect(v_ready.index(slot), desc_v.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_v, [off_b, block * BLOCK_N, off_hk, 0], v_ready.index(slot),
                                    v_smem.index(slot))


@gluon.jit
def _issue_qk(q_tile, k_smem, k_ready, block, s_layout: gl.constexpr, NUM_BUFFERS: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    slot = block % NUM_BUFFERS
    # each slot's barrier completes once per use of the slot: its parity flips every NUM_BUFFERS blocks
    mbarrier.wait(k_ready.index(slot), (block // NUM_BUFFERS) & 1)
    k_tile = k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM])
    # use_acc=False: the hardware ignores the accumulator, so no zero fill is paid per block
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    return warpgroup_mma(q_tile, k_tile.permute((1, 0)), acc, use_acc=False, is_async=True)


@gluon.jit
def _issue_pv(p, v_smem, v_ready, o, block, NUM_BUFFERS: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr):
    slot = block % NUM_BUFFERS
    mbarrier.wait(v_ready.index(slot), (block // NUM_BUFFERS) & 1)
    v_tile = v_smem.index(slot).reshape([BLOCK_N, HEAD_DIM])
    # P stays in registers as wgmma's A operand: FlashAttention-3's trick that saves the smem round trip
    return warpgroup_mma(p, v_tile, o, is_async=True)


@gluon.jit
def _softmax_step(s, m_i, l_i, block, row_idx, seqlen, qk_scale, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                  CAUSAL: gl.constexpr, MASK: gl.constexpr):
    """Online softmax of one key block in base 2; returns unnormalised P (fp32), alpha and the new stats."""
    # MASK is a compile-time choice (two copies of the loop), not a runtime branch: ptxas answers a
    # branch joining inside the softmax with a full wgmma wait at the join, which kills the overlap
    if MASK:
        col = block * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        keep = gl.expand_dims(col < seqlen, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(col, 0) <= gl.expand_dims(row_idx, 1))
        s = gl.where(keep, s, float("-inf"))
    # the scale is folded into the exponent (one FMA per element) instead of a pass over S
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    # finite always: key 0 is visible to every row, so m_new is finite from the first block on
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _rescale_and_issue_pv(o, p, alpha, v_smem, v_ready, block, o_layout: gl.constexpr, p_layout: gl.constexpr,
                          NUM_BUFFERS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    # O must be rescaled in registers before the wgmma accumulates into it: only legal once the
    # previous PV has retired, which is why every caller waits first
    o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    return _issue_pv(p, v_smem, v_ready, o, block, NUM_BUFFERS, BLOCK_N, HEAD_DIM), p


@gluon.jit
def _key_block(j, s, o, p_prev, m_i, l_i, q_tile, k_smem, v_smem, k_ready, v_ready, desc_k, desc_v, off_b, off_hk,
               n_blocks, row_idx, seqlen, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr,
               p_layout: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr, MASK: gl.constexpr):
    """One steady-state iteration: S_j is in registers, PV_{j-1} is in flight, block j+1 exists."""
    s_next = _issue_qk(q_tile, k_smem, k_ready, j + 1, s_layout, NUM_BUFFERS, BLOCK_M, BLOCK_N, HEAD_DIM)
    # the tensor cores now hold PV_{j-1} and QK^T_{j+1}: this softmax runs under both
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, j, row_idx, seqlen, qk_scale, s_layout, BLOCK_N, CAUSAL, MASK)
    # one full wait for both. Finer waits (wait(1) for PV_{j-1} here, wait(1) for S_{j+1} after
    # issuing PV_j) made ptxas serialise every wgmma in the kernel (C7514); see docs/gluon.md
    # p_prev is PV_{j-1}'s A operand: naming it here keeps its registers untouched until retirement
    o, p_prev, s_next = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_prev, s_next))
    # block j-1's slot is free now (its K retired with S_{j-1}, its V with PV_{j-1}): refill it. The
    # CTA-wide barrier Triton puts before the TMA issue also covers the other warpgroup's reads.
    refill = j - 1 + NUM_BUFFERS
    if (j >= 1) & (refill < n_blocks):
        _load_kv(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, refill, off_b, off_hk, NUM_BUFFERS, BLOCK_N)
    # PV_j stays in flight into the next iteration's softmax
    o, p = _rescale_and_issue_pv(o, p, alpha, v_smem, v_ready, j, o_layout, p_layout, NUM_BUFFERS, BLOCK_N,
                                 HEAD_DIM)
    return s_next, o, p, m_i, l_i


@gluon.jit
def _gluon_attn_fwd_kernel(desc_q, desc_k, desc_v, desc_o, LSE, stride_lb, stride_lh, seqlen, n_heads, heads_per_kv,
                           qk_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           NUM_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr):
    # block j+NUM_BUFFERS-1 is loaded during iteration j, after which block j+1 must already be resident
    gl.static_assert(NUM_BUFFERS >= 3)
    NUM_WARPS: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_N)
    o_layout: gl.constexpr = mma_layout(NUM_WARPS, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    n_m_blocks = gl.cdiv(seqlen, BLOCK_M)
    pid_m = gl.program_id(0)
    if CAUSAL:
        # the longest (bottom) query tiles start first: the tail of the grid is then short work
        pid_m = n_m_blocks - 1 - pid_m
    pid_bh = gl.program_id(1)
    off_b = pid_bh // n_heads
    off_h = pid_bh % n_heads
    off_hk = off_h // heads_per_kv
    m0 = pid_m * BLOCK_M

    # shared memory: Q (later reused to stage O), a ring of K and V tiles, one barrier per tile.
    # The 4-D block [1, rows, 1, d] is what the (b, s, h, d) descriptors move; MMAs see a 2-D view.
    q_smem = gl.allocate_shared_memory(desc_q.dtype, desc_q.block_type.shape, desc_q.layout)
    k_smem = gl.allocate_shared_memory(desc_k.dtype, [NUM_BUFFERS] + desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [NUM_BUFFERS] + desc_v.block_type.shape, desc_v.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
    # barrier initialisation must be visible to the TMA unit (async proxy) before it signals them
    fence_async_shared()

    if CAUSAL:
        # keys past the tile's last row are never visible: those blocks are skipped, not masked
        n_blocks = gl.cdiv(gl.minimum(seqlen, m0 + BLOCK_M), BLOCK_N)
        # blocks whose every key is <= the tile's first row (and inside seqlen) need no mask
        n_unmasked = gl.minimum((m0 + 1) // BLOCK_N, seqlen // BLOCK_N)
    else:
        n_blocks = gl.cdiv(seqlen, BLOCK_N)
        n_unmasked = seqlen // BLOCK_N

    mbarrier.expect(q_ready, desc_q.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_q, [off_b, m0, off_h, 0], q_ready, q_smem)
    # fill the ring; later refills happen inside the loop as slots drain
    for i in gl.static_range(NUM_BUFFERS):
        if i < n_blocks:
            _load_kv(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, i, off_b, off_hk, NUM_BUFFERS, BLOCK_N)

    q_tile = q_smem.reshape([BLOCK_M, HEAD_DIM])
    mbarrier.wait(q_ready, 0)

    row_idx = m0 + gl.arange(0, BLOCK_M, row_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    # O is carried across iterations as an in-flight accumulator (PV_j completes in iteration j+1)
    o = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout))
    # P_{j-1} feeds the PV wgmma still in flight: it must stay alive (in registers) until that wgmma
    # retires, which is what passing it through warpgroup_mma_wait's deps guarantees
    p = gl.zeros([BLOCK_M, BLOCK_N], gl.bfloat16, p_layout)

    s = _issue_qk(q_tile, k_smem, k_ready, 0, s_layout, NUM_BUFFERS, BLOCK_M, BLOCK_N, HEAD_DIM)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))

    # every block but the last, in two copies of the same pipelined loop: first the blocks that need
    # no mask, then the diagonal / ragged ones. The pipeline state (S_j ready, PV_{j-1} in flight)
    # flows from the first loop into the second unchanged.
    n_steady = n_blocks - 1
    n_fast = gl.minimum(n_unmasked, n_steady)
    for j in range(0, n_fast):
        s, o, p, m_i, l_i = _key_block(j, s, o, p, m_i, l_i, q_tile, k_smem, v_smem, k_ready, v_ready, desc_k, desc_v,
                                       off_b, off_hk, n_blocks, row_idx, seqlen, qk_scale, s_layout, o_layout,
                                       p_layout, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL, False)
    for j in range(n_fast, n_steady):
        s, o, p, m_i, l_i = _key_block(j, s, o, p, m_i, l_i, q_tile, k_smem, v_smem, k_ready, v_ready, desc_k, desc_v,
                                       off_b, off_hk, n_blocks, row_idx, seqlen, qk_scale, s_layout, o_layout,
                                       p_layout, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL, True)

    # last block: no QK^T left to issue. ptxas puts a full wgmma wait at this loop exit, so this
    # softmax does not overlap PV of the block before (one exposed softmax per CTA). Masking it
    # unconditionally is correct (a no-op when the block is full) and keeps the code branch-free.
    last = n_blocks - 1
    p_last, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, last, row_idx, seqlen, qk_scale, s_layout, BLOCK_N, CAUSAL,
                                            True)
    o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
    o, p_last = _rescale_and_issue_pv(o, p_last, alpha, v_smem, v_ready, last, o_layout, p_layout, NUM_BUFFERS,
                                      BLOCK_N, HEAD_DIM)
    o, p_last = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_last))

    mbarrier.invalidate(q_ready)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))

    _epilogue(o, m_i, l_i, q_smem, q_tile, desc_o, LSE, stride_lb, stride_lh, off_b, off_h, m0, row_idx, seqlen,
              o_layout)


@gluon.jit
def _epilogue(o, m_i, l_i, q_smem, q_tile, desc_o, LSE, stride_lb, stride_lh, off_b, off_h, m0, row_idx, seqlen,
              o_layout: gl.constexpr):
    inv_l = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout))
    o = o * gl.expand_dims(inv_l, 1)
    # FlashAttention's lse is natural-log: ln(sum e^(x*scale)) = (m + log2 l) * ln 2 with m in base 2
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(LSE + off_b * stride_lb + off_h * stride_lh + row_idx, lse, mask=row_idx < seqlen)
    # Q's tile is dead (every wgmma reading it has retired): stage O there for one TMA store, which
    # also clips the rows past seqlen
    q_tile.store(o.to(gl.bfloat16))
    # generic-proxy smem writes must be visible to the TMA engine (async proxy) before it reads them
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_o, [off_b, m0, off_h, 0], q_smem)
    tma.store_wait(pendings=0)


def fwd_config(head_dim: int, causal: bool) -> dict:
    """Tile sizes and warps: two warpgroups over 128 query rows, a three-deep K/V ring. One config for
    both head dims for now (untuned; d = 128 already uses 255 registers and ~224 KiB of shared memory)."""
    return dict(BLOCK_M=128, BLOCK_N=128, NUM_BUFFERS=3, num_warps=8)
