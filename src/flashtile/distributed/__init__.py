"""Context parallelism: one long sequence split across ranks, on flashtile's kernels.

Functions take flash_attn_func's arguments (ALiBi included) for this rank's shards plus ``group=``,
``cu_seqlens=``, ``learnable_sink=`` and ``attention_chunk=`` (docs/distributed.md):

- :func:`ring_flash_attn_func`: K/V travel a ring; contiguous shards.
- :func:`zigzag_ring_flash_attn_func`: the same ring over zigzag shards (balanced causal work).
- :func:`kv_allgather_flash_attn_func`: K/V gathered once (cheaper with few K/V heads, GQA).
- :func:`ulysses_flash_attn_func`: all-to-all from sequence shards to head shards and back (contiguous or
  zigzag shards).
- :func:`hybrid_flash_attn_func`: Ulysses inside ``ulysses_group``, a ring across ``ring_group``.

Helpers: :func:`shard`, :func:`unshard`, :func:`shard_hybrid`, :func:`varlen_shard_meta`, and
:func:`simulated_ring_attention` (the ring's math in one process).
"""

from flashtile.distributed.allgather import kv_allgather_flash_attn_func
from flashtile.distributed.hybrid import hybrid_flash_attn_func
from flashtile.distributed.ring import ring_flash_attn_func
from flashtile.distributed.sharding import LAYOUTS, shard, shard_hybrid, unshard, varlen_shard_meta
from flashtile.distributed.simulate import simulated_ring_attention
from flashtile.distributed.ulysses import ulysses_flash_attn_func
from flashtile.distributed.zigzag import zigzag_ring_flash_attn_func

__all__ = [
    "LAYOUTS",
    "hybrid_flash_attn_func",
    "kv_allgather_flash_attn_func",
    "ring_flash_attn_func",
    "shard",
    "shard_hybrid",
    "simulated_ring_attention",
    "ulysses_flash_attn_func",
    "unshard",
    "varlen_shard_meta",
    "zigzag_ring_flash_attn_func",
]
