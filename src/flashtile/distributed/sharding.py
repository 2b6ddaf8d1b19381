"""How a sequence is split across ranks, and the helpers that shard and unshard batches.

Layouts (``S`` tokens over ``W`` ranks):

- ``"contiguous"``: rank ``r`` holds tokens ``[r*S/W, (r+1)*S/W)``.
- ``"zigzag"``: the sequence is cut into ``2W`` chunks; rank ``r`` holds chunk ``r`` then chunk
  ``2W-1-r``. Under a causal mask every rank then has the same amount of work::

      chunks   0   1   2   3   4   5   6   7        (W = 4)
      rank     0   1   2   3   3   2   1   0

A layout is a list of ``(start, length)`` runs per rank, in the order the rank stores them
(:func:`layout_runs`); the step planner (plan.py) works from these runs.
"""

from __future__ import annotations

import bisect

import torch
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"flashtile: layout must be one of {LAYOUTS}, got {layout!r}")


def pieces_per_rank(layout: str) -> int:
    """How many equal chunks each rank holds (the local length must divide by it)."""
    check_layout(layout)
    return 2 if layout == "zigzag" else 1


def layout_runs(layout: str, total: int, world: int, rank: int) -> list[tuple[int, int]]:
    """The ``(start, length)`` runs of global positions that ``rank`` holds, in its storage order."""
    per = pieces_per_rank(layout)
    if total % (world * per):
        raise ValueError(f"flashtile: sequence length {total} must be divisible by {world * per} "
                         f"({layout} sharding over {world} ranks)")
    if layout == "contiguous":
        n = total // world
        return [(rank * n, n)]
    c = total // (2 * world)
    return [(rank * c, c), ((2 * world - 1 - rank) * c, c)]


def shard(x: Tensor, world: int, rank: int, layout: str = "contiguous", dim: int = 1) -> Tensor:
    """This rank's shard of ``x`` along ``dim`` (the sequence dim: 1 for ``(b, s, ...)``), a new tensor."""
    runs = layout_runs(layout, x.shape[dim], world, rank)
    return torch.cat([x.narrow(dim, s, n) for s, n in runs], dim=dim)


def unshard(shards: list[Tensor], layout: str = "contiguous", dim: int = 1) -> Tensor:
    """The full sequence from every rank's shard (``shards[r]`` is rank ``r``'s), inverse of :func:`shard`."""
    world = len(shards)
    total = sum(s.shape[dim] for s in shards)
    parts = {}
    for r, x in enumerate(shards):
        local = 0
        for start, n in layout_runs(layout, total, world, r):
            parts[start] = x.narrow(dim, local, n)
            local += n
    return torch.cat([parts[s] for s in sorted(parts)], dim=dim)


def shard_hybrid(x: Tensor, ring_world: int, ring_rank: int, ulysses_world: int, ulysses_rank: int,
                 layout: str = "contiguous", dim: int = 1) -> Tensor:
    """The shard of the 2-D scheme: the ring layout's shard of ``ring_rank``, then its ``ulysses_rank``-th
    contiguous part of ``ulysses_world`` (the Ulysses all-to-all rebuilds the ring shard from its parts)."""
    ring = shard(x, ring_world, ring_rank, layout, dim)
    if ring.shape[dim] % ulysses_world:
        raise ValueError(f"flashtile: the ring shard's length {ring.shape[dim]} must be divisible by the "
                         f"Ulysses group size {ulysses_world}")
    n = ring.shape[dim] // ulysses_world
    return ring.narrow(dim, ulysses_rank * n, n).clone()


def cu_seqlens_list(cu_seqlens) -> tuple[int, ...]:
    """Document boundaries as Python ints (a list, or a tensor: a CUDA tensor costs one device sync,
    which a CPU tensor or list avoids)."""
    values = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
    values = tuple(int(v) for v in values)
    if len(values) < 2 or values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError("flashtile: cu_seqlens must start at 0 and be non-decreasing, "
                         f"got {list(values)[:8]}{'...' if len(values) > 8 else ''}")
    return values


def varlen_shard_meta(cu_seqlens, world: int, rank: int, layout: str = "contiguous"):
    """What a rank needs to know about its share of a packed sequence.

    Returns ``(cu_seqlens_local, position_ids)``: int32 cumulative lengths of the document pieces the
    rank holds, in its storage order (a piece never crosses a run boundary), and int64 ``(n,)`` each
    local token's position inside its document (for rotary embeddings).
    """
    docs = cu_seqlens_list(cu_seqlens)
    cuts, positions = [0], []
    for start, n in layout_runs(layout, docs[-1], world, rank):
        pos = start
        while pos < start + n:
            d = bisect.bisect_right(docs, pos) - 1
            end = min(start + n, docs[d + 1])
            positions.extend(range(pos - docs[d], end - docs[d]))
            cuts.append(cuts[-1] + end - pos)
            pos = end
    return torch.tensor(cuts, dtype=torch.int32), torch.tensor(positions, dtype=torch.int64)
