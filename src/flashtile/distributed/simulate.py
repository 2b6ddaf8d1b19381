"""The ring schedule with its ranks simulated in one process: no process group, same per-step math.

:func:`simulated_ring_attention` shards full tensors, runs every rank's steps with blocks.py (the code the
process-group functions run) and reassembles the full output, lse and gradients. Tests check the schedule
on one GPU or CPU with it, and it shows what a ring computes without launching ranks.
"""

from __future__ import annotations

from torch import Tensor

from flashtile.distributed.blocks import acc_dtype, accumulators, backward_step, bind, forward_step, grad_buffer
from flashtile.distributed.common import check_call
from flashtile.distributed.merge import finish
from flashtile.distributed.ring import ring_plan
from flashtile.distributed.sharding import shard, unshard


def simulated_ring_attention(q: Tensor, k: Tensor, v: Tensor, world: int, layout: str = "contiguous",
                             dout: Tensor | None = None, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, cu_seqlens=None, alibi_slopes=None, attention_chunk=0):
    """Full-sequence q ``(b, s, h, d)``, k / v ``(b, s, h_k, d)`` through a simulated ring of ``world`` ranks
    (keywords as :func:`ring_flash_attn_func`'s; ``cu_seqlens`` the whole sequence's documents).

    Returns ``(out, lse)`` (``out`` (b, s, h, dv), ``lse`` (b, h, s)), and with ``dout`` also
    ``(dq, dk, dv)``: ``(out, lse, dq, dk, dv)``.
    """
    qs = [shard(q, world, r, layout) for r in range(world)]
    ks = [shard(k, world, r, layout) for r in range(world)]
    vs = [shard(v, world, r, layout) for r in range(world)]
    spec = check_call(qs[0], ks[0], vs[0], 0.0, softmax_scale, causal, window_size, softcap, alibi_slopes, False,
                      world, layout, cu_seqlens, "simulated_ring_attention", attention_chunk)
    b, n = qs[0].shape[:2]
    steps = []
    for r in range(world):
        plan = ring_plan(layout, spec.total, world, r, spec.left, spec.right, spec.plan_docs, spec.alibi is not None)
        steps.append([bind(list(calls), b, n, n, q.device, spec.alibi, acc_dtype(q)) for calls in plan])
    outs, lses = [], []
    for r in range(world):
        acc_out, acc_lse = accumulators(qs[r], v.shape[-1])
        for s in range(world):
            src = (r - s) % world
            forward_step(acc_out, acc_lse, qs[r], ks[src], vs[src], steps[r][s], spec.opt)
        o, lse_r = finish(acc_out, acc_lse, None, q.dtype)
        outs.append(o)
        lses.append(lse_r)
    out, lse = unshard(outs, layout), unshard(lses, layout, dim=2)
    if dout is None:
        return out, lse
    douts = [shard(dout, world, r, layout) for r in range(world)]
    dqs = [grad_buffer(x) for x in qs]
    dks = [grad_buffer(x) for x in ks]
    dvs = [grad_buffer(x) for x in vs]
    for r in range(world):
        for s in range(world):
            src = (r - s) % world
            backward_step(dqs[r], dks[src], dvs[src], douts[r], qs[r], ks[src], vs[src], outs[r], lses[r],
                          steps[r][s], spec.opt)
    grads = [unshard([g.to(x.dtype) for g in gs], layout) for gs, x in ((dqs, q), (dks, k), (dvs, v))]
    return (out, lse, *grads)
