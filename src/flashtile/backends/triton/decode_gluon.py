"""Which KV-cache decode calls take the Gluon warps-along-keys kernel (kernels/gluon_decode_warp_keys.py), and
its launch. The rule (``by_rule``): on Hopper, calls it covers (``refusal``) at d = 128 with about two programs on
every SM (b x kv heads >= ``MIN_PROGRAMS_PER_SM`` x SMs) and a cache of at least ``MIN_CAPACITY`` keys a row
(``MIN_CAPACITY_APPENDING`` when the call appends new keys, which this kernel does more cheaply).
``FLASHTILE_DECODE_GLUON_WARP_KEYS=1`` sends every covered call there, ``0`` none. Grids below the rule's
(b = 4-16 with 8 kv heads) run split into the fewest powers of two that reach it, from SPLIT_MIN_CAPACITY keys
(``requested_splits``, session 32), merged by the combine kernel.

Why: at b = 32 cuDNN's decode led the Triton kernel by 0.5%-1.3% with the same traffic (session 17,
docs/decode_tuning_log.md). This kernel has cuDNN's warp shape. In 8-layer graphs at b = 32 it was faster than
the Triton kernel from 16k keys on two leases (64k: 1842.3-1843.3 against 1858.4 us in session 17, 1843.9-1844.2
against 1856.7-1857.5 in session 18) and slower at 8k (239.5 against 237.3); results in
benchmarks/results/decode_gluon_warp_keys_ab_*. Since session 23 its warps merge through shared memory, 2-3 us a
call faster, and it is faster at 8k too (236.9 against 237.9, 236.5 against 237.4 us).

Covered: one query token, 16 or fewer query heads a kv head, a contiguous bf16 / fp16 cache (16-byte
aligned, outer strides multiples of 16 elements), d = 64 or 128, no left window edge, softcap, ALiBi, rotary,
batch index or left padding, and the heuristic's split count (num_splits = 0: unsplit on a grid that fills the
GPU, split by ``requested_splits`` on smaller ones) or an explicit 1. Unsplit, the kernel appends new keys
itself, unless they share storage with the cache (then the separate append kernel runs first, as it always does
before a split launch).
"""

from __future__ import annotations

import math

import torch

from flashtile import env
from flashtile.backends.triton.host import device_guard, next_pow2, run_kernel

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)
MAX_GROUP = 16  # the kernel's 16 query rows
# The rule's shortest cache: the lengths live on the GPU (reading them would sync), so the rule goes by the
# capacity, the most a program can read. Measured at b = 32 (8-layer graphs): until session 22 0.1% faster than the
# Triton kernel at 16k, 0.5%-0.85% from 64k and 0.5%-0.9% slower at 8k; since session 23's warp merge through
# shared memory (about 3 us a call less) 0.4% faster at 8k (236.9 against 237.9 us, lease J23,
# read_ceiling_smem_merge_leaseJ23_h200_2026-12-01_session23.json). Below 8k unmeasured since.
MIN_CAPACITY = 8192
# With a serving step's append (one new token, in the kernel) the Gluon kernel was 3.3% faster than the Triton
# kernel's in-kernel append at b = 32, 8k (245.1 against 253.4-253.6 us) and 2.4% at 16k
# (decode_gluon_append_{8k,16k}_ab_h200_2026-11-30_session18.json); below 8k is unmeasured. Since session 19 the
# Triton path appends with the separate append kernel instead (faster at b = 1 / 8); against that path at b = 32,
# 8k-16k this bound is unmeasured.
MIN_CAPACITY_APPENDING = 8192
# Programs (batch rows x kv heads) an SM the rule needs: measured faster at 1.94 (b = 32 with 8 kv heads on 132
# SMs) and 3.88 (b = 64), 17% slower at 0.97 (b = 16); between 1 and 1.9 unmeasured, so the Triton kernel's.
MIN_PROGRAMS_PER_SM = 1.9
RULE_HEAD_DIM = 128


# The ring: two 64-key K / V slots, 64 KB, two programs an SM. A ring of three slots was 2%-4% slower in session
# 17's probe (probe_decode_gluon_warp_keys_h200_2026-11-30_session17.json); cuDNN's 128-key tiles as two K slots
# and one V slot (96 KB, session 18) were 1.6%-1.8% slower at b = 32 in session 19
# (decode_gluon_tile128_ab_h200_2026-12-01_session19.json) and were removed.
BLOCK_N = 64
NUM_BUFFERS = 2
# The kernel appends a call's new keys itself (FUSED_NEW): close to free at b = 32, 8k in session 18 (1.4% behind
# cuDNN with one appended key, about as far as without one; decode_gluon_append_8k_ab_h200_2026-11-30_session18
# .json). Against this kernel after the separate append kernel it is unmeasured. False: the separate append kernel
# first, and the rule's bound without appends.
FUSED_APPEND = True
# The ring's first tile copied before the row's length is read (EARLY_TILES; session 31): the copies no longer wait
# for the length's load, one round trip off every program's start. On lease D31, a fast board, in 8-layer graphs at
# b = 32, alternated 0 1 0 1 0 1 (gluon_early_leaseD31_h200_2026-12-02_session31.json), us a call: 8k 235.66-235.83
# against 236.32-236.40 (cuDNN 236.08-236.18), 16k 463.48-464.07 against 464.30-464.47, 32k 921.38-922.14 against
# 922.06-922.35. FLASHTILE_DECODE_GLUON_EARLY=0 turns it off.
EARLY_TILES = True
# A diagnostic (session 23): an int64 tensor of (programs, 4) here makes the next launches write each program's
# start, key-loop end, end and merge end (%globaltimer, ns) into it (scripts/probe_read_ceiling.py --stamps reads
# them). None: the kernel as always (the stamps are compiled out).
STAMPS = None


