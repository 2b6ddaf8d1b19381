"""The 2-D scheme: Ulysses inside a group of ranks, a ring across groups.

Ulysses' all-to-all is fast inside a node but needs the heads to divide by its group; the ring scales
across nodes with point-to-point traffic only. The hybrid runs Ulysses within ``ulysses_group`` (``U``
ranks) to assemble each group's ring shard for ``h / U`` heads, runs ring attention (contiguous or zigzag)
across ``ring_group`` (``R`` ranks) on it, and returns to sequence shards. Shards come from
:func:`flashtile.distributed.shard_hybrid`: the ring layout's shard of the ring rank, cut in ``U`` parts.
"""

from __future__ import annotations

import torch.distributed as dist

from flashtile.distributed.comm import heads_to_seq_grad, lse_heads_to_seq, resolve_group, seq_to_heads_grad
from flashtile.distributed.common import check_call, check_shards, result
from flashtile.distributed.ring import ring_attention
from flashtile.distributed.sharding import check_layout
from flashtile.distributed.ulysses import head_shard, split_heads_check
from flashtile.validation import check_alibi, check_sink


def check_groups(ulysses_group, ring_group, fn: str) -> None:
    """The two groups must meet in exactly this rank (one is a row, the other a column of a 2-D grid)."""
    me = dist.get_rank()
    u = set(dist.get_process_group_ranks(ulysses_group))
    r = set(dist.get_process_group_ranks(ring_group))
    if u & r != {me}:
        raise ValueError(f"flashtile.{fn}: ulysses_group {sorted(u)} and ring_group {sorted(r)} must share exactly "
                         f"this rank ({me}): they are a row and a column of the same 2-D grid of ranks")


def hybrid_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                           ulysses_group=None, ring_group=None, layout="contiguous", cu_seqlens=None,
                           learnable_sink=None, attention_chunk=0):
    """Ulysses within ``ulysses_group`` and ring attention across ``ring_group`` (groups or 1-D meshes).

    q: (b, n, h, d) with h divisible by the Ulysses group size; ``layout`` is the ring's (contiguous or
    zigzag); ``cu_seqlens`` describes the whole packed sequence; ``learnable_sink`` as in
    :func:`ring_flash_attn_func` (a rank's gradient: its heads' and rows' share); ``alibi_slopes`` and
    ``attention_chunk`` as there. Returns as :func:`ring_flash_attn_func`.
    """
    fn = "hybrid_flash_attn_func"
    check_layout(layout)
    if ulysses_group is None or ring_group is None:
        raise ValueError(f"flashtile.{fn}: pass both ulysses_group and ring_group")
    ug, rg = resolve_group(ulysses_group, "ulysses_group"), resolve_group(ring_group, "ring_group")
    check_groups(ug, rg, fn)
    check_shards(q, k, v, fn)
    u = dist.get_world_size(ug)
    sink = check_sink(learnable_sink, q)
    alibi = check_alibi(alibi_slopes, q.device, q.shape[0], q.shape[2])
    k, v = split_heads_check(q, k, v, u, fn, "ulysses_group")
    q2, k2, v2 = (seq_to_heads_grad(x, ug) for x in (q, k, v))
    spec = check_call(q2, k2, v2, dropout_p, softmax_scale, causal, window_size, softcap,
                      head_shard(alibi, q2.shape[2], ug), deterministic, dist.get_world_size(rg), layout, cu_seqlens,
                      fn, attention_chunk)
    out2, lse2 = ring_attention(q2, k2, v2, rg, layout, spec, head_shard(sink, q2.shape[2], ug))
    out = heads_to_seq_grad(out2, ug)
    lse = lse_heads_to_seq(lse2, ug) if return_attn_probs else None
    return result(out, lse, return_attn_probs)
