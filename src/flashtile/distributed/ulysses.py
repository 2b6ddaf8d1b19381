"""Ulysses (DeepSpeed's sequence parallelism): trade sequence shards for head shards and back.

An all-to-all turns each rank's ``(b, n, h, d)`` sequence shard into the whole sequence for ``h / W`` of
the heads; the rank runs ordinary flash attention on it (every mask and feature of the single-device call,
ALiBi and ``attention_chunk`` included, since the rank sees the whole sequence); a second all-to-all
returns the output to sequence shards. The traffic is a constant share of q, k, v and out per rank,
whatever ``W``, but ``W`` cannot exceed the heads. K/V heads fewer than ``W`` (GQA) are repeated up to
``W`` before the exchange.

Zigzag shards: the all-to-all lays the ranks' shards end to end, each in its storage order, so the rank
puts the sequence in its natural order (:func:`unshard`) before attending and back in shard order
(:func:`shard`) after: two copies of the rank's ``(b, S, h/W, d)`` tensors, which lets a model keep one
zigzag layout for Ulysses and the ring schemes alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashtile.distributed.comm import heads_to_seq_grad, lse_heads_to_seq, resolve_group, seq_to_heads_grad
from flashtile.distributed.common import check_call, result
from flashtile.distributed.sharding import check_layout, shard, unshard
from flashtile.flash_attn_interface import flash_attn_func, flash_attn_varlen_func
from flashtile.validation import check_sink


def split_heads_check(q, k, v, world: int, fn: str, what: str = "group"):
    """Check that the heads split over ``world`` ranks; repeat K/V heads when there are fewer than ``world``."""
    h, hk = q.shape[2], k.shape[2]
    if h % world:
        raise ValueError(f"flashtile.{fn}: q's heads ({h}) must be divisible by the Ulysses {what} size ({world})")
    if hk % world == 0:
        return k, v
    if world % hk:
        raise ValueError(f"flashtile.{fn}: k's heads ({hk}) must divide or be divisible by the Ulysses {what} "
                         f"size ({world})")
    rep = world // hk  # query head i uses kv head i // (h / hk); after repeating, i // (h / W)
    return k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)


def head_shard(x, heads: int, group):
    """This rank's heads of a per-head tensor (a learnable sink ``(h,)``, ALiBi slopes ``(h,)`` / ``(b, h)``)
    after Ulysses' all-to-all (rank ``r`` holds heads ``[r * heads, (r + 1) * heads)``); a view, so a
    sink's gradient reaches the full sink."""
    return None if x is None else x.narrow(-1, dist.get_rank(group) * heads, heads)


def local_attention(q, k, v, spec, sink=None, alibi=None):
    """Flash attention over a whole sequence (``(b, s, h, d)``); packed documents through the varlen call.
    ``alibi``: this rank's heads' slopes ``(h,)`` / ``(b, h)``."""
    opt = spec.opt
    if spec.docs is None:
        out, lse, _ = flash_attn_func(q, k, v, 0.0, opt.softmax_scale, False, (spec.left, spec.right),
                                      opt.softcap, alibi, opt.deterministic, True, learnable_sink=sink,
                                      attention_chunk=spec.chunk)
        return out, lse
    b, s = q.shape[:2]
    ndocs = len(spec.docs) - 1
    cu = torch.tensor([c + i * s for i in range(b) for c in spec.docs[:-1]] + [b * s], dtype=torch.int32,
                      device=q.device)
    longest = max(e - a for a, e in zip(spec.docs, spec.docs[1:]))
    if alibi is not None and alibi.dim() == 2:  # one row of slopes per sequence: each batch row's documents
        alibi = alibi.repeat_interleave(ndocs, dim=0)
    flat = [x.reshape(b * s, *x.shape[2:]) for x in (q, k, v)]
    out, lse, _ = flash_attn_varlen_func(*flat, cu, cu, longest, longest, 0.0, opt.softmax_scale, False,
                                         (spec.left, spec.right), opt.softcap, alibi, opt.deterministic, True,
                                         learnable_sink=sink, attention_chunk=spec.chunk)
    return out.reshape(b, s, *out.shape[1:]), lse.reshape(lse.shape[0], b, s).transpose(0, 1)


def natural_order(x, world: int, layout: str, dim: int = 1):
    """The gathered sequence (ranks' shards end to end along ``dim``) in its natural order."""
    return x if layout == "contiguous" else unshard(list(x.chunk(world, dim)), layout, dim)


def shard_order(x, world: int, layout: str, dim: int = 1):
    """The inverse of :func:`natural_order`: the ranks' shards end to end along ``dim``."""
    return x if layout == "contiguous" else torch.cat([shard(x, world, r, layout, dim) for r in range(world)], dim)


def ulysses_attention(q, k, v, group, spec, return_lse: bool, sink=None, layout="contiguous"):
    """Both all-to-alls around :func:`local_attention`: ``(out, lse or None)`` of this rank's shard."""
    world = dist.get_world_size(group)
    q2, k2, v2 = (natural_order(seq_to_heads_grad(x, group), world, layout) for x in (q, k, v))
    heads = q2.shape[2]
    out2, lse2 = local_attention(q2, k2, v2, spec, head_shard(sink, heads, group),
                                 head_shard(spec.alibi, heads, group))
    out = heads_to_seq_grad(shard_order(out2, world, layout), group)
    return out, (lse_heads_to_seq(shard_order(lse2, world, layout, dim=2), group) if return_lse else None)


def ulysses_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                            group=None, layout="contiguous", cu_seqlens=None, learnable_sink=None,
                            attention_chunk=0):
    """Ulysses attention over sequence shards cut by ``layout`` (``"contiguous"`` or ``"zigzag"``,
    sharding.py); q's heads (and k's, or ``W`` a multiple of them) must divide by the group size ``W``.
    Arguments and returns as :func:`ring_flash_attn_func` (a rank's ``learnable_sink`` gradient holds its
    heads' share)."""
    fn = "ulysses_flash_attn_func"
    check_layout(layout)
    group = resolve_group(group)
    world = dist.get_world_size(group)
    spec = check_call(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, world, layout, cu_seqlens, fn, attention_chunk)
    sink = check_sink(learnable_sink, q)
    k, v = split_heads_check(q, k, v, world, fn)
    out, lse = ulysses_attention(q, k, v, group, spec, return_attn_probs, sink, layout)
    return result(out, lse, return_attn_probs)
