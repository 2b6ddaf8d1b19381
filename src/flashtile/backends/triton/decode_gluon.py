"""Which KV-cache decode calls take the Gluon warps-along-keys kernel (kernels/gluon_decode_warp_keys.py), and
its launch. An experiment, off by default: ``FLASHTILE_DECODE_GLUON_WARP_KEYS=1`` routes every call it covers
there, on Hopper.

Why: at b = 32 cuDNN's decode is 0.5%-1.3% ahead of the Triton kernel with the same traffic (session 17,
docs/decode_tuning_log.md). The Gluon kernel has cuDNN's warp shape, and in single-call graphs it led both
flashtile and cuDNN at 16k and 64k keys a row (477.6-478.8 against 479.1-483.8 and 480.1-485.4 us at 16k,
1882.8-1883.7 against 1907.7-1916.8 and 1887.9-1910.6 at 64k) but trailed at 8k (244.1-244.9 against
241.9-242.3 and 241.9-244.5; probe_decode_gluon_warp_keys_h200_2026-11-30_session17.json).

Covered: one query token, 16 or fewer query heads a kv head, a contiguous bf16 / fp16 cache (16-byte
aligned, outer strides multiples of 16 elements), d = 64 or 128, no left window edge, softcap, ALiBi, rotary,
batch index or left padding, and calls that are not split (an explicit num_splits of 1, or the heuristic's on
a grid that fills the GPU). New keys are appended by the separate append kernel first.
"""

from __future__ import annotations

import torch

from flashtile import env
from flashtile.backends.triton.host import device_guard, run_kernel

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)
MAX_GROUP = 16  # the kernel's 16 query rows
BLOCK_N, NUM_BUFFERS = 64, 2  # the probe's faster ring (64 KB of shared memory, two programs an SM)


def early_refill() -> bool:
    """FLASHTILE_DECODE_GLUON_WK_EARLY=1: refill a ring slot before waiting for the next tile (an A/B knob, not yet
    measured: the wait then has two tiles in flight, not one)."""
    return bool(env.switch("FLASHTILE_DECODE_GLUON_WK_EARLY"))


def requested() -> bool:
    """FLASHTILE_DECODE_GLUON_WARP_KEYS: 1 routes covered calls to the kernel; 0 or unset: off."""
    return bool(env.switch("FLASHTILE_DECODE_GLUON_WARP_KEYS"))


def refusal(*, arch: str, dtype: torch.dtype, cache_dtype: torch.dtype, d: int, sq: int, group: int, paged: bool,
            batch_idx: bool, leftpad: bool, window_left: int, softcap: float, alibi: bool, rotary: bool,
            num_splits: int, grid_full: bool, aligned: bool) -> str | None:
    """Why the kernel cannot compute this call (None: it can). With one query token a causal mask or a right
    window edge hides no key (the token is the row's last position); only a left edge does."""
    if arch != "sm90":
        return "not an sm_90 GPU"
    if dtype not in (torch.bfloat16, torch.float16) or cache_dtype != dtype:
        return f"dtype {dtype} with a {cache_dtype} cache (takes bf16 / fp16, the same for both)"
    if d not in HEAD_DIMS:
        return f"head_dim {d} (takes {HEAD_DIMS})"
    if sq != 1 or group > MAX_GROUP:
        return f"{sq} query tokens of {group} heads a kv head (takes 1 token, at most {MAX_GROUP} heads)"
    if paged or batch_idx or leftpad:
        return "a paged cache, cache_batch_idx or cache_leftpad"
    if window_left >= 0 or softcap > 0 or alibi or rotary:
        return "a local window, softcap, ALiBi or rotary"
    if num_splits > 1 or (num_splits <= 0 and not grid_full):
        return "a split launch"
    if not aligned:
        return "cache not 16-byte aligned, or an outer stride not a multiple of 16 elements"
    return None


def aligned(*tensors: torch.Tensor) -> bool:
    """16-byte copies need 16-byte aligned bases and rows. The JIT marks an integer argument aligned only when
    it is a multiple of 16, so every outer stride must be one (in elements): 8 would be 16 bytes of 2-byte data,
    but the compiler would not know it and could not build 16-byte copies."""
    return all(x.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in x.stride()[:-1]) and x.stride(-1) == 1
               for x in tensors)


def gluon_decode(q, k_cache, v_cache, *, cache_seqlens, cache_len_const, s_new, softmax_scale):
    """Attention of q (b, 1, h, d) over the contiguous (b, capacity, h_k, d) cache, which already holds this
    call's new keys: out (b, 1, h, d), lse (b, h, 1)."""
    from flashtile.kernels.gluon_decode_warp_keys import _gluon_decode_warp_keys_kernel

    b, _, h, d = q.shape
    h_k = k_cache.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(b, h, 1, device=q.device, dtype=torch.float32)
    if b == 0:
        return out, lse
    has_seqlens = cache_seqlens is not None
    with device_guard(q):
        run_kernel(_gluon_decode_warp_keys_kernel, (b * h_k,),
            q, k_cache, v_cache, out, lse, cache_seqlens if has_seqlens else lse, softmax_scale * LOG2E, h_k,
            h // h_k, cache_len_const if not has_seqlens else 0, s_new, k_cache.shape[1],
            q.stride(0), q.stride(2), *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0), out.stride(2),
            lse.stride(0), lse.stride(1),
            HEAD_DIM=d, BLOCK_N=BLOCK_N, NUM_BUFFERS=NUM_BUFFERS, HAS_SEQLENS=has_seqlens,
            EARLY_REFILL=early_refill(), num_warps=4)
    return out, lse
