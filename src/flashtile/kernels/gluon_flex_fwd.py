"""Hopper (sm_90) forward of programmable attention (flashtile.flex) in Gluon: the Gluon forward's pipeline
(kernels/gluon_fwd.py: QK^T of the next key tile and PV of the last one in flight under each softmax) walking
a block mask's key lists instead of a contiguous key range, with the generated mods in the softmax.

One CTA owns BLOCK_M query rows of one (batch, head). Its key tiles are the query block's partly visible
sparse blocks (mask_mod runs on them), then its fully visible ones (no mask work), each walked in
SPARSE_KV // BLOCK_N tiles: tile t of that flattened walk lands in K / V ring slot t % NUM_BUFFERS, its
first key read from the lists a few iterations before the copy is issued. The two lists run as two copies of
the pipelined loop (the mask a compile-time choice, as the Gluon forward's masked / unmasked copies), the
pipeline state flowing from one into the other.

The mods are the generated ``@triton.jit`` helpers the Triton flex kernels take (backends/triton/flex/
codegen.py): ``SCORE_MOD(score, b, h, q_idx, kv_idx, BUFS)``, ``MASK_MOD(b, h, q_idx, kv_idx, BUFS)``; their
``tl`` element-wise ops run on this kernel's wgmma-layout tiles as they are.

Layout: q, k, v, out (b, h, s, d) with a unit last stride, through tensor descriptors whose boxes are one
(batch, head)'s rows ([1, 1, rows, d]; the copy engine zero-fills rows past a sequence); lse (b, h, sq) fp32,
natural log, +inf for a row that sees no key (its output is 0), as the Triton flex forward's.
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
    _invalidate_rings,
    _issue_qk,
    _rescale_and_issue_pv,
    _ring_barriers,
    mma_layout,
)

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _tile_start(IDX, FULL_IDX, n_part, n_tiles, t, SUBS: gl.constexpr, BLOCK_N: gl.constexpr,
                SPARSE_KV: gl.constexpr):
    """First key of tile ``t`` of the walk (the partly visible blocks' tiles, then the fully visible ones').
    ``t`` past the walk reads its last tile instead, so a lookahead never leaves the lists; an empty walk reads the
    full list's first entry (every list row has one), a value nobody uses."""
    t = gl.maximum(gl.minimum(t, n_tiles - 1), 0)
    in_part = t < n_part
    i = gl.where(in_part, t, t - n_part)
    block = gl.load(gl.where(in_part, IDX, FULL_IDX) + i // SUBS)
    return block * SPARSE_KV + (i % SUBS) * BLOCK_N


@gluon.jit
def _load_tile(desc, smem, ready, t, b, kv_head, col0, NUM_BUFFERS: gl.constexpr):
    slot = t % NUM_BUFFERS
    mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [b, kv_head, col0, 0], ready.index(slot), smem.index(slot))


