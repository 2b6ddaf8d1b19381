"""Whole-row decode in Gluon with descriptor (TMA) copies: the whole-row kernel (kernels/gluon_decode_rows.py)
with its 16-key tiles moved by TMA copies instead of 16-byte copies a thread (an experiment, off by default:
FLASHTILE_DECODE_GLUON_ROWS=1 takes it unless FLASHTILE_DECODE_GLUON_ROWS_TMA=0; backends/triton/decode_gluon_rows.py).

Why: the 16-byte copies cost every thread 32 copy instructions a tile, each with its own 64-bit address and
mask, and DRAM sees the tile as 4096 separate requests; a TMA copy is one instruction, and the copy engine walks
the tile's 16 whole 2 KB rows (h_k = 8, d = 128) in order.

The descriptors see the (b, capacity, h_k, d) cache as [b, h_k, capacity, d] (strides [stride_b, stride_h,
stride_n, 1]) with [1, h_k, 16, 64] blocks: a tile is one copy a 64-wide half of d, and each lands in shared
memory as [head, key, 64], so one head's 16 keys are 16 consecutive swizzled 128-byte rows, from which the MMA
operands load without bank conflicts (a [key, head, d] copy would put them 2 KB apart, on the same banks). The
products are the whole-row kernel's, transposed (S^T = K Q^T, O^T += V^T P^T), one MMA per half of d.

The ring: K_SLOTS K tiles and V_SLOTS V tiles in flight, each slot with its own mbarrier; a CTA barrier after a
tile's MMAs (every warp has read the slot) comes before the slot's refill. TMA copies keys past the cache's
capacity as zeros but keys in [seqlen, capacity) as whatever the cache holds there (perhaps NaN): their scores are
masked to -inf and their values to 0 in registers, so P V never sees them.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from flashtile.kernels.gluon_decode_rows import _load_q_t, _softmax_step, _store_partials
from flashtile.kernels.gluon_decode_warp_keys import _row_length

BLOCK_N = 16  # keys a tile: S^T's MMA rows
HALF = 64  # d columns a TMA block row: 128 bytes, the widest swizzled row


@gluon.jit
def _issue_tile(desc, smem, bars, tile, lo, b, SLOTS: gl.constexpr, HALVES: gl.constexpr):
    """Start the TMA copies of keys [lo + 16 tile, + 16) of batch row b, every kv head, into slot tile % SLOTS:
    one copy a 64-wide half of d, into buffers HALVES * slot + half, both signalling the slot's barrier."""
    slot = tile % SLOTS
    mbarrier.expect(bars.index(slot), HALVES * desc.block_type.nbytes)
    for half in gl.static_range(HALVES):
        tma.async_copy_global_to_shared(desc, [b, 0, lo + tile * 16, half * 64], bars.index(slot),
                                        smem.index(slot * HALVES + half))


@gluon.jit
def _half(smem, slot, half: gl.constexpr, HEADS: gl.constexpr, HALVES: gl.constexpr):
    """Slot ``slot``'s d columns [64 half, + 64) as a [HEADS, 16 keys, 64] view."""
    return smem.index(slot * HALVES + half).reshape([HEADS, 16, 64])


