"""Whole-row decode on every SM: the row kernel's work (kernels/decode_rows.py) shared out stream-K style.

The split row kernel gives each (batch row, kv-head group) the same number of key splits, so its grid is a multiple
of the rows: at b = 32 on 132 SMs, 4 splits are 128 programs and 4 SMs idle. On most H200s 128 streaming programs
read as fast as 132, but on some (session 24's lease J24) a plain read on 128 programs was 2.3% slower than on 132,
and every 128-SM decode kernel trailed cuDNN by 1.2%-1.6%. Here the (unit, key tile) pairs, a unit being a (batch
row, kv-head group) with its row's tiles in order, are laid end to end and program p of P takes tiles
[p T / P, (p + 1) T / P) of the T in all: one program an SM, each the same share of the bytes, a segment of one unit
at a time.

Partial slots: a unit's k-th segment (its programs in order, those with tiles) writes its normalized output and lse
to slot u * SEGS + k while k < SEGS, and the program holding the unit's first tile writes -inf to the lse of the
unit's unused slots and the segment count to COUNTS[u]; so the merge kernel reads a unit's SEGS slots and its count
in one round trip, without the lengths. A unit of more segments (ragged rows: a long row among short ones) puts
segment k >= SEGS of program p at slot units * SEGS + u + p: along the tile order both the unit and the program only
grow and each new segment moves at least one of them, so no two segments share it; the merge kernel finds those
from the lengths, on that unit's programs only.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashtile.kernels.decode_rows import _rows_range, _stamp


@triton.jit
def _unit_tiles(SEQLENS, cache_len_const, s_new, capacity, n_units, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
                UNITS_P2: tl.constexpr, HAS_SEQLENS: tl.constexpr, POLICY: tl.constexpr):
    """Every unit's keys (its row's length after this call's appends, at most the capacity) and key tiles, the
    tiles' running end, and the tiles in all: [UNITS_P2] vectors (units past n_units have none) and a scalar."""
    ru = tl.arange(0, UNITS_P2)
    ok = ru < n_units
    if HAS_SEQLENS:
        lens = tl.load(SEQLENS + ru // GROUPS, mask=ok, other=0, eviction_policy=POLICY)
    else:
        lens = tl.zeros([UNITS_P2], tl.int32) + cache_len_const
    lens = tl.where(ok, tl.minimum(lens + s_new, capacity), 0)
    tiles = tl.cdiv(lens, BLOCK_N)
    ends = tl.cumsum(tiles, 0)
    return ru, lens, tiles, ends, tl.sum(tiles, 0)


@triton.jit
def _unit_span(u, ru, tiles, ends):
    """Unit u's tiles [start, end) in the order of all units' tiles (int64 scalars)."""
    here = ru == u
    u_end = tl.sum(tl.where(here, ends, 0), 0).to(tl.int64)
    return u_end - tl.sum(tl.where(here, tiles, 0), 0), u_end


@triton.jit
def _owner(x, total, programs):
    """The program whose tile range [p total / P, (p + 1) total / P) holds tile x (int64 scalars; total >= 1)."""
    return ((x + 1) * programs + total - 1) // total - 1


@triton.jit
def _unit_programs(u_start, u_end, total, programs):
    """The first and last program holding tiles [u_start, u_end) of ``total`` (p_hi = p_lo - 1 for a unit without
    tiles), and how many of those programs hold any: with fewer tiles than programs some take none, and every other
    one a single tile."""
    some = tl.maximum(total, 1)  # (no tiles at all: every unit is empty, and no division by zero)
    p_lo = _owner(u_start, some, programs)
    p_hi = tl.where(u_end > u_start, _owner(u_end - 1, some, programs), p_lo - 1)
    return p_lo, p_hi, tl.where(total >= programs, p_hi - p_lo + 1, u_end - u_start)


@triton.jit
def _segment_index(p, p_lo, u_start, total, programs):
    """Program p's segment's place among its unit's segments: its program's place among the unit's programs, or,
    with fewer tiles than programs (one tile a program that has any), its tile's place in the unit."""
    return tl.where(total >= programs, p - p_lo, p * total // programs - u_start)


@triton.jit
def _load_unit_q(Q, u, head_row, row_ok, offs_d, group, stride_qb, stride_qh, GROUPS: tl.constexpr,
                 HEADS: tl.constexpr):
    """Unit u's query heads, [HEADS, BLOCK_M, HEAD_DIM] (rows past the group zero)."""
    b = (u // GROUPS).to(tl.int64)
    return tl.load(Q + b * stride_qb + ((u % GROUPS) * HEADS * group + head_row) * stride_qh + offs_d, mask=row_ok,
                   other=0.0)


@triton.jit
def _segment_slot(pid, u, u_start, u_end, total, programs, n_units, SEGS: tl.constexpr):
    """Where program pid's segment of unit u (tiles [u_start, u_end) among all units') goes (the module docstring),
    and the unit's segment count (int64 scalars)."""
    p_lo, p_hi, segments = _unit_programs(u_start, u_end, total, programs)
    k = _segment_index(pid, p_lo, u_start, total, programs)
    return tl.where(k < SEGS, u.to(tl.int64) * SEGS + k, n_units * SEGS + u + pid), segments


@triton.jit
def _write_segment(O_PART, LSE_PART, COUNTS, m_i, l_i, acc, u, slot, segments, holds_first, head_row, row_ok, offs_d,
                   lse_row, lse_ok, stride_ops, stride_oph, stride_lps, unit_rows, SEGS: tl.constexpr,
                   LSE_ROWS: tl.constexpr):
    """A segment's normalized output and lse into ``slot``, and, from the program holding unit u's first tile, the
    unit's count and its unused slots' -inf."""
    tl.store(O_PART + slot * stride_ops + head_row * stride_oph + offs_d, acc / l_i[:, :, None], mask=row_ok)
    tl.store(LSE_PART + slot * stride_lps + lse_row, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=lse_ok)
    if holds_first:
        _close_unused_slots(LSE_PART, COUNTS, u, segments, stride_lps, unit_rows, SEGS, LSE_ROWS)


@triton.jit
def _rows_streamk_kernel(
    Q, K, V, O_PART, LSE_PART, COUNTS, SEQLENS, qk_scale, cache_len_const, s_new, capacity, group, n_units, programs,
    stride_qb, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_ops, stride_oph, stride_lps,
    HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, UNITS_P2: tl.constexpr, SEGS: tl.constexpr, LSE_ROWS: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, USE_PDL: tl.constexpr = False, STAMPS=None, STAMP: tl.constexpr = False,
    SEQLENS_POLICY: tl.constexpr = "",
):
    """q (b, 1, h, d) over a (b, capacity, h_k, d) cache; unit u = batch row u // GROUPS, kv heads
    (u % GROUPS) * HEADS onwards, its HEADS * group query heads (LSE_ROWS, a power of two, at least). Writes each of
    its segments' normalized output O_PART[slot, unit query head, :] (fp32) and lse LSE_PART[slot, unit query head]
    (natural log) at the slot the module docstring gives, and COUNTS and the unused slots' -inf lse for the units
    whose first tile it holds (or, for a unit without tiles, program u % P). STAMP: the diagnostic
    (decode_rows._stamp): the program's start, the end of its segments and its end, and its SM."""
    if USE_PDL:
        gdc_wait()
    pid = tl.program_id(0).to(tl.int64)
    if STAMP:
        _stamp(STAMPS, pid, 0)
    ru, lens, tiles, ends, total = _unit_tiles(SEQLENS, cache_len_const, s_new, capacity, n_units, GROUPS, BLOCK_N,
                                               UNITS_P2, HAS_SEQLENS, SEQLENS_POLICY)
    total = total.to(tl.int64)
    t = pid * total // programs
    t_stop = (pid + 1) * total // programs
    u = tl.sum((ends <= t).to(tl.int32), 0)  # the first unit that ends past this program's first tile
    offs_h = tl.arange(0, HEADS)[:, None, None]
    offs_m = tl.arange(0, BLOCK_M)[None, :, None]
    offs_n = tl.arange(0, BLOCK_N)[None, :, None]
    offs_d = tl.arange(0, HEAD_DIM)[None, None, :]
    head_row = offs_h * group + offs_m  # the unit's query head of each (head, row): [HEADS, BLOCK_M, 1]
    row_ok = offs_m < group
    lse_row = tl.arange(0, HEADS)[:, None] * group + tl.arange(0, BLOCK_M)[None, :]
    lse_ok = tl.arange(0, BLOCK_M)[None, :] < group
    unit_rows = HEADS * group
    while t < t_stop:
        u_start, u_end = _unit_span(u, ru, tiles, ends)
        seg_end = tl.minimum(t_stop, u_end)
        if seg_end > t:  # (a unit without keys has no segment)
            b = (u // GROUPS).to(tl.int64)
            kv0 = (u % GROUPS) * HEADS
            lo = ((t - u_start) * BLOCK_N).to(tl.int32)
            hi = tl.minimum(((seg_end - u_start) * BLOCK_N).to(tl.int32), tl.sum(tl.where(ru == u, lens, 0), 0))
            q = _load_unit_q(Q, u, head_row, row_ok, offs_d, group, stride_qb, stride_qh, GROUPS, HEADS)
            k_ptrs = K + b * stride_kb + (kv0 + offs_h) * stride_kh + (lo + offs_n).to(tl.int64) * stride_kn + offs_d
            v_ptrs = V + b * stride_vb + (kv0 + offs_h) * stride_vh + (lo + offs_n).to(tl.int64) * stride_vn + offs_d
            m_i, l_i, acc = _rows_range(q, k_ptrs, v_ptrs, lo, hi, qk_scale, offs_n, stride_kn, stride_vn, HEADS,
                                        BLOCK_M, BLOCK_N, HEAD_DIM)
            slot, segments = _segment_slot(pid, u, u_start, u_end, total, programs, n_units, SEGS)
            _write_segment(O_PART, LSE_PART, COUNTS, m_i, l_i, acc, u, slot, segments, t == u_start, head_row, row_ok,
                           offs_d, lse_row, lse_ok, stride_ops, stride_oph, stride_lps, unit_rows, SEGS, LSE_ROWS)
        t = seg_end
        u += 1
    # units without tiles: no program holds their first tile; program u % P writes their count and -inf lse
    for e in range(pid, n_units, programs):
        if tl.sum(tl.where(ru == e, tiles, 0), 0) == 0:
            _close_unused_slots(LSE_PART, COUNTS, e, 0, stride_lps, unit_rows, SEGS, LSE_ROWS)
    if STAMP:
        _stamp(STAMPS, pid, 1)
    if USE_PDL:
        gdc_launch_dependents()  # the merge kernel may start launching (it waits for this grid's end)
    if STAMP:
        _stamp(STAMPS, pid, 2)


@triton.jit
def _close_unused_slots(LSE_PART, COUNTS, u, segments, stride_lps, unit_rows, SEGS: tl.constexpr,
                        LSE_ROWS: tl.constexpr):
    """Unit u's segment count to COUNTS[u], and -inf to the lse of its slots past its segments."""
    rs = tl.arange(0, SEGS)[:, None]
    rr = tl.arange(0, LSE_ROWS)[None, :]
    tl.store(LSE_PART + (u * SEGS + rs) * stride_lps + rr, tl.full([SEGS, LSE_ROWS], float("-inf"), tl.float32),
             mask=(rs >= segments) & (rr < unit_rows))
    tl.store(COUNTS + u, segments)


@triton.jit
def _rows_streamk_combine(
    O_PART, LSE_PART, O, LSE, COUNTS, SEQLENS, cache_len_const, s_new, capacity, n_units, unit_heads, programs,
    stride_ops, stride_oph, stride_lps, stride_ob, stride_oh, stride_lse_b, stride_lse_h,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, UNITS_P2: tl.constexpr,
    SEGS: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SEQLENS: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """One (unit, query head of the unit): lse = logsumexp over its segments' lse, out = sum exp(lse_s - lse)
    out_s; a unit without keys gets out 0 and lse +inf. Its first SEGS slots and its count load together; a unit of
    more segments then reads the rest BLOCK_S at a time with a running max, from its programs' overflow slots."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    u = pid // unit_heads
    j = pid % unit_heads
    offs_d = tl.arange(0, HEAD_DIM)
    slots = u.to(tl.int64) * SEGS + tl.arange(0, SEGS)
    segments = tl.load(COUNTS + u)
    lse_s = tl.load(LSE_PART + slots * stride_lps + j)
    o_s = tl.load(O_PART + slots[:, None] * stride_ops + j * stride_oph + offs_d[None, :])
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)  # 0 in an unused slot, whose output was never written: masked below
    w_sum = tl.sum(w, 0)
    out = tl.sum(tl.where((lse_s > float("-inf"))[:, None], o_s, 0.0) * w[:, None], 0)
    if segments > SEGS:  # a long unit among short ones: its other segments sit in its programs' overflow slots
        ru, lens, tiles, ends, total = _unit_tiles(SEQLENS, cache_len_const, s_new, capacity, n_units, GROUPS,
                                                   BLOCK_N, UNITS_P2, HAS_SEQLENS, "")
        total = total.to(tl.int64)
        u_start, u_end = _unit_span(u, ru, tiles, ends)
        p_lo, p_hi, _ = _unit_programs(u_start, u_end, total, programs)
        offs_s = tl.arange(0, BLOCK_S).to(tl.int64)
        for p0 in range(p_lo, p_hi + 1, BLOCK_S):
            p = p0 + offs_s
            has = (p + 1) * total // programs > p * total // programs  # (some programs hold no tile)
            ok = (p <= p_hi) & has & (_segment_index(p, p_lo, u_start, total, programs) >= SEGS)
            slot = n_units * SEGS + u + p
            lse_x = tl.load(LSE_PART + slot * stride_lps + j, mask=ok, other=float("-inf"))
            o_x = tl.load(O_PART + slot[:, None] * stride_ops + j * stride_oph + offs_d[None, :], mask=ok[:, None],
                          other=0.0)
            m_new = tl.maximum(m, tl.max(lse_x, 0))  # (finite: the unit has SEGS segments already)
            scale = tl.exp(m - m_new)
            w_x = tl.exp(lse_x - m_new)
            w_sum = w_sum * scale + tl.sum(w_x, 0)
            out = out * scale + tl.sum(o_x * w_x[:, None], 0)
            m = m_new
    empty = w_sum == 0.0
    out = out / tl.where(empty, 1.0, w_sum)
    lse = tl.where(empty, float("inf"), m + tl.log(tl.where(empty, 1.0, w_sum)))
    b = u // GROUPS
    head = (u % GROUPS) * unit_heads + j
    tl.store(O + b * stride_ob + head * stride_oh + offs_d, out.to(O.dtype.element_ty))
    tl.store(LSE + b * stride_lse_b + head * stride_lse_h, lse)
