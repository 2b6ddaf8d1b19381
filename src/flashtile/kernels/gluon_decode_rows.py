"""Whole-row decode in Gluon: one program per (batch row, key split) over every kv head, a warp a kv head
(an experiment, off by default; backends/triton/decode_gluon_rows.py).

In FlashAttention's (b, s, h_k, d) cache one key's kv heads lie side by side, h_k * d * 2 bytes (2 KB at h_k = 8,
d = 128). The per-head kernels read d * 2 bytes of each such row and leave the rest to other programs; on
head-major memory the Gluon per-head kernel matched cuDNN at b = 32, 128k where on this layout it trailed by
0.8% (session 19). Here a program copies whole rows, 16 keys a tile (32 KB of K and 32 KB of V at h_k = 8,
d = 128), and splits the keys so that two programs run on every SM.

Two programs of h_k warps an SM leave 128 registers a thread at h_k = 8, too few for a 16-row accumulator of
d = 128 per warp (64 registers, three quarters of them padding for a GQA group of 4). So the products are
transposed: S^T = K Q^T (keys are the MMA's 16 rows, the group's query heads its 8 columns) and
O^T += V^T P^T (d the rows, the query heads the columns): an 8-column accumulator, 32 registers at d = 128.
The online softmax runs down the columns of S^T.

The ring: two K slots and one V slot (96 KB at h_k = 8, d = 128). Tile j: wait for K_j, a barrier (every warp is
done with tile j - 1), issue K_{j+1} into the other K slot; S^T; wait for V_j, a barrier... O^T; a barrier (every
warp has read V_j), issue V_{j+1}. Copies of keys past the split's end are zero-filled and their scores -inf.

Writes the split's normalized partial output O_PART[split, b, 0, head] (fp32) and LSE_PART[split, b, head, 0]
(natural log; -inf for a split without keys); the split-KV combine kernel merges them.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from flashtile.kernels.gluon_decode_warp_keys import _row_length


@gluon.jit
def _issue_rows(smem, base, row0, hi, stride_n, heads, keys, cols, ok):
    """Copy keys [row0, row0 + BLOCK_N) of every kv head, as [head, key, d], into ``smem``; keys at or past
    ``hi`` (all of them when ``ok`` is false) are zero-filled; the caller commits the group."""
    pos = row0 + keys  # [1, BLOCK_N, 1]
    ptrs = base + pos.to(gl.int64) * stride_n + heads + cols
    async_copy.async_copy_global_to_shared(smem, ptrs, mask=(pos < hi) & ok)


@gluon.jit
def _load_q_t(Q, b, stride_qb, stride_qh, group, d0, HEADS: gl.constexpr, WIDTH: gl.constexpr, COLS: gl.constexpr,
              layout: gl.constexpr):
    """Q^T's d columns [d0, d0 + WIDTH) of batch row b as [kv head, d, query head of the group] in ``layout``;
    columns past the group are zero."""
    q_h = gl.arange(0, HEADS, gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    q_d = gl.arange(0, WIDTH, gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    q_c = gl.arange(0, COLS, gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    q_head = gl.expand_dims(gl.expand_dims(q_h, 1), 2) * group + gl.expand_dims(gl.expand_dims(q_c, 0), 1)
    q_ptrs = (Q + b.to(gl.int64) * stride_qb + q_head.to(gl.int64) * stride_qh
              + gl.expand_dims(gl.expand_dims(d0 + q_d, 0), 2))
    q_ok = gl.expand_dims(gl.expand_dims(q_c < group, 0), 1) & gl.expand_dims(gl.expand_dims(q_h >= 0, 1), 2)
    return gl.load(q_ptrs, mask=q_ok, other=0.0)


@gluon.jit
def _softmax_step(st, valid, qk_scale, m_i, l_i):
    """One tile of the online softmax down S^T's columns ([head, key, query head], keys along axis 1): the
    probabilities p (log2 units, unnormalized), the rescale alpha of the earlier tiles, and the new max and sum."""
    # scaled, then masked: a masked -inf times a scale of 0 or below would be NaN
    st = gl.where(valid, st * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(st, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(st - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _store_partials(O_PART, LSE_PART, ot, m_i, l_i, b, split, group, d0, stride_ops, stride_opb, stride_oph,
                    stride_lps, stride_lpb, stride_lph, WITH_LSE: gl.constexpr, HEADS: gl.constexpr,
                    WIDTH: gl.constexpr, COLS: gl.constexpr, mma: gl.constexpr):
    """The split's normalized partial output O^T [kv head, d in [d0, d0 + WIDTH), query head] into
    O_PART[split, b, 0, head, d] (fp32), and when WITH_LSE its log-sum-exp (natural log, -inf for no keys) into
    LSE_PART[split, b, head, 0]; m_i / l_i [kv head, query head] are the online softmax's max (log2 units) and sum."""
    empty = l_i == 0.0
    out = ot / gl.expand_dims(gl.where(empty, 1.0, l_i), 1)
    o_h = gl.arange(0, HEADS, gl.SliceLayout(1, gl.SliceLayout(2, mma)))
    o_d = gl.arange(0, WIDTH, gl.SliceLayout(0, gl.SliceLayout(2, mma)))
    o_c = gl.arange(0, COLS, gl.SliceLayout(0, gl.SliceLayout(1, mma)))
    o_head = gl.expand_dims(gl.expand_dims(o_h, 1), 2) * group + gl.expand_dims(gl.expand_dims(o_c, 0), 1)
    o_ptrs = (O_PART + split.to(gl.int64) * stride_ops + b.to(gl.int64) * stride_opb
              + o_head.to(gl.int64) * stride_oph + gl.expand_dims(gl.expand_dims(d0 + o_d, 0), 2))
    o_ok = gl.expand_dims(gl.expand_dims(o_c < group, 0), 1) & gl.expand_dims(gl.expand_dims(o_h >= 0, 1), 2)
    gl.store(o_ptrs, out, mask=o_ok)
    if WITH_LSE:
        col_state: gl.constexpr = gl.SliceLayout(1, mma)
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        l_h = gl.arange(0, HEADS, gl.SliceLayout(1, col_state))
        l_c = gl.arange(0, COLS, gl.SliceLayout(0, col_state))
        l_head = gl.expand_dims(l_h, 1) * group + gl.expand_dims(l_c, 0)
        l_ok = gl.expand_dims(l_c < group, 0) & gl.expand_dims(l_h >= 0, 1)
        gl.store(LSE_PART + split.to(gl.int64) * stride_lps + b.to(gl.int64) * stride_lpb
                 + l_head.to(gl.int64) * stride_lph, lse, mask=l_ok)