def early_tiles() -> bool:
    """Copy the ring's first tiles before the row's length is known? FLASHTILE_DECODE_GLUON_EARLY (0 / 1), else
    EARLY_TILES."""
    forced = env.switch("FLASHTILE_DECODE_GLUON_EARLY")
    return EARLY_TILES if forced is None else forced


def requested() -> bool | None:
    """FLASHTILE_DECODE_GLUON_WARP_KEYS: 1 routes every covered call to the kernel, 0 none, unset: the rule."""
    return env.switch("FLASHTILE_DECODE_GLUON_WARP_KEYS")


def by_rule(*, capacity: int, programs: int, sms: int, d: int, appends: bool = False) -> bool:
    """The default for a covered call: d = 128 (the only head dim measured: at d = 64 a tile is half the bytes,
    so two programs an SM would have no more in flight than the lone program that lost), about two programs on
    every SM (one has a single 64-key tile in flight, too few bytes to keep HBM busy: at b = 16, one program an
    SM, it was 17% slower than the Triton kernel) and a cache of at least MIN_CAPACITY keys a row, or of
    MIN_CAPACITY_APPENDING when the kernel appends the call's new keys (``appends``)."""
    shortest = MIN_CAPACITY_APPENDING if appends else MIN_CAPACITY
    return d == RULE_HEAD_DIM and programs >= MIN_PROGRAMS_PER_SM * sms and capacity >= shortest


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


def merge_rows(group: int) -> int:
    """Rows of the warps' merge that hold query heads: the group, as a power of two of at least 4 (the merge's
    4 warps along the rows), at most the kernel's 16. Reading back only these, not all 16 padded rows, saved
    0.2-0.4 us a call at b = 32, 8k-16k (lease M23, read_ceiling_group_rows_leaseM23_h200_2026-12-01_session23.json)."""
    return min(MAX_GROUP, max(4, 1 << (group - 1).bit_length()))


def one_token_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-token decode call's outputs, unfilled: out like q (b, 1, h, d) and lse (b, h, 1), fp32."""
    return torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], 1, device=q.device, dtype=torch.float32)


def aligned(*tensors: torch.Tensor) -> bool:
    """16-byte copies need 16-byte aligned bases and rows. The JIT marks an integer argument aligned only when
    it is a multiple of 16, so every outer stride must be one (in elements): 8 would be 16 bytes of 2-byte data,
    but the compiler would not know it and could not build 16-byte copies."""
    return all(x.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in x.stride()[:-1]) and x.stride(-1) == 1
               for x in tensors)


