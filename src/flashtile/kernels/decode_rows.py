"""Whole-row decode: one program per (batch row, group of kv heads, key split); the rule for long caches on large
batches since session 24 (backends/triton/decode_rows.py says which calls).

In the (b, capacity, h_k, d) cache that flash_attn_with_kvcache takes, one key's kv heads lie side by side:
a program per (row, kv head) reads d * 2 bytes (256 B at d = 128) of every h_k * d * 2-byte key row, and the
row's other heads come from other programs at other times. On the same kernel a head-major cache (each kv
head one contiguous stream, the layout cuDNN reads) was 0.8% faster at b = 32, 128k (session 19). A program
here reads HEADS adjacent kv heads of each key, HEADS * d * 2 contiguous bytes (all h_k heads: whole rows),
and splits the keys instead, so that the grid stays as large. Batched (3D) dots: one head's query group a
batch entry, padded to BLOCK_M rows. The splits are merged by the split-KV combine kernel (or, FUSED_COMBINE, by
the last split of a row to finish). A paged cache (PAGE_SIZE > 0, a multiple of BLOCK_N) is read the same way, each
tile from the page the row's block table names (session 26).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _stamp(STAMPS, pid, slot: tl.constexpr):
    """The STAMP diagnostic (backends/triton/decode_rows.STAMPS): %globaltimer (ns) into STAMPS[pid, slot], and at
    slot 0 the SM's id (%smid) into STAMPS[pid, 3]."""
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(STAMPS + pid * 4 + slot, t)
    if slot == 0:
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
        tl.store(STAMPS + pid * 4 + 3, sm.to(tl.int64))


