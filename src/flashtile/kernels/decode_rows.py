"""Whole-row decode: one program per (batch row, group of adjacent kv heads, key split), for long caches on large
batches (backends/triton/decode/route.py says which calls).

In the (b, capacity, h_k, d) cache that flash_attn_with_kvcache takes, one key's kv heads lie side by side:
a program per (row, kv head) reads d * 2 bytes (256 B at d = 128) of every h_k * d * 2-byte key row, and the
row's other heads come from other programs at other times. A program here reads HEADS adjacent kv heads of each
key, HEADS * d * 2 contiguous bytes (all h_k heads: whole rows), and splits the keys instead, so that the grid
stays as large. Batched (3D) dots: one head's query group a batch entry, padded to BLOCK_M rows. The splits are
merged by the split-KV combine kernel. A paged cache (PAGE_SIZE > 0, a multiple of BLOCK_N) is read the same way,
each tile from the page the row's block table names.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


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
def _decode_rows_kernel(
    Q, K, V, O_PART, LSE_PART, SEQLENS, BLOCK_TABLE, qk_scale, cache_len_const, s_new, capacity, group,
    stride_qb, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt_b,
    stride_ops, stride_opb, stride_oph, stride_lps, stride_lpb, stride_lph,
    HEADS: tl.constexpr, GROUPS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SEQLENS: tl.constexpr, USE_PDL: tl.constexpr = False,
    PAGE_SIZE: tl.constexpr = 0,
):
    """q (b, 1, h, d) over a (b, capacity, h_k, d) cache holding cache_seqlens[b] (or cache_len_const) keys a
    row before this call's s_new appended ones; program pid = (b * GROUPS + kv head group) * NUM_SPLITS + split.
    Writes the split's partial output O_PART[split, b, 0, head] (normalized, fp32) and LSE_PART[split, b, head, 0]
    (natural log, -inf for a split without keys), which the combine kernel merges. ``qk_scale`` is
    softmax_scale * log2(e). USE_PDL: launched as a programmatic dependent, it waits for the kernel before it ahead
    of its first read, and lets the merge kernel launch after its key loop (from its start instead, the merge's
    programs would wait on the SMs that finish first, which was slower at b = 32). PAGE_SIZE > 0: K and V are
    (pages, PAGE_SIZE, h_k, d) pools, a row's keys in the pages that BLOCK_TABLE[b] lists (BLOCK_N divides
    PAGE_SIZE); stride_kb / stride_vb are then a page's strides."""
    if USE_PDL:
        gdc_wait()
    pid = tl.program_id(0)
    split32 = pid % NUM_SPLITS
    split = split32.to(tl.int64)  # for the partials' offsets: split x a partial's stride can pass 2^31
    bg = pid // NUM_SPLITS
    kv0 = (bg % GROUPS) * HEADS
    b = (bg // GROUPS).to(tl.int64)
    if HAS_SEQLENS:
        seqlen = tl.load(SEQLENS + b)
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
