"""Communication through ``torch.distributed`` only: the ring exchange and the collectives.

NCCL runs point-to-point and collective work on its own streams, so a send issued before a kernel
overlaps it without a side stream of ours; gloo (CPU) runs it on its own threads. Nothing here reads a
tensor's values on the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def resolve_group(group, name: str = "group"):
    """A process group from ``group``: a ProcessGroup, a 1-D DeviceMesh, or None for the default group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"flashtile: {name} needs torch.distributed initialised (init_process_group)")
    if group is None:
        return dist.group.WORLD
    if hasattr(group, "get_group") and hasattr(group, "ndim"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"flashtile: {name} must be a 1-D DeviceMesh, got one with {group.ndim} dims")
        return group.get_group()
    return group


class Ring:
    """Neighbours of this rank in ``group``'s ring: blocks go to ``rank + 1`` and come from ``rank - 1``."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def exchange(self, tensors: list[Tensor], tag: int, shift: int = 1) -> Pending:
        """Start sending ``tensors`` to the next rank and receiving as many from the previous one (with
        ``shift``: to rank ``+ shift`` and from rank ``- shift``).

        Every rank issues its exchanges in the same order; ``tag`` keeps the K/V stream apart from the
        gradient stream in the backward (gloo matches by tag, NCCL by order).
        """
        to, src = self.next, self.prev
        if shift % self.world != 1:
            to = dist.get_global_rank(self.group, (self.rank + shift) % self.world)
            src = dist.get_global_rank(self.group, (self.rank - shift) % self.world)
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), to, self.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, src, self.group, tag) for b in bufs]
        return Pending(dist.batch_isend_irecv(ops), bufs)


class Pending:
    """An exchange in flight; :meth:`wait` returns the received tensors."""

    def __init__(self, works, bufs: list[Tensor]):
        self.works, self.bufs = works, bufs

    def wait(self) -> list[Tensor]:
        for w in self.works:
            w.wait()
        # drop the finished works now: a gloo work still referenced when the interpreter shuts down is
        # destroyed on gloo's thread without the GIL and aborts the process ("terminate called without an
        # active exception", seen once in a few hundred torchrun runs of the example)
        self.works = []
        return self.bufs


def all_gather_seq(x: Tensor, group) -> list[Tensor]:
    """Every rank's ``x`` (same shape everywhere), as a list indexed by rank."""
    world = dist.get_world_size(group)
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _ALL_GATHER(out, x.contiguous(), group=group)  # ranks' tensors end to end along dim 0
    return list(out.view(world, *x.shape).unbind(0))


def reduce_scatter_seq(parts: list[Tensor], group) -> Tensor:
    """Sum over ranks of ``parts[rank]`` for this rank (``parts[r]`` is this rank's share for rank ``r``)."""
    stacked = torch.cat(parts)  # ranks' shares end to end along dim 0
    out = torch.empty(parts[0].shape, dtype=stacked.dtype, device=stacked.device)
    _REDUCE_SCATTER(out, stacked, group=group)
    return out


def seq_to_heads(x: Tensor, group) -> Tensor:
    """Ulysses' first all-to-all: ``(b, n, h, d)`` sequence shards in, ``(b, W*n, h/W, d)`` out (the
    sequence in rank order, this rank's ``h/W`` heads)."""
    world = dist.get_world_size(group)
    b, n, h, d = x.shape
    send = x.reshape(b, n, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * n, h // world, d)


def heads_to_seq(x: Tensor, group) -> Tensor:
    """The inverse all-to-all: ``(b, W*n, h/W, d)`` in, ``(b, n, h, d)`` out."""
    world = dist.get_world_size(group)
    b, s, hw, d = x.shape
    n = s // world
    send = x.reshape(b, world, n, hw, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n, world * hw, d)


def lse_heads_to_seq(lse: Tensor, group) -> Tensor:
    """lse ``(b, h/W, W*n)`` of this rank's heads as ``(b, h, n)`` of its sequence shard."""
    return heads_to_seq(lse.transpose(1, 2).unsqueeze(-1), group).squeeze(-1).transpose(1, 2).contiguous()


class _AllToAll(torch.autograd.Function):
    """One of Ulysses' all-to-alls (``to_heads``: :func:`seq_to_heads`, else :func:`heads_to_seq`); its
    backward is the other one."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (seq_to_heads if to_heads else heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (heads_to_seq if ctx.to_heads else seq_to_heads)(grad.contiguous(), ctx.group), None, None


def seq_to_heads_grad(x: Tensor, group) -> Tensor:
    """:func:`seq_to_heads`, differentiable."""
    return _AllToAll.apply(x, group, True)


def heads_to_seq_grad(x: Tensor, group) -> Tensor:
    """:func:`heads_to_seq`, differentiable."""
    return _AllToAll.apply(x, group, False)
