"""MLA decode (DeepSeek's multi-head latent attention, absorbed form) on Hopper in Gluon.

A query row r (token r // h, head r % h of the one latent head) scores key n as
``(q[r] . k[n] + qv[r] . v[n]) * scale`` with q / k the 64 rope dims and qv / v the 512 latent dims, and its
output is ``sum_n P[r, n] v[n]``: the latent cache is both the rest of the key and the value. At h = 128 a key
costs about as many tensor-core cycles as HBM cycles, so the kernel must keep both busy and compute nothing
twice. The Triton kernel (decode_mla.py) cannot: ``tl.dot`` gives both warpgroups of an 8-warp program the
same 64 rows, so each computes every score. Here the layouts split the work explicitly:

    one CTA: 64 query rows, 8 warps = two warpgroups
    scores S (64 x BLOCK_N keys)       warps [4, 2]: warpgroup w computes keys w * BLOCK_N / 2 ...
    output O (64 x 512) as two halves  warps [4, 2]: each warpgroup owns 128 columns of each half
    P (64 x BLOCK_N) is converted to the A-operand layout both warpgroups need (through shared memory)

Each block's row max of S crosses the two warpgroups (the compiler reduces through shared memory); the row
sums stay per score column until the loop ends. K (64 dims)
and V (512 dims, as two 256-column TMA boxes, TMA's widest) stream through a NUM_BUFFERS-deep ring of TMA
loads issued by the same warps, one barrier per slot; q and qv sit in shared memory for the whole loop.

Each program covers one split of the keys (NUM_SPLITS > 1: normalised fp32 partials and their lse, merged
by decode/common.combine). The cache is contiguous (b, s, 1, d) or paged (pages, page_size, 1, d) with
BLOCK_N dividing page_size, read through 2-D descriptors over its rows. Keys past a row's length are masked
in the scores; the values of the sequence's last, partial block are zeroed in shared memory first, since the
cache past the length may hold anything (0 * NaN is NaN in the output product).
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

# TMA moves boxes of at most 256 elements a dimension: v's 512 latent dims arrive as two
V_BOX_COLS = 256
V_BOX = gl.constexpr(V_BOX_COLS)


@gluon.constexpr_function
def split_mma_layout(n):
    # 8 warps: the two warpgroups side by side along N, each over all 64 rows
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, n // 2, 16])


@gluon.jit
def _load_block(desc_k, desc_v, k_smem, v_smem, ready, j, blk, b, page_size, cache_rows, BLOCK_TABLE, stride_bt,
                NUM_BUFFERS: gl.constexpr, BLOCK_N: gl.constexpr, PAGED: gl.constexpr):
    """TMA loads of key block ``blk`` (the program's ``j``-th) into ring slot j % NUM_BUFFERS."""
    slot = j % NUM_BUFFERS
    start = blk * BLOCK_N
    if PAGED:
        page = gl.load(BLOCK_TABLE + b * stride_bt + start // page_size)
        row = page * page_size + start % page_size
    else:
        row = b * cache_rows + start
    bar = ready.index(slot)
    mbarrier.expect(bar, desc_k.block_type.nbytes + 2 * desc_v.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_k, [row, 0], bar, k_smem.index(slot))
    tma.async_copy_global_to_shared(desc_v, [row, 0], bar, v_smem.index(2 * slot))
    tma.async_copy_global_to_shared(desc_v, [row, V_BOX], bar, v_smem.index(2 * slot + 1))


@gluon.jit
def _zero_tail(v_smem, slot, valid, BLOCK_N: gl.constexpr):
    """Zero the value rows at and past ``valid`` in both halves of a slot (the sequence's partial last block)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    keep = gl.expand_dims(gl.arange(0, BLOCK_N, gl.SliceLayout(1, layout)) < valid, 1)
    for half in gl.static_range(2):
        tile = v_smem.index(2 * slot + half)
        tile.store(gl.where(keep, tile.load(layout), 0.0))
    # every warp's stores done, and visible to the tensor cores' (async proxy) reads
    gl.thread_barrier()
    fence_async_shared()


@gluon.jit
def _issue_scores(q_smem, qv_smem, k_smem, v_smem, ready, j, s_layout: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """S = q . K^T + qv . V^T of the program's j-th block, issued (in flight on return)."""
    slot = j % NUM_BUFFERS
    mbarrier.wait(ready.index(slot), (j // NUM_BUFFERS) & 1)
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(qv_smem.index(0), v_smem.index(2 * slot).permute((1, 0)), s, is_async=True)
    return warpgroup_mma(qv_smem.index(1), v_smem.index(2 * slot + 1).permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax(s, m_i, l_cols, blk, last_key, qk_scale, col_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """Online softmax of one block's scores (base 2): P, the rescale of what came before, the new row max and
    the per-column row sums."""
    key = blk * BLOCK_N + gl.arange(0, BLOCK_N, col_layout)
    s = gl.where(gl.expand_dims(key, 0) <= gl.expand_dims(last_key, 1), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    # a row whose keys all lie past its diagonal in this block keeps P and alpha at 0, not NaN
    m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_base, 1))
    alpha = gl.exp2(m_i - m_base)
    return p, alpha, m_new, l_cols * gl.expand_dims(alpha, 1) + p


@gluon.jit
def _issue_pv(p, alpha, o0, o1, v_smem, slot, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """O = O * alpha + P V of one block, both 256-column halves, issued; returns P in its operand layout (it
    must stay live until the products retire)."""
    scale = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    o0 = warpgroup_mma(p, v_smem.index(2 * slot), o0 * scale, is_async=True)
    o1 = warpgroup_mma(p, v_smem.index(2 * slot + 1), o1 * scale, is_async=True)
    return o0, o1, p


@gluon.jit
def _gluon_mla_decode_kernel(desc_k, desc_v, Q, QV, O, LSE, O_PART, LSE_PART, SEQLENS, BLOCK_TABLE,
                             qk_scale, cache_len_const, s_new, seqlen_q, heads, num_m_blocks, page_size, cache_rows,
                             stride_qb, stride_qm, stride_qh, stride_qvb, stride_qvm, stride_qvh,
                             stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
                             stride_ops, stride_opb, stride_opm, stride_oph, stride_lps, stride_lpb, stride_lph,
                             stride_bt,
                             HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr,
                             NUM_BUFFERS: gl.constexpr, NUM_SPLITS: gl.constexpr, PAGED: gl.constexpr,
                             HAS_SEQLENS: gl.constexpr, CAUSAL: gl.constexpr):
    """q (b, sq, h, HEAD_DIM), qv (b, sq, h, HEAD_DIM_V) against one latent head: desc_k / desc_v over the
    cache's rows (b * cache_rows or pages * page_size, HEAD_DIM / HEAD_DIM_V; v in V_BOX-column boxes).
    Writes out (b, sq, h, dv) and lse (b, h, sq) (natural log), or with NUM_SPLITS > 1 the split's normalised
    partial O_PART (ns, b, sq, h, dv) fp32 and LSE_PART (ns, b, h, sq). ``qk_scale``: softmax_scale * log2(e).
    CAUSAL (several query tokens): token t sees the keys up to its own, seqlen_k - seqlen_q + t. Every product
    is waited for in its block: the row max crosses the warpgroups through shared memory, and with the next
    block's scores issued before the softmax (the Gluon forward's schedule) ptxas still waited for them there."""
    BLOCK_M: gl.constexpr = 64
    gl.static_assert(gl.num_warps() == 8)
    gl.static_assert(HEAD_DIM_V == 2 * V_BOX)
    s_layout: gl.constexpr = split_mma_layout(BLOCK_N)
    o_layout: gl.constexpr = split_mma_layout(V_BOX)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    pid = gl.program_id(0)
    pid_m = pid % num_m_blocks
    split = (pid // num_m_blocks) % NUM_SPLITS
    b = pid // (num_m_blocks * NUM_SPLITS)
    # the keys: the cache's before this call's append, and the s_new appended (already written)
    if HAS_SEQLENS:
        seqlen_k = gl.load(SEQLENS + b) + s_new
    else:
        seqlen_k = cache_len_const + s_new
    n_blocks = gl.cdiv(seqlen_k, BLOCK_N)
    per_split = gl.cdiv(n_blocks, NUM_SPLITS)
    blk_lo = split * per_split
    blk_hi = gl.minimum(blk_lo + per_split, n_blocks)
    n_mine = gl.maximum(blk_hi - blk_lo, 0)

    # shared memory: q, qv (two halves) for the whole loop, a ring of K and V (two halves a slot)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], Q.dtype.element_ty)
    qv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, V_BOX], Q.dtype.element_ty)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [BLOCK_M, HEAD_DIM], q_sl)
    qv_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, BLOCK_M, V_BOX], qv_sl)
    k_smem = gl.allocate_shared_memory(desc_k.dtype, [NUM_BUFFERS] + desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [2 * NUM_BUFFERS] + desc_v.block_type.shape, desc_v.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()
    for i in gl.static_range(NUM_BUFFERS):
        if i < n_mine:
            _load_block(desc_k, desc_v, k_smem, v_smem, ready, i, blk_lo + i, b, page_size, cache_rows,
                        BLOCK_TABLE, stride_bt, NUM_BUFFERS, BLOCK_N, PAGED)

    # the query rows: r = t * heads + head; rows past seqlen_q * heads load as 0 and are never stored
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    r = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, ld))
    r_ok = gl.expand_dims(r < seqlen_q * heads, 1)
    t = (r // heads).to(gl.int64)
    head = (r % heads).to(gl.int64)
    b64 = b.to(gl.int64)
    cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, ld))
    q_rows = Q + b64 * stride_qb + t * stride_qm + head * stride_qh
    q_smem.store(gl.load(gl.expand_dims(q_rows, 1) + gl.expand_dims(cols, 0), mask=r_ok, other=0.0))
    vcols = gl.arange(0, V_BOX, gl.SliceLayout(0, ld))
    qv_rows = QV + b64 * stride_qvb + t * stride_qvm + head * stride_qvh
    for half in gl.static_range(2):
        ptrs = gl.expand_dims(qv_rows, 1) + gl.expand_dims(vcols + half * V_BOX, 0)
        qv_smem.index(half).store(gl.load(ptrs, mask=r_ok, other=0.0))
    gl.thread_barrier()
    fence_async_shared()

    rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, row_layout)
    # each row's last visible key (CAUSAL: the bottom-right diagonal of its token)
    last_key = gl.full([BLOCK_M], 0, gl.int32, row_layout) + (seqlen_k - 1)
    if CAUSAL:
        last_key = seqlen_k - seqlen_q + rows // heads
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    # the row sums stay per score column until the end: summed every block, they would cross the two
    # warpgroups (shared memory and a barrier) once more per block than the row max already does
    l_cols = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    o0 = gl.zeros([BLOCK_M, V_BOX], gl.float32, o_layout)
    o1 = gl.zeros([BLOCK_M, V_BOX], gl.float32, o_layout)
    for j in range(0, n_mine):
        slot = j % NUM_BUFFERS
        blk = blk_lo + j
        mbarrier.wait(ready.index(slot), (j // NUM_BUFFERS) & 1)
        if (blk + 1) * BLOCK_N > seqlen_k:
            _zero_tail(v_smem, slot, seqlen_k - blk * BLOCK_N, BLOCK_N)
        s = _issue_scores(q_smem, qv_smem, k_smem, v_smem, ready, j, s_layout, NUM_BUFFERS, BLOCK_M, BLOCK_N)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        p, alpha, m_i, l_cols = _softmax(s, m_i, l_cols, blk, last_key, qk_scale, col_layout, BLOCK_N)
        o0, o1, p = _issue_pv(p, alpha, o0, o1, v_smem, slot, o_layout, p_layout)
        o0, o1, p = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, p))
        # the slot is free (its K and V retired with these products): refill it with the block NUM_BUFFERS on
        if j + NUM_BUFFERS < n_mine:
            _load_block(desc_k, desc_v, k_smem, v_smem, ready, j + NUM_BUFFERS, blk + NUM_BUFFERS, b, page_size,
                        cache_rows, BLOCK_TABLE, stride_bt, NUM_BUFFERS, BLOCK_N, PAGED)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(ready.index(i))

    # O / l and the natural-log lse. A row that saw no key gets 0 and, as a partial (an empty split), lse -inf,
    # which the merge weighs to nothing; as the final result lse +inf, the contract's rule
    l_i = gl.sum(l_cols, 1)
    seen = l_i > 0.0
    inv_l = gl.convert_layout(gl.where(seen, 1.0 / l_i, 0.0), gl.SliceLayout(1, o_layout))
    lse = gl.where(seen, (m_i + gl.log2(l_i)) * 0.6931471805599453, float("-inf") if NUM_SPLITS > 1 else float("inf"))
    orow = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, o_layout))
    ocol = gl.arange(0, V_BOX, gl.SliceLayout(0, o_layout))
    ot = (orow // heads).to(gl.int64)
    ohead = (orow % heads).to(gl.int64)
    o_ok = gl.expand_dims(orow < seqlen_q * heads, 1)
    lt = (rows // heads).to(gl.int64)
    lhead = (rows % heads).to(gl.int64)
    l_ok = rows < seqlen_q * heads
    if NUM_SPLITS > 1:
        o_base = O_PART + split.to(gl.int64) * stride_ops + b64 * stride_opb + ot * stride_opm + ohead * stride_oph
        gl.store(LSE_PART + split.to(gl.int64) * stride_lps + b64 * stride_lpb + lhead * stride_lph + lt, lse,
                 mask=l_ok)
    else:
        o_base = O + b64 * stride_ob + ot * stride_om + ohead * stride_oh
        gl.store(LSE + b64 * stride_lb + lhead * stride_lh + lt, lse, mask=l_ok)
    _store_half(o0, inv_l, o_base, ocol, o_ok, O, NUM_SPLITS > 1)
    _store_half(o1, inv_l, o_base, ocol + V_BOX, o_ok, O, NUM_SPLITS > 1)


@gluon.jit
def _store_half(acc, inv_l, o_base, ocol, o_ok, O, PARTIAL: gl.constexpr):
    out = acc * gl.expand_dims(inv_l, 1)
    ptrs = gl.expand_dims(o_base, 1) + gl.expand_dims(ocol, 0)
    if PARTIAL:
        gl.store(ptrs, out, mask=o_ok)
    else:
        gl.store(ptrs, out.to(O.dtype.element_ty), mask=o_ok)


# Key blocks by cache layout, first that fits: 64 keys in a 2-slot ring (~220 KiB with q and qv, 244 registers) where
# the pages hold whole blocks (1.2x-1.6x faster than 32 keys in 3 slots on an H100: fewer barriers and wgmma waits
# per key, scripts/tune_gluon_mla.py), else 32 keys in 3 slots (~184 KiB, 218 registers) for 32-key pages
GLUON_MLA_CONFIGS = (dict(BLOCK_N=64, NUM_BUFFERS=2, num_warps=8), dict(BLOCK_N=32, NUM_BUFFERS=3, num_warps=8))


def gluon_mla_config(page_size: int | None) -> dict | None:
    """The launch config for a contiguous cache (``page_size`` None) or pages of ``page_size`` keys; None when no
    config's key block divides the pages."""
    for cfg in GLUON_MLA_CONFIGS:
        if page_size is None or page_size % cfg["BLOCK_N"] == 0:
            return cfg
    return None
