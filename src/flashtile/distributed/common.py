"""Argument checks and normalisation shared by every context-parallel function.

Each function takes flash_attn_func's arguments for this rank's shards, plus FlashAttention-3's
``attention_chunk``. What context parallelism cannot do is refused here with an error naming the argument:
dropout (each block's mask would have to be replayed in the backward with the positions of the whole
sequence, which the kernels' Philox stream does not offer) and shards of q that differ in length from k's
(self-attention is what splitting one sequence means).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from flashtile.backends.masking import normalize_window
from flashtile.distributed.blocks import Options
from flashtile.distributed.plan import chunk_docs
from flashtile.distributed.sharding import cu_seqlens_list, pieces_per_rank
from flashtile.validation import check_alibi, check_chunk


@dataclass(frozen=True)
class CallSpec:
    """A checked call: the options, the normalised window over the whole sequence, the documents, the
    chunk size (0: none) and the ALiBi slopes ``(h,)`` / ``(b, h)`` fp32 or None."""

    opt: Options
    left: int
    right: int
    total: int
    docs: tuple[int, ...] | None
    chunk: int = 0
    alibi: Tensor | None = None

    @property
    def plan_docs(self) -> tuple[int, ...] | None:
        """The boundaries the step planner masks by: the documents, each cut into chunks."""
        return chunk_docs(self.docs, self.total, self.chunk)


def check_shards(q: Tensor, k: Tensor, v: Tensor, fn: str) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 4:
            raise ValueError(f"flashtile.{fn}: {name} must be a (batch, seqlen, heads, head_dim) tensor shard, "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
    if k.shape[:3] != v.shape[:3] or k.shape[0] != q.shape[0]:
        raise ValueError(f"flashtile.{fn}: k {tuple(k.shape)} and v {tuple(v.shape)} must share batch, seqlen "
                         f"and heads with each other and batch with q {tuple(q.shape)}")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"flashtile.{fn}: k's local seqlen ({k.shape[1]}) must equal q's ({q.shape[1]}): "
                         "context parallelism shards one sequence of self-attention")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"flashtile.{fn}: q's heads ({q.shape[2]}) must be a multiple of k's ({k.shape[2]})")


def check_call(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               world: int, layout: str, cu_seqlens, fn: str, attention_chunk: int = 0) -> CallSpec:
    """Check one rank's call; the sequence is ``world`` shards of ``q.shape[1]`` tokens in ``layout``."""
    check_shards(q, k, v, fn)
    if dropout_p:
        raise ValueError(f"flashtile.{fn}: dropout_p must be 0 (got {dropout_p}): context-parallel attention "
                         "refuses dropout, since a block's mask could not be replayed consistently in the backward")
    per = pieces_per_rank(layout)
    if q.shape[1] % per:
        raise ValueError(f"flashtile.{fn}: q's local seqlen ({q.shape[1]}) must be divisible by {per} "
                         f"({layout} shards hold {per} chunks)")
    total = q.shape[1] * world
    docs = None
    if cu_seqlens is not None:
        docs = cu_seqlens_list(cu_seqlens)
        if docs[-1] != total:
            raise ValueError(f"flashtile.{fn}: cu_seqlens ends at {docs[-1]} but the sequence has {total} tokens "
                             f"({world} ranks x {q.shape[1]}): pass the full packed sequence's cu_seqlens")
    left, right = normalize_window(tuple(int(w) for w in window_size), bool(causal), total)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    alibi = check_alibi(alibi_slopes, q.device, q.shape[0], q.shape[2])
    return CallSpec(Options(scale, float(softcap), bool(deterministic)), left, right, total, docs,
                    check_chunk(attention_chunk, q), alibi)


def result(out: Tensor, lse: Tensor, return_attn_probs: bool):
    """FlashAttention's return convention: ``out``, or ``(out, lse, S_dmask)`` with an empty S_dmask."""
    return (out, lse, out.new_empty(0)) if return_attn_probs else out