@gluon.jit
def _gluon_decode_rows_kernel(
    Q, K, V, O_PART, LSE_PART, SEQLENS, qk_scale, group, cache_len_const, s_new, capacity, num_splits,
    stride_qb, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_ops, stride_opb, stride_oph, stride_lps, stride_lpb, stride_lph,
    HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, HAS_SEQLENS: gl.constexpr = True,
):
    """q (b, 1, h, d) against a (b, capacity, HEADS, d) cache holding cache_seqlens[b] (or cache_len_const)
    + s_new keys a row (the new ones already appended); program pid = b * num_splits + split, a warp a kv head
    (the split count a runtime argument: it follows b, which must not compile a kernel per batch size).
    ``qk_scale`` is softmax_scale * log2(e); ``group`` (h / h_k) is at most 8."""
    BLOCK_N: gl.constexpr = 16  # keys a tile: S^T's MMA rows
    COLS: gl.constexpr = 8  # the group's query heads, padded to one MMA's columns
    gl.static_assert(gl.num_warps() == HEADS, "a warp a kv head")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[HEADS, 1, 1],
                                                  instr_shape=[1, 16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # copies: 16 bytes a thread along d; a warp's threads cover whole d-pieces of TPH adjacent heads of one key row
    # (contiguous in global memory), the warps the remaining heads and further keys
    TPD: gl.constexpr = HEAD_DIM // 8  # threads along d
    TPH: gl.constexpr = 32 // TPD  # threads along heads
    WH: gl.constexpr = HEADS // TPH  # warps along heads
    cp_layout: gl.constexpr = gl.BlockedLayout([1, 1, 8], [TPH, 1, TPD], [WH, HEADS // WH, 1], [2, 0, 1])
    smem_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0])

    pid = gl.program_id(0)
    b = pid // num_splits
    split = pid % num_splits
    _, seqlen = _row_length(SEQLENS, b, cache_len_const, s_new, capacity, HAS_SEQLENS, "")
    per = gl.cdiv(gl.cdiv(seqlen, BLOCK_N), num_splits) * BLOCK_N
    lo = split * per
    hi = gl.minimum(lo + per, seqlen)
    n = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    k_base = K + b.to(gl.int64) * stride_kb
    v_base = V + b.to(gl.int64) * stride_vb

    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [2, HEADS, BLOCK_N, HEAD_DIM], smem_layout)
    v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [1, HEADS, BLOCK_N, HEAD_DIM], smem_layout)
    c_h = gl.arange(0, HEADS, gl.SliceLayout(1, gl.SliceLayout(2, cp_layout)))
    c_n = gl.arange(0, BLOCK_N, gl.SliceLayout(0, gl.SliceLayout(2, cp_layout)))
    c_d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, gl.SliceLayout(1, cp_layout)))
    keys = gl.expand_dims(gl.expand_dims(c_n, 0), 2)  # [1, BLOCK_N, 1]
    k_heads = gl.expand_dims(gl.expand_dims(c_h * stride_kh, 1), 2)  # [HEADS, 1, 1]
    v_heads = gl.expand_dims(gl.expand_dims(c_h * stride_vh, 1), 2)
    cols = gl.expand_dims(gl.expand_dims(c_d, 0), 1)  # [1, 1, HEAD_DIM]
    # groups in flight at a tile's top: K_j, V_j (in that order)
    _issue_rows(k_smem.index(0), k_base, lo, hi, stride_kn, k_heads, keys, cols, n > 0)
    async_copy.commit_group()
    _issue_rows(v_smem.index(0), v_base, lo, hi, stride_vn, v_heads, keys, cols, n > 0)
    async_copy.commit_group()

    qt = _load_q_t(Q, b, stride_qb, stride_qh, group, 0, HEADS, HEAD_DIM, COLS, b_layout)

    col_state: gl.constexpr = gl.SliceLayout(1, mma)  # [head, query head]
    m_i = gl.full([HEADS, COLS], float("-inf"), gl.float32, col_state)
    l_i = gl.zeros([HEADS, COLS], gl.float32, col_state)
    ot = gl.zeros([HEADS, HEAD_DIM, COLS], gl.float32, mma)
    s_n = gl.arange(0, BLOCK_N, gl.SliceLayout(0, gl.SliceLayout(2, mma)))
    key_in_tile = gl.expand_dims(gl.expand_dims(s_n, 0), 2)  # [1, BLOCK_N, 1]
    for j in range(0, n):
        row0 = lo + j * BLOCK_N
        # K_j landed for every thread, and every warp is done with tile j - 1 (its K slot takes K_{j+1})
        async_copy.wait_group(1)
        gl.thread_barrier()
        _issue_rows(k_smem.index((j + 1) % 2), k_base, row0 + BLOCK_N, hi, stride_kn, k_heads, keys, cols,
                    j + 1 < n)
        async_copy.commit_group()
        kt = k_smem.index(j % 2).load(a_layout)  # [head, key, d]: S^T's A operand
        st = mma_v2(kt, qt, gl.zeros([HEADS, BLOCK_N, COLS], gl.float32, mma))
        p, alpha, m_i, l_i = _softmax_step(st, row0 + key_in_tile < hi, qk_scale, m_i, l_i)
        # V_j landed for every thread (K_{j+1} may still be in flight)
        async_copy.wait_group(1)
        gl.thread_barrier()
        vt = v_smem.index(0).permute((0, 2, 1)).load(a_layout)  # [head, d, key]: O^T's A operand
        pt = gl.convert_layout(p.to(V.dtype.element_ty), b_layout)  # [head, key, query head]
        ot = mma_v2(vt, pt, ot * gl.expand_dims(alpha, 1))
        gl.thread_barrier()  # every warp has read V_j: its slot takes V_{j+1}
        _issue_rows(v_smem.index(0), v_base, row0 + BLOCK_N, hi, stride_vn, v_heads, keys, cols, j + 1 < n)
        async_copy.commit_group()
    async_copy.wait_group(0)

    _store_partials(O_PART, LSE_PART, ot, m_i, l_i, b, split, group, 0, stride_ops, stride_opb, stride_oph,
                    stride_lps, stride_lpb, stride_lph, True, HEADS, HEAD_DIM, COLS, mma)
