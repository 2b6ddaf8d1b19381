"""Host side of the whole-row (row-stream) decode kernel (kernels/decode_rows.py): one program per (batch row,
group of H adjacent kv heads, key split), batched dots, the splits merged by the combine kernel.

The rule (``by_rule``, since session 24): on Hopper, calls of the plain kind (``kvcache_fwd``'s ``_plain_call``:
one query token, no left window edge, softcap, ALiBi, rotary, batch index or left padding), d = 128 and 8 kv heads
(whole 2 KB key rows a program; since session 28 half rows, 4 heads, on contiguous caches where those programs fill
the SMs once: ``one_wave``), the heuristic's split count (num_splits = 0), and a long cache on a large batch
(``RULE_BOUNDS``); since session 26 paged caches too, with pages of whole tiles, by their own bounds
(``PAGED_RULE_BOUNDS``, ``SMALL_PAGE_RULE_BOUNDS``); since session 34 an H100's contiguous caches by
``H100_BAND`` (b = 32: the Gluon kernel below 96k keys, whole rows from there). Both kernels launch as
programmatic dependents (``FLASHTILE_DECODE_ROWS_PDL=0`` turns that off).

Why: a program per (row, kv head), as every other decode kernel here is, reads 256-byte pieces of FlashAttention's
(b, s, h_k, d) cache rows; no such kernel passed cuDNN from 64k keys at b = 32 (session 23's read ceilings). This
one reads whole rows, the order of the fastest plain read (docs/decode_tuning_log.md, session 24).

``FLASHTILE_DECODE_ROWS=H`` sends every covered call (``covers``: a bf16 / fp16 cache, d of 16-128, at most 16
query heads a kv head, H dividing h_k) to programs of H kv heads, whatever its split count; ``0`` none; unset the
rule. Knobs: ``FLASHTILE_DECODE_ROWS_CFG=BLOCK_N,warps,stages`` and ``FLASHTILE_DECODE_ROWS_SPLITS=n`` override
the launch; ``FLASHTILE_DECODE_ROWS_FUSED=1`` merges the splits in the kernel's last split instead of the combine
kernel (no faster in session 24); stream-K shares the work among one program a slot
(kernels/decode_rows_streamk.py): on full-grid boards by ``full_grid_rule`` (board.py), elsewhere only when
``FLASHTILE_DECODE_ROWS_STREAMK=1`` forces it (slower where 128 programs stream as fast as 132, sessions 24-25; a
variant with one key loop across a program's units, session 26, was 3%-4.5% slower still and is removed).
``STAMPS`` is the row kernels' per-program timing diagnostic.
New keys are appended by the separate append kernel first (through the block table on a paged cache).
"""

from __future__ import annotations

import torch

from flashtile import env
from flashtile.backends.triton import decode_gluon
from flashtile.backends.triton.decode_gluon import LOG2E
from flashtile.backends.triton.host import SM90_SHARED_PER_SM, cdiv, device_guard, launch, next_pow2
from flashtile.kernels.decode_rows import _decode_rows_kernel
from flashtile.kernels.decode_rows_streamk import _rows_streamk_combine, _rows_streamk_kernel

