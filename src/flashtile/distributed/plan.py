"""Which kernel calls one ring step makes: the mask of a query shard against a key block, as rectangles.

A rank's shard is a list of *segments*: runs of consecutive global positions, in the order the shard
stores them (contiguous sharding has one, zigzag two). A step attends the local queries to one block of
keys (another rank's shard, or the whole gathered sequence); every (query segment, key segment) pair,
cut further by document boundaries for packed (varlen) sequences, is a rectangle whose mask is a band
``-left <= key_pos - query_pos <= right`` in global positions.

The kernels align a band at the bottom-right corner (row ``i`` of ``sq`` sees keys ``j`` with
``i + sk - sq - left' <= j <= i + sk - sq + right'``, ``left', right' >= 0`` or -1 for unbounded). Any
band of a rectangle fits that form once the rectangle loses its fully masked last rows or last columns:
only the *ends* move the kernel's diagonal (``sk - sq``) without moving the band, so a plan trims rows
or columns at the end until the diagonal lies inside the band, then states the band relative to it.
Trimmed rows see no key of the block, trimmed columns are seen by no row: nothing is lost. A rectangle
with no visible pair is skipped, which is what makes causal ring steps cheap.

One more rule of the kernels shapes the plan: FlashAttention reads a window bound ``>= sk`` as unbounded.
A rectangle taller than wide can need a right bound that large which still masks its first rows; such a
rectangle is cut in two row ranges, each of which then states its band in the kernels' terms.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

UNBOUNDED = -1


@dataclass(frozen=True)
class Segment:
    """``length`` consecutive global positions from ``start``, stored at local index ``local``."""

    start: int
    length: int
    local: int


def segments(runs: list[tuple[int, int]]) -> tuple[Segment, ...]:
    """Segments of a shard that stores the ``(start, length)`` runs one after another."""
    out, local = [], 0
    for start, length in runs:
        out.append(Segment(start, length, local))
        local += length
    return tuple(out)


@dataclass(frozen=True)
class Piece:
    """One kernel rectangle: local query rows ``[q0, q1)`` against local keys ``[k0, k1)`` of the block,
    with the kernel's window ``(left, right)`` (bottom-right aligned; -1 unbounded)."""

    q0: int
    q1: int
    k0: int
    k1: int
    left: int
    right: int

    @property
    def full(self) -> bool:
        return self.left == UNBOUNDED and self.right == UNBOUNDED


@dataclass(frozen=True)
class Call:
    """One kernel call: a single piece runs as a padded call on slices; several (documents of a packed
    sequence, all with the same window, disjoint query rows) run as one varlen call."""

    pieces: tuple[Piece, ...]

    @property
    def left(self) -> int:
        return self.pieces[0].left

    @property
    def right(self) -> int:
        return self.pieces[0].right


def band_piece(q_pos: int, nq: int, k_pos: int, nk: int, left: int, right: int) -> tuple[int, int, int, int] | None:
    """The kernel form of a band on one rectangle, or None when no pair is visible.

    Queries at global positions ``[q_pos, q_pos + nq)``, keys at ``[k_pos, k_pos + nk)``; a pair is
    visible when ``-left <= key - query <= right`` (-1 = unbounded). Returns ``(rows, cols, left', right')``:
    the first ``rows`` queries against the first ``cols`` keys with the kernel's window.
    """
    d0 = q_pos - k_pos  # local (i, j) is visible when lo <= j - i <= hi
    lo = None if left < 0 else d0 - left
    hi = None if right < 0 else d0 + right
    if (lo is not None and lo > nk - 1) or (hi is not None and hi < -(nq - 1)) or \
            (lo is not None and hi is not None and lo > hi):
        return None
    rows, cols = nq, nk
    if lo is not None and cols - rows < lo:
        rows = cols - lo  # rows from here on would need keys at or past the block's end
    elif hi is not None and cols - rows > hi:
        cols = rows + hi  # keys from here on are past every row's band
    diag = cols - rows
    kl = UNBOUNDED if lo is None else diag - lo
    kr = UNBOUNDED if hi is None else hi - diag
    # a bound that masks nothing in this rectangle runs unmasked (the kernels skip mask work then)
    if kl != UNBOUNDED and kl >= cols - 1:
        kl = UNBOUNDED
    if kr != UNBOUNDED and kr >= rows - 1:
        kr = UNBOUNDED
    return rows, cols, kl, kr


def band_pieces(q_pos: int, nq: int, k_pos: int, nk: int, left: int,
                right: int) -> list[tuple[int, int, int, int, int]]:
    """:func:`band_piece` in rectangles the kernels read as meant: ``(row0, rows, cols, left', right')``.

    A right bound at or past the rectangle's width reads as unbounded in the kernels; when it is not
    (rows before ``t`` still see fewer keys), rows ``[0, t)`` and ``[t, nq)`` become separate rectangles.
    """
    band = band_piece(q_pos, nq, k_pos, nk, left, right)
    if band is None:
        return []
    rows, cols, kl, kr = band
    if kr == UNBOUNDED or kr < cols:
        return [(0, rows, cols, kl, kr)]
    t = rows - 1 - kr  # row t is the first whose band reaches the last key
    head = band_pieces(q_pos, t, k_pos, nk, left, right)
    tail = band_pieces(q_pos + t, nq - t, k_pos, nk, left, right)
    return head + [(t + r0, *rest) for r0, *rest in tail]