@gluon.jit
def _flex_softmax(s, m_i, l_i, col0, b, h, q_idx, seqlen_k, sm_scale, BUFS, s_layout: gl.constexpr,
                  BLOCK_N: gl.constexpr, SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr,
                  HAS_SCORE_MOD: gl.constexpr, APPLY_MASK: gl.constexpr, EVEN_N: gl.constexpr, full=False):
    """Online softmax of one key tile (keys from ``col0``) in base 2: score_mod on the scaled scores, mask_mod
    where APPLY_MASK (``full``: the tile belongs to a fully visible block after all, which keeps every key), the
    sequence's end unless EVEN_N. Returns unnormalised P, alpha and the new stats. A row may have seen only
    -inf so far (a mask, or a score_mod returning -inf): its max stays -inf and 0 is subtracted instead."""
    cols = col0 + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    kv_idx = cols
    if not EVEN_N:
        # the mods see in-range indices only (a captured table is never read past its end); the lanes past the
        # keys are hidden below
        kv_idx = gl.minimum(cols, seqlen_k - 1)
    kv_idx = gl.expand_dims(kv_idx, 0)
    if HAS_SCORE_MOD:
        s = SCORE_MOD(s * sm_scale, b, h, q_idx, kv_idx, BUFS)
        scale2 = LOG2E
    else:
        # no mod: the scale folds into the exponent's FMA, as in the plain kernels
        scale2 = sm_scale * LOG2E
    if APPLY_MASK:
        keep = MASK_MOD(b, h, q_idx, kv_idx, BUFS) | full
        if not EVEN_N:
            keep = keep & gl.expand_dims(cols < seqlen_k, 0)
        s = gl.where(keep, s, float("-inf"))
    elif not EVEN_N:
        s = gl.where(gl.expand_dims(cols < seqlen_k, 0), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale2)
    m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * scale2 - gl.expand_dims(m_base, 1))
    alpha = gl.exp2(m_i - m_base)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _flex_tile(t, s, col0, o, p_prev, m_i, l_i, q_tile, k_smem, v_smem, k_ready, v_ready, desc_k, desc_v, IDX,
               FULL_IDX, n_part, n_tiles, b, h, kv_head, q_idx, seqlen_k, sm_scale, BUFS, s_layout: gl.constexpr,
               o_layout: gl.constexpr, p_layout: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, SUBS: gl.constexpr, SPARSE_KV: gl.constexpr,
               SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr, HAS_SCORE_MOD: gl.constexpr,
               APPLY_MASK: gl.constexpr, EVEN_N: gl.constexpr):
    """One steady-state iteration: S of tile t (first key ``col0``) is in registers, PV of tile t-1 in flight,
    tile t+1 exists. Returns the state of iteration t+1 (its S in flight until the next wait, its first key)."""
    # the list reads this iteration needs later are issued first: their latency hides under the softmax
    col_next = _tile_start(IDX, FULL_IDX, n_part, n_tiles, t + 1, SUBS, BLOCK_N, SPARSE_KV)
    k_col = _tile_start(IDX, FULL_IDX, n_part, n_tiles, t + 1 + NUM_BUFFERS, SUBS, BLOCK_N, SPARSE_KV)
    v_col = _tile_start(IDX, FULL_IDX, n_part, n_tiles, t - 1 + NUM_BUFFERS, SUBS, BLOCK_N, SPARSE_KV)
    s_next, s_unused = _issue_qk(q_tile, q_tile, k_smem, k_smem, k_ready, t + 1, s_layout, NUM_BUFFERS, BLOCK_M,
                                 BLOCK_N, HEAD_DIM, 0)
    # the tensor cores now hold PV_{t-1} and QK^T_{t+1}: this softmax runs under both
    p, alpha, m_i, l_i = _flex_softmax(s, m_i, l_i, col0, b, h, q_idx, seqlen_k, sm_scale, BUFS, s_layout, BLOCK_N,
                                       SCORE_MOD, MASK_MOD, HAS_SCORE_MOD, APPLY_MASK, EVEN_N)
    o, p_prev, s_next = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_prev, s_next))
    # S_{t+1} retired: tile t+1's K slot refills; PV_{t-1} too: tile t-1's V slot does (kernels/gluon_fwd.py)
    if t + 1 + NUM_BUFFERS < n_tiles:
        _load_tile(desc_k, k_smem, k_ready, t + 1 + NUM_BUFFERS, b, kv_head, k_col, NUM_BUFFERS)
    if (t >= 1) & (t - 1 + NUM_BUFFERS < n_tiles):
        _load_tile(desc_v, v_smem, v_ready, t - 1 + NUM_BUFFERS, b, kv_head, v_col, NUM_BUFFERS)
    o, p = _rescale_and_issue_pv(o, p, alpha, v_smem, v_ready, t, o_layout, p_layout, NUM_BUFFERS, BLOCK_N,
                                 HEAD_DIM, False)
    return s_next, col_next, o, p, m_i, l_i