# (BLOCK_N, num_warps, num_stages) by heads a program: a stage of K and V is 2 * H * BLOCK_N * d * 2 bytes
# (32 KB at H = 2 / 32 keys, two programs an SM at d = 128; 64 KB at H = 4 / 32 keys and H = 8 / 16 keys, one).
# H = 4 on 32-key tiles (session 28; 16-key tiles, two programs an SM, lost in session 27): in 8-layer graphs on lease
# E28 (rows4_leaseE28_h200_2026-12-02_session28.json, twice each) b = 32 1874.5-1874.7 against the 8-head rule's
# 1877.5-1877.7 us at 64k (2 splits against 4: half the merge), 3739.5-3740.7 against 3739.2-3739.7 at 128k; b = 64
# 476.9 against 479.9 at 8k, 943.2-944.1 against 946.1-946.3 at 16k (no split); at 8 warps 0.5%-0.8% slower.
CONFIGS = {1: (64, 4, 3), 2: (32, 4, 3), 4: (32, 4, 3), 8: (16, 8, 3)}
# Paged caches at 8 heads: a third buffer of K and V (4 stages, launched as 7: launch_stages). On lease C26, in 8-layer
# graphs (row_stages_b{32,64}_leaseC26_h200_2026-12-02_session26.json), 16-key pages: b = 32 1898.3 against 1903.2 us
# at 64k, 3772.2 against 3783.0 at 128k, 482.9 against 484.0 at 16k; b = 64 483.5 against 484.9 at 8k, 1899.1 against
# 1905.7 at 32k; 256-key pages 1881.6 / 3744.9 against 1883.0 / 3749.2 at b = 32 (64k / 128k). On the contiguous cache
# the same third buffer changed nothing (1877.8 against 1877.5 at b = 32, 64k; 3744.6 against 3743.9 at 128k).
# Paged caches at 4 heads keep 16-key tiles (pages of 16 keys; not measured on 32).
PAGED_CONFIGS = {8: (16, 8, 4), 4: (16, 4, 3)}
# Paged caches: each tile's block-table load feeds its K / V addresses, and Triton's pipeliner splits the stages
# between that chain's two loads: a paged build at s stages keeps (s - 1) // 2 buffers of K and V in shared memory,
# a contiguous one s - 1. So a paged launch takes 2 s - 1 stages for the contiguous launch's s (sm_90 builds at
# d = 128, 8 heads: contiguous 3 / 4 stages 163840 / 229376 bytes, paged 5 / 7 stages 163848 / 229388; paged 3 and
# 4 kept one buffer, 6 two; tests/test_sm90_compile.py checks it).


def launch_stages(stages: int, paged: bool) -> int:
    """The num_stages of a launch whose contiguous-cache config has ``stages``: 2 stages - 1 on a paged cache."""
    return 2 * stages - 1 if paged else stages
# The in-kernel merge unrolls its loop over the splits; more splits than this go to the combine kernel.
FUSED_MAX_SPLITS = 8
# Stream-K (kernels/decode_rows_streamk.py): every program loads every unit's length, so at most this many units.
STREAMK_MAX_UNITS = 4096
# Stream-K runs on full-grid boards (full_grid_rule, board.py) and where FLASHTILE_DECODE_ROWS_STREAMK=1 forces it
# (=0 keeps it off, on the heads the rule picked). In 8-layer graphs it was 0.3%-0.5% slower than the split kernel at
# b = 32, 64k-128k and 1%-2% at b = 64 on the boards where 128 programs read as fast as 132 (leases A25-F25), and
# 1.3%-1.4% faster at b = 32 on one where they do not (E26, row_streamk_b32_leaseE26_h200_2026-12-02_session26.json;
# C29: full_grid_rule's comment). Timing both kernels on a call's first eager use was tried and reverted: eager
# launches rank them the other way round (docs/decode_tuning_log.md, session 25); board.py times a plain read instead.
# The STAMP diagnostic (scripts/probe_streamk.py --stamps): an int64 (programs, 4) tensor that the row kernels (split
# and stream-K) fill with each program's %globaltimer at its start, loop end and end, and its SM id; None: off.
STAMPS = None