@gluon.jit
def _gluon_decode_rows_tma_kernel(
    Q, desc_k, desc_v, O_PART, LSE_PART, SEQLENS, qk_scale, group, cache_len_const, s_new, capacity, num_splits,
    stride_qb, stride_qh, stride_ops, stride_opb, stride_oph, stride_lps, stride_lpb, stride_lph,
    HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, K_SLOTS: gl.constexpr = 2, V_SLOTS: gl.constexpr = 1,
    HAS_SEQLENS: gl.constexpr = True,
):
    """q (b, 1, h, d) against the caches behind desc_k / desc_v ([b, HEADS, capacity, d] views, blocks
    [1, HEADS, 16, 64]) holding cache_seqlens[b] (or cache_len_const) + s_new keys a row (the new ones
    already appended); program pid = b * num_splits + split, a warp a kv head. ``qk_scale`` is
    softmax_scale * log2(e); ``group`` (h / h_k) is at most 8. Writes the split's partials as the whole-row kernel
    does (the combine kernel merges them; an in-kernel merge by the last split to finish was no faster at b = 32
    and 1%-7% slower at b = 8 in session 20, and was removed: code at b7d5fd5)."""
    COLS: gl.constexpr = 8  # the group's query heads, padded to one MMA's columns
    HALVES: gl.constexpr = HEAD_DIM // 64
    gl.static_assert(gl.num_warps() == HEADS, "a warp a kv head")
    gl.static_assert(HALVES == 1 or HALVES == 2, "d = 64 or 128")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[HEADS, 1, 1],
                                                  instr_shape=[1, 16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    dtype: gl.constexpr = desc_k.dtype

    pid = gl.program_id(0)
    b = pid // num_splits
    split = pid % num_splits
    _, seqlen = _row_length(SEQLENS, b, cache_len_const, s_new, capacity, HAS_SEQLENS, "")
    per = gl.cdiv(gl.cdiv(seqlen, 16), num_splits) * 16
    lo = split * per
    hi = gl.minimum(lo + per, seqlen)
    n = gl.cdiv(gl.maximum(hi - lo, 0), 16)

    k_smem = gl.allocate_shared_memory(dtype, [K_SLOTS * HALVES] + desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [V_SLOTS * HALVES] + desc_v.block_type.shape, desc_v.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [K_SLOTS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(K_SLOTS):
        mbarrier.init(k_ready.index(i), count=1)
    for i in gl.static_range(V_SLOTS):
        mbarrier.init(v_ready.index(i), count=1)
    fence_async_shared()  # the barriers' initialisation is visible to the TMA unit before it signals them
    for i in gl.static_range(K_SLOTS):
        if i < n:
            _issue_tile(desc_k, k_smem, k_ready, i, lo, b, K_SLOTS, HALVES)
    for i in gl.static_range(V_SLOTS):
        if i < n:
            _issue_tile(desc_v, v_smem, v_ready, i, lo, b, V_SLOTS, HALVES)

    qt0 = _load_q_t(Q, b, stride_qb, stride_qh, group, 0, HEADS, 64, COLS, b_layout)
    qt1 = _load_q_t(Q, b, stride_qb, stride_qh, group, 64 * (HALVES - 1), HEADS, 64, COLS, b_layout)
    col_state: gl.constexpr = gl.SliceLayout(1, mma)  # [head, query head]
    m_i = gl.full([HEADS, COLS], float("-inf"), gl.float32, col_state)
    l_i = gl.zeros([HEADS, COLS], gl.float32, col_state)
    ot0 = gl.zeros([HEADS, 64, COLS], gl.float32, mma)
    ot1 = gl.zeros([HEADS, 64, COLS], gl.float32, mma)  # d = 64: never updated (the compiler drops it)
    s_n = gl.arange(0, 16, gl.SliceLayout(0, gl.SliceLayout(2, mma)))
    key_in_tile = gl.expand_dims(gl.expand_dims(s_n, 0), 2)  # [1, 16, 1]: S^T's keys
    v_n = gl.arange(0, 16, gl.SliceLayout(0, gl.SliceLayout(1, a_layout)))
    v_key = gl.expand_dims(gl.expand_dims(v_n, 0), 1)  # [1, 1, 16]: V^T's keys
    for j in range(0, n):
        row0 = lo + j * 16
        ks = j % K_SLOTS
        mbarrier.wait(k_ready.index(ks), (j // K_SLOTS) & 1)
        st = mma_v2(_half(k_smem, ks, 0, HEADS, HALVES).load(a_layout), qt0,
                    gl.zeros([HEADS, 16, COLS], gl.float32, mma))
        if HALVES == 2:
            st = mma_v2(_half(k_smem, ks, 1, HEADS, HALVES).load(a_layout), qt1, st)
        gl.thread_barrier()  # every warp has read K_j: its slot takes K_{j + K_SLOTS}
        if j + K_SLOTS < n:
            _issue_tile(desc_k, k_smem, k_ready, j + K_SLOTS, lo, b, K_SLOTS, HALVES)
        p, alpha, m_i, l_i = _softmax_step(st, row0 + key_in_tile < hi, qk_scale, m_i, l_i)
        pt = gl.convert_layout(p.to(dtype), b_layout)  # [head, key, query head]
        vs = j % V_SLOTS
        mbarrier.wait(v_ready.index(vs), (j // V_SLOTS) & 1)
        v_ok = row0 + v_key < hi  # keys past the split's end: perhaps not finite (never appended)
        vt0 = _half(v_smem, vs, 0, HEADS, HALVES).permute((0, 2, 1)).load(a_layout)  # [head, d, key]
        vt0 = gl.where(v_ok, vt0, 0.0).to(dtype)
        ot0 = mma_v2(vt0, pt, ot0 * gl.expand_dims(alpha, 1))
        if HALVES == 2:
            vt1 = _half(v_smem, vs, 1, HEADS, HALVES).permute((0, 2, 1)).load(a_layout)
            vt1 = gl.where(v_ok, vt1, 0.0).to(dtype)
            ot1 = mma_v2(vt1, pt, ot1 * gl.expand_dims(alpha, 1))
        gl.thread_barrier()  # every warp has read V_j: its slot takes V_{j + V_SLOTS}
        if j + V_SLOTS < n:
            _issue_tile(desc_v, v_smem, v_ready, j + V_SLOTS, lo, b, V_SLOTS, HALVES)
    for i in gl.static_range(K_SLOTS):
        mbarrier.invalidate(k_ready.index(i))
    for i in gl.static_range(V_SLOTS):
        mbarrier.invalidate(v_ready.index(i))

    _store_partials(O_PART, LSE_PART, ot0, m_i, l_i, b, split, group, 0, stride_ops, stride_opb, stride_oph,
                    stride_lps, stride_lpb, stride_lph, True, HEADS, 64, COLS, mma)
    if HALVES == 2:
        _store_partials(O_PART, LSE_PART, ot1, m_i, l_i, b, split, group, 64, stride_ops, stride_opb, stride_oph,
                        stride_lps, stride_lpb, stride_lph, False, HEADS, 64, COLS, mma)
