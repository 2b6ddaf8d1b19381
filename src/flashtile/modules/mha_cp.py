"""MHA's context-parallel path: ``x`` is this rank's sequence shard and attention runs through
``flashtile.distributed`` (docs/distributed.md).

Rotary embeddings turn each token by its position in the whole sequence (in its document, with
``cu_seqlens``), as the same module on the whole sequence does: the rank's positions are the whole
sequence's positions cut the way ``x`` was cut, so a zigzag shard gets its two chunks' positions. ALiBi
slopes go to the scheme, which measures distances between global positions.

Refused, each with its reason: cross-attention (context parallelism splits one self-attention
sequence), ``key_padding_mask`` (a mask differs per batch row, while one call shares its documents over
the batch and keeps equal shards per rank: pack the rows and pass ``cu_seqlens`` instead) and generation
(a KV cache split over the ranks would need every rank's keys for each new token).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist

from flashtile import distributed as cp
from flashtile.distributed.comm import resolve_group
from flashtile.distributed.sharding import cu_seqlens_list, varlen_shard_meta
from flashtile.layers.rotary import apply_rotary_emb

# MHA's cp_scheme names: the context-parallel function and the layout of the shards it takes
CP_SCHEMES = {
    "ring": (cp.ring_flash_attn_func, "contiguous"),
    "zigzag": (cp.zigzag_ring_flash_attn_func, "zigzag"),
    "ulysses": (cp.ulysses_flash_attn_func, "contiguous"),
    "ulysses_zigzag": (cp.ulysses_flash_attn_func, "zigzag"),
    "allgather": (cp.kv_allgather_flash_attn_func, "contiguous"),
    "allgather_zigzag": (cp.kv_allgather_flash_attn_func, "zigzag"),
    "hybrid": (cp.hybrid_flash_attn_func, "contiguous"),
    "hybrid_zigzag": (cp.hybrid_flash_attn_func, "zigzag"),
}
# these two carry their layout in their name and take no layout= keyword
_NAMED_LAYOUT = (cp.ring_flash_attn_func, cp.zigzag_ring_flash_attn_func)


def check_cp_args(cp_group, cp_scheme: str, cross_attn: bool) -> None:
    """MHA's constructor checks of ``cp_group`` / ``cp_scheme``."""
    if cp_scheme not in CP_SCHEMES:
        raise ValueError(f"flashtile: cp_scheme must be one of {sorted(CP_SCHEMES)}, got {cp_scheme!r}")
    if cp_group is None:
        return
    if cp_scheme.startswith("hybrid") != isinstance(cp_group, (tuple, list)):
        raise ValueError("flashtile: cp_group must be (ulysses_group, ring_group) exactly when cp_scheme is "
                         f"hybrid, got {type(cp_group).__name__} for {cp_scheme!r}")
    if cross_attn:
        raise ValueError("flashtile: cross_attn cannot be combined with cp_group: context parallelism splits one "
                         "self-attention sequence across ranks, while cross-attention's keys come from x_kv")


def refuse(x_kv, key_padding_mask, inference_params) -> None:
    """The forward arguments the context-parallel path refuses, each with its reason."""
    if inference_params is not None:
        raise ValueError("flashtile: MHA with cp_group does not support generation (inference_params): decoding "
                         "appends one token at a time to a KV cache, and a cache split over the ranks' sequence "
                         "shards would need every rank's keys for each new token; generate with an MHA without "
                         "cp_group holding the same weights (load_state_dict)")
    if key_padding_mask is not None:
        raise ValueError("flashtile: MHA with cp_group does not take key_padding_mask: a padding mask differs per "
                         "batch row, while a context-parallel call shares one document layout over the batch and "
                         "keeps equal shards on every rank; pack the sequences without padding and pass "
                         "cu_seqlens (the documents of the whole sequence) instead")
    if x_kv is not None:
        raise ValueError("flashtile: MHA with cp_group does not take x_kv (cross-attention is refused)")