# The rule's calls: (programs a per-head kernel would have per SM, b x h_k / SMs, at least; capacity at least).
# Measured in 8-layer graphs against the per-head default of the time (docs/decode_tuning_log.md, session 24):
# - b = 64 (3.9 an SM): 6.5% faster at 8k, 7.6% at 16k (lease G24, row_rule_short_b64_leaseG24_...json), 8.4% at
#   32k, 7.9% at 64k, 8.4% at 128k (D24, row_rule_b64_leaseD24_...json), and ahead of cuDNN at every length;
# - b = 128 (7.8): 1.1% faster at 8k, 2.7% at 16k, a tie at 32k (G24, row_rule_short_b128_leaseG24_...json);
# - b = 32 (1.9): 0.2% faster at 64k, 0.8% at 128k, 0.2% slower at 32k (D24); leases B24, C24 and D24
#   (row_pipeline_*_session24.json) agree: 0.3%-0.5% faster at 64k (a tie on B24 without PDL), 0.9%-1.0% at
#   128k, 0.7%-1.3% slower at 16k; on F24 even at 64k and 128k (row_pipeline_diag_leaseF24_...json);
# - b = 16 (0.97): 0.3%-1.6% slower (8 splits), so never whole rows (half rows from 128k: NARROW_RULE_BOUNDS).
#   Below 8k keys unmeasured.
RULE_BOUNDS = ((3.8, 8192), (1.9, 65536))
# H100 SXM (session 34; the bounds above are the H200's). On lease C34, a normal H100 board, in 8-layer graphs at
# b = 32, contiguous caches, us a call at 64k / 96k / 128k keys, two runs each, alternated, cuDNN in brackets
# (b32_long_gluon_leaseC34_..., b32_long_gluon_96k_leaseC34_..., b32_whole_rows_leaseC34_h100_2026-12-06_
# session34.json): half rows (the H200 rule) 2677.1-2678.3 / 4021.7-4028.5 / 5326.9-5331.6; whole rows
# 2671.6-2672.1 / 4002.6-4003.3 / 5326.6-5327.1; the per-head Gluon kernel 2669.1-2670.1 / 4011.3-4012.6 /
# 5349.4-5350.9 (cuDNN 2670.3-2671.9 / 4004.4-4005.9 / 5330.9-5335.7). Half rows win nowhere there, so on an H100
# b = 32's grid leaves the calls below 96k keys to the Gluon kernel (decode_gluon.by_rule) and takes whole rows from
# 96k; on the two H100s before (A33, A34) half rows trailed cuDNN at b = 32, 64k by 0.1% in issue 5's table.
# Between 64k and 96k unmeasured. On the full-grid H100 B34 (b32_long_gluon_leaseB34{,_run2}_...json) the Gluon
# kernel and stream-K whole rows were even at 64k (2674.6-2675.7 against 2675.3-2676.9; cuDNN 2678.4-2679.2):
# full_grid_rule keeps stream-K from 96k. Only b = 32's grid was measured (1.94 programs an SM at 8 kv heads on 132
# SMs): H100_BAND holds it alone; other grids (b = 33-62 in the H200's 1.9 band, b = 64), paged caches and H100s of
# other SM counts keep the H200's bounds.
H100_BAND = (1.9, 2.0)  # programs an SM, [low, high)
H100_WHOLE_FROM = 98304  # capacity from which the band takes whole rows; below, another kernel (the Gluon one)
# Paged caches (pages of whole tiles: 16 keys and up): against the per-head paged kernel, in 8-layer graphs on lease
# A26 (paged_rows{,_b16,_b128}_leaseA26_h200_2026-12-01_session26.json; 8k / 32k / 128k keys, per call, us):
# - b = 128 (7.8 an SM), 8k / 32k: 16-key pages 961.1 / 3780.7 against 1009.5 / 4019.7; 256-key pages 952.9 /
#   3752.4 against 963.0 / 3799.0;
# - b = 64 (3.9), 16-key pages: 485.0 / 1903.9 / 7560.5 against 599.4 / 2410.1 / 9647.2; 256-key pages 481.1 /
#   1885.4 / 7470.7 against 484.2 / 1890.6 / 7511.8 (the contiguous cache: 480.2 / 1878.9 / 7459.1);
# - b = 32 (1.9): 16-key pages 246.4 / 956.6 / 3794.4 against 246.9 / 972.4 / 3864.2; 256-key pages 244.8 / 948.6 /
#   3750.6 against 246.8 / 954.4 / 3815.9;
# - b = 16 (0.97): 16-key pages 128.6 / 488.2 / 1920.2 against 138.3 / 535.6 / 2135.5 (the per-head kernel is slow on
#   small pages); 64-key pages 128.7 / 488.3 / 1912.4 against 125.1 / 480.5 / 1918.4, 256-key 127.3 / 484.6 /
#   1897.4 against 125.4 / 478.2 / 1881.7, so larger pages stay per-head there;
# - b = 8 (0.48): slower, 69.7 / 248.9 / 965.5 against 68.0 / 247.9 / 965.2-1026.4 (16-key pages) and 69.6 / 247.4 /
#   957.5 against 66.7 / 243.6 / 948.8 (256).
# Caches under 8k keys and 32-key pages unmeasured (32-key pages take the larger pages' bound).
PAGED_RULE_BOUNDS = ((1.9, 8192),)
SMALL_PAGE_RULE_BOUNDS = ((0.95, 8192),)  # pages of one 16-key tile
RULE_KV_HEADS = 8
RULE_HEAD_DIM = 128
# Contiguous caches take 4 heads a program (half a kv-head row, CONFIGS[4]) where those programs fill the SMs in one
# wave (one_wave: b = 32 and 64 measured, session 28); other grids (b = 128: two waves; b = 48: 96 programs) and paged
# caches keep the whole row.
RULE_NARROW_HEADS = 4
ONE_WAVE_SLACK = 8
# Calls that only half rows win, where they fill the SMs once: b = 16 (0.97 an SM; 32 units x 4 splits) from 128k
# keys. In 8-layer graphs on lease A29 (rows4_small_leaseA29_... and rows_b16_leaseA29_h200_2026-12-02_session29.json,
# two runs each, us a call), half rows / the per-head default: 1881.2-1883.5 / 1890.9-1895.1 at 128k (cuDNN
# 1878.7-1881.5); but 949.2-949.6 / 946.8 at 64k, 479.0-479.9 / 475.5-475.7 at 32k and 125.8-126.0 / 123.9 at 8k,
# where the per-head kernel (one program a row and head, no merge) stays. Whole
# rows at b = 16 (8 splits) lost at every length (sessions 24 and 29). (Programs an SM at least, below, capacity at
# least): b = 16 alone on 132 SMs; b = 21, 22 and 31 also fill the SMs once with half rows, unmeasured.
NARROW_RULE_BOUNDS = ((0.95, 1.0, 131072),)


