"""Zigzag ring attention: the ring of ring.py over zigzag shards, which balance causal work.

Rank ``r`` of ``W`` holds chunks ``r`` and ``2W-1-r`` of the sequence cut into ``2W`` (sharding.py draws
it). Under a causal mask the own step is causal on both halves (and the second half sees the first in
full); a block from an earlier rank is seen in full by both halves through its first chunk only; a block
from a later rank is seen in full by the second half only. Every rank thus computes the same amount at
every step, where contiguous shards leave the first rank idle after its own step.
"""

from __future__ import annotations

from flashtile.distributed.ring import ring_call


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                group=None, cu_seqlens=None, learnable_sink=None, attention_chunk=0):
    """Ring attention over zigzag shards (``flashtile.distributed.shard(x, W, r, "zigzag")`` makes them).

    Arguments and returns as :func:`ring_flash_attn_func`; the local seqlen must be even. ``cu_seqlens``
    describes the whole packed sequence in its natural order.
    """
    return ring_call("zigzag_ring_flash_attn_func", "zigzag", q, k, v, dropout_p, softmax_scale, causal,
                     window_size, softcap, alibi_slopes, deterministic, return_attn_probs, group, cu_seqlens,
                     learnable_sink, attention_chunk)
