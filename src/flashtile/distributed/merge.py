"""Merging partial attention results by their log-sum-exp.

Attention of a row over the union of disjoint key sets is the softmax-weighted mix of the partial results:
``lse = log(sum_i exp(lse_i))`` and ``out = sum_i exp(lse_i - lse) * out_i``. A row that saw no key of a
part has ``lse_i = -inf`` here and weight 0. The kernels mark such rows with ``+inf`` (FlashAttention's
convention), so results are converted on the way in (:func:`to_merge_lse`) and back on the way out
(:func:`to_fa_lse`).
"""

from __future__ import annotations

import torch
from torch import Tensor

INF = float("inf")


def to_merge_lse(lse: Tensor) -> Tensor:
    """Kernel lse (``+inf`` = saw nothing) as merge lse (``-inf`` = saw nothing)."""
    return lse.masked_fill(lse == INF, -INF)


def to_fa_lse(lse: Tensor) -> Tensor:
    """Merged lse back in FlashAttention's convention (``+inf`` for a row that saw no key)."""
    return lse.masked_fill(lse == -INF, INF)


def merge_(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor) -> None:
    """Fold one part into the running result, in place.

    ``out`` ``(..., h, d)`` and ``lse`` ``(..., h)`` hold the running result (fp32 or fp64, lse ``-inf``
    where nothing was seen yet); ``part_out`` / ``part_lse`` are the part's, same shapes, any float dtype.
    """
    part_lse = to_merge_lse(part_lse.to(lse.dtype))
    new = torch.logaddexp(lse, part_lse)
    # rows empty in both stay empty: shift by 0 there so no -inf - -inf (NaN) appears
    shift = new.masked_fill(new == -INF, 0.0)
    out.mul_(torch.exp(lse - shift).unsqueeze(-1))
    out.add_(part_out.to(out.dtype) * torch.exp(part_lse - shift).unsqueeze(-1))
    lse.copy_(new)


def fold_sink_(out: Tensor, lse: Tensor, sink: Tensor) -> None:
    """Fold a learnable sink (``(h,)`` logits) into merged results, in place: a part with no value whose lse
    is the sink, so ``lse = logaddexp(lse, sink)`` and ``out`` shrinks by ``exp(old lse - lse)``. A row that
    saw no key ends with out 0 and lse = its sink (the contract's rule)."""
    new = torch.logaddexp(lse, sink.to(lse.dtype))
    shift = new.masked_fill(new == -INF, 0.0)  # a -inf sink on an empty row: no NaN
    out.mul_(torch.exp(lse - shift).unsqueeze(-1))
    lse.copy_(new)


def finish(acc_out: Tensor, acc_lse: Tensor, sink: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A scheme's merged accumulators as its result: the sink folded in (when given), ``out`` in the inputs'
    dtype, lse ``(b, h, n)`` in FlashAttention's convention."""
    if sink is not None:
        fold_sink_(acc_out, acc_lse, sink)
    return acc_out.to(dtype), to_fa_lse(acc_lse.transpose(1, 2).contiguous())


def merge_all(outs: list[Tensor], lses: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Merge several parts of the same rows (merge lse convention): returns ``(out, lse)`` in fp32 (fp64
    for fp64 parts)."""
    acc = torch.float64 if outs[0].dtype == torch.float64 else torch.float32
    out = torch.zeros(outs[0].shape, dtype=acc, device=outs[0].device)
    lse = torch.full(lses[0].shape, -INF, dtype=acc, device=lses[0].device)
    for o, s in zip(outs, lses):
        merge_(out, lse, o, s)
    return out, lse
