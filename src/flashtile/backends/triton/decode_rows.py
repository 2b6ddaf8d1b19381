"""Host side of the row-stream decode experiment (kernels/decode_rows.py), off unless asked for.

``FLASHTILE_DECODE_ROWS=H`` sends decode calls with one query token and no left window edge, softcap, ALiBi,
rotary, batch index, left padding or paging (``kvcache_fwd``'s ``_plain_call``) to programs of H adjacent kv heads
(H divides h_k), when ``covers`` holds: a bf16 / fp16 cache, d of 16-128, at most 16 query heads a kv head.
Knobs: ``FLASHTILE_DECODE_ROWS_CFG=BLOCK_N,warps,stages`` and ``FLASHTILE_DECODE_ROWS_SPLITS=n`` override the
launch; ``FLASHTILE_DECODE_ROWS_FUSED=1`` merges the splits in the kernel's last split instead of the combine
kernel (slower at b = 32, session 19); ``FLASHTILE_DECODE_ROWS_PDL=1`` launches both kernels as programmatic
dependents (sm_90+). New keys are appended by the separate append kernel.
"""

from __future__ import annotations

import torch

from flashtile import env
from flashtile.backends.triton import decode_gluon
from flashtile.backends.triton.decode_gluon import LOG2E
from flashtile.backends.triton.host import SM90_SHARED_PER_SM, cdiv, device_guard, launch, next_pow2
from flashtile.kernels.decode_rows import _decode_rows_kernel

# (BLOCK_N, num_warps, num_stages) by heads a program: a stage of K and V is 2 * H * BLOCK_N * d * 2 bytes
# (32 KB at H = 2 / 32 keys and H = 4 / 16 keys, two programs an SM at d = 128; 64 KB at H = 8, one)
CONFIGS = {1: (64, 4, 3), 2: (32, 4, 3), 4: (16, 4, 3), 8: (16, 8, 3)}
# The in-kernel merge unrolls its loop over the splits; more splits than this go to the combine kernel.
FUSED_MAX_SPLITS = 8


def requested() -> int:
    """Heads a program from FLASHTILE_DECODE_ROWS (0: off)."""
    text = env.get("FLASHTILE_DECODE_ROWS", "")
    if text in ("", "0"):  # every decode call asks: the off path first
        return 0
    if text not in tuple(map(str, CONFIGS)):
        raise ValueError(f"FLASHTILE_DECODE_ROWS must be one of 0 {' '.join(map(str, CONFIGS))}, got {text!r}")
    return int(text)


def config(heads: int) -> tuple[int, int, int]:
    text = env.get("FLASHTILE_DECODE_ROWS_CFG", "")
    if not text:
        return CONFIGS[heads]
    parts = text.split(",")
    if len(parts) != 3 or not all(x.isdigit() for x in parts):
        raise ValueError(f"FLASHTILE_DECODE_ROWS_CFG must be BLOCK_N,warps,stages, got {text!r}")
    block_n, warps, stages = map(int, parts)
    if block_n < 16 or block_n & (block_n - 1) or warps not in (1, 2, 4, 8, 16) or stages < 1:
        raise ValueError(f"FLASHTILE_DECODE_ROWS_CFG: BLOCK_N a power of two >= 16, warps 1-16 (a power of two), "
                         f"stages >= 1; got {text!r}")
    return block_n, warps, stages


def num_splits(programs: int, stage_bytes: int, stages: int, sms: int, key_blocks: int) -> int:
    """Splits that fill every SM's program slots once (slots from the shared memory the stages take), at most one
    a key block and MAX_SPLITS."""
    from flashtile.backends.triton.decode import MAX_SPLITS

    splits = env.count("FLASHTILE_DECODE_ROWS_SPLITS")
    if splits is None:
        per_sm = max(1, SM90_SHARED_PER_SM // max(1, stage_bytes * stages))
        splits = round(per_sm * sms / max(1, programs))
    return max(1, min(splits, MAX_SPLITS, key_blocks))


def covers(q, k_cache, v_cache, heads: int) -> bool:
    """Whether the kernel computes this call (the caller has checked the plain-call conditions)."""
    h, d = q.shape[2], q.shape[3]
    h_k = k_cache.shape[2]
    return (q.shape[1] == 1 and h_k % heads == 0 and h // h_k <= 16 and d in (16, 32, 64, 128)
            and q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype == v_cache.dtype
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1)


def rows_decode(q, k_cache, v_cache, *, cache_seqlens, cache_len_const, s_new, softmax_scale, heads, sms):
    """Attention of q (b, 1, h, d) over the (b, capacity, h_k, d) cache holding cache_seqlens (or
    cache_len_const) keys a row: out (b, 1, h, d), lse (b, h, 1)."""
    from flashtile.backends.triton.decode import _merge_counters, combine, pdl_capable, split_partials

    b, _, h, d = q.shape
    h_k = k_cache.shape[2]
    out, lse = decode_gluon.one_token_outputs(q)
    if b == 0:
        return out, lse
    block_n, warps, stages = config(heads)
    groups = h_k // heads
    splits = num_splits(b * groups, 2 * heads * block_n * d * k_cache.element_size(), stages, sms,
                        cdiv(max(k_cache.shape[1], 1), block_n))
    o_part, lse_part = split_partials(splits, b, 1, h, d, q.device)
    counters = None
    if env.switch("FLASHTILE_DECODE_ROWS_FUSED") and 1 < splits <= FUSED_MAX_SPLITS:
        counters = _merge_counters(q.device, b * groups)
    pdl = bool(env.switch("FLASHTILE_DECODE_ROWS_PDL")) and pdl_capable(q.device)
    with device_guard(q):
        launch(
            _decode_rows_kernel, (b * groups * splits,),
            q, k_cache, v_cache, o_part, lse_part, out, lse, counters if counters is not None else lse,
            cache_seqlens if cache_seqlens is not None else lse,
            softmax_scale * LOG2E, cache_len_const, s_new, k_cache.shape[1], h // h_k,
            q.stride(0), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            o_part.stride(0), o_part.stride(1), o_part.stride(3), lse_part.stride(0), lse_part.stride(1),
            lse_part.stride(2), out.stride(0), out.stride(2), lse.stride(0), lse.stride(1),
            HEADS=heads, GROUPS=groups, NUM_SPLITS=splits, HEAD_DIM=d, BLOCK_M=16, BLOCK_N=block_n,
            HAS_SEQLENS=cache_seqlens is not None, FUSED_COMBINE=counters is not None,
            MERGE_ROWS=max(16, next_pow2(heads * (h // h_k))), num_warps=warps,
            num_stages=stages, **(dict(USE_PDL=True, launch_pdl=True) if pdl else {}),
        )
    return (out, lse) if counters is not None else combine(o_part, lse_part, out, lse, pdl=pdl)
