"""Chunked attention as a batch of shorter sequences, where the two are the same computation.

With ``attention_chunk = c`` a query sees only the keys of its own chunk. When q and k have the same
length ``s`` (not varlen, no ``seqused``) and ``c`` divides ``s``, the chunks are independent sequences:
``(b, s, h, d)`` viewed as ``(b * s / c, c, h, d)`` (a free view of any tensor whose batch stride is ``s``
times its sequence stride) is plain attention with the same causal mask, window, ALiBi distances,
softcap and sink, since all of them depend on ``i - j`` only. The plain kernels then run at their full
speed (the Gluon routes included), doing exactly the visible work. Only the lse moves: ``(b, h, s)``
outside, ``(b * s / c, h, c)`` inside.

Dropout stays on the chunk-aware kernels: its random stream is keyed by the (batch, row, column)
coordinates, which the view renames.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flashtile.params import AttnParams


def chunks_per_sequence(q: torch.Tensor, k: torch.Tensor, p: AttnParams) -> int:
    """n > 0 when the call may run as ``b * n`` sequences of ``s / n`` tokens (1: the chunk covers the whole
    sequence and changes nothing); 0 when it must stay chunk-aware."""
    c = p.attention_chunk
    if c <= 0 or q.dim() != 4 or p.varlen or p.seqused_q is not None or p.seqused_k is not None:
        return 0
    if p.dropout_p > 0 or q.shape[1] != k.shape[1]:
        return 0
    s = q.shape[1]
    if c >= s:
        return 1
    return s // c if s % c == 0 else 0


def _foldable(x: torch.Tensor, s: int) -> bool:
    return x.dim() == 4 and x.shape[1] == s and (x.shape[0] == 1 or x.stride(0) == s * x.stride(1))


def fold(x: torch.Tensor, n: int) -> torch.Tensor:
    """(b, s, ...) -> (b * n, s / n, ...) as a view."""
    b, s = x.shape[:2]
    return x.view(b * n, s // n, *x.shape[2:])


def fold_lse(lse: torch.Tensor, n: int) -> torch.Tensor:
    """(b, h, s) -> (b * n, h, s / n), contiguous."""
    b, h, s = lse.shape
    return lse.reshape(b, h, n, s // n).transpose(1, 2).reshape(b * n, h, s // n)


def unfold_lse(lse: torch.Tensor, n: int) -> torch.Tensor:
    """(b * n, h, c) -> (b, h, n * c), contiguous."""
    bn, h, c = lse.shape
    return lse.reshape(bn // n, n, h, c).transpose(1, 2).reshape(bn // n, h, n * c)


def params_for(p: AttnParams, n: int, batch: int) -> AttnParams:
    """The chunk-free parameters of the folded call: per-batch ALiBi slopes and fp8 descales repeat
    for the n sequences each batch row became."""
    def per_row(t):
        return t.repeat_interleave(n, dim=0) if t is not None and t.dim() == 2 and t.shape[0] == batch else t

    return replace(p, attention_chunk=0, alibi_slopes=per_row(p.alibi_slopes), q_descale=per_row(p.q_descale),
                   k_descale=per_row(p.k_descale), v_descale=per_row(p.v_descale))


def plan(q: torch.Tensor, p: AttnParams, *tensors: torch.Tensor) -> int:
    """n for a call over ``tensors`` (all (b, s, h, *)); 0 when any of them cannot be viewed folded."""
    n = chunks_per_sequence(q, tensors[0] if tensors else q, p)
    if n > 1 and not all(_foldable(x, q.shape[1]) for x in (q, *tensors)):
        return 0
    return n
