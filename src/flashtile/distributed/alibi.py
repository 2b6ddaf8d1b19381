"""ALiBi on the planner's rectangles: turning the kernels' bias into the bias of global positions.

The kernels add ``-slope * |o|`` to a score, with ``o = i - j + nk - nq`` for local row ``i`` and key ``j``
of an ``nq x nk`` rectangle (bottom-right aligned). The whole sequence needs ``-slope * |g|`` with ``g``
the query's global position minus the key's, and ``g = o + c`` for one constant ``c`` per rectangle:
``c = (q_pos - k_pos) - (nk - nq)``.

- ``c = 0`` (the rectangle's keys end where its queries end): the kernels' bias is the global one.
- Otherwise, when every visible pair has one sign of ``g`` (``sg``) and one sign of ``o`` (``so``),
  ``|g| = sg * (o + c)`` and ``|o| = so * o``, so ``-slope*|g| = -(slope*sg*so)*|o| - slope*sg*c``: the
  kernel runs with its slopes times ``sign = sg * so`` (a negative slope is a growing bias, which the
  kernels compute as well) and every score of the rectangle is off by ``-slope * shift`` with
  ``shift = sg * c``, a constant per head. A constant leaves the softmax of the rectangle alone and moves
  its lse: the true lse is the kernel's minus ``slope * shift``, and the backward gets the merged lse plus
  ``slope * shift`` (blocks.py).

:func:`alibi_rects` cuts a rectangle of global positions so each part has ``c = 0`` or one sign of ``g``;
:func:`alibi_bands` then cuts a kernel rectangle at its own diagonal where ``o`` takes both signs.

Precision: where ``so`` and ``sg`` differ the kernel's bias grows to ``slope * nk`` on the keys nearest
the queries, and the lse shift takes it back; in fp32 that costs about ``slope * nk * 2**-24`` of those
keys' relative weight (docs/distributed.md).
"""

from __future__ import annotations

from flashtile.distributed.band import UNBOUNDED, band_pieces

Band = tuple[int, int, int, int, int, int, int]  # (row0, rows, cols, left', right', sign, shift)


def alibi_rects(q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> list[tuple[int, int, int, int]]:
    """``[q_lo, q_hi) x [k_lo, k_hi)`` (global positions) as rectangles whose keys end where their queries
    end, or whose keys all lie after (or all before) their queries: ``(q_lo, q_hi, k_lo, k_hi)`` each."""
    rects = []
    if k_hi > q_hi:  # keys after every query
        rects.append((q_lo, q_hi, max(k_lo, q_hi), k_hi))
    end = min(k_hi, q_hi)
    if k_lo >= end:
        return rects
    if end == q_hi:
        return rects + [(q_lo, q_hi, k_lo, end)]
    if q_lo < end:  # the rows up to the keys' end: aligned
        rects.append((q_lo, end, k_lo, end))
    return rects + [(max(q_lo, end), q_hi, k_lo, end)]  # rows after every key


def _o_range(rows: int, cols: int, left: int, right: int) -> tuple[int, int]:
    """The least and greatest ``o`` of the rectangle's visible pairs (every value between occurs)."""
    lo = 1 - rows if right == UNBOUNDED else max(1 - rows, -right)
    hi = cols - 1 if left == UNBOUNDED else min(cols - 1, left)
    return lo, hi


def alibi_bands(rows: int, cols: int, left: int, right: int, q_pos: int, k_pos: int, depth: int = 0) -> list[Band]:
    """A kernel rectangle (window ``left, right``; first query at global ``q_pos``, first key at ``k_pos``)
    as rectangles with their slope sign and lse shift; cut at its diagonal where ``o`` takes both signs."""
    c = (q_pos - k_pos) - (cols - rows)
    if c == 0:
        return [(0, rows, cols, left, right, 1, 0)]
    lo, hi = _o_range(rows, cols, left, right)
    if lo + c >= 0:
        sg = 1
    elif hi + c <= 0:
        sg = -1
    else:
        raise AssertionError(f"flashtile: an ALiBi rectangle crosses the diagonal unaligned ({rows}x{cols}, c={c})")
    if lo >= 0 or hi <= 0:
        return [(0, rows, cols, left, right, sg if lo >= 0 else -sg, sg * c)]
    if depth > 2:
        raise AssertionError("flashtile: an ALiBi rectangle did not split into one-signed parts")
    d = cols - rows
    # in coordinates where key j sits at j - d, o is query - key: o >= 0 is a causal band, o <= -1 a band
    # of keys one past the queries (key' = key - 1, so left' = 0)
    parts = [(-d, left, 0)]
    if right != 0:
        parts.append((-d - 1, 0, UNBOUNDED if right == UNBOUNDED else right - 1))
    out = []
    for k0, lb, rb in parts:
        for r0, rr, cc, kl, kr in band_pieces(0, rows, k0, cols, lb, rb):
            out += [(r0 + a, *rest) for a, *rest in alibi_bands(rr, cc, kl, kr, q_pos + r0, k_pos, depth + 1)]
    return out