def _doc_cuts(lo: int, hi: int, docs: tuple[int, ...] | None) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut at document boundaries (``docs`` = cumulative lengths, or None for one document)."""
    if docs is None:
        return [(lo, hi)]
    cuts, i = [], bisect.bisect_right(docs, lo) - 1
    while lo < hi:
        end = min(hi, docs[i + 1])
        cuts.append((lo, end))
        lo, i = end, i + 1
    return cuts


def _doc_of(pos: int, docs: tuple[int, ...] | None) -> int:
    return 0 if docs is None else bisect.bisect_right(docs, pos) - 1


def plan_pieces(q_segs, k_segs, left: int, right: int, docs: tuple[int, ...] | None = None) -> list[Piece]:
    """Every visible rectangle of local queries ``q_segs`` against the key block ``k_segs``.

    ``left``/``right`` are the call's normalised window (causal is ``right = 0``); ``docs`` the packed
    sequence's cumulative document lengths (``cu_seqlens``), or None: queries see keys of their own
    document only.
    """
    if _one_causal_rectangle(q_segs, k_segs, left, right, docs):
        n = sum(sg.length for sg in q_segs)
        return [Piece(0, n, 0, n, UNBOUNDED, 0)]
    pieces = []
    for qs in q_segs:
        for q_lo, q_hi in _doc_cuts(qs.start, qs.start + qs.length, docs):
            doc = _doc_of(q_lo, docs)
            for ks in k_segs:
                k_lo, k_hi = ks.start, ks.start + ks.length
                if docs is not None:
                    k_lo, k_hi = max(k_lo, docs[doc]), min(k_hi, docs[doc + 1])
                if k_lo >= k_hi:
                    continue
                for r0, rows, cols, kl, kr in band_pieces(q_lo, q_hi - q_lo, k_lo, k_hi - k_lo, left, right):
                    q0, k0 = qs.local + q_lo - qs.start + r0, ks.local + k_lo - ks.start
                    pieces.append(Piece(q0, q0 + rows, k0, k0 + cols, kl, kr))
    return _merge_full(pieces)


def _one_causal_rectangle(q_segs, k_segs, left, right, docs) -> bool:
    """A causal step of a rank against its own runs, stored in increasing global order (zigzag's own
    step): local order is then global order, so one causal call over the whole shard is exact."""
    return (docs is None and (left, right) == (UNBOUNDED, 0) and tuple(q_segs) == tuple(k_segs)
            and all(a.start + a.length <= b.start for a, b in zip(q_segs, q_segs[1:])))


def _merge_full(pieces: list[Piece]) -> list[Piece]:
    """Join unmasked pieces that share their rows and abut in keys (or share keys and abut in rows):
    an unmasked rectangle does not care about the order of its keys, so one call does both."""
    pieces = list(pieces)
    merged = True
    while merged:
        merged = False
        for i, a in enumerate(pieces):
            for j, b in enumerate(pieces):
                if i == j or not (a.full and b.full):
                    continue
                joined = None
                if (a.q0, a.q1) == (b.q0, b.q1) and a.k1 == b.k0:
                    joined = Piece(a.q0, a.q1, a.k0, b.k1, UNBOUNDED, UNBOUNDED)
                elif (a.k0, a.k1) == (b.k0, b.k1) and a.q1 == b.q0:
                    joined = Piece(a.q0, b.q1, a.k0, a.k1, UNBOUNDED, UNBOUNDED)
                if joined is not None:
                    pieces = [p for n, p in enumerate(pieces) if n not in (i, j)] + [joined]
                    merged = True
                    break
            if merged:
                break
    return sorted(pieces, key=lambda p: (p.q0, p.k0))


def plan_calls(q_segs, k_segs, left: int, right: int, docs: tuple[int, ...] | None = None) -> list[Call]:
    """The kernel calls of one step: each piece alone for one document; for packed documents, pieces
    with the same window and disjoint query rows share one varlen call."""
    pieces = plan_pieces(q_segs, k_segs, left, right, docs)
    if docs is None:
        return [Call((p,)) for p in pieces]
    groups: list[list[Piece]] = []
    for p in pieces:
        for g in groups:
            if (g[0].left, g[0].right) == (p.left, p.right) and all(p.q1 <= o.q0 or o.q1 <= p.q0 for o in g):
                g.append(p)
                break
        else:
            groups.append([p])
    return [Call(tuple(sorted(g, key=lambda p: p.q0))) for g in groups]
