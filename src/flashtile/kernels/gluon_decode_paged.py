"""Split-KV decode over a pool of small pages, in Gluon for Hopper (an experiment: FLASHTILE_DECODE_GLUON_PAGED=1).

The Triton decode kernel reads a tile of 16-token pages with 16-byte cp.async copies at per-key
addresses (kernels/decode.py); Nsight Compute found that split kernel issue-bound at b = 1 (17.9 us
against 15.6-16.4 for 256-token pages, which take one descriptor load per tile). Triton cannot land
several descriptor boxes in one tile's shared buffer; Gluon can. Here a tile of BLOCK_N keys is
BLOCK_N / PAGE boxes [PAGE, d], one per page (of the pool seen as (pages * PAGE, h_k * d)), each TMA copy landing in its rows of the tile's
buffer, and one warp-group MMA per tile reads the whole buffer.

One program per (batch row, kv head, split), one warpgroup, like the Triton kernel's layout: its query
rows are the ``group`` query heads of its kv head for the one new token (padded to the 64 rows of a
warp-group MMA), so each K/V byte is read once per kv head. Reads only: the launcher appends new keys
first (the separate append kernel). The split's share of the row's key blocks, the lse convention and
the partial outputs are the Triton kernel's, so its merge kernel serves both; so is programmatic dependent
launch (USE_PDL: wait before the first read, let the next kernel launch after the key loop).

Keys past the row's length: their scores are masked to -inf; their V rows in the last tile are
zeroed in shared memory before the PV MMA (the slots past a row's length may hold NaN, which P's
zeros would not cancel). Table entries past the row's pages are never trusted: they are clamped into
the pool, and whatever page they then name lands only in those masked and zeroed rows.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def _gdc_wait():
    # programmatic dependent launch (Gluon 3.6 has no wrapper; the PTX is Triton's gdc_wait): wait here,
    # before the first read, until the previous kernel in the stream has finished and flushed its writes
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    # the next kernel (the split merge, or the next layer's decode) may start launching; it waits itself
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.constexpr_function
def _pow2_at_least(n):
    p = 1
    while p < n:
        p *= 2
    return p


@gluon.jit
def _page_ids(table_row, n_table, n_pages, first, COUNT: gl.constexpr, id_layout: gl.constexpr):
    """COUNT table entries from index ``first`` in one load (id_layout gives every thread all of them),
    clamped into the pool: an entry past the row's pages (padding such as -1, or past the table row) then
    names some page of the pool, whose keys are masked and whose V rows are zeroed like any slot past the
    row's length, so no copy depends on how TMA treats a box outside the tensor."""
    idx = first + gl.arange(0, COUNT, id_layout)
    ids = gl.load(table_row + idx, mask=idx < n_table, other=0)
    return gl.minimum(gl.maximum(ids, 0), n_pages - 1)


@gluon.jit
def _load_tile(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, ids, base: gl.constexpr, slot, kv_head,
               PAGES: gl.constexpr, id_layout: gl.constexpr):
    """Issue the TMA copies of one tile's pages, ``ids[base:base + PAGES]`` (loaded earlier, so that no copy
    waits for a table read), into ring slot ``slot``; one barrier per tensor, each completing PAGES boxes."""
    PAGE: gl.constexpr = desc_k.block_type.shape[0]
    HEAD_DIM: gl.constexpr = desc_k.block_type.shape[1]
    mbarrier.expect(k_ready.index(slot), PAGES * desc_k.block_type.nbytes)
    mbarrier.expect(v_ready.index(slot), PAGES * desc_v.block_type.nbytes)
    sel = gl.arange(0, ids.shape[0], id_layout)
    for i in gl.static_range(PAGES):
        page = gl.sum(gl.where(sel == base + i, ids, 0), axis=0)  # within each thread: it holds every entry
        at = [page * PAGE, kv_head * HEAD_DIM]
        tma.async_copy_global_to_shared(desc_k, at, k_ready.index(slot), k_smem.index(slot).slice(i * PAGE, PAGE))
        tma.async_copy_global_to_shared(desc_v, at, v_ready.index(slot), v_smem.index(slot).slice(i * PAGE, PAGE))


