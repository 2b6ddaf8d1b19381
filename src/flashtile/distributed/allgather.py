"""Attention with K/V all-gathered once instead of passed around a ring.

With grouped-query attention K/V are ``h / h_k`` times smaller than q, so gathering the whole K/V
sequence costs less traffic than ``W - 1`` ring hops of K/V plus their gradients, in one collective
that overlaps nothing but also waits on nothing. The rank then attends its queries to the whole
sequence in one or two kernel calls (plan.py trims each query run's keys to what its band can see).
The backward gathers K/V again (rather than keeping the gathered copy alive between forward and
backward) and reduce-scatters the full-sequence dK/dV in fp32 back to the owners.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist

from flashtile.distributed.blocks import acc_dtype, accumulators, backward_step, bind, forward_step, grad_buffer
from flashtile.distributed.comm import all_gather_seq, reduce_scatter_seq, resolve_group
from flashtile.distributed.common import check_call, result
from flashtile.distributed.merge import finish
from flashtile.distributed.plan import Call, Segment, plan_calls, segments
from flashtile.distributed.sharding import check_layout, layout_runs, shard, unshard
from flashtile.ops import sink_grad
from flashtile.validation import check_sink


@lru_cache(maxsize=256)
def gather_plan(layout: str, total: int, world: int, rank: int, left: int, right: int,
                docs: tuple[int, ...] | None, alibi: bool = False) -> tuple[Call, ...]:
    """The kernel calls of ``rank``'s queries against the whole sequence's keys in natural order
    (``docs``: the planner's boundaries, documents and chunks)."""
    mine = segments(layout_runs(layout, total, world, rank))
    return tuple(plan_calls(mine, (Segment(0, total, 0),), left, right, docs, alibi))


def _gather(x, group, layout):
    return unshard(all_gather_seq(x, group), layout)


class KVAllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, group, layout, bound, opt):
        kf, vf = _gather(k, group, layout), _gather(v, group, layout)
        acc_out, acc_lse = accumulators(q, v.shape[-1])
        forward_step(acc_out, acc_lse, q, kf, vf, bound, opt)
        out, lse = finish(acc_out, acc_lse, sink, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.group, ctx.layout, ctx.bound, ctx.opt = group, layout, bound, opt
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        group, layout = ctx.group, ctx.layout
        world = dist.get_world_size(group)
        kf, vf = _gather(k, group, layout), _gather(v, group, layout)
        dq, dkf, dvf = grad_buffer(q), grad_buffer(kf), grad_buffer(vf)
        backward_step(dq, dkf, dvf, dout, q, kf, vf, out, lse, ctx.bound, ctx.opt)
        dk = reduce_scatter_seq([shard(dkf, world, r, layout) for r in range(world)], group)
        dv = reduce_scatter_seq([shard(dvf, world, r, layout) for r in range(world)], group)
        dsink = sink_grad(sink, lse, dout, out, varlen=False) if sink is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, None, None, None, None


def kv_allgather_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                 softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                 group=None, layout="contiguous", cu_seqlens=None, learnable_sink=None,
                                 attention_chunk=0):
    """Context-parallel attention that all-gathers K/V (the cheaper exchange when ``h_k`` is small).

    ``layout``: how the shards were cut, ``"contiguous"`` or ``"zigzag"`` (sharding.py). Other arguments
    and returns as :func:`ring_flash_attn_func`.
    """
    check_layout(layout)
    group = resolve_group(group)
    world = dist.get_world_size(group)
    spec = check_call(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, world, layout, cu_seqlens, "kv_allgather_flash_attn_func", attention_chunk)
    plan = gather_plan(layout, spec.total, world, dist.get_rank(group), spec.left, spec.right, spec.plan_docs,
                       spec.alibi is not None)
    bound = bind(list(plan), q.shape[0], q.shape[1], spec.total, q.device, spec.alibi, acc_dtype(q))
    sink = check_sink(learnable_sink, q)
    out, lse = KVAllGatherAttention.apply(q, k, v, sink, group, layout, bound, spec.opt)
    return result(out, lse, return_attn_probs)
