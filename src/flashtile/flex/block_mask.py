"""BlockMask and create_block_mask: which (query block, key block) pairs a mask_mod leaves visible.

FlexAttention's data structure, with its field names: for each (batch, head, query block) the key
blocks that are *partly* visible (``kv_num_blocks`` / ``kv_indices``: the kernels evaluate mask_mod
on them) and those *fully* visible (``full_kv_num_blocks`` / ``full_kv_indices``: no mask work), each
list in increasing block order and padded; every other block is skipped. The ``q_*`` fields are the
transposes (per key block, the query blocks), which the backward's dK/dV kernel walks. Build one
with :func:`create_block_mask` once per mask and shape and pass it to every call.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from flashtile.backends.flex_cpu import evaluate_mask

_DEFAULT_BLOCK = 128
_CHUNK_ELEMENTS = 1 << 26  # mask elements evaluated at a time (memory, not speed)


def noop_mask(b, h, q_idx, kv_idx):
    """Every key visible (FlexAttention's ``noop_mask``)."""
    return torch.ones_like(q_idx, dtype=torch.bool)


def and_masks(*mask_mods):
    """A mask_mod that keeps what every one of ``mask_mods`` keeps."""
    if not mask_mods:
        raise ValueError("and_masks needs at least one mask_mod")

    def and_mask(b, h, q_idx, kv_idx):
        out = mask_mods[0](b, h, q_idx, kv_idx)
        for m in mask_mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    and_mask.__name__ = "and_masks(" + ", ".join(getattr(m, "__name__", "mask") for m in mask_mods) + ")"
    return and_mask


def or_masks(*mask_mods):
    """A mask_mod that keeps what any one of ``mask_mods`` keeps."""
    if not mask_mods:
        raise ValueError("or_masks needs at least one mask_mod")

    def or_mask(b, h, q_idx, kv_idx):
        out = mask_mods[0](b, h, q_idx, kv_idx)
        for m in mask_mods[1:]:
            out = out | m(b, h, q_idx, kv_idx)
        return out

    or_mask.__name__ = "or_masks(" + ", ".join(getattr(m, "__name__", "mask") for m in mask_mods) + ")"
    return or_mask


def _lists(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """(count, indices) of the True entries of the last dim: indices in increasing order, then the rest."""
    num = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num, order.contiguous()


def _dense(num: Tensor, indices: Tensor, nk: int) -> Tensor:
    """Bool (..., nk): the first ``num`` entries of each ``indices`` row marked (the inverse of ``_lists``).
    Entries past ``num`` are padding of any value (FlexAttention's lists repeat or zero them), so they are
    sent to block 0 with weight 0, and marks are counted, not scattered, since a padded row may repeat one."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < num.unsqueeze(-1)
    idx = torch.where(listed, indices.long(), 0)
    counts = torch.zeros((*indices.shape[:-1], nk), dtype=torch.int32, device=indices.device)
    return counts.scatter_add(-1, idx, listed.to(torch.int32)) > 0


@dataclasses.dataclass(repr=False)
class BlockMask:
    """A block-sparse attention mask (FlexAttention's fields). Shapes: ``kv_num_blocks`` (B, H, nq),
    ``kv_indices`` (B, H, nq, nk), ``q_num_blocks`` (B, H, nk), ``q_indices`` (B, H, nk, nq), and the
    ``full_*`` counterparts; B or H is 1 where the mask does not depend on it (broadcast)."""

    seq_lengths: tuple[int, int]
    kv_num_blocks: Tensor
    kv_indices: Tensor
    full_kv_num_blocks: Tensor
    full_kv_indices: Tensor
    q_num_blocks: Tensor
    q_indices: Tensor
    full_q_num_blocks: Tensor
    full_q_indices: Tensor
    BLOCK_SIZE: tuple[int, int]
    mask_mod: object

    @classmethod
    def from_blocks(cls, partial: Tensor, full: Tensor, seq_lengths, block_size, mask_mod) -> BlockMask:
        """From bool (B, H, nq, nk) tensors: which blocks are partly and which fully visible."""
        kv_num, kv_idx = _lists(partial)
        fkv_num, fkv_idx = _lists(full)
        q_num, q_idx = _lists(partial.transpose(-1, -2))
        fq_num, fq_idx = _lists(full.transpose(-1, -2))
        return cls(tuple(seq_lengths), kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx,
                   tuple(block_size), mask_mod)

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Tensor | None = None,
                       full_kv_indices: Tensor | None = None, BLOCK_SIZE=_DEFAULT_BLOCK, mask_mod=None,
                       seq_lengths=None) -> BlockMask:
        """A BlockMask from its key-side lists (FlexAttention's ``BlockMask.from_kv_blocks``), the query-side
        transposes derived. ``kv_num_blocks`` (B, H, nq) int, ``kv_indices`` (B, H, nq, nk) int: per query
        block, how many and which key blocks are partly visible (mask_mod runs there; None: every key of
        them visible); the ``full_*`` pair likewise for fully visible blocks (None: none). ``seq_lengths``
        (Q_LEN, KV_LEN) defaults to the blocks' extent."""
        if kv_indices.dim() != 4 or kv_num_blocks.shape != kv_indices.shape[:3]:
            raise ValueError(f"BlockMask.from_kv_blocks: kv_indices must be (B, H, nq, nk) and kv_num_blocks "
                             f"(B, H, nq), got {tuple(kv_indices.shape)} and {tuple(kv_num_blocks.shape)}")
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError("BlockMask.from_kv_blocks: give full_kv_num_blocks and full_kv_indices together")
        if full_kv_indices is not None and (full_kv_indices.shape != kv_indices.shape
                                            or full_kv_num_blocks.shape != kv_num_blocks.shape):
            raise ValueError("BlockMask.from_kv_blocks: full_kv_num_blocks / full_kv_indices must have the shapes "
                             "of kv_num_blocks / kv_indices")
        block = _block_size(BLOCK_SIZE)
        nq, nk = kv_indices.shape[-2:]
        partial = _dense(kv_num_blocks, kv_indices, nk)
        full = (_dense(full_kv_num_blocks, full_kv_indices, nk) if full_kv_indices is not None
                else torch.zeros_like(partial))
        if bool((partial & full).any()):
            raise ValueError("BlockMask.from_kv_blocks: a block is listed both partly (kv_indices) and fully "
                             "(full_kv_indices) visible")
        lengths = tuple(seq_lengths) if seq_lengths is not None else (nq * block[0], nk * block[1])
        return cls.from_blocks(partial, full, lengths, block, mask_mod)

    def as_tuple(self, flatten: bool = True) -> tuple:
        """FlexAttention's flat form: (Q_LEN, KV_LEN, the eight index tensors as :meth:`tensors`, BLOCK_SIZE's
        two sizes, mask_mod); with ``flatten=False`` the lengths and the block size stay pairs."""
        lengths, block = (self.seq_lengths, self.BLOCK_SIZE) if flatten else ((self.seq_lengths,), (self.BLOCK_SIZE,))
        return (*lengths, *self.tensors(), *block, self.mask_mod)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, H, Q_LEN, KV_LEN); B and H are 1 where broadcast."""
        return (*self.kv_num_blocks.shape[:2], *self.seq_lengths)

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    def tensors(self) -> tuple[Tensor, ...]:
        """The eight index tensors, forward's four then the transposes."""
        return (self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
                self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices)

    def to(self, device) -> BlockMask:
        moved = [t.to(device) for t in self.tensors()]
        return BlockMask(self.seq_lengths, *moved, self.BLOCK_SIZE, self.mask_mod)

    def numel(self) -> int:
        """Blocks in the mask: B * H * nq * nk."""
        return self.kv_indices.numel()

    def sparsity(self) -> float:
        """Percentage of blocks skipped (neither partly nor fully visible)."""
        visited = int(self.kv_num_blocks.sum()) + int(self.full_kv_num_blocks.sum())
        return 100.0 * (1.0 - visited / max(self.numel(), 1))

    def to_dense(self) -> Tensor:
        """Bool (B, H, nq, nk): blocks the kernels visit (partly or fully visible)."""
        nk = self.kv_indices.shape[-1]
        return (_dense(self.kv_num_blocks, self.kv_indices, nk)
                | _dense(self.full_kv_num_blocks, self.full_kv_indices, nk))

    def to_string(self, limit: int = 16) -> str:
        """Block picture of batch 0, head 0: '#' full, '+' partial, '.' skipped (first ``limit`` blocks)."""
        nq, nk = self.kv_indices.shape[-2:]
        rows = []
        for i in range(min(nq, limit)):
            part = set(self.kv_indices[0, 0, i, : int(self.kv_num_blocks[0, 0, i])].tolist())
            full = set(self.full_kv_indices[0, 0, i, : int(self.full_kv_num_blocks[0, 0, i])].tolist())
            rows.append("".join("#" if j in full else "+" if j in part else "." for j in range(min(nk, limit))))
        return "\n".join(rows)

    def __repr__(self) -> str:
        name = getattr(self.mask_mod, "__name__", repr(self.mask_mod))
        return (f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, sparsity={self.sparsity():.2f}%, "
                f"mask_mod={name})")


def _block_size(BLOCK_SIZE) -> tuple[int, int]:
    bq, bkv = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    for v in (bq, bkv):
        if v < 16 or v & (v - 1):
            raise ValueError(f"BLOCK_SIZE must be a power of two >= 16, got {BLOCK_SIZE}")
    return bq, bkv


def full_block_mask(B: int, H: int, Q_LEN: int, KV_LEN: int, device, BLOCK_SIZE=_DEFAULT_BLOCK) -> BlockMask:
    """Every block fully visible (the mask of a call without one), built without evaluating a mask_mod."""
    bq, bkv = _block_size(BLOCK_SIZE)
    nq, nk = -(-Q_LEN // bq), -(-KV_LEN // bkv)
    full = torch.ones(B, H, nq, nk, dtype=torch.bool, device=device)
    return BlockMask.from_blocks(torch.zeros_like(full), full, (Q_LEN, KV_LEN), (bq, bkv), noop_mask)


def create_block_mask(mask_mod, B, H, Q_LEN: int, KV_LEN: int, device="cuda", BLOCK_SIZE=_DEFAULT_BLOCK,
                      _compile: bool = False) -> BlockMask:
    """Evaluate ``mask_mod(b, h, q_idx, kv_idx)`` on the whole grid once and sort its blocks into skipped,
    partly and fully visible. ``B`` / ``H`` None: the mask does not depend on them (stored once, broadcast).
    ``BLOCK_SIZE``: an int or (Q_BLOCK, KV_BLOCK), powers of two >= 16. Positions past Q_LEN / KV_LEN
    (a ragged last block) count as neither visible nor hidden. ``_compile`` is accepted for
    FlexAttention compatibility and ignored."""
    bq, bkv = _block_size(BLOCK_SIZE)
    B = 1 if B is None else int(B)
    H = 1 if H is None else int(H)
    if mask_mod is noop_mask:
        return full_block_mask(B, H, Q_LEN, KV_LEN, device, (bq, bkv))
    nq, nk = -(-Q_LEN // bq), -(-KV_LEN // bkv)
    any_vis = torch.zeros(B, H, nq, nk, dtype=torch.bool, device=device)
    all_vis = torch.ones(B, H, nq, nk, dtype=torch.bool, device=device)
    rows = max(bq, (_CHUNK_ELEMENTS // max(B * H * KV_LEN, 1)) // bq * bq)
    for start in range(0, Q_LEN, rows):
        stop = min(start + rows, Q_LEN)
        m = evaluate_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, start, stop)
        pad_q, pad_k = (-(stop - start)) % bq, nk * bkv - KV_LEN
        blocks = torch.nn.functional.pad(m, (0, pad_k, 0, pad_q), value=False).view(B, H, -1, bq, nk, bkv)
        hidden = torch.nn.functional.pad(~m, (0, pad_k, 0, pad_q), value=False).view(B, H, -1, bq, nk, bkv)
        qb = slice(start // bq, start // bq + blocks.shape[2])
        any_vis[:, :, qb] = blocks.any(5).any(3)
        all_vis[:, :, qb] = ~hidden.any(5).any(3)
    full = any_vis & all_vis
    return BlockMask.from_blocks(any_vis & ~full, full, (Q_LEN, KV_LEN), (bq, bkv), mask_mod)