def requested() -> int | None:
    """FLASHTILE_DECODE_ROWS: heads a program for every covered call, 0 for none, None (unset) for the rule."""
    text = env.get("FLASHTILE_DECODE_ROWS", "")
    if text == "":
        return None
    if text != "0" and text not in tuple(map(str, CONFIGS)):
        raise ValueError(f"FLASHTILE_DECODE_ROWS must be one of 0 {' '.join(map(str, CONFIGS))} or unset (the "
                         f"default rule), got {text!r}")
    return int(text)


def by_rule(*, arch: str, b: int, h_k: int, d: int, capacity: int, num_splits: int, sms: int,
            page_size: int = 0, h100: bool = False) -> int:
    """Heads a program for a covered plain call by default (0: another kernel). Only the measured shape: Hopper,
    8 kv heads of d = 128 (whole rows), the split heuristic's call (an explicit num_splits keeps its kernel), and
    a grid and cache in RULE_BOUNDS (a paged cache, ``page_size`` > 0: SMALL_PAGE_RULE_BOUNDS for 16-key pages,
    PAGED_RULE_BOUNDS for larger ones). ``h100``: an H100 of 132 SMs, whose contiguous caches on the grid in
    H100_BAND take whole rows from H100_WHOLE_FROM keys and another kernel below. The capacity stands for the
    lengths, which live on the GPU."""
    if not measured_shape(arch, h_k, d, num_splits):
        return 0
    per_sm = b * h_k / sms
    if h100 and page_size <= 0 and H100_BAND[0] <= per_sm < H100_BAND[1]:
        return h_k if capacity >= H100_WHOLE_FROM else 0
    bounds = RULE_BOUNDS if page_size <= 0 else SMALL_PAGE_RULE_BOUNDS if page_size <= 16 else PAGED_RULE_BOUNDS
    whole = any(per_sm >= least and capacity >= shortest for least, shortest in bounds)
    half_only = page_size <= 0 and any(least <= per_sm < most and capacity >= shortest
                                       for least, most, shortest in NARROW_RULE_BOUNDS)
    if not (whole or half_only):
        return 0  # most calls (short caches, small batches) end here, before one_wave's arithmetic
    if page_size <= 0 and one_wave(b * h_k // RULE_NARROW_HEADS, sms):
        return RULE_NARROW_HEADS
    return h_k if whole else 0


# Boards where a grid that leaves SMs idle reads slower (board.full_grid_board: leases J24, E26, C29). In 8-layer
# graphs on C29 (full_grid_leaseC29_h200_2026-12-02_session29.json, one run each, us a call, cuDNN in brackets):
# - the calls the rule above takes, as whole rows on stream-K (one program an SM, every SM): b = 32 1884.5 at 64k
#   (1888.8), 3747.0 at 128k (3768.3), against the rule's 1915.2 / 3819.3 there (1888.5 / 3770.7); b = 16 1886.6
#   at 128k (1894.1) against half rows' 1913.9; b = 64, 32k 1887.3 against 1915.6 (1919.6; probe_streamk);
# - b = 16 at 64k, the same: 955.2 (952.1) against the per-head kernel's 966.7 (952.9);
# - b = 1, 2 and 8, half rows (4 heads a program, split: 2 x 66, 4 x 33 and 16 x 8 programs): b = 1 126.6 at 128k
#   (128.3) against 128.2 (128.1); b = 2 126.4 / 243.0 at 64k / 128k (127.8 / 245.2) against 127.5 / 247.9; b = 8
#   245.6 / 481.8 at 32k / 64k (245.0 / 483.0) against 247.9 / 487.6;
# - b = 8 from 128k, whole rows on stream-K: 953.7 (952.8) against half rows' 956.4-957.6 and the per-head kernel's
#   969.9 (on E26 too stream-K was the nearest there: 957.5 against cuDNN's 951.1; nothing measured reaches cuDNN at
#   b = 8, 128k on these boards).
# Shorter caches keep the normal rule (b = 1 at 64k: half rows 67.5 against 66.8; b = 2 at 32k 67.4 against 66.4).
# - b = 4 from 128k, half rows (lease A31, full_grid_b4_leaseA31_h200_2026-12-02_session31.json): 482.3 (480.2)
#   against the per-head split kernel's 488.1 / 487.7 before and after it (480.2 / 481.2; C30: 487.9-489.1), stream-K
#   484.2 on whole rows, 495.0 on half rows; at 32k half rows 127.4 as the per-head kernel (127.4 / 127.5): unchanged.
# FULL_GRID_CALLS: batch -> ((shortest capacity, heads a program, stream-K), ...) by capacity, at 8 kv heads
# (by_rule's shape); a call takes the last entry whose capacity it reaches.
FULL_GRID_CALLS = {1: ((131072, 4, False),), 2: ((65536, 4, False),), 4: ((131072, 4, False),),
                   8: ((32768, 4, False), (131072, 8, True)), 16: ((65536, 8, True),)}
# Stream-K for the rule's own calls up to b = 64 at 8 kv heads (3.9 an SM); b = 128 unmeasured on these boards.
FULL_GRID_STREAMK_MAX_PER_SM = 4.0


def full_grid_rule(*, normal: int, arch: str, b: int, h_k: int, d: int, capacity: int, num_splits: int, sms: int,
                   page_size: int = 0) -> tuple[int, bool]:
    """(heads a program, stream-K) on a board where grids that leave SMs idle read slower (board.full_grid_board),
    from ``normal``, by_rule's heads for the same call; heads 0: another kernel. Contiguous caches only (paged ones
    keep by_rule: unmeasured on such boards)."""
    heads = normal
    if page_size > 0 or not measured_shape(arch, h_k, d, num_splits):
        return heads, False
    if heads and b * h_k / sms < FULL_GRID_STREAMK_MAX_PER_SM:
        return RULE_KV_HEADS, True
    reached = [(kind, streamk) for shortest, kind, streamk in FULL_GRID_CALLS.get(b, ()) if capacity >= shortest]
    return reached[-1] if reached else (heads, False)


def measured_shape(arch: str, h_k: int, d: int, num_splits: int) -> bool:
    """The shape the rules were measured on: Hopper, 8 kv heads of d = 128, the split heuristic's call."""
    return arch == "sm90" and h_k == RULE_KV_HEADS and d == RULE_HEAD_DIM and num_splits == 0


def one_wave(units: int, sms: int) -> bool:
    """Do ``units`` programs of RULE_NARROW_HEADS heads, split by ``num_splits``'s count, fill the SMs once, within
    ONE_WAVE_SLACK idle SMs (b = 32 and 64 with 8 kv heads on 132 SMs: 128 programs)?"""
    block_n, _, stages = CONFIGS[RULE_NARROW_HEADS]
    per_sm = programs_per_sm(stage_bytes(RULE_NARROW_HEADS, block_n, RULE_HEAD_DIM, 2), stages)
    programs = units * filling_splits(units, per_sm, sms)
    return sms - ONE_WAVE_SLACK <= programs <= per_sm * sms


def config(heads: int, paged: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages) of a launch of ``heads`` kv heads a program (stages as on a contiguous cache: see
    launch_stages); FLASHTILE_DECODE_ROWS_CFG overrides it."""
    text = env.get("FLASHTILE_DECODE_ROWS_CFG", "")
    if not text:
        return PAGED_CONFIGS.get(heads, CONFIGS[heads]) if paged else CONFIGS[heads]
    parts = text.split(",")
    if len(parts) != 3 or not all(x.isdigit() for x in parts):
        raise ValueError(f"FLASHTILE_DECODE_ROWS_CFG must be BLOCK_N,warps,stages, got {text!r}")
    block_n, warps, stages = map(int, parts)
    if block_n < 16 or block_n & (block_n - 1) or warps not in (1, 2, 4, 8, 16) or stages < 1:
        raise ValueError(f"FLASHTILE_DECODE_ROWS_CFG: BLOCK_N a power of two >= 16, warps 1-16 (a power of two), "
                         f"stages >= 1; got {text!r}")
    return block_n, warps, stages


def num_splits(programs: int, per_stage: int, stages: int, sms: int, key_blocks: int) -> int:
    """Splits that fill every SM's program slots once (slots from the shared memory the stages take), at most one
    a key block and MAX_SPLITS."""
    from flashtile.backends.triton.decode import MAX_SPLITS

    splits = env.count("FLASHTILE_DECODE_ROWS_SPLITS")
    if splits is None:
        splits = filling_splits(programs, programs_per_sm(per_stage, stages), sms)
    return max(1, min(splits, MAX_SPLITS, key_blocks))


def filling_splits(programs: int, per_sm: int, sms: int) -> int:
    """The split count that gives ``sms`` SMs ``per_sm`` programs each, nearest, for ``programs`` unsplit ones."""
    return max(1, round(per_sm * sms / max(1, programs)))


def stage_bytes(heads: int, block_n: int, d: int, itemsize: int) -> int:
    """Shared memory of one pipeline stage: a K and a V tile of ``heads`` kv heads x ``block_n`` keys x ``d``."""
    return 2 * heads * block_n * d * itemsize


def programs_per_sm(per_stage: int, stages: int) -> int:
    """The programs an SM holds at once, from the shared memory their stages of K and V take (``per_stage`` bytes
    each)."""
    return max(1, SM90_SHARED_PER_SM // max(1, per_stage * stages))


def covers(q, k_cache, v_cache, heads: int, block_table=None) -> bool:
    """Whether the kernel computes this call (the caller has checked the plain-call conditions). A paged cache
    (``block_table``) only with pages of whole tiles (the tile's BLOCK_N divides the page size: 16, 32, ..., 256)."""
    h, d = q.shape[2], q.shape[3]
    h_k = k_cache.shape[2]
    if block_table is not None and k_cache.shape[1] % config(heads, paged=True)[0]:
        return False
    return (q.shape[1] == 1 and h_k % heads == 0 and h // h_k <= 16 and d in (16, 32, 64, 128)
            and q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype == v_cache.dtype
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1)


def rows_decode(q, k_cache, v_cache, *, cache_seqlens, cache_len_const, s_new, softmax_scale, heads, sms,
                block_table=None, streamk=False):
    """Attention of q (b, 1, h, d) over the (b, capacity, h_k, d) cache holding cache_seqlens (or
    cache_len_const) keys a row: out (b, 1, h, d), lse (b, h, 1). With ``block_table`` (b, pages a row), int32, the
    caches are (pages, page_size, h_k, d) pools and row i's keys lie in the pages block_table[i] lists.
    ``streamk``: the stream-K launch (contiguous caches; FLASHTILE_DECODE_ROWS_STREAMK=0 / 1 overrides it)."""
    from flashtile.backends.triton.decode import capacity_of, pdl_capable

    b, _, h, d = q.shape
    h_k = k_cache.shape[2]
    out, lse = decode_gluon.one_token_outputs(q)
    if b == 0:
        return out, lse
    cfg = block_n, _, stages = config(heads, paged=block_table is not None)
    groups = h_k // heads
    units = b * groups
    stage = stage_bytes(heads, block_n, d, k_cache.element_size())
    capacity = capacity_of(k_cache, block_table)
    key_blocks = cdiv(max(capacity, 1), block_n)
    # on unless FLASHTILE_DECODE_ROWS_PDL=0: 2.1-3.6 us a call faster than without at b = 32 (leases C24, D24)
    pdl = env.switch("FLASHTILE_DECODE_ROWS_PDL") is not False and pdl_capable(q.device)
    args = (q, k_cache, v_cache, heads, groups, cfg, softmax_scale, pdl, out, lse, cache_seqlens, cache_len_const,
            s_new)
    if block_table is not None:  # paged: the split kernel (stream-K reads contiguous caches only)
        return _split(*args, num_splits(units, stage, stages, sms, key_blocks), block_table=block_table)
    # stream-K: on full-grid boards by the caller's rule (full_grid_rule), or FLASHTILE_DECODE_ROWS_STREAMK=1 (slower
    # where 128 programs read as fast as 132, session 25)
    forced = env.switch("FLASHTILE_DECODE_ROWS_STREAMK")
    if (streamk if forced is None else forced) and units <= STREAMK_MAX_UNITS:
        # one program a slot, never more than the key tiles; FLASHTILE_DECODE_ROWS_PROGRAMS=n forces n (tests:
        # programs that span several units, units several programs)
        programs = env.count("FLASHTILE_DECODE_ROWS_PROGRAMS") or min(
            programs_per_sm(stage, stages) * sms, units * key_blocks)
        return _streamk(*args, programs)
    return _split(*args, num_splits(units, stage, stages, sms, key_blocks))


def _split(q, k_cache, v_cache, heads, groups, cfg, softmax_scale, pdl, out, lse, cache_seqlens, cache_len_const,
           s_new, splits, block_table=None):
    """The split launch: b * groups * splits programs, then the combine kernel (or, FLASHTILE_DECODE_ROWS_FUSED=1,
    the in-kernel merge). ``block_table``: a paged cache (rows_decode)."""
    from flashtile.backends.triton.decode import _merge_counters, capacity_of, combine, split_partials

    b, _, h, d = q.shape
    h_k = k_cache.shape[2]
    block_n, warps, stages = cfg
    o_part, lse_part = split_partials(splits, b, 1, h, d, q.device)
    counters = None
    if env.switch("FLASHTILE_DECODE_ROWS_FUSED") and 1 < splits <= FUSED_MAX_SPLITS:
        counters = _merge_counters(q.device, b * groups)
    with device_guard(q):
        launch(
            _decode_rows_kernel, (b * groups * splits,),
            q, k_cache, v_cache, o_part, lse_part, out, lse, counters if counters is not None else lse,
            cache_seqlens if cache_seqlens is not None else lse, block_table if block_table is not None else lse,
            softmax_scale * LOG2E, cache_len_const, s_new, capacity_of(k_cache, block_table), h // h_k,
            q.stride(0), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            0 if block_table is None else block_table.stride(0),
            o_part.stride(0), o_part.stride(1), o_part.stride(3), lse_part.stride(0), lse_part.stride(1),
            lse_part.stride(2), out.stride(0), out.stride(2), lse.stride(0), lse.stride(1),
            HEADS=heads, GROUPS=groups, NUM_SPLITS=splits, HEAD_DIM=d, BLOCK_M=16, BLOCK_N=block_n,
            HAS_SEQLENS=cache_seqlens is not None, FUSED_COMBINE=counters is not None,
            MERGE_ROWS=max(16, next_pow2(heads * (h // h_k))), num_warps=warps,
            num_stages=launch_stages(stages, block_table is not None),
            **(dict(USE_PDL=True, launch_pdl=True) if pdl else {}), **_stamps(), **seqlens_policy(cache_seqlens),
            **({} if block_table is None else dict(PAGE_SIZE=k_cache.shape[1])),
        )
    return (out, lse) if counters is not None else combine(o_part, lse_part, out, lse, pdl=pdl)


def _stamps() -> dict:
    return {} if STAMPS is None else dict(STAMPS=STAMPS, STAMP=True)


def seqlens_policy(cache_seqlens) -> dict:
    """The decode kernels' SEQLENS_POLICY for a call's ``cache_seqlens``: {} (the default build) unless
    FLASHTILE_DECODE_SEQLENS_EVICT_LAST=1, then "evict_last". Every program of a split or stream-K kernel reads the
    lengths before its first key, so that load's latency opens every call; a layer's multi-GB key stream evicts the
    lengths from L2, and the next layer's call reads them from HBM. Marked evict_last, they could stay for it (in
    a model the layers share one ``cache_seqlens``). Session 31: built, not yet measured."""
    if cache_seqlens is None or not env.switch("FLASHTILE_DECODE_SEQLENS_EVICT_LAST"):
        return {}
    return dict(SEQLENS_POLICY="evict_last")


def _streamk(q, k_cache, v_cache, heads, groups, cfg, softmax_scale, pdl, out, lse, cache_seqlens, cache_len_const,
             s_new, programs):
    """The stream-K launch (kernels/decode_rows_streamk.py): ``programs`` programs share every unit's key tiles
    evenly, then the merge kernel, one program a (unit, query head)."""
    b, _, h, d = q.shape
    block_n, warps, stages = cfg
    units = b * groups
    unit_heads = heads * (h // k_cache.shape[2])
    # a unit's segments at equal lengths: about programs / units, one more where a program boundary falls inside it
    segs = max(2, next_pow2(-(-programs // units) + 1))
    o_part = torch.empty(units * segs + units + programs, unit_heads, d, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(o_part.shape[:2], device=q.device, dtype=torch.float32)
    counts = torch.empty(units, device=q.device, dtype=torch.int32)
    lens = cache_seqlens if cache_seqlens is not None else lse
    units_p2 = max(2, next_pow2(units))
    extra = dict(USE_PDL=True, launch_pdl=True) if pdl else {}
    with device_guard(q):
        launch(
            _rows_streamk_kernel, (programs,),
            q, k_cache, v_cache, o_part, lse_part, counts, lens, softmax_scale * LOG2E, cache_len_const, s_new,
            k_cache.shape[1], h // k_cache.shape[2], units, programs,
            q.stride(0), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), o_part.stride(0), o_part.stride(1),
            lse_part.stride(0),
            HEADS=heads, GROUPS=groups, HEAD_DIM=d, BLOCK_M=16, BLOCK_N=block_n, UNITS_P2=units_p2, SEGS=segs,
            LSE_ROWS=max(2, next_pow2(unit_heads)), HAS_SEQLENS=cache_seqlens is not None, num_warps=warps,
            num_stages=stages, **extra, **_stamps(), **seqlens_policy(cache_seqlens),
        )
        # the overflow loop's chunk: a unit past SEGS segments is a long row among short ones, over many programs
        block_s = 8
        launch(
            _rows_streamk_combine, (units * unit_heads,),
            o_part, lse_part, out, lse, counts, lens, cache_len_const, s_new, k_cache.shape[1], units, unit_heads,
            programs, o_part.stride(0), o_part.stride(1), lse_part.stride(0), out.stride(0), out.stride(2),
            lse.stride(0), lse.stride(1),
            GROUPS=groups, HEAD_DIM=d, BLOCK_N=block_n, UNITS_P2=units_p2, SEGS=segs, BLOCK_S=block_s,
            HAS_SEQLENS=cache_seqlens is not None, num_warps=1 if max(segs, block_s) * d <= 1024 else 4,
            num_stages=1, **extra,
        )
    return out, lse