@gluon.jit
def _gluon_flex_fwd_kernel(desc_q, desc_k, desc_v, desc_o, OUT, LSE, KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, BUFS,
                           sm_scale, seqlen_q, seqlen_k, num_heads, group, stride_ob, stride_oh, stride_om,
                           stride_lse_b, stride_lse_h, stride_nb, stride_nh, stride_nm, stride_ib, stride_ih,
                           stride_im, SCORE_MOD: gl.constexpr, MASK_MOD: gl.constexpr,
                           HAS_SCORE_MOD: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, SPARSE_Q: gl.constexpr,
                           SPARSE_KV: gl.constexpr, EVEN_M: gl.constexpr, EVEN_N: gl.constexpr):
    """Out (through desc_o; OUT / stride_o* for a query block that sees no key) and lse of BLOCK_M query rows
    of one (batch, head): grid (cdiv(seqlen_q, BLOCK_M), batch * heads). q / k / v / out share HEAD_DIM (a power
    of two). The block-mask tensors (KV_NUM (b, h, nq), KV_IDX (b, h, nq, nk), and FULL_*) come expanded to
    (b, h) (a broadcast dimension has stride 0); BLOCK_M divides SPARSE_Q and BLOCK_N divides SPARSE_KV.
    EVEN_M / EVEN_N: the lengths are multiples of the sparse blocks (no index bound, no end mask)."""
    # the V copy of iteration t is read in iteration t - 1 + NUM_BUFFERS (kernels/gluon_fwd.py)
    gl.static_assert(NUM_BUFFERS >= 2)
    gl.static_assert(SPARSE_Q % BLOCK_M == 0)
    gl.static_assert(SPARSE_KV % BLOCK_N == 0)
    SUBS: gl.constexpr = SPARSE_KV // BLOCK_N
    NUM_WARPS: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_N, 16)
    o_layout: gl.constexpr = mma_layout(NUM_WARPS, HEAD_DIM, 16)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    kv_head = h // group
    m0 = pid_m * BLOCK_M
    sparse_row = m0 // SPARSE_Q
    n_part = gl.load(KV_NUM + b * stride_nb + h * stride_nh + sparse_row * stride_nm) * SUBS
    n_tiles = n_part + gl.load(FULL_NUM + b * stride_nb + h * stride_nh + sparse_row * stride_nm) * SUBS
    IDX = KV_IDX + b * stride_ib + h * stride_ih + sparse_row * stride_im
    FULL = FULL_IDX + b * stride_ib + h * stride_ih + sparse_row * stride_im
    if n_tiles == 0:
        # a query block that sees no key: out 0, lse +inf, before any barrier or copy
        rows = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, o_layout))
        ptrs = (OUT + b.to(gl.int64) * stride_ob + h * stride_oh + gl.expand_dims(rows * stride_om, 1)
                + gl.expand_dims(cols, 0))
        gl.store(ptrs, gl.zeros([BLOCK_M, HEAD_DIM], OUT.dtype.element_ty, o_layout),
                 mask=gl.expand_dims(rows < seqlen_q, 1))
        gl.store(LSE + b * stride_lse_b + h * stride_lse_h + rows,
                 gl.full([BLOCK_M], float("inf"), gl.float32, gl.SliceLayout(1, o_layout)), mask=rows < seqlen_q)
        return

    q_smem = gl.allocate_shared_memory(desc_q.dtype, desc_q.block_type.shape, desc_q.layout)
    k_smem = gl.allocate_shared_memory(desc_k.dtype, [NUM_BUFFERS] + desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [NUM_BUFFERS] + desc_v.block_type.shape, desc_v.layout)
    q_ready, k_ready, v_ready = _ring_barriers(NUM_BUFFERS)

    mbarrier.expect(q_ready, desc_q.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_q, [b, h, m0, 0], q_ready, q_smem)
    for i in gl.static_range(NUM_BUFFERS):
        if i < n_tiles:
            col = _tile_start(IDX, FULL, n_part, n_tiles, i, SUBS, BLOCK_N, SPARSE_KV)
            _load_tile(desc_k, k_smem, k_ready, i, b, kv_head, col, NUM_BUFFERS)
            _load_tile(desc_v, v_smem, v_ready, i, b, kv_head, col, NUM_BUFFERS)
    col0 = _tile_start(IDX, FULL, n_part, n_tiles, 0, SUBS, BLOCK_N, SPARSE_KV)
    k_col = _tile_start(IDX, FULL, n_part, n_tiles, NUM_BUFFERS, SUBS, BLOCK_N, SPARSE_KV)

    q_tile = q_smem.reshape([BLOCK_M, HEAD_DIM])
    mbarrier.wait(q_ready, 0)
    rows = m0 + gl.arange(0, BLOCK_M, row_layout)
    q_idx = rows
    if not EVEN_M:
        # rows past the queries compute on zero-filled q and are never stored; the mods see the last row instead
        q_idx = gl.minimum(rows, seqlen_q - 1)
    q_idx = gl.expand_dims(q_idx, 1)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    o = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout))
    p = gl.zeros([BLOCK_M, BLOCK_N], desc_v.dtype, p_layout)

    s, s_unused = _issue_qk(q_tile, q_tile, k_smem, k_smem, k_ready, 0, s_layout, NUM_BUFFERS, BLOCK_M, BLOCK_N,
                            HEAD_DIM, 0)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    # S_0 retired: K slot 0 takes tile NUM_BUFFERS (iteration t refills tile t + 1 + NUM_BUFFERS)
    if NUM_BUFFERS < n_tiles:
        _load_tile(desc_k, k_smem, k_ready, NUM_BUFFERS, b, kv_head, k_col, NUM_BUFFERS)

    # every tile but the last: the partly visible blocks' tiles with mask_mod, then the fully visible ones'
    n_steady = n_tiles - 1
    n_masked = gl.minimum(n_part, n_steady)
    for t in range(0, n_masked):
        s, col0, o, p, m_i, l_i = _flex_tile(t, s, col0, o, p, m_i, l_i, q_tile, k_smem, v_smem, k_ready, v_ready,
                                             desc_k, desc_v, IDX, FULL, n_part, n_tiles, b, h, kv_head, q_idx,
                                             seqlen_k, sm_scale, BUFS, s_layout, o_layout, p_layout, HEAD_DIM,
                                             BLOCK_M, BLOCK_N, NUM_BUFFERS, SUBS, SPARSE_KV, SCORE_MOD, MASK_MOD,
                                             HAS_SCORE_MOD, True, EVEN_N)
    for t in range(n_masked, n_steady):
        s, col0, o, p, m_i, l_i = _flex_tile(t, s, col0, o, p, m_i, l_i, q_tile, k_smem, v_smem, k_ready, v_ready,
                                             desc_k, desc_v, IDX, FULL, n_part, n_tiles, b, h, kv_head, q_idx,
                                             seqlen_k, sm_scale, BUFS, s_layout, o_layout, p_layout, HEAD_DIM,
                                             BLOCK_M, BLOCK_N, NUM_BUFFERS, SUBS, SPARSE_KV, SCORE_MOD, MASK_MOD,
                                             HAS_SCORE_MOD, False, EVEN_N)

    # the last tile: mask_mod runs unless it belongs to a fully visible block (one copy of the code for both)
    last = n_tiles - 1
    p_last, alpha, m_i, l_i = _flex_softmax(s, m_i, l_i, col0, b, h, q_idx, seqlen_k, sm_scale, BUFS, s_layout,
                                            BLOCK_N, SCORE_MOD, MASK_MOD, HAS_SCORE_MOD, True, EVEN_N,
                                            last >= n_part)
    o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
    o, p_last = _rescale_and_issue_pv(o, p_last, alpha, v_smem, v_ready, last, o_layout, p_layout, NUM_BUFFERS,
                                      BLOCK_N, HEAD_DIM, False)
    o, p_last = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_last))

    _invalidate_rings(q_ready, k_ready, v_ready, NUM_BUFFERS)

    # a row that saw no key: sum 0, out 0, lse +inf
    empty = l_i == 0.0
    inv_l = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_i))
    o = o * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout)), 1)
    lse = gl.where(empty, float("inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    gl.store(LSE + b * stride_lse_b + h * stride_lse_h + rows, lse, mask=rows < seqlen_q)
    # Q's tile is dead (every wgmma reading it has retired): stage O there for one TMA store, which clips the
    # rows past the queries
    q_tile.store(o.to(desc_o.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_o, [b, h, m0, 0], q_smem)
    tma.store_wait(pendings=0)


# (BLOCK_M, BLOCK_N, NUM_BUFFERS, num_warps) by head dim: 64-key tiles leave registers for the mods' arithmetic
# (128 x 128 tiles spill with a learned bias table). The entry compiles for sm_90 without spills and with a whole
# tile's exp2 under in-flight wgmmas for the tests' mods (tests/test_gluon_flex_compile.py). d = 128 only: the one
# timed (d = 64 ran correctly at 128 x 64 on an H100, but the plain Gluon forward lost to Triton there).
GLUON_FLEX_FWD_CONFIGS = {
    128: (128, 64, 3, 8),
}
