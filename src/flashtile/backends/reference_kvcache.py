"""``flash_attn_with_kvcache`` in plain PyTorch: the reference and the CPU path.

The call is done in three visible steps, the way the contract states it:

1. rotate the new keys (and the queries) with the rotary tables, at absolute cache positions;
2. write the new keys/values into the cache, in place, at ``cache_seqlens .. cache_seqlens + s_new``
   (through ``cache_batch_idx`` or the ``block_table`` pages);
3. gather every row's valid keys ``[cache_leftpad, cache_seqlens + s_new)`` into a dense
   ``(b, s, h_k, d)`` tensor and run :func:`flashtile.backends.reference.attention_ref` with
   ``seqused_k`` giving each row its key length (bottom-right alignment then follows from it).

Memory is O(cache capacity) per row (the gathered keys plus an ``(h, sq, s)`` score matrix), which
is what a CPU decode step needs; the Triton kernels never build either.
"""

from __future__ import annotations

import torch

from flashtile.backends.reference import attention_ref
from flashtile.backends.reference_fp8 import attention_ref_fp8
from flashtile.backends.reference_rotary import rotate_at_positions
from flashtile.fp8 import FP8_DTYPE

NAME = "reference"


def refusal(op: str, q: torch.Tensor, p=None) -> str | None:
    """This module is the CPU path of ``flash_attn_with_kvcache`` (dispatch's "kvcache" op) only."""
    if op != "kvcache":
        return f"runs flash_attn_with_kvcache only, not {op}"
    if q.device.type != "cpu":
        return f"runs CPU tensors only, got {q.device.type} (it reads index tensors' values on the host)"
    return None


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               interleaved: bool) -> torch.Tensor:
    """Rotate the first ``rotary_dim = 2 * cos.shape[1]`` channels of ``x`` (b, s, h, d).

    ``positions`` (b, s) int64 index the rows of ``cos``/``sin`` (seqlen_ro, rotary_dim / 2).
    Interleaved pairs channels (0, 1), (2, 3), ...; otherwise channel i pairs with i + rotary_dim/2.
    The rotation runs in fp32 and is rounded once to ``x``'s dtype, as the kernels do; a position
    past the table (only queries beyond the cache can get there) is left unrotated. The math is the
    rotary layer's PyTorch path (:func:`flashtile.backends.reference_rotary.rotate_at_positions`).
    """
    return rotate_at_positions(x, cos, sin, positions, interleaved)