# s_new and the table width change between calls: a specialisation on them (Triton makes 1 a constant,
# multiples of 16 aligned) would compile again, possibly inside a CUDA-graph capture
@gluon.jit(do_not_specialize=["s_new", "n_table", "n_pages"])
def _gluon_paged_decode_kernel(
    Q, desc_k, desc_v, O, LSE, O_PART, LSE_PART, SEQLENS, BLOCK_TABLE,
    qk_scale, s_new, num_kv_heads, group, n_table, n_pages,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_lse_b, stride_lse_h,
    stride_ops, stride_opb, stride_oph, stride_lps, stride_lpb, stride_lph, stride_bt_b,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr,
    NUM_BUFFERS: gl.constexpr, NUM_SPLITS: gl.constexpr, USE_PDL: gl.constexpr = False,
):
    """q (b, 1, h, d) against a (pages, PAGE, h_k, d) pool, whose descriptors see it as (pages * PAGE, h_k * d)
    with box [PAGE, d] (a page's rows of one kv head); program = (b * h_k + kv_head) * NUM_SPLITS + split.
    NUM_SPLITS == 1 writes O (b, 1, h, d) and LSE (b, h, 1); otherwise O_PART (splits, b, 1, h, d) fp32
    and LSE_PART (splits, b, h, 1) with -inf for an empty split."""
    if USE_PDL:
        _gdc_wait()
    PAGES: gl.constexpr = BLOCK_N // PAGE
    gl.static_assert(BLOCK_M == 64 and gl.num_warps() == 4, "one warpgroup on 64 query rows")
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    id_layout: gl.constexpr = gl.BlockedLayout([PAGES], [32], [4], [0])
    RING_IDS: gl.constexpr = _pow2_at_least(NUM_BUFFERS * PAGES)  # gl.arange wants a power of two
    ring_id_layout: gl.constexpr = gl.BlockedLayout([RING_IDS], [32], [4], [0])

    pid = gl.program_id(0)
    split = pid % NUM_SPLITS
    bk = pid // NUM_SPLITS
    b = bk // num_kv_heads
    kv_head = bk % num_kv_heads

    seqlen = gl.load(SEQLENS + b) + s_new  # the keys after this call's append (done before this kernel)
    n_blocks = gl.cdiv(seqlen, BLOCK_N)
    per_split = gl.cdiv(n_blocks, NUM_SPLITS)
    lo = split * per_split
    n = gl.maximum(gl.minimum(lo + per_split, n_blocks) - lo, 0)
    table_row = BLOCK_TABLE + b.to(gl.int64) * stride_bt_b

    # shared memory: q, and a ring of NUM_BUFFERS tiles of K and V, each PAGES page boxes deep
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], Q.dtype.element_ty)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [BLOCK_M, HEAD_DIM], q_smem_layout)
    k_smem = gl.allocate_shared_memory(desc_k.dtype, [NUM_BUFFERS, BLOCK_N, HEAD_DIM], desc_k.layout)
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [NUM_BUFFERS, BLOCK_N, HEAD_DIM], desc_v.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
    fence_async_shared()

    # the ring's first tiles: one table read for all of them, then the copies
    ring_ids = _page_ids(table_row, n_table, n_pages, lo * PAGES, RING_IDS, ring_id_layout)
    for i in gl.static_range(NUM_BUFFERS):
        if i < n:
            _load_tile(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, ring_ids, i * PAGES, i, kv_head, PAGES,
                       ring_id_layout)

    # q rows: the group's query heads of this kv head (rows past the group are zero)
    rows = gl.arange(0, BLOCK_M, gl.SliceLayout(1, ld_layout))
    cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, ld_layout))
    head = kv_head * group + rows
    q_ptrs = Q + b.to(gl.int64) * stride_qb + gl.expand_dims(head.to(gl.int64) * stride_qh, 1) + gl.expand_dims(cols, 0)
    q = gl.load(q_ptrs, mask=gl.expand_dims(rows < group, 1), other=0.0)
    q_smem.store(q)
    fence_async_shared()

    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    key = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    for j in range(0, n):
        slot = j % NUM_BUFFERS
        phase = (j // NUM_BUFFERS) & 1
        start = (lo + j) * BLOCK_N
        k_tile = k_smem.index(slot)
        v_tile = v_smem.index(slot)
        # the refill's table entries, read now so their latency passes under this tile's MMAs
        ids_next = _page_ids(table_row, n_table, n_pages, (lo + j + NUM_BUFFERS) * PAGES, PAGES, id_layout)
        mbarrier.wait(k_ready.index(slot), phase)
        s = warpgroup_mma(q_smem, k_tile.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                          use_acc=False)
        # scaled, then masked: a masked -inf times a scale of 0 or below would be NaN
        s = gl.where(gl.expand_dims(start + key < seqlen, 0), s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        mbarrier.wait(v_ready.index(slot), phase)
        if start + BLOCK_N > seqlen:
            # the row's last tile: zero V's rows past its length (they may hold NaN), 16 rows at a time
            # (a whole tile in registers would raise the kernel's register peak)
            for r in gl.static_range(BLOCK_N // 16):
                if start + r * 16 + 16 > seqlen:  # chunks wholly inside the row's length stay as they are
                    chunk = v_tile.slice(r * 16, 16)
                    v = chunk.load(ld_layout)
                    vrow = start + r * 16 + gl.arange(0, 16, gl.SliceLayout(1, ld_layout))
                    chunk.store(gl.where(gl.expand_dims(vrow < seqlen, 1), v, gl.zeros_like(v)))
            fence_async_shared()
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        o = warpgroup_mma(gl.convert_layout(p.to(desc_v.dtype), p_layout), v_tile, o)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
        # the slot is free again (both MMAs reading it have retired): refill it NUM_BUFFERS tiles ahead
        if j + NUM_BUFFERS < n:
            _load_tile(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, ids_next, 0, slot, kv_head, PAGES, id_layout)

    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
    if USE_PDL:
        _gdc_launch_dependents()

    empty = l_i == 0.0
    inv_l = gl.convert_layout(gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_i)), gl.SliceLayout(1, o_layout))
    out = o * gl.expand_dims(inv_l, 1)
    lse = (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453
    orow = gl.arange(0, BLOCK_M, gl.SliceLayout(1, o_layout))
    ocol = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, o_layout))
    ohead = (kv_head * group + orow).to(gl.int64)
    o_ok = gl.expand_dims(orow < group, 1)
    lrow = gl.arange(0, BLOCK_M, row_layout)
    lhead = (kv_head * group + lrow).to(gl.int64)
    if NUM_SPLITS == 1:
        o_ptrs = O + b.to(gl.int64) * stride_ob + gl.expand_dims(ohead * stride_oh, 1) + gl.expand_dims(ocol, 0)
        gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_ok)
        gl.store(LSE + b.to(gl.int64) * stride_lse_b + lhead * stride_lse_h, gl.where(empty, float("inf"), lse),
                 mask=lrow < group)
    else:
        base = O_PART + split.to(gl.int64) * stride_ops + b.to(gl.int64) * stride_opb
        o_ptrs = base + gl.expand_dims(ohead * stride_oph, 1) + gl.expand_dims(ocol, 0)
        gl.store(o_ptrs, out, mask=o_ok)
        lbase = LSE_PART + split.to(gl.int64) * stride_lps + b.to(gl.int64) * stride_lpb
        gl.store(lbase + lhead * stride_lph, gl.where(empty, float("-inf"), lse), mask=lrow < group)
