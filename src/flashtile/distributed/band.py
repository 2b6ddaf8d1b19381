"""One band of global positions on one rectangle, stated in the kernels' terms.

A rectangle holds queries at global positions ``[q_pos, q_pos + nq)`` and keys at ``[k_pos, k_pos + nk)``;
its mask is the band ``-left <= key - query <= right`` (-1 = unbounded; causal is ``right = 0``).

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

UNBOUNDED = -1


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
