"""Which decode calls take the whole-row Gluon kernels, and their launch: an experiment, off unless
``FLASHTILE_DECODE_GLUON_ROWS=1``.

Two kernels read FlashAttention's (b, s, h_k, d) cache a whole key row (every kv head) at a time: one with TMA
copies (kernels/gluon_decode_rows_tma.py, session 20; taken unless FLASHTILE_DECODE_GLUON_ROWS_TMA=0) and one with
16-byte copies (kernels/gluon_decode_rows.py, session 19).

Why it stays off (sessions 20-21, 8-layer graphs, docs/decode_tuning_log.md): the TMA kernel with a ring of three K
and three V tiles (one program an SM) streams as fast as cuDNN's head-major kernel, but at b = 32 its 4 key splits
need a merge (2.0 us a call since session 21's one-warp merge, 4.4 before) that cuDNN's unsplit grid does not. At
b = 32, 128k it was 0.25%-0.9% faster than the per-head default on eleven H200s of thirteen, and 1.8% slower on
two (leases E20 and G21, where cuDNN itself took 3768 us against 3649-3752 elsewhere; there rings that fit two
programs an SM were as fast as the default and one program an SM was not). Over those thirteen boards that
averages about +0.3%, but it lost on two of the four boards of the slow class it ran on, and that class (cuDNN at
3740-3768 us) was eight of the leases of sessions 19-21. So the kernel stays an experiment: a rule for it was
written and reverted in session 20, and again in session 21.

Covered: sm_90, one query token, bf16 / fp16 (cache the same), d = 64 or 128, 4 or 8 kv heads (a warp each), at
most 8 query heads a kv head, a 16-byte aligned contiguous-last-dim cache, and no paging, batch index, left
padding, left window edge, softcap, ALiBi or rotary. New keys are appended by the separate append kernel first.
"""

from __future__ import annotations

import torch

from flashtile import env
from flashtile.backends.triton import decode_gluon
from flashtile.backends.triton.decode_gluon import LOG2E
from flashtile.backends.triton.host import SM90_SHARED_PER_SM, cdiv, device_guard, run_kernel

HEAD_DIMS = (64, 128)
KV_HEADS = (4, 8)
MAX_GROUP = 8  # the kernel's 8 MMA columns
BLOCK_N = 16
# the 16-byte-copy kernel: 96 KB of shared memory and 128 registers a thread at h_k = 8, d = 128; the TMA kernel
# runs as many as its ring lets fit, at most this many
PROGRAMS_PER_SM = 2
SHARED_RESERVE = 1024  # the kernel's mbarriers and what the runtime keeps a block
DEFAULT_SLOTS = (3, 3)


def requested() -> bool:
    """FLASHTILE_DECODE_GLUON_ROWS=1 sends every covered call to the kernel (unset or 0: none)."""
    return bool(env.switch("FLASHTILE_DECODE_GLUON_ROWS"))


def tma_slots() -> tuple[int, int]:
    """The TMA variant's ring, FLASHTILE_DECODE_GLUON_ROWS_SLOTS="K,V" tiles in flight (default 3,3: 192 KB at
    h_k = 8, d = 128, one program an SM; session 20 measured it ahead of 2,1 (two programs an SM, 0.7% at b = 32,
    128k), 4,3, and 3,3 with 33 or 66 splits)."""
    value = env.get("FLASHTILE_DECODE_GLUON_ROWS_SLOTS", "") or ",".join(map(str, DEFAULT_SLOTS))
    try:
        k, v = (int(x) for x in value.split(","))
    except ValueError:
        k = v = 0
    if not (1 <= k <= 8 and 1 <= v <= 8):
        raise ValueError(f"FLASHTILE_DECODE_GLUON_ROWS_SLOTS must be 'K,V' with 1-8 tiles each, got {value!r}")
    return k, v


def refusal(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, arch: str) -> str | None:
    """Why the kernel cannot compute this call (None: it can); the caller has checked the plain-call
    conditions (no paging, batch index, left padding, left window edge, softcap, ALiBi or rotary)."""
    b, sq, h, d = q.shape
    h_k = k_cache.shape[2]
    if arch != "sm90":
        return "not an sm_90 GPU"
    if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return f"dtype {q.dtype} with a {k_cache.dtype} cache (takes bf16 / fp16, the same for both)"
    if d not in HEAD_DIMS or h_k not in KV_HEADS or sq != 1 or h // h_k > MAX_GROUP:
        return f"d = {d}, {h_k} kv heads, {sq} query tokens, {h // h_k} query heads a kv head"
    if not decode_gluon.aligned(k_cache, v_cache):
        return "cache not 16-byte aligned, or an outer stride not a multiple of 16 elements"
    return None


