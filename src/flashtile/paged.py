"""Paged KV for the varlen functions: ``flash_attn_varlen_func(..., block_table=...)``.

The paged cache ``(num_blocks, page_size, h_k, d)`` is gathered into the packed varlen layout with
one ``max_seqlen_k``-long slot per sequence, and each sequence's true length goes to ``seqused_k``,
so the ordinary varlen kernels run unchanged and no value leaves the device (no host sync). Any
page size works. This costs one gather of the keys a call reads (prefill reads them once anyway);
a kernel that follows the block table itself is the optimisation still to come.
"""

from __future__ import annotations

import torch

from flashtile.validation import bad_pages_in_use, check_cu_seqlens, check_seqused


def _fail(msg: str, exc=ValueError):
    raise exc(f"flashtile: {msg}")


def paged_to_varlen(k_cache, v_cache, block_table, cu_seqlens_k, max_seqlen_k: int, seqused_k=None):
    """Gather a paged cache for the varlen kernels.

    k_cache, v_cache: (num_blocks, page_size, h_k, d); block_table: int32 (b, max_blocks), row i
    listing the pages of sequence i in order; cu_seqlens_k: int32 (b+1,) with the key lengths.
    Returns ``(k, v, cu_seqlens_k, seqused_k)`` with k, v (b * slots, h_k, d), slots =
    min(max_seqlen_k, the table's capacity). On CPU the lengths and the pages in use are checked
    (lengths within max_seqlen_k and the table, pages within the pool); on CUDA they are not read.
    """
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
        _fail("block_table must be an int32 tensor of shape (b, max_blocks)", TypeError)
    for name, x in (("k", k_cache), ("v", v_cache)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            _fail(f"with block_table, {name} must be a paged cache (num_blocks, page_size, h_k, d), "
                  f"got shape {tuple(getattr(x, 'shape', ()))}")
    if v_cache.shape != k_cache.shape:
        _fail(f"v must have the same shape as k, got k {tuple(k_cache.shape)} and v {tuple(v_cache.shape)}")
    if block_table.device != k_cache.device:
        _fail(f"block_table must be on the same device as k ({k_cache.device}), got {block_table.device}")
    b = block_table.shape[0]
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k_cache.device, batch=b)
    check_seqused("seqused_k", seqused_k, k_cache.device, b)
    num_blocks, page_size = k_cache.shape[:2]
    # one slot per key a sequence may have: max_seqlen_k, or the table's capacity if that is smaller
    slots = min(max_seqlen_k, block_table.shape[1] * page_size)
    lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    if seqused_k is not None:
        lens = torch.minimum(lens, seqused_k)
    if k_cache.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_host_values(lens, block_table, num_blocks, page_size, max_seqlen_k)
    # on CUDA the values are not read (a host sync): lengths past max_seqlen_k or past the table break
    # the contract, and the clamp keeps such a call from reading past the gathered keys
    lens = lens.clamp(max=slots)
    pos = torch.arange(slots, device=k_cache.device)
    rows = block_table[:, pos // page_size].long() * page_size + pos % page_size  # (b, slots)
    # slots past a sequence's length may name unused (even invalid) pages: keep the gather in range,
    # seqused_k masks those keys out
    rows = rows.clamp_(0, num_blocks * page_size - 1).flatten()
    k = k_cache.flatten(0, 1)[rows]
    # a slot past its sequence's length holds whatever page it names (an unwritten pool may hold NaN): its key is
    # masked, but P = 0 times a NaN value is NaN, and the kernels that read V by TMA do not mask its rows
    v = v_cache.flatten(0, 1)[rows].masked_fill_((pos[None, :] >= lens[:, None]).flatten()[:, None, None], 0)
    cu_dense = torch.arange(b + 1, device=k_cache.device, dtype=torch.int32) * slots
    return k, v, cu_dense, lens


def _check_host_values(lens, block_table, num_blocks: int, page_size: int, max_seqlen_k: int):
    """The checks that are free on CPU tensors (on CUDA they would be host syncs)."""
    if (lens < 0).any():
        _fail(f"cu_seqlens_k must be non-decreasing, got key lengths {lens.tolist()}")
    longest = int(lens.max()) if lens.numel() else 0
    if longest > max_seqlen_k:
        _fail(f"max_seqlen_k={max_seqlen_k} is below the longest key length {longest} (cu_seqlens_k / seqused_k)")
    capacity = block_table.shape[1] * page_size
    if longest > capacity:
        _fail(f"a key length {longest} exceeds block_table's capacity ({block_table.shape[1]} pages of "
              f"{page_size} tokens)")
    if bad_pages_in_use(block_table, 0, lens, page_size, num_blocks):
        _fail(f"block_table entries of the pages in use must be in [0, num_blocks={num_blocks})")