@triton.jit
def _rows_tile(q, m_i, l_i, acc, k_ptrs, v_ptrs, start, hi, qk_scale, offs_n, MASKED: tl.constexpr):
    """One tile of BLOCK_N keys from ``start``: the online-softmax step for every head of the program."""
    if MASKED:
        ok = (start + offs_n) < hi  # [1, BLOCK_N, 1]
        k = tl.load(k_ptrs, mask=ok, other=0.0)
        v = tl.load(v_ptrs, mask=ok, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = tl.dot(q, tl.permute(k, (0, 2, 1))) * qk_scale  # [HEADS, BLOCK_M, BLOCK_N], log2 units
    if MASKED:
        s = tl.where(tl.permute(ok, (0, 2, 1)), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 2))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, :, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 2)
    acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _tile_ptrs(k_ptrs, v_ptrs, BT_ROW, start, stride_kb, stride_kn, stride_vb, stride_vn, PAGE_SIZE: tl.constexpr):
    """The K and V pointers of the tile of keys from ``start``. Contiguous (PAGE_SIZE 0): k_ptrs / v_ptrs as they
    are. Paged: k_ptrs / v_ptrs point at a page's first row, and the tile (``start`` a multiple of BLOCK_N, which
    divides PAGE_SIZE: it lies in one page) is in the page the row's block table BT_ROW lists."""
    if PAGE_SIZE > 0:
        page = tl.load(BT_ROW + start // PAGE_SIZE).to(tl.int64)
        row = start % PAGE_SIZE
        return k_ptrs + (page * stride_kb + row * stride_kn), v_ptrs + (page * stride_vb + row * stride_vn)
    else:
        return k_ptrs, v_ptrs


@triton.jit
def _rows_range(q, k_ptrs, v_ptrs, lo, hi, qk_scale, offs_n, stride_kn, stride_vn, HEADS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BT_ROW=None, stride_kb=0,
                stride_vb=0, PAGE_SIZE: tl.constexpr = 0):
    """Keys [lo, hi) of one row: the whole tiles (the loop Triton pipelines), then a partial last one. Returns the
    online softmax's (m, l, unnormalized acc) for every head's rows. k_ptrs / v_ptrs: the tile at key lo, or on a
    paged cache (PAGE_SIZE > 0) a page's first row, each tile's page looked up in BT_ROW (_tile_ptrs; the table
    load is one more load the pipeliner issues ahead with the tile's)."""
    m_i = tl.full([HEADS, BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS, BLOCK_M], tl.float32)
    acc = tl.zeros([HEADS, BLOCK_M, HEAD_DIM], tl.float32)
    full = tl.maximum(hi - lo, 0) // BLOCK_N
    for i in range(0, full):
        start = lo + i * BLOCK_N
        kp, vp = _tile_ptrs(k_ptrs, v_ptrs, BT_ROW, start, stride_kb, stride_kn, stride_vb, stride_vn, PAGE_SIZE)
        m_i, l_i, acc = _rows_tile(q, m_i, l_i, acc, kp, vp, start, hi, qk_scale, offs_n, MASKED=False)
        if PAGE_SIZE == 0:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
    start = lo + full * BLOCK_N
    if start < hi:
        kp, vp = _tile_ptrs(k_ptrs, v_ptrs, BT_ROW, start, stride_kb, stride_kn, stride_vb, stride_vn, PAGE_SIZE)
        m_i, l_i, acc = _rows_tile(q, m_i, l_i, acc, kp, vp, start, hi, qk_scale, offs_n, MASKED=True)
    return m_i, l_i, acc


@triton.jit
def _merge_row_splits(O_PART, LSE_PART, O, LSE, b, q0, rows, stride_ops, stride_opb, stride_oph, stride_lps,
                      stride_lpb, stride_lph, stride_ob, stride_oh, stride_lse_b, stride_lse_h,
                      NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, MERGE_ROWS: tl.constexpr):
    """The in-kernel merge of a row's splits, query heads q0 .. q0 + rows - 1 (a program's kv heads' groups, side
    by side): [MERGE_ROWS, HEAD_DIM] tiles without the per-head padding of the main loop's BLOCK_M. Unrolled
    (static_range), so every split's loads issue together instead of one L2 trip a split. Reads past L1 (.cg):
    the other splits' partials were written by other SMs."""
    rq = tl.arange(0, MERGE_ROWS)
    ok = rq < rows
    qh = q0 + rq
    rd = tl.arange(0, HEAD_DIM)[None, :]
    lps = stride_lps.to(tl.int64)  # split x a partial's stride can pass 2^31
    ops = stride_ops.to(tl.int64)
    lse_ptrs = LSE_PART + b * stride_lpb + qh * stride_lph
    o_ptrs = O_PART + b * stride_opb + qh[:, None] * stride_oph + rd
    m_all = tl.full([MERGE_ROWS], float("-inf"), tl.float32)
    for sp in tl.static_range(NUM_SPLITS):
        m_all = tl.maximum(m_all, tl.load(lse_ptrs + sp * lps, mask=ok, other=float("-inf"), cache_modifier=".cg"))
    none = m_all == float("-inf")
    m_safe = tl.where(none, 0.0, m_all)
    w_sum = tl.zeros([MERGE_ROWS], tl.float32)
    merged = tl.zeros([MERGE_ROWS, HEAD_DIM], tl.float32)
    for sp in tl.static_range(NUM_SPLITS):
        w = tl.exp(tl.load(lse_ptrs + sp * lps, mask=ok, other=float("-inf"), cache_modifier=".cg") - m_safe)
        merged += tl.load(o_ptrs + sp * ops, mask=ok[:, None], other=0.0, cache_modifier=".cg") * w[:, None]
        w_sum += w
    final = merged / tl.where(none, 1.0, w_sum)[:, None]
    tl.store(O + b * stride_ob + qh[:, None] * stride_oh + rd, final.to(O.dtype.element_ty), mask=ok[:, None])
    tl.store(LSE + b * stride_lse_b + qh * stride_lse_h,
             tl.where(none, float("inf"), m_all + tl.log(tl.where(none, 1.0, w_sum))), mask=ok)


@triton.jit
def _decode_rows_kernel(
    Q, K, V, O_PART, LSE_PART, O, LSE, COUNTER, SEQLENS, BLOCK_TABLE, qk_scale, cache_len_const, s_new, capacity,
    group, stride_qb, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt_b,
    stride_ops, stride_opb, stride_oph, stride_lps, stride_lpb, stride_lph, stride_ob, stride_oh, stride_lse_b,
    stride_lse_h,
    HEADS: tl.constexpr, GROUPS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SEQLENS: tl.constexpr, FUSED_COMBINE: tl.constexpr,
    USE_PDL: tl.constexpr = False, MERGE_ROWS: tl.constexpr = 16, STAMPS=None, STAMP: tl.constexpr = False,
    PAGE_SIZE: tl.constexpr = 0, SEQLENS_POLICY: tl.constexpr = "",
):
    """q (b, 1, h, d) over a (b, capacity, h_k, d) cache holding cache_seqlens[b] (or cache_len_const) keys a
    row before this call's s_new appended ones; program pid = (b * GROUPS + kv head group) * NUM_SPLITS + split. Writes the split's partial output
    O_PART[split, b, 0, head] (normalized, fp32) and LSE_PART[split, b, head, 0] (natural log, -inf for a
    split without keys). ``qk_scale`` is softmax_scale * log2(e). With FUSED_COMBINE the last split of a
    (row, head group) to finish merges them into O (b, 1, h, d) and LSE (b, h, 1) (+inf for a row without keys):
    a counter a (row, head group), which the merger resets, says which split is last. USE_PDL: launched as a
    programmatic dependent, it waits for the kernel before it ahead of its first read, and lets the merge kernel
    launch after its key loop (from its start instead, the merge's programs waiting on the SMs that finish first, it
    was 3-5 us a call slower at b = 32, lease G25). STAMP: the diagnostic (_stamp): the program's start, loop end
    and end, and its SM. PAGE_SIZE > 0: K and V are (pages, PAGE_SIZE, h_k, d) pools, a row's keys in the pages
    that BLOCK_TABLE[b] lists (BLOCK_N divides PAGE_SIZE); stride_kb / stride_vb are then a page's strides."""
    if USE_PDL:
        gdc_wait()
    pid = tl.program_id(0)
    if STAMP:
        _stamp(STAMPS, pid, 0)
    split32 = pid % NUM_SPLITS
    split = split32.to(tl.int64)  # for the partials' offsets: split x a partial's stride can pass 2^31
    bg = pid // NUM_SPLITS
    kv0 = (bg % GROUPS) * HEADS
    b = (bg // GROUPS).to(tl.int64)
    if HAS_SEQLENS:  # SEQLENS_POLICY: see backends/triton/decode_rows.seqlens_policy
        seqlen = tl.load(SEQLENS + b, eviction_policy=SEQLENS_POLICY)
    else:
        seqlen = cache_len_const
    seqlen = tl.minimum(seqlen + s_new, capacity)
    per = tl.cdiv(tl.cdiv(seqlen, BLOCK_N), NUM_SPLITS) * BLOCK_N
    lo = split32 * per
    hi = tl.minimum(lo + per, seqlen)

    offs_h = tl.arange(0, HEADS)[:, None, None]
    offs_m = tl.arange(0, BLOCK_M)[None, :, None]
    offs_n = tl.arange(0, BLOCK_N)[None, :, None]
    offs_d = tl.arange(0, HEAD_DIM)[None, None, :]
    q_head = (kv0 + offs_h) * group + offs_m  # [HEADS, BLOCK_M, 1]
    q = tl.load(Q + b * stride_qb + q_head * stride_qh + offs_d, mask=offs_m < group, other=0.0)
    if PAGE_SIZE > 0:  # a page's first row: each tile adds its page and row (_tile_ptrs)
        k_ptrs = K + (kv0 + offs_h) * stride_kh + offs_n * stride_kn + offs_d
        v_ptrs = V + (kv0 + offs_h) * stride_vh + offs_n * stride_vn + offs_d
    else:
        k_ptrs = K + b * stride_kb + (kv0 + offs_h) * stride_kh + (lo + offs_n).to(tl.int64) * stride_kn + offs_d
        v_ptrs = V + b * stride_vb + (kv0 + offs_h) * stride_vh + (lo + offs_n).to(tl.int64) * stride_vn + offs_d
    m_i, l_i, acc = _rows_range(q, k_ptrs, v_ptrs, lo, hi, qk_scale, offs_n, stride_kn, stride_vn, HEADS, BLOCK_M,
                                BLOCK_N, HEAD_DIM, BLOCK_TABLE + b * stride_bt_b, stride_kb, stride_vb, PAGE_SIZE)

    if STAMP:
        _stamp(STAMPS, pid, 1)
    if USE_PDL:
        gdc_launch_dependents()  # the merge kernel may start launching (it waits for this grid's end)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, :, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    row_ok = offs_m < group
    tl.store(O_PART + split * stride_ops + b * stride_opb + q_head * stride_oph + offs_d, out, mask=row_ok)
    lse_head = (kv0 + tl.arange(0, HEADS)[:, None]) * group + tl.arange(0, BLOCK_M)[None, :]
    tl.store(LSE_PART + split * stride_lps + b * stride_lpb + lse_head * stride_lph, lse,
             mask=tl.arange(0, BLOCK_M)[None, :] < group)
    if FUSED_COMBINE:
        # every thread's partial stores, then the count (acquire-release); the merger reads past L1 (.cg)
        tl.debug_barrier()
        done = tl.atomic_add(COUNTER + bg, 1, sem="acq_rel", scope="gpu")
        if done == NUM_SPLITS - 1:
            _merge_row_splits(O_PART, LSE_PART, O, LSE, b, kv0 * group, HEADS * group, stride_ops, stride_opb,
                              stride_oph, stride_lps, stride_lpb, stride_lph, stride_ob, stride_oh, stride_lse_b,
                              stride_lse_h, NUM_SPLITS, HEAD_DIM, MERGE_ROWS)
            tl.atomic_xchg(COUNTER + bg, 0, sem="relaxed", scope="gpu")
    if STAMP:
        _stamp(STAMPS, pid, 2)