class ShardGeometry:
    """How this rank's shard was cut from the whole sequence, read from ``cp_group`` and the scheme."""

    def __init__(self, cp_group, cp_scheme: str):
        self.fn, self.layout = CP_SCHEMES[cp_scheme]
        self.hybrid = cp_scheme.startswith("hybrid")
        if self.hybrid:
            ug, rg = resolve_group(cp_group[0], "ulysses_group"), resolve_group(cp_group[1], "ring_group")
            self.groups = dict(ulysses_group=cp_group[0], ring_group=cp_group[1])
            self.world, self.rank = dist.get_world_size(rg), dist.get_rank(rg)
            self.parts, self.part = dist.get_world_size(ug), dist.get_rank(ug)
        else:
            g = resolve_group(cp_group)
            self.groups = dict(group=cp_group)
            self.world, self.rank = dist.get_world_size(g), dist.get_rank(g)
            self.parts, self.part = 1, 0

    def total(self, n: int) -> int:
        """The whole sequence's length from a shard of ``n`` tokens."""
        return n * self.world * self.parts

    def positions(self, n: int, cu_seqlens) -> torch.Tensor:
        """This shard's token positions (inside their documents with ``cu_seqlens``), int64 ``(n,)`` on the CPU."""
        docs = (0, self.total(n)) if cu_seqlens is None else cu_seqlens_list(cu_seqlens)
        return _positions(docs, self.world, self.rank, self.layout, self.parts, self.part)

    def keywords(self) -> dict:
        """The scheme's group and layout keywords."""
        return self.groups if self.fn in _NAMED_LAYOUT else dict(self.groups, layout=self.layout)


@lru_cache(maxsize=64)
def _positions(docs: tuple[int, ...], world: int, rank: int, layout: str, parts: int, part: int) -> torch.Tensor:
    ring = varlen_shard_meta(docs, world, rank, layout)[1]  # the ring shard; a hybrid rank holds one part
    n = ring.numel() // parts
    return ring[part * n:(part + 1) * n]


def rotate(rotary_emb, q, k, positions: torch.Tensor, table_len: int):
    """q ``(b, n, h, d)`` and k ``(b, n, h_k, d)`` turned by ``rotary_emb`` at ``positions`` ``(n,)``, out of place;
    ``table_len`` is the length the module on the whole sequence builds its table for (XPos depends on it)."""
    rotary_emb._update_cos_sin_cache(table_len, device=q.device, dtype=q.dtype)
    pos = positions.to(q.device)
    cos, sin = rotary_emb._cos_cached[pos], rotary_emb._sin_cached[pos]  # row t: the table's row at pos[t]
    xpos = rotary_emb._cos_k_cached is not None
    cos_k, sin_k = (rotary_emb._cos_k_cached[pos], rotary_emb._sin_k_cached[pos]) if xpos else (cos, sin)
    return (apply_rotary_emb(q, cos, sin, rotary_emb.interleaved),
            apply_rotary_emb(k, cos_k, sin_k, rotary_emb.interleaved))


def cp_forward(mha, x, cu_seqlens, max_seqlen) -> torch.Tensor:
    """The attention block of ``mha`` (projections included) on this rank's shard ``x`` ``(b, n, e)``;
    ``cu_seqlens`` (optional) the whole packed sequence's documents, with their ``max_seqlen``."""
    if x.dim() != 3:
        raise ValueError(f"flashtile: with cp_group, x must be this rank's (b, n, e) shard, got {tuple(x.shape)}")
    if cu_seqlens is not None and max_seqlen is None:
        raise ValueError("flashtile: max_seqlen is required with cu_seqlens")
    b, n = x.shape[:2]
    h, h_k, d = mha.num_heads, mha.num_heads_kv, mha.head_dim
    q, k, v = mha.Wqkv(x).view(b, n, h + 2 * h_k, d).split((h, h_k, h_k), dim=2)
    shape = ShardGeometry(mha.cp_group, mha.cp_scheme)
    if mha.rotary_emb_dim > 0:
        table_len = shape.total(n) if cu_seqlens is None else int(max_seqlen)
        q, k = rotate(mha.rotary_emb, q, k, shape.positions(n, cu_seqlens), table_len)
    out = shape.fn(q, k, v, **mha._attn_kwargs(), **shape.keywords(), cu_seqlens=cu_seqlens)
    return mha.out_proj(out.reshape(b, n, h * d))
