"""The masking and bias rules of the contract, written once for every PyTorch implementation.

Row ``i`` (query) and column ``j`` (key) of a sequence with ``seqlen_q`` queries and ``seqlen_k``
keys are aligned at the bottom-right corner: the diagonal of row ``i`` is ``i + seqlen_k - seqlen_q``.
Everything here broadcasts, so callers pass index tensors shaped for their tile and per-batch
lengths shaped ``(b, 1, 1, 1)`` (or plain ints).
"""

from __future__ import annotations


def visible(rows, cols, seqlen_q, seqlen_k, window_left: int, window_right: int, chunk: int = 0):
    """Boolean mask: may query ``rows`` see key ``cols``?

    ``window_left``/``window_right`` are already normalised (-1 = unbounded; causal means right=0).
    ``chunk`` > 0 (FlashAttention-3's ``attention_chunk``, Llama 4's chunked attention): a row sees only
    the keys of its diagonal's chunk, ``[c, c + chunk)`` with ``c = diag - diag mod chunk`` (floor, so a
    negative diagonal falls in the chunk below 0), on top of the window.
    Rows past ``seqlen_q`` and columns past ``seqlen_k`` are invisible.
    """
    diag = rows + seqlen_k - seqlen_q
    ok = (cols < seqlen_k) & (rows < seqlen_q)
    if window_left >= 0:
        ok = ok & (cols >= diag - window_left)
    if window_right >= 0:
        ok = ok & (cols <= diag + window_right)
    if chunk > 0:
        start = diag - diag % chunk  # tensors' % takes the divisor's sign: a floor
        ok = ok & (cols >= start) & (cols < start + chunk)
    return ok


def alibi_bias(slopes, rows, cols, seqlen_q, seqlen_k):
    """ALiBi score bias ``-slope * |i + sk - sq - j|`` in ``slopes``' dtype, broadcast against the tile."""
    dist = (rows + seqlen_k - seqlen_q - cols).abs().to(slopes.dtype)
    return -slopes * dist


def normalize_window(window_size, causal: bool, max_seqlen_k: int) -> tuple[int, int]:
    """Apply FlashAttention's window conventions: causal sets right=0, a bound >= sk is unbounded."""
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    if left >= max_seqlen_k:
        left = -1
    if right >= max_seqlen_k:
        right = -1
    return left, right
