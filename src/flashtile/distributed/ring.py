"""Ring attention: K/V blocks travel around the ring while each rank attends its queries to them.

Step ``s`` of ``W``: rank ``r`` holds the K/V shard of rank ``r - s``; it posts the send of that block to
``r + 1`` (and the receive of the next one from ``r - 1``) before computing on it, so the transfer runs
under the kernels. The step's kernel calls come from the planner (plan.py): a causal step against an
earlier rank's block is unmasked, the own block is causal, a later rank's block is skipped. Results merge
by lse (merge.py). Chunked attention and ALiBi come out of the same planner: a step whose queries and
keys share no chunk has no piece and is skipped like a causal step's later block.

Backward: K/V go around again; each rank adds its share of dK/dV for the block it holds into a partial
sum that travels with the block, so after ``W`` hops every block's gradient arrives back at its owner.
The partial sums travel in fp32.

When no rank has anything to compute past step ``L - 1`` (a sliding window or chunks shorter than a
shard reach only the next ``L - 1`` ranks' blocks), the ring stops after ``L`` steps, in both passes: K/V
make ``L - 1`` hops instead of ``W - 1``, and each block's finished gradient goes straight back to its
owner, ``L - 1`` ranks behind, in one last exchange.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist

from flashtile.distributed.blocks import acc_dtype, accumulators, backward_step, bind, forward_step, grad_buffer
from flashtile.distributed.comm import Ring, resolve_group
from flashtile.distributed.common import CallSpec, check_call, result
from flashtile.distributed.merge import finish
from flashtile.distributed.plan import Call, plan_calls, segments
from flashtile.distributed.sharding import layout_runs
from flashtile.ops import sink_grad
from flashtile.validation import check_sink


@lru_cache(maxsize=256)
def ring_plan(layout: str, total: int, world: int, rank: int, left: int, right: int,
              docs: tuple[int, ...] | None, alibi: bool = False) -> tuple[tuple[Call, ...], ...]:
    """The kernel calls of each step of ``rank`` (step ``s`` attends to rank ``(rank - s) % world``'s block);
    ``docs``: the planner's boundaries (documents and chunks, ``CallSpec.plan_docs``)."""
    mine = segments(layout_runs(layout, total, world, rank))
    return tuple(tuple(plan_calls(mine, segments(layout_runs(layout, total, world, (rank - s) % world)),
                                  left, right, docs, alibi))
                 for s in range(world))


@lru_cache(maxsize=256)
def ring_steps(layout: str, total: int, world: int, left: int, right: int, docs: tuple[int, ...] | None,
               alibi: bool = False) -> int:
    """How many steps the ring takes: one past the last step at which any rank has a kernel call (at least
    the own step). Every rank computes the same number from the same arguments."""
    last = 0
    for rank in range(world):
        plan = ring_plan(layout, total, world, rank, left, right, docs, alibi)
        last = max([last] + [s for s, calls in enumerate(plan) if calls])
    return last + 1


class RingAttention(torch.autograd.Function):
    """Forward and backward of ring attention over ``ring`` with the steps' bound calls (``len(steps)`` of
    them, at most the ring's size)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, ring: Ring, steps, opt):
        acc_out, acc_lse = accumulators(q, v.shape[-1])
        kb, vb = k, v
        hops = len(steps)
        for s in range(hops):
            pending = ring.exchange([kb, vb], tag=0) if s + 1 < hops else None
            forward_step(acc_out, acc_lse, q, kb, vb, steps[s], opt)
            if pending is not None:
                kb, vb = pending.wait()
        out, lse = finish(acc_out, acc_lse, sink, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.ring, ctx.steps, ctx.opt = ring, steps, opt
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        ring, hops = ctx.ring, len(ctx.steps)
        dq = grad_buffer(q)
        kb, vb, pending_grad = k, v, None
        for s in range(hops):
            pending_kv = ring.exchange([kb, vb], tag=0) if s + 1 < hops else None
            dk, dv = grad_buffer(k), grad_buffer(v)
            backward_step(dq, dk, dv, dout, q, kb, vb, out, lse, ctx.steps[s], ctx.opt)
            if pending_grad is not None:  # the partial sums of this block from the ranks before
                got_k, got_v = pending_grad.wait()
                dk += got_k
                dv += got_v
            if s + 1 < hops:
                pending_grad = ring.exchange([dk, dv], tag=1)
            if pending_kv is not None:
                kb, vb = pending_kv.wait()
        if hops > 1:  # the block held last is complete: back to its owner, hops - 1 ranks behind
            dk, dv = ring.exchange([dk, dv], tag=2, shift=1 - hops).wait()
        # with the sink in the saved lse the steps' gradients are already right (as in the kernels); the
        # sink's own is this rank's rows' share
        dsink = sink_grad(sink, lse, dout, out, varlen=False) if sink is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, None, None, None


def ring_attention(q, k, v, group, layout: str, spec: CallSpec, sink=None):
    """Run the ring over a resolved group: ``(out, lse)``; ``sink``: a checked learnable sink or None."""
    ring = Ring(group)
    key = (layout, spec.total, ring.world, spec.left, spec.right, spec.plan_docs, spec.alibi is not None)
    plan = ring_plan(key[0], key[1], key[2], ring.rank, *key[3:])[:ring_steps(*key)]
    n = q.shape[1]
    steps = [bind(list(calls), q.shape[0], n, n, q.device, spec.alibi, acc_dtype(q)) for calls in plan]
    return RingAttention.apply(q, k, v, sink, ring, steps, spec.opt)


def ring_call(fn: str, layout: str, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
              alibi_slopes, deterministic, return_attn_probs, group, cu_seqlens, learnable_sink=None,
              attention_chunk=0):
    group = resolve_group(group)
    spec = check_call(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, dist.get_world_size(group), layout, cu_seqlens, fn, attention_chunk)
    out, lse = ring_attention(q, k, v, group, layout, spec, check_sink(learnable_sink, q))
    return result(out, lse, return_attn_probs)


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                         group=None, cu_seqlens=None, learnable_sink=None, attention_chunk=0):
    """Ring attention over contiguous shards: rank ``r`` of ``W`` holds tokens ``[r*n, (r+1)*n)``.

    q: (b, n, h, d), k / v: (b, n, h_k, d) / (b, n, h_k, dv), this rank's shards; ``group``: a process
    group or 1-D DeviceMesh (default: the world). ``cu_seqlens`` (int32 ``(docs+1,)``, list or tensor; a
    CPU one avoids a device sync): documents packed along the *whole* sequence of ``W*n`` tokens, the same
    for every batch row; attention stays within each document. Other arguments as flash_attn_func (dropout
    refused); ``alibi_slopes`` fp32 ``(h,)`` / ``(b, h)`` measure distances between global positions.
    ``learnable_sink`` ``(h,)``: as flash_attn_func's, the same on every rank; its gradient on a rank is
    that rank's rows' share (sum it over the group, as any parameter's). ``attention_chunk`` (FlashAttention-3's):
    > 0 limits each query to the keys of its chunk of that many tokens of the whole sequence (of its
    document, with ``cu_seqlens``). Returns this rank's ``out`` (b, n, h, dv), or ``(out, lse (b, h, n),
    empty)`` when ``return_attn_probs``. Under a causal mask later ranks do more work:
    :func:`zigzag_ring_flash_attn_func` balances it.
    """
    return ring_call("ring_flash_attn_func", "contiguous", q, k, v, dropout_p, softmax_scale, causal,
                     window_size, softcap, alibi_slopes, deterministic, return_attn_probs, group, cu_seqlens,
                     learnable_sink, attention_chunk)
