"""Which kernel calls one ring step makes: the mask of a query shard against a key block, as rectangles.

A rank's shard is a list of *segments*: runs of consecutive global positions, in the order the shard
stores them (contiguous sharding has one, zigzag two). A step attends the local queries to one block of
keys (another rank's shard, or the whole gathered sequence); every (query segment, key segment) pair,
cut further by document boundaries for packed (varlen) sequences, is a rectangle whose mask is a band
``-left <= key_pos - query_pos <= right`` in global positions, which band.py states in the kernels'
terms. Chunked attention (``attention_chunk``) reaches the planner as more document boundaries
(:func:`chunk_docs`); ALiBi as rectangles whose bias alibi.py reconciles with global positions.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from flashtile.distributed.alibi import alibi_bands, alibi_rects
from flashtile.distributed.band import UNBOUNDED, band_pieces


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
    with the kernel's window ``(left, right)`` (bottom-right aligned; -1 unbounded). Under ALiBi the kernel
    runs with its slopes times ``sign`` and its lse is off by ``slope * shift`` (alibi.py)."""

    q0: int
    q1: int
    k0: int
    k1: int
    left: int
    right: int
    sign: int = 1
    shift: int = 0

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


def chunk_docs(docs: tuple[int, ...] | None, total: int, chunk: int) -> tuple[int, ...] | None:
    """Document boundaries with every document also cut into chunks of ``chunk`` tokens from its start.

    FlashAttention-3's ``attention_chunk`` lets a query see only the keys of its own chunk (the chunk of
    its diagonal, which for self-attention is its own position in the document): to the planner that is
    one more document per chunk. ``chunk`` 0 leaves ``docs`` as it is.
    """
    if chunk <= 0:
        return docs
    bounds = docs if docs is not None else (0, total)
    if docs is None and chunk >= total:
        return None
    cuts = [p for a, b in zip(bounds, bounds[1:]) for p in range(a, b, chunk)]
    return tuple(cuts) + (total,)


def plan_pieces(q_segs, k_segs, left: int, right: int, docs: tuple[int, ...] | None = None,
                alibi: bool = False) -> list[Piece]:
    """Every visible rectangle of local queries ``q_segs`` against the key block ``k_segs``.

    ``left``/``right`` are the call's normalised window (causal is ``right = 0``); ``docs`` the packed
    sequence's cumulative document lengths (``cu_seqlens``, with chunks cut in), or None: queries see keys
    of their own document only. ``alibi``: the pieces carry the slope sign and lse shift that make the
    kernels' ALiBi bias the global one (alibi.py).
    """
    if not alibi and _one_causal_rectangle(q_segs, k_segs, left, right, docs):
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
                pieces += _rectangle(qs, ks, q_lo, q_hi, k_lo, k_hi, left, right, alibi)
    # joined pieces would move the kernels' diagonal, which ALiBi's bias is measured from
    return sorted(pieces, key=lambda p: (p.q0, p.k0)) if alibi else _merge_full(pieces)


def _rectangle(qs: Segment, ks: Segment, q_lo: int, q_hi: int, k_lo: int, k_hi: int, left: int, right: int,
               alibi: bool) -> list[Piece]:
    """The pieces of queries ``[q_lo, q_hi)`` of segment ``qs`` against keys ``[k_lo, k_hi)`` of ``ks``."""
    rects = alibi_rects(q_lo, q_hi, k_lo, k_hi) if alibi else [(q_lo, q_hi, k_lo, k_hi)]
    out = []
    for a, a_end, b, b_end in rects:
        for r0, rows, cols, kl, kr in band_pieces(a, a_end - a, b, b_end - b, left, right):
            bands = alibi_bands(rows, cols, kl, kr, a + r0, b) if alibi else [(0, rows, cols, kl, kr, 1, 0)]
            q0, k0 = qs.local + a - qs.start + r0, ks.local + b - ks.start
            out += [Piece(q0 + r1, q0 + r1 + rr, k0, k0 + cc, l2, r2, sign, shift)
                    for r1, rr, cc, l2, r2, sign, shift in bands]
    return out


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


def plan_calls(q_segs, k_segs, left: int, right: int, docs: tuple[int, ...] | None = None,
               alibi: bool = False) -> list[Call]:
    """The kernel calls of one step: each piece alone for one document; for packed documents, pieces
    with the same window and disjoint query rows share one varlen call (ALiBi's per-piece slope signs
    and shifts ride along per sequence, blocks.py)."""
    pieces = plan_pieces(q_segs, k_segs, left, right, docs, alibi)
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