def use_tma(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """TMA copies unless FLASHTILE_DECODE_GLUON_ROWS_TMA=0, or a cache a descriptor cannot describe: no keys (a
    descriptor's dims must be positive) or a zero stride (an expanded cache); those take the 16-byte copies."""
    if env.switch("FLASHTILE_DECODE_GLUON_ROWS_TMA") is False or k_cache.shape[1] == 0:
        return False
    return all(s > 0 for x in (k_cache, v_cache) for s in x.stride()[:3])


def ring_bytes(k_slots: int, v_slots: int, h_k: int, d: int, element_size: int) -> int:
    """The TMA kernel's shared memory: its K and V tiles of 16 whole rows."""
    return (k_slots + v_slots) * h_k * BLOCK_N * d * element_size


def num_splits(b: int, capacity: int, sms: int, per_sm: int = PROGRAMS_PER_SM) -> int:
    """Key splits that give every SM per_sm programs (FLASHTILE_DECODE_GLUON_ROWS_SPLITS=N: N, for experiments),
    at most one a 16-key tile and 128."""
    from flashtile.backends.triton.decode import MAX_SPLITS  # decode imports this module

    want = env.count("FLASHTILE_DECODE_GLUON_ROWS_SPLITS", 1, MAX_SPLITS)
    if want is None:
        want = round(per_sm * sms / max(b, 1))
    return max(1, min(want, cdiv(max(capacity, 1), BLOCK_N), MAX_SPLITS))


def _tma_descriptors(k_cache, v_cache):
    """[b, h_k, capacity, d] views of the caches with [1, h_k, 16, 64] blocks (one TMA copy a half of d)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashtile.backends.triton.gluon_fwd import _smem_layout

    block = [1, k_cache.shape[2], BLOCK_N, 64]
    layout = _smem_layout(tuple(block), k_cache.dtype)
    return tuple(TensorDescriptor(x, [x.shape[0], x.shape[2], x.shape[1], x.shape[3]],
                                  [x.stride(0), x.stride(2), x.stride(1), 1], block, layout)
                 for x in (k_cache, v_cache))


def gluon_rows_decode(q, k_cache, v_cache, *, cache_seqlens, cache_len_const, s_new, softmax_scale, sms):
    """Attention of q (b, 1, h, d) over the (b, capacity, h_k, d) cache holding cache_seqlens (or cache_len_const)
    + s_new keys a row (already appended): out (b, 1, h, d), lse (b, h, 1)."""
    from flashtile.backends.triton.decode import combine, split_partials
    from flashtile.kernels.gluon_decode_rows import _gluon_decode_rows_kernel

    b, _, h, d = q.shape
    h_k = k_cache.shape[2]
    out, lse = decode_gluon.one_token_outputs(q)
    if b == 0:
        return out, lse
    tma = use_tma(k_cache, v_cache)
    if tma:
        k_slots, v_slots = tma_slots()
        shared = ring_bytes(k_slots, v_slots, h_k, d, k_cache.element_size()) + SHARED_RESERVE
        if shared > SM90_SHARED_PER_SM:
            raise ValueError(f"FLASHTILE_DECODE_GLUON_ROWS_SLOTS={k_slots},{v_slots} needs {shared} bytes of shared "
                             f"memory at h_k = {h_k}, d = {d}, more than an SM's {SM90_SHARED_PER_SM}")
        splits = num_splits(b, k_cache.shape[1], sms, min(PROGRAMS_PER_SM, SM90_SHARED_PER_SM // shared))
    else:
        splits = num_splits(b, k_cache.shape[1], sms)
    o_part, lse_part = split_partials(splits, b, 1, h, d, q.device)
    has_seqlens = cache_seqlens is not None
    seqlens = cache_seqlens if has_seqlens else lse
    common = (softmax_scale * LOG2E, h // h_k, cache_len_const if not has_seqlens else 0, s_new, k_cache.shape[1],
              splits, q.stride(0), q.stride(2))
    parts = (o_part.stride(0), o_part.stride(1), o_part.stride(3), lse_part.stride(0), lse_part.stride(1),
             lse_part.stride(2))
    with device_guard(q):
        if tma:
            from flashtile.kernels.gluon_decode_rows_tma import _gluon_decode_rows_tma_kernel

            desc_k, desc_v = _tma_descriptors(k_cache, v_cache)
            run_kernel(_gluon_decode_rows_tma_kernel, (b * splits,), q, desc_k, desc_v, o_part, lse_part, seqlens,
                       *common, *parts, HEADS=h_k, HEAD_DIM=d, K_SLOTS=k_slots, V_SLOTS=v_slots,
                       HAS_SEQLENS=has_seqlens, num_warps=h_k)
        else:
            run_kernel(_gluon_decode_rows_kernel, (b * splits,), q, k_cache, v_cache, o_part, lse_part, seqlens,
                       *common, *k_cache.stride()[:3], *v_cache.stride()[:3], *parts,
                       HEADS=h_k, HEAD_DIM=d, HAS_SEQLENS=has_seqlens, num_warps=h_k)
    return combine(o_part, lse_part, out, lse)
