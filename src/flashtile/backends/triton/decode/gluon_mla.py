"""Launcher of the Gluon MLA decode kernel (kernels/gluon_decode_mla.py) and the calls it takes.

The MLA route (decode/mla.py) hands a call here when ``refusal`` finds nothing to refuse: DeepSeek's shape
(q / k 64 rope dims, qv / v 512 latent dims, one latent head), bf16 / fp16, an sm_90 GPU, a contiguous cache
or pages of a multiple of the kernel's key block, optionally causal, and none of the features only the Triton
MLA kernel has (windows, softcap, ALiBi, rotary, cache_batch_idx, left padding, sinks, chunks).
``config.gluon`` (FLASHTILE_GLUON=0) turns it off with every other Gluon route.
"""

from __future__ import annotations

import torch

from flashtile import config
from flashtile.backends.triton.decode.common import LOG2E, combine, split_partials
from flashtile.backends.triton.gluon_fwd import _descriptor
from flashtile.backends.triton.host import capability, cdiv, device_guard, run_kernel

HEAD_DIM, HEAD_DIM_V = 64, 512
DTYPES = (torch.bfloat16, torch.float16)


def _rows_ok(cache: torch.Tensor) -> bool:
    """Can the cache (n, s, 1, d) be read as (n * s, d) rows by TMA (one head, rows evenly spaced, 16-byte
    aligned)? Checked on every decode call, so strides only: the view is made by the launch."""
    n, s, h, d = cache.shape
    return (h == 1 and cache.stride(-1) == 1 and cache.stride(0) == s * cache.stride(1)
            and (cache.stride(1) * cache.element_size()) % 16 == 0 and cache.data_ptr() % 16 == 0)


def _rows_2d(cache: torch.Tensor) -> torch.Tensor:
    """The cache (n, s, 1, d) as its (n * s, d) rows (the caller checked ``_rows_ok``)."""
    n, s, _, d = cache.shape
    return cache.as_strided((n * s, d), (cache.stride(1), 1))


def refusal(q, qv, k_cache, v_cache, *, block_table, cache_batch_idx, cache_leftpad, rotary_cos, window_left,
            window_right, softcap, alibi_slopes, learnable_sink, attention_chunk) -> str | None:
    """Why the Gluon MLA kernel cannot run this call (None: it can)."""
    from flashtile.kernels.gluon_decode_mla import GLUON_MLA_CONFIGS, gluon_mla_config

    if not config.get().gluon:
        return "FLASHTILE_GLUON=0"
    if qv is None or q.device.type != "cuda" or capability(q.device) != (9, 0):
        return "no qv, or not an sm_90 GPU"
    if q.dtype not in DTYPES or any(x.dtype != q.dtype for x in (qv, k_cache, v_cache)):
        return f"dtype {q.dtype} (takes {DTYPES}, one for q, qv and the caches)"
    if q.shape[-1] != HEAD_DIM or v_cache.shape[-1] != HEAD_DIM_V or k_cache.shape[2] != 1:
        return f"head dims ({q.shape[-1]}, {v_cache.shape[-1]}) with {k_cache.shape[2]} kv heads (takes 64, 512, 1)"
    if cache_batch_idx is not None or cache_leftpad is not None or rotary_cos is not None:
        return "cache_batch_idx, cache_leftpad or rotary"
    # causal arrives as the window (-1, 0); any other window is the Triton kernel's
    if window_left >= 0 or window_right > 0 or softcap > 0 or alibi_slopes is not None:
        return "a window, softcap or ALiBi"
    if learnable_sink is not None or attention_chunk:
        return "a learnable sink or an attention chunk"
    if block_table is not None and gluon_mla_config(k_cache.shape[1]) is None:
        return f"pages of {k_cache.shape[1]} keys (takes multiples of {GLUON_MLA_CONFIGS[-1]['BLOCK_N']})"
    if not (_rows_ok(k_cache) and _rows_ok(v_cache)):
        return "caches whose rows TMA cannot read"
    if q.stride(-1) != 1 or qv.stride(-1) != 1:
        return "q or qv with a non-unit last stride"
    return None


def decode(q, qv, k_cache, v_cache, splits: int, *, s_new: int, cache_seqlens, cache_len_const: int, block_table,
           softmax_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (b, sq, h, 64) and qv (b, sq, h, 512) over the (already updated) latent caches k_cache
    (n, s, 1, 64), v_cache (n, s, 1, 512), contiguous (n = b) or paged (``block_table``); ``splits`` ways over
    the keys, merged by the combine kernel. Returns out (b, sq, h, 512), lse (b, h, sq). The caller checked
    ``refusal``."""
    from flashtile.kernels.gluon_decode_mla import V_BOX_COLS, _gluon_mla_decode_kernel, gluon_mla_config

    b, sq, h, _ = q.shape
    out = torch.empty(b, sq, h, HEAD_DIM_V, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, h, sq, device=q.device, dtype=torch.float32)
    if b == 0 or sq == 0:
        return out, lse
    paged = block_table is not None
    cfg = gluon_mla_config(k_cache.shape[1] if paged else None)
    bn = cfg["BLOCK_N"]
    m_blocks = cdiv(sq * h, 64)
    if splits > 1:
        o_part, lse_part = split_partials(splits, b, sq, h, HEAD_DIM_V, q.device)
    else:
        o_part, lse_part = out, lse  # unused
    seqlens = cache_seqlens if cache_seqlens is not None else lse
    desc_k = _descriptor(_rows_2d(k_cache), [bn, HEAD_DIM])
    desc_v = _descriptor(_rows_2d(v_cache), [bn, V_BOX_COLS])
    with device_guard(q):
        run_kernel(_gluon_mla_decode_kernel, (b * splits * m_blocks,),
            desc_k, desc_v, q, qv, out, lse, o_part, lse_part, seqlens, block_table if paged else lse,
            softmax_scale * LOG2E, cache_len_const, s_new, sq, h, m_blocks, k_cache.shape[1], k_cache.shape[1],
            *q.stride()[:3], *qv.stride()[:3], *out.stride()[:3], *lse.stride()[:2],
            *(o_part.stride()[:4] if splits > 1 else (0,) * 4), *(lse_part.stride()[:3] if splits > 1 else (0,) * 3),
            block_table.stride(0) if paged else 0,
            HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, BLOCK_N=bn, NUM_BUFFERS=cfg["NUM_BUFFERS"],
            NUM_SPLITS=splits, PAGED=paged, HAS_SEQLENS=cache_seqlens is not None, CAUSAL=bool(causal),
            num_warps=cfg["num_warps"])
    if splits > 1:
        combine(o_part, lse_part, out, lse)
    return out, lse