def _cache_index(abs_pos: torch.Tensor, batch_rows: torch.Tensor, block_table, page_size: int,
                 num_blocks: int | None = None):
    """(dim-0 index, dim-1 index) into a cache for absolute positions ``abs_pos`` (b, n) of each row.

    ``num_blocks``: clamp the pages into the pool, for reads of positions that are masked afterwards
    (past a row's pages in use the table may hold padding such as -1)."""
    if block_table is None:
        return batch_rows.view(-1, 1).expand_as(abs_pos), abs_pos
    pages = torch.gather(block_table.long(), 1, abs_pos // page_size)
    if num_blocks is not None:
        pages = pages.clamp(0, num_blocks - 1)
    return pages, abs_pos % page_size


def kvcache_ref(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, upcast=True,
                q_descale=None, k_descale=None, v_descale=None, qv=None, learnable_sink=None, attention_chunk=0):
    """Reference ``flash_attn_with_kvcache``: updates ``k_cache``/``v_cache`` in place, returns ``(out, lse)``.

    Shapes as in the contract: q (b, sq, h, d); k_cache (b_cache, s_cache, h_k, d) and v_cache
    (b_cache, s_cache, h_k, dv), or paged (num_blocks, page_size, h_k, d / dv) with ``block_table`` int
    (b, max_blocks); new k (b, s_new, h_k, d) and v (b, s_new, h_k, dv); ``cache_seqlens`` int or int
    (b,) tensor (None: every row holds the full capacity); ``cache_batch_idx``/``cache_leftpad`` int
    (b,). out (b, sq, h, dv), lse fp32 (b, h, sq). Arguments are assumed valid (``flashtile.kvcache``
    checks them). Reads index tensors' values on the host, so it is for CPU tensors and tests, not a
    CUDA hot path.

    ``qv`` (b, sq, h, dv): multi-head latent attention in absorbed form, as ``attention_ref`` takes
    it: the scores gain ``qv . v`` (qv is not rotated) and the default scale is 1 / sqrt(d + dv).

    ``learnable_sink`` (h,) and ``attention_chunk`` as ``attention_ref`` takes them, on each row's gathered keys: a
    chunk is counted in those keys' positions, from ``cache_leftpad``, as every mask is (not with fp8).

    fp8 (e4m3) q, caches and new k/v: the append copies the e4m3 bytes, and attention runs on the
    dequantised values (``x.float() * x_descale[batch row, kv head]``, descales fp32 (b, h_k) or
    None = 1) through :func:`attention_ref_fp8`; out is bf16 (as the kernels return it).
    """
    fp8 = q.dtype == FP8_DTYPE
    b, sq = q.shape[:2]
    dev = q.device
    paged = block_table is not None
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    if cache_seqlens is None:
        lens = torch.full((b,), capacity, dtype=torch.long, device=dev)
    elif isinstance(cache_seqlens, int):
        lens = torch.full((b,), cache_seqlens, dtype=torch.long, device=dev)
    else:
        lens = cache_seqlens.to(dev, torch.long)
    left = torch.zeros(b, dtype=torch.long, device=dev) if cache_leftpad is None else cache_leftpad.to(dev, torch.long)
    rows = torch.arange(b, device=dev) if cache_batch_idx is None else cache_batch_idx.to(dev, torch.long)
    s_new = 0 if k is None else k.shape[1]

    if rotary_cos is not None:
        t_new = torch.arange(s_new, device=dev).view(1, -1)
        if k is not None:
            k = rotary_ref(k, rotary_cos, rotary_sin, lens.view(-1, 1) + t_new, rotary_interleaved)
        # queries sit at the end of the cache; without a causal/local mask FlashAttention gives all of
        # them the first new position
        t_q = torch.arange(sq, device=dev).view(1, -1)
        if not (causal or window_size[0] >= 0 or window_size[1] >= 0):
            t_q = t_q * 0
        q = rotary_ref(q, rotary_cos, rotary_sin, lens.view(-1, 1) + t_q, rotary_interleaved)

    if k is not None:
        pos = lens.view(-1, 1) + torch.arange(s_new, device=dev).view(1, -1)
        i0, i1 = _cache_index(pos, rows, block_table, page_size)
        if fp8:  # indexing ops are not all implemented for float8: move the bytes
            k_cache.view(torch.uint8)[i0, i1] = k.view(torch.uint8)
            v_cache.view(torch.uint8)[i0, i1] = v.view(torch.uint8)
        else:
            k_cache[i0, i1] = k.to(k_cache.dtype)
            v_cache[i0, i1] = v.to(v_cache.dtype)

    seqlen_k = lens + s_new - left  # each row's key length after the append
    width = max(int(seqlen_k.max()) if b else 0, 0)
    j = torch.arange(width, device=dev).view(1, -1)
    # positions past a row's length are clamped into the row's valid range and masked by seqused_k
    abs_pos = (left.view(-1, 1) + j).clamp(max=capacity - 1).clamp(min=0)
    i0, i1 = _cache_index(abs_pos, rows, block_table, page_size, k_cache.shape[0])
    if fp8:
        keys = k_cache.view(torch.uint8)[i0, i1].view(FP8_DTYPE)
        values = v_cache.view(torch.uint8)[i0, i1].view(FP8_DTYPE)
        out, lse = attention_ref_fp8(q, keys, values, q_descale, k_descale, v_descale, causal=causal,
                                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                     softmax_scale=softmax_scale, seqused_k=seqlen_k.clamp(min=0).to(torch.int32))
        return out.to(torch.bfloat16), lse
    keys = k_cache[i0, i1]
    values = v_cache[i0, i1]
    return attention_ref(q, keys, values, causal=causal, window_size=window_size, softcap=softcap,
                         alibi_slopes=alibi_slopes, softmax_scale=softmax_scale,
                         seqused_k=seqlen_k.clamp(min=0).to(torch.int32), upcast=upcast, qv=qv,
                         learnable_sink=learnable_sink, attention_chunk=attention_chunk)


def kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len_const, cache_batch_idx,
            cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
            alibi_slopes, num_splits, descales=(None, None, None), qv=None, learnable_sink=None, attention_chunk=0):
    """Dispatch's "kvcache" op on CPU tensors: a checked call (the Triton backend's arguments) on the reference.
    ``num_splits`` changes nothing here; ``cache_len_const`` (-1: none) stands for an int ``cache_seqlens``."""
    seqlens = cache_seqlens if cache_seqlens is not None else (None if cache_len_const < 0 else cache_len_const)
    q_descale, k_descale, v_descale = descales
    return kvcache_ref(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx, cache_leftpad,
                       block_table, softmax_scale, causal, (window_left, window_right), softcap, rotary_interleaved,
                       alibi_slopes, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, qv=qv,
                       learnable_sink=learnable_sink, attention_chunk=attention_chunk)