def gluon_decode(q, k_cache, v_cache, *, cache_seqlens, cache_len_const, s_new, softmax_scale, k_new=None,
                 v_new=None, splits: int = 1):
    """Attention of q (b, 1, h, d) over the contiguous (b, capacity, h_k, d) cache holding cache_seqlens + s_new
    keys a row: out (b, 1, h, d), lse (b, h, 1). With k_new / v_new ((b, s_new, h_k, d)) the kernel first appends
    them at cache_seqlens; without, the cache already holds them. ``splits`` > 1 (requested_splits, an experiment):
    each row's keys in that many programs, merged by the combine kernel (no k_new then: append first)."""
    from flashtile.kernels.gluon_decode_warp_keys import _gluon_decode_warp_keys_kernel

    b, _, h, d = q.shape
    h_k = k_cache.shape[2]
    out, lse = one_token_outputs(q)
    fused = k_new is not None and s_new > 0
    if fused and splits > 1:
        raise ValueError("gluon_decode: a split launch reads the new keys from the cache (append them first)")
    if b == 0:
        return out, lse
    has_seqlens = cache_seqlens is not None
    release = False
    policy = {}
    if splits > 1:  # the partials (splits, b, 1, h, d) / (splits, b, h, 1), merged below
        from flashtile.backends.triton.decode import combine, merge_pdl, split_partials
        from flashtile.backends.triton.decode_rows import seqlens_policy

        # a split's first key waits on its row's length (FLASHTILE_DECODE_SEQLENS_EVICT_LAST: kept in L2)
        policy = seqlens_policy(cache_seqlens)
        # the merge as a programmatic dependent, as behind the Triton split kernel (decode.merge_pdl)
        release = merge_pdl(q.device, False, splits, False)
        o_dst, lse_dst = split_partials(splits, b, 1, h, d, q.device)
        o_strides, lse_strides = (o_dst.stride(1), o_dst.stride(3)), lse_dst.stride()[1:3]
        split_strides = (o_dst.stride(0), lse_dst.stride(0))
    else:
        o_dst, lse_dst = out, lse
        o_strides, lse_strides = (out.stride(0), out.stride(2)), lse.stride()[:2]
        split_strides = (0, 0)
    with device_guard(q):
        run_kernel(_gluon_decode_warp_keys_kernel, (b * h_k * splits,),
            q, k_cache, v_cache, o_dst, lse_dst, cache_seqlens if has_seqlens else lse, k_new if fused else q,
            v_new if fused else q, softmax_scale * LOG2E, h_k, h // h_k, cache_len_const if not has_seqlens else 0,
            s_new, k_cache.shape[1],
            q.stride(0), q.stride(2), *k_cache.stride()[:3], *v_cache.stride()[:3], *o_strides, *lse_strides,
            *(k_new.stride()[:3] if fused else (0, 0, 0)), *(v_new.stride()[:3] if fused else (0, 0, 0)),
            lse if STAMPS is None else STAMPS, *split_strides,
            HEAD_DIM=d, BLOCK_N=BLOCK_N, NUM_BUFFERS=NUM_BUFFERS, HAS_SEQLENS=has_seqlens, FUSED_NEW=fused,
            STAMP=STAMPS is not None, GROUP_ROWS=merge_rows(h // h_k), EARLY_TILES=early_tiles() and splits == 1,
            **({} if splits == 1 else dict(NUM_SPLITS=splits, RELEASE_MERGE=release)), **policy, num_warps=4)
        if splits > 1:
            combine(o_dst, lse_dst, out, lse, pdl=release)
    return out, lse


MAX_SPLITS = 16
# The split rule (session 32): heuristic calls whose unsplit grid is below the rule's (MIN_PROGRAMS_PER_SM) run split
# into the fewest powers of two that reach it, from SPLIT_MIN_CAPACITY keys and at most RULE_MAX_SPLITS ways. On
# lease A32 (an H100, 8-layer graphs, contiguous caches, gluon_splits_leaseA32_h100_2026-12-06_session32.json) it was
# faster than the rule before it (the whole-row / per-head Triton kernels) in all nine rows measured, b = 4 / 8 / 16
# (8 / 4 / 2 splits) at 32k-128k, us a call: b = 8, 128k 1337.3-1337.9 against 1350.5-1353.4 (cuDNN 1341.4-1341.7),
# b = 4, 128k 672.0 against 679.8-680.4, b = 16, 128k 2672.6-2672.9 against 2680.6-2689.2; 8 splits at b = 8 / 16
# (more than the fewest) were 1.5%-4.9% slower. Below 32k keys, and 16 splits (b = 2), unmeasured. On the H200 A35
# (session 35, gluon_split_rule_leaseA35_h200_2026-12-06_session35.json) 0.2%-0.4% faster at b = 8 from 32k and
# b = 4 from 64k, but 0.2%-0.5% slower at b = 16, 128k (two runs, one board: not yet a bound).
SPLIT_MIN_CAPACITY = 32768
RULE_MAX_SPLITS = 8


def requested_splits(pairs: int, sms: int, capacity: int) -> int | None:
    """Splits for a heuristic call of ``pairs`` (batch rows x kv heads) programs, too few for this kernel's rule
    (MIN_PROGRAMS_PER_SM), on a cache of ``capacity`` keys a row; None: unsplit (a grid the rule takes as it is,
    or one the split rule leaves to the Triton kernels). FLASHTILE_DECODE_GLUON_SPLITS: unset the split rule; 1
    never split; N (2-16) N splits on every such grid; 0 the fewest powers of two that reach the rule's grid at any
    capacity (b = 16 / 8 / 4 / 2 with 8 kv heads on 132 SMs: 2 / 4 / 8 / 16 splits, 256 programs)."""
    value = env.count("FLASHTILE_DECODE_GLUON_SPLITS", 0, MAX_SPLITS)
    if value == 1 or pairs >= MIN_PROGRAMS_PER_SM * sms or pairs == 0:
        return None
    if value is not None and value > 1:
        return value
    fewest = next_pow2(math.ceil(MIN_PROGRAMS_PER_SM * sms / pairs))
    if value == 0:
        return min(MAX_SPLITS, fewest)
    return fewest if capacity >= SPLIT_MIN_CAPACITY and fewest <= RULE_MAX_SPLITS else None
