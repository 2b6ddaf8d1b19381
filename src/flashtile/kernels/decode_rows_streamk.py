"""Whole-row decode on every SM: the row kernel's work (kernels/decode_rows.py) shared out stream-K style.

The split row kernel gives each (batch row, kv-head group) the same number of key splits, so its grid is a multiple
of the rows: at b = 32 on 132 SMs, 4 splits are 128 programs and 4 SMs idle. On most H200s 128 streaming programs
read as fast as 132, but on some (session 24's lease J24) a plain read on 128 programs was 2.3% slower than on 132,
and every 128-SM decode kernel trailed cuDNN by 1.2%-1.6%. Here the (unit, key tile) pairs, a unit being a (batch
row, kv-head group) with its row's tiles in order, are laid end to end and program p of P takes tiles
[p T / P, (p + 1) T / P) of the T in all: one program an SM, each the same share of the bytes, a segment of one unit
at a time. A segment's normalized output and lse go to partial slot unit + p: along the tile order both the unit
and the program only grow and each new segment moves at least one of them, so no two segments share a slot, and
units + P slots hold them all. The merge kernel finds a unit's slots from the same lengths.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashtile.kernels.decode_rows import _rows_range, _stamp


@triton.jit
def _unit_tiles(SEQLENS, cache_len_const, s_new, capacity, n_units, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
                UNITS_P2: tl.constexpr, HAS_SEQLENS: tl.constexpr):
    """Every unit's keys (its row's length after this call's appends, at most the capacity) and key tiles, the
    tiles' running end, and the tiles in all: [UNITS_P2] vectors (units past n_units have none) and a scalar."""
    ru = tl.arange(0, UNITS_P2)
    ok = ru < n_units
    if HAS_SEQLENS:
        lens = tl.load(SEQLENS + ru // GROUPS, mask=ok, other=0)
    else:
        lens = tl.zeros([UNITS_P2], tl.int32) + cache_len_const
    lens = tl.where(ok, tl.minimum(lens + s_new, capacity), 0)
    tiles = tl.cdiv(lens, BLOCK_N)
    ends = tl.cumsum(tiles, 0)
    return ru, lens, tiles, ends, tl.sum(tiles, 0)


@triton.jit
def _owner(x, total, programs):
    """The program whose tile range [p total / P, (p + 1) total / P) holds tile x (int64 scalars)."""
    return ((x + 1) * programs + total - 1) // total - 1


@triton.jit
def _unit_programs(u_start, u_end, total, programs):
    """The first and last program holding tiles [u_start, u_end) of ``total`` (p_hi = p_lo - 1 for a unit without
    tiles), and how many of those programs hold any: with fewer tiles than programs some take none, and every other
    one takes a single tile."""
    some = tl.maximum(total, 1)  # (no tiles at all: every unit is empty, and no division by zero)
    p_lo = _owner(u_start, some, programs)
    p_hi = tl.where(u_end > u_start, _owner(u_end - 1, some, programs), p_lo - 1)
    return p_lo, p_hi, tl.where(total >= programs, p_hi - p_lo + 1, u_end - u_start)


@triton.jit
def _unit_programs_of(u, ru, tiles, ends, total, programs):
    """_unit_programs for unit u, from _unit_tiles' vectors."""
    here = ru == u
    u_end = tl.sum(tl.where(here, ends, 0), 0).to(tl.int64)
    return _unit_programs(u_end - tl.sum(tl.where(here, tiles, 0), 0), u_end, total, programs)


@triton.jit
def _has_tiles(p, total, programs):
    """Whether program p's range [p total / P, (p + 1) total / P) holds a tile."""
    some = tl.maximum(total, 1)
    return (p + 1) * some // programs > p * some // programs


@triton.jit
def _merge_unit(O_PART, LSE_PART, O, LSE, u, p_lo, p_hi, total, programs, b, head0, rows, stride_ops, stride_oph,
                stride_lps, stride_ob, stride_oh, stride_lse_b, stride_lse_h, HEAD_DIM: tl.constexpr,
                MERGE_ROWS: tl.constexpr, BLOCK_S: tl.constexpr):
    """A unit's segments (slots u + p for its programs p_lo..p_hi that hold tiles) merged into O's and LSE's query
    heads head0 .. head0 + rows - 1 of row b: [BLOCK_S, MERGE_ROWS, HEAD_DIM] tiles, BLOCK_S segments' loads issued
    together, a running max across chunks. Reads past L1 (.cg): other SMs wrote the partials."""
    offs_s = tl.arange(0, BLOCK_S).to(tl.int64)[:, None]
    rq = tl.arange(0, MERGE_ROWS)[None, :]
    rd = tl.arange(0, HEAD_DIM)[None, None, :]
    row_ok = rq < rows
    m = tl.full([MERGE_ROWS], float("-inf"), tl.float32)
    w_sum = tl.zeros([MERGE_ROWS], tl.float32)
    merged = tl.zeros([MERGE_ROWS, HEAD_DIM], tl.float32)
    for p0 in range(p_lo, p_hi + 1, BLOCK_S):
        p = p0 + offs_s  # [BLOCK_S, 1]
        ok = (p <= p_hi) & _has_tiles(p, total, programs) & row_ok
        slot = u + p
        lse_s = tl.load(LSE_PART + slot * stride_lps + rq, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o_s = tl.load(O_PART + slot[:, :, None] * stride_ops + rq[:, :, None] * stride_oph + rd, mask=ok[:, :, None],
                      other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse_s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp(m - m_safe)
        w = tl.exp(lse_s - m_safe[None, :])
        w_sum = w_sum * scale + tl.sum(w, 0)
        merged = merged * scale[:, None] + tl.sum(o_s * w[:, :, None], 0)
        m = m_new
    empty = w_sum == 0.0
    heads = head0 + tl.arange(0, MERGE_ROWS)
    ok = tl.arange(0, MERGE_ROWS) < rows
    tl.store(O + b * stride_ob + heads[:, None] * stride_oh + tl.arange(0, HEAD_DIM)[None, :],
             (merged / tl.where(empty, 1.0, w_sum)[:, None]).to(O.dtype.element_ty), mask=ok[:, None])
    tl.store(LSE + b * stride_lse_b + heads * stride_lse_h,
             tl.where(empty, float("inf"), m + tl.log(tl.where(empty, 1.0, w_sum))), mask=ok)


@triton.jit
def _merge_if_owed(O_PART, LSE_PART, O, LSE, COUNTER, u, ru, tiles, ends, total, programs, group, stride_ops,
                   stride_oph, stride_lps, stride_ob, stride_oh, stride_lse_b, stride_lse_h, HEADS: tl.constexpr,
                   GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, MERGE_ROWS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Unit u's merge (nothing for u = -1), then its counter reset for the next call."""
    if u >= 0:
        p_lo, p_hi, _ = _unit_programs_of(u, ru, tiles, ends, total, programs)
        _merge_unit(O_PART, LSE_PART, O, LSE, u, p_lo, p_hi, total, programs, u // GROUPS,
                    (u % GROUPS) * HEADS * group, HEADS * group, stride_ops, stride_oph, stride_lps, stride_ob,
                    stride_oh, stride_lse_b, stride_lse_h, HEAD_DIM, MERGE_ROWS, BLOCK_S)
        tl.atomic_xchg(COUNTER + u, 0, sem="relaxed", scope="gpu")


@triton.jit
def _rows_streamk_kernel(
    Q, K, V, O_PART, LSE_PART, O, LSE, COUNTER, SEQLENS, qk_scale, cache_len_const, s_new, capacity, group, n_units,
    programs,
    stride_qb, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_ops, stride_oph, stride_lps, stride_ob, stride_oh, stride_lse_b, stride_lse_h,
    HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, UNITS_P2: tl.constexpr, HAS_SEQLENS: tl.constexpr, FUSED: tl.constexpr = False,
    MERGE_ROWS: tl.constexpr = 32, BLOCK_S: tl.constexpr = 4, USE_PDL: tl.constexpr = False, STAMPS=None,
    STAMP: tl.constexpr = False,
):
    """q (b, 1, h, d) over a (b, capacity, h_k, d) cache; unit u = batch row u // GROUPS, kv heads
    (u % GROUPS) * HEADS onwards. Writes each of its segments' normalized output O_PART[slot, unit query head, :]
    (fp32) and lse LSE_PART[slot, unit query head] (natural log) at slot = unit + program. FUSED: the program that
    finishes a unit's last segment (a counter a unit, which it resets, counts them) merges the unit's segments into O
    (b, 1, h, d) and LSE (b, h, 1), and program u % P writes the zero output and +inf lse of a unit u without keys;
    otherwise _rows_streamk_combine does both. STAMP: the diagnostic (decode_rows._stamp): the program's start, the
    end of its segments and its end, and its SM."""
    if USE_PDL:
        gdc_wait()
        # the next kernel may start launching: its programs find no room on an SM before this one's end, and its
        # own wait holds it until this grid is done
        gdc_launch_dependents()
    pid = tl.program_id(0).to(tl.int64)
    if STAMP:
        _stamp(STAMPS, pid, 0)
    ru, lens, tiles, ends, total = _unit_tiles(SEQLENS, cache_len_const, s_new, capacity, n_units, GROUPS, BLOCK_N,
                                               UNITS_P2, HAS_SEQLENS)
    total = total.to(tl.int64)
    t = pid * total // programs
    t_stop = (pid + 1) * total // programs
    u = tl.sum((ends <= t).to(tl.int32), 0)  # the first unit that ends past this program's first tile
    t_first = t
    merge_first = u * 0 - 1  # (FUSED) the units whose merge this program does, -1 for none
    merge_last = u * 0 - 1

    offs_h = tl.arange(0, HEADS)[:, None, None]
    offs_m = tl.arange(0, BLOCK_M)[None, :, None]
    offs_n = tl.arange(0, BLOCK_N)[None, :, None]
    offs_d = tl.arange(0, HEAD_DIM)[None, None, :]
    head_row = offs_h * group + offs_m  # the unit's query head of each (head, row): [HEADS, BLOCK_M, 1]
    row_ok = offs_m < group
    lse_row = tl.arange(0, HEADS)[:, None] * group + tl.arange(0, BLOCK_M)[None, :]
    lse_ok = tl.arange(0, BLOCK_M)[None, :] < group
    while t < t_stop:
        here = ru == u
        u_end = tl.sum(tl.where(here, ends, 0), 0).to(tl.int64)
        u_start = u_end - tl.sum(tl.where(here, tiles, 0), 0)
        seg_end = tl.minimum(t_stop, u_end)
        if seg_end > t:  # (a unit without keys has no segment)
            b = (u // GROUPS).to(tl.int64)
            kv0 = (u % GROUPS) * HEADS
            lo = ((t - u_start) * BLOCK_N).to(tl.int32)
            hi = tl.minimum(((seg_end - u_start) * BLOCK_N).to(tl.int32), tl.sum(tl.where(here, lens, 0), 0))
            q = tl.load(Q + b * stride_qb + (kv0 * group + head_row) * stride_qh + offs_d, mask=row_ok, other=0.0)
            k_ptrs = K + b * stride_kb + (kv0 + offs_h) * stride_kh + (lo + offs_n).to(tl.int64) * stride_kn + offs_d
            v_ptrs = V + b * stride_vb + (kv0 + offs_h) * stride_vh + (lo + offs_n).to(tl.int64) * stride_vn + offs_d
            m_i, l_i, acc = _rows_range(q, k_ptrs, v_ptrs, lo, hi, qk_scale, offs_n, stride_kn, stride_vn, HEADS,
                                        BLOCK_M, BLOCK_N, HEAD_DIM)
            p_lo, p_hi, segments = _unit_programs(u_start, u_end, total, programs)
            if FUSED and segments == 1:  # the unit's only segment: its output as it is
                qh = kv0 * group + head_row
                tl.store(O + b * stride_ob + qh * stride_oh + offs_d, (acc / l_i[:, :, None]).to(O.dtype.element_ty),
                         mask=row_ok)
                tl.store(LSE + b * stride_lse_b + (kv0 * group + lse_row) * stride_lse_h,
                         (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=lse_ok)
            else:
                slot = u.to(tl.int64) + pid
                tl.store(O_PART + slot * stride_ops + head_row * stride_oph + offs_d, acc / l_i[:, :, None],
                         mask=row_ok)
                tl.store(LSE_PART + slot * stride_lps + lse_row, (m_i + tl.log2(l_i)) * 0.6931471805599453,
                         mask=lse_ok)
                if FUSED:
                    # every thread's partial stores, then the count (acquire-release); the merger reads past L1
                    tl.debug_barrier()
                    done = tl.atomic_add(COUNTER + u, 1, sem="acq_rel", scope="gpu")
                    if done == segments - 1:
                        # a shared unit is a program's first or last segment: its merge waits for the loop's end,
                        # where no segment's registers are live
                        if t == t_first:
                            merge_first = u
                        else:
                            merge_last = u
        t = seg_end
        u += 1
    if STAMP:
        _stamp(STAMPS, pid, 1)
    if FUSED:
        _merge_if_owed(O_PART, LSE_PART, O, LSE, COUNTER, merge_first, ru, tiles, ends, total, programs, group,
                       stride_ops, stride_oph, stride_lps, stride_ob, stride_oh, stride_lse_b, stride_lse_h, HEADS,
                       GROUPS, HEAD_DIM, MERGE_ROWS, BLOCK_S)
        _merge_if_owed(O_PART, LSE_PART, O, LSE, COUNTER, merge_last, ru, tiles, ends, total, programs, group,
                       stride_ops, stride_oph, stride_lps, stride_ob, stride_oh, stride_lse_b, stride_lse_h, HEADS,
                       GROUPS, HEAD_DIM, MERGE_ROWS, BLOCK_S)
        # units without keys have no segment to merge: program u % P writes their output (no slots: zero, +inf)
        for e in range(pid, n_units, programs):
            if tl.sum(tl.where(ru == e, tiles, 0), 0) == 0:
                _merge_unit(O_PART, LSE_PART, O, LSE, e, 0, -1, total, programs, e // GROUPS,
                            (e % GROUPS) * HEADS * group, HEADS * group, stride_ops, stride_oph, stride_lps,
                            stride_ob, stride_oh, stride_lse_b, stride_lse_h, HEAD_DIM, MERGE_ROWS, BLOCK_S)
    if STAMP:
        _stamp(STAMPS, pid, 2)


@triton.jit
def _rows_streamk_combine(
    O_PART, LSE_PART, O, LSE, SEQLENS, cache_len_const, s_new, capacity, n_units, unit_heads, programs,
    stride_ops, stride_oph, stride_lps, stride_ob, stride_oh, stride_lse_b, stride_lse_h,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, UNITS_P2: tl.constexpr,
    BLOCK_S: tl.constexpr, HAS_SEQLENS: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """One (unit, query head of the unit): lse = logsumexp over its segments' lse, out = sum exp(lse_s - lse)
    out_s; a unit without keys gets out 0 and lse +inf. Its segments are slots unit + p for the programs p that
    hold its first to last tile (those with tiles: with more programs than tiles some have none), read BLOCK_S
    at a time with a running max."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    u = pid // unit_heads
    j = pid % unit_heads
    ru, lens, tiles, ends, total = _unit_tiles(SEQLENS, cache_len_const, s_new, capacity, n_units, GROUPS, BLOCK_N,
                                               UNITS_P2, HAS_SEQLENS)
    total = total.to(tl.int64)
    here = ru == u
    u_end = tl.sum(tl.where(here, ends, 0), 0).to(tl.int64)
    u_start = u_end - tl.sum(tl.where(here, tiles, 0), 0)
    p_lo, p_hi, _ = _unit_programs(u_start, u_end, total, programs)
    offs_s = tl.arange(0, BLOCK_S).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([1], float("-inf"), tl.float32)
    w_sum = tl.zeros([1], tl.float32)
    out = tl.zeros([HEAD_DIM], tl.float32)
    for p0 in range(p_lo, p_hi + 1, BLOCK_S):
        p = p0 + offs_s
        # with more programs than tiles some take none, and may sit between a unit's first and last program
        ok = (p <= p_hi) & _has_tiles(p, total, programs)
        slot = u + p
        lse_s = tl.load(LSE_PART + slot * stride_lps + j, mask=ok, other=float("-inf"))
        o_s = tl.load(O_PART + slot[:, None] * stride_ops + j * stride_oph + offs_d[None, :], mask=ok[:, None],
                      other=0.0)
        m_new = tl.maximum(m, tl.max(lse_s, 0))
        scale = tl.exp(m - m_new)
        w = tl.exp(lse_s - m_new)
        w_sum = w_sum * scale + tl.sum(w, 0)
        out = out * scale + tl.sum(o_s * w[:, None], 0)
        m = m_new
    empty = w_sum == 0.0
    out = out / tl.where(empty, 1.0, w_sum)
    lse = tl.where(empty, float("inf"), m + tl.log(tl.where(empty, 1.0, w_sum)))
    b = u // GROUPS
    head = (u % GROUPS) * unit_heads + j
    tl.store(O + b * stride_ob + head * stride_oh + offs_d, out.to(O.dtype.element_ty))
    tl.store(LSE + b * stride_lse_b + head * stride_lse_h + tl.arange(0, 1), lse)
