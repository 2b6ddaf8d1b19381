"""Unsplit decode over a contiguous cache in Gluon, with K and V copies issued as early as the buffers allow
(an experiment for b = 32, run by scripts/probe_decode_gluon_cp_async.py; not wired into the launcher).

At b = 32 the Triton decode kernel runs at 2 stages so two programs share an SM, and Triton's pipeliner then
gives K and V one shared-memory buffer each: it issues tile j + 1's copies at the end of tile j and waits for
both at the top of j + 1, so a program has nothing in flight while it computes. Nsight Compute (session 17)
found it moving exactly cuDNN's traffic, at 96.2% of DRAM peak against cuDNN's 97.4%; cuDNN's SASS spreads its
copies through the loop body. Here the loop is written with explicit rings of NUM_BUFFERS K and V tiles
filled by 16-byte ``cp.async`` (as the Triton kernel's copies, not TMA boxes: session 16's TMA ring lost
3%-5%). Each refill is issued as soon as every warp is done with its slot: K(j + NUM_BUFFERS) right after
tile j's scores are computed, V(j + NUM_BUFFERS - 1) right after tile j - 1's PV product. The copy groups
stay in one order (K0 V0 K1 V1 ...), so every wait is ``wait_group(2 * NUM_BUFFERS - 2)``. Two CTA barriers a
tile, where the Triton build has nine: the scores of one warp-group MMA (64 rows, the ``group`` query heads
of the kv head padded) keep each row inside one warp, so the softmax needs no cross-warp reduction.

Keys past the row's length are zero-filled by the copies' masks (so V holds no NaN there) and masked to -inf.
Writes O only (b, 1, h, d); no lse, splits, windows or appends: a probe of the loop's speed.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _issue_tile(smem, base, row0, seqlen, stride_n, rows, cols, ok):
    """Copy rows [row0, row0 + BLOCK_N) of one kv head into ``smem``; rows at or past ``seqlen`` (and all of
    them when ``ok`` is false) are zero-filled; the caller commits the group."""
    pos = row0 + rows
    ptrs = base + gl.expand_dims(pos.to(gl.int64) * stride_n, 1) + gl.expand_dims(cols, 0)
    async_copy.async_copy_global_to_shared(smem, ptrs, mask=gl.expand_dims((pos < seqlen) & ok, 1))


@gluon.jit
def _gluon_decode_cp_async_kernel(
    Q, K, V, O, SEQLENS, qk_scale, num_kv_heads, group,
    stride_qb, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_ob, stride_oh,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr,
):
    """q (b, 1, h, d) against a contiguous (b, capacity, h_k, d) cache; one program per (batch row, kv head)."""
    BLOCK_M: gl.constexpr = 64  # a warp-group MMA's rows
    gl.static_assert(gl.num_warps() == 4, "one warpgroup")
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    # 16 bytes a thread along d: 16 threads cover a 128-wide row, a warp two rows
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [4, 1], [1, 0])
    kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], K.dtype.element_ty)
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], Q.dtype.element_ty)

    pid = gl.program_id(0)
    b = pid // num_kv_heads
    kv_head = pid % num_kv_heads
    seqlen = gl.load(SEQLENS + b)
    n = gl.cdiv(seqlen, BLOCK_N)
    k_base = K + b.to(gl.int64) * stride_kb + kv_head * stride_kh
    v_base = V + b.to(gl.int64) * stride_vb + kv_head * stride_vh

    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [BLOCK_M, HEAD_DIM], q_smem_layout)
    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [NUM_BUFFERS, BLOCK_N, HEAD_DIM], kv_smem_layout)
    v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [NUM_BUFFERS, BLOCK_N, HEAD_DIM], kv_smem_layout)

    rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, ld_layout))
    cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, ld_layout))
    # the rings' first copies, in the loop's group order: K0 V0 K1 V1 ... K(NUM_BUFFERS - 1)
    for i in gl.static_range(NUM_BUFFERS):
        _issue_tile(k_smem.index(i), k_base, i * BLOCK_N, seqlen, stride_kn, rows, cols, i < n)
        async_copy.commit_group()
        if i < NUM_BUFFERS - 1:
            _issue_tile(v_smem.index(i), v_base, i * BLOCK_N, seqlen, stride_vn, rows, cols, i < n)
            async_copy.commit_group()

    # q rows: the group's query heads of this kv head (rows past the group are zero)
    qrows = gl.arange(0, BLOCK_M, gl.SliceLayout(1, ld_layout))
    head = kv_head * group + qrows
    q_ptrs = Q + b.to(gl.int64) * stride_qb + gl.expand_dims(head.to(gl.int64) * stride_qh, 1) + gl.expand_dims(cols, 0)
    q_smem.store(gl.load(q_ptrs, mask=gl.expand_dims(qrows < group, 1), other=0.0))

    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    key = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    for j in range(0, n):
        slot = j % NUM_BUFFERS
        # K(j) landed for every thread, and every warp is done with PV(j - 1)
        async_copy.wait_group(2 * NUM_BUFFERS - 2)
        fence_async_shared()  # this thread's landed copies, visible to the MMAs' proxy
        gl.thread_barrier()
        nxt_v = j + NUM_BUFFERS - 1
        _issue_tile(v_smem.index(nxt_v % NUM_BUFFERS), v_base, nxt_v * BLOCK_N, seqlen, stride_vn, rows, cols,
                    nxt_v < n)
        async_copy.commit_group()
        s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)),
                          gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        # scaled, then masked: a masked -inf times a scale of 0 or below would be NaN
        s = gl.where(gl.expand_dims(j * BLOCK_N + key < seqlen, 0), s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        # V(j) landed for every thread, and every warp is done with the scores of K(j)
        async_copy.wait_group(2 * NUM_BUFFERS - 2)
        fence_async_shared()  # this thread's landed copies, visible to the MMAs' proxy
        gl.thread_barrier()
        nxt_k = j + NUM_BUFFERS
        _issue_tile(k_smem.index(slot), k_base, nxt_k * BLOCK_N, seqlen, stride_kn, rows, cols, nxt_k < n)
        async_copy.commit_group()
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        o = warpgroup_mma(gl.convert_layout(p.to(V.dtype.element_ty), p_layout), v_smem.index(slot), o)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
    async_copy.wait_group(0)

    inv_l = gl.convert_layout(1.0 / gl.where(l_i == 0.0, 1.0, l_i), gl.SliceLayout(1, o_layout))
    out = o * gl.expand_dims(inv_l, 1)
    orow = gl.arange(0, BLOCK_M, gl.SliceLayout(1, o_layout))
    ocol = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, o_layout))
    ohead = (kv_head * group + orow).to(gl.int64)
    o_ptrs = O + b.to(gl.int64) * stride_ob + gl.expand_dims(ohead * stride_oh, 1) + gl.expand_dims(ocol, 0)
    gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=gl.expand_dims(orow < group, 1))
