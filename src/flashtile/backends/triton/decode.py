"""Launchers of the KV-cache kernels: append (+ rotary), split-KV decode, and the split combine.

Nothing here reads a tensor's values: lengths stay on the device and the grid depends on shapes
only, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch

from flashtile import env
from flashtile.backends.triton import board, decode_gluon, decode_gluon_rows, decode_rows
from flashtile.backends.triton.attn_fwd import _tma_ok
from flashtile.backends.triton.host import capability, cdiv, device_guard, launch, next_pow2, run_kernel
from flashtile.fp8 import FP8_DTYPE
from flashtile.kernels.decode import MAX_BLOCK_M, _combine_kernel, _decode_kernel, decode_config
from flashtile.kernels.kv_append import _kv_append_kernel

LOG2E = 1.4426950408889634
H200_SMS = 132  # the split heuristic's target when no CUDA device is there to ask (interpreter)

# Tests pin a tiny config here: (BLOCK_N, num_warps, num_stages).
CONFIG_OVERRIDE: tuple[int, int, int] | None = None
# The Triton decode kernel's own append (one launch fewer per step) instead of the separate append kernel
# first. Off: it made the decode kernel 5-8 us longer at b = 1 / 8
# (probe_decode_append_leaseC_h200_2026-12-01_session19.json), where the separate kernel costs less in an 8-layer
# graph (b = 1, 8k: 17.3-17.4 against 22.1 us a call; decode_fused_append_ab_leaseC_h200_2026-12-01_session19.json).
# FLASHTILE_DECODE_FUSED_APPEND=1 (read at import) turns it on; tests run both. The Gluon kernel's own append is
# separate (decode_gluon.FUSED_APPEND).
FUSED_APPEND = bool(env.switch("FLASHTILE_DECODE_FUSED_APPEND"))
# The split merge inside the decode kernel (the last split to finish merges; one launch fewer):
# off until it has run on the GPU (a cross-program handshake the interpreter cannot stress).
# FLASHTILE_DECODE_FUSED_COMBINE=1 turns it on for experiments.
FUSED_COMBINE = env.get("FLASHTILE_DECODE_FUSED_COMBINE", "0") not in ("", "0")
# Tensor-descriptor (TMA) loads of the K and V tiles of a contiguous cache's unmasked key blocks
# (kernels/decode.py _decode_inner), instead of pointer loads. Measured on the H200 in 8-layer graphs
# (decode_layers8_small_tma_ab_h200_2026-11-30_session10.json, five runs 0 1 0 1 0; and
# decode_layers8_tma_ab_..._session10.json): faster where a program reads few key blocks (b = 1 at 8k
# 16.2 -> 15.8 us, b = 8 at 16k 125.7 -> 125.1, b = 32 at 8k 242.6 -> 240.7), mixed at 128 blocks
# (b = 32 at 16k even, b = 8 at 32k 0.3% slower) and 0.3%-0.9% slower from 256 (b = 8 at 64k / 128k,
# b = 32 at 32k-128k). So by default a launch takes them when each program reads at most
# TMA_MAX_BLOCKS_PER_PROGRAM blocks (capacity / BLOCK_N / splits), on sm_90 (the measured GPU), when
# the head dim fills its tile (d = 32 / 64 / 128 / 256; at d = 128 the GPU tests found them bitwise
# equal to pointer loads, and a padded d rounds differently in the interpreter). Eager and captured
# calls choose alike: a kernel first compiled inside a CUDA-graph capture could not be loaded there.
# Page-aligned paged caches (pages of whole tiles, e.g. 256 tokens) of 2 bytes per element (the
# measured ones) take them where a program reads at most PAGED_TMA_MAX_BLOCKS_PER_PROGRAM blocks:
# bf16 256-token pages in 8-layer graphs
# (decode_layers8_p256_tma_ab_h200_2026-11-30_session11.json, 0 1 0 1) went from 17.3 / 17.4 to 16.9
# us at b = 1, 8k (4 blocks per program), 25.3 -> 25.0 at 16k (8), 70.0 -> 69.7 at 64k (32) and
# 69.5 -> 69.4 at b = 8, 8k (32), but 129.0 -> 129.3 at b = 8, 16k (64 blocks).
# FLASHTILE_DECODE_TMA=1 / 0 forces them on (sm_90+) / off; tests pin TMA_OVERRIDE (True runs it
# under the interpreter too).
TMA_OVERRIDE: bool | None = None
TMA_MAX_BLOCKS_PER_PROGRAM = 64
PAGED_TMA_MAX_BLOCKS_PER_PROGRAM = 32


def use_decode_tma(k_cache: torch.Tensor, v_cache: torch.Tensor, paged: bool, *, blocks_per_program: int,
                   d_fills_block: bool, page_aligned: bool = False) -> bool:
    """Load the interior key blocks by tensor descriptor? 16- / 32-bit caches whose base and strides
    TMA can address (fp8 caches: not tested with it), contiguous (one row per batch row) or paged with
    ``page_aligned`` tiles (every key tile inside one page); by default where ``blocks_per_program``
    (key blocks one program reads at the cache's capacity) is small (the paged limit is lower) and the
    head dim fills its power-of-two tile (``d_fills_block``), on sm_90; forced on for sm_90+ GPUs, or
    the interpreter by TMA_OVERRIDE."""
    # the cheap refusals first: a small-page call (most of a server's) pays no device or env lookups
    if paged and not page_aligned:
        return False
    if TMA_OVERRIDE is None:
        forced = env.switch("FLASHTILE_DECODE_TMA")
        most = PAGED_TMA_MAX_BLOCKS_PER_PROGRAM if paged else TMA_MAX_BLOCKS_PER_PROGRAM
        # paged pools: measured with 2-byte caches only, so by default only those
        unmeasured = paged and k_cache.element_size() != 2
        if forced is False or (forced is None and (blocks_per_program > most or not d_fills_block or unmeasured)):
            return False
        if k_cache.device.type != "cuda" or torch.version.hip is not None:
            return False
        major = capability(k_cache.device)[0]
        if major < 9 or (forced is None and major != 9):
            return False
    elif not TMA_OVERRIDE:
        return False
    # _tma_ok also refuses empty tensors
    return k_cache.dtype != FP8_DTYPE and _tma_ok(k_cache) and _tma_ok(v_cache)


# Small-page gather by page: power-of-two pages smaller than the key tile, without left padding, let
# an unmasked tile read its BLOCK_N / page_size table entries and spread them to its keys in registers,
# instead of one table entry per key (kernels/decode.py _key_offsets, PAGES_PER_TILE; the loop body's
# PTX shrinks by a quarter at 16-token pages). Measured on the H200 with 16-token pages in 8-layer
# graphs (decode_layers8_p16_gather_ab_h200_2026-11-30_session11.json, 0 1 0 1; ..._b8_b32_...: 0 1):
# faster in every row, b = 1 8k 18.96 / 18.98 -> 18.74 / 18.72 us, 64k 72.3 -> 71.7, b = 8 8k 71.9 ->
# 71.6, and b = 32 8k (64-key tiles) 267.4 -> 252.1. On by default; FLASHTILE_DECODE_PAGE_GATHER=0
# turns it off; tests pin PAGE_GATHER_OVERRIDE.
PAGE_GATHER_OVERRIDE: bool | None = None


def pages_per_tile(paged: bool, page_size: int, block_n: int, has_leftpad: bool) -> int:
    """PAGES_PER_TILE of a launch: block_n // page_size where the by-page gather applies, else 0."""
    on = PAGE_GATHER_OVERRIDE
    if on is None:
        on = env.switch("FLASHTILE_DECODE_PAGE_GATHER") is not False
    if not (on and paged and not has_leftpad and 0 < page_size < block_n and page_size & (page_size - 1) == 0):
        return 0
    return block_n // page_size


def cache_descriptor(x: torch.Tensor, block_n: int, block_d: int):
    """A (batch, capacity, kv heads, d) cache's (or a (pages, page_size, kv heads, d) pool's)
    descriptor with box [1, block_n, 1, block_d].

    Built without TensorDescriptor's own checks, which use_decode_tma has made (_tma_ok: non-empty,
    16-byte aligned base and strides; a cache's last stride is 1): on this project's CPU they took
    over twice the time of the construction itself, on every eager decode call
    (tests/test_decode_tma.py compares the fields with the checked constructor's)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides = x, list(x.shape), list(x.stride())
    desc.block_shape, desc.padding = [1, block_n, 1, block_d], "zero"
    return desc


# Warps for long programs: single-call sweeps on the H200 found (128 keys, 8 warps, 3 stages) faster
# than the table's 4 warps at b = 32 from 64k: 3722 against 3749 us at 128k
# (tune_decode_b32_warps_h200_2026-11-30_session10.json), 3803 / 3811 against 3835 / 3836 in session
# 11's alternated sweep (tune_decode_long_h200_2026-11-30_session11.json, where b = 8 at 128k tied:
# 960.7 / 959.5 against 960.7 / 960.5), 1903 against 1924 at 64k (tune_decode_b32_h200_2026-11-29.json);
# 0.3% slower at 8k (64 blocks per program). So on sm_90 contiguous-cache programs of at least
# LONG_PROGRAM_BLOCKS key blocks take 8 warps, in the measured shape only (``measured``: d = 128,
# 128-key tiles, a 2-byte cache that is not fp8; other head dims and dtypes keep the table's warps
# until measured). FLASHTILE_DECODE_LONG_WARPS=0 keeps the table's warps, =4 / =8 forces that count on
# long programs of any shape and GPU.
LONG_PROGRAM_BLOCKS = 256
LONG_PROGRAM_WARPS = 8


def long_program_warps(blocks_per_program: int, paged: bool, num_warps: int, arch: str = "default",
                       measured: bool = False) -> int:
    """The warps of a decode launch whose programs read ``blocks_per_program`` key blocks; ``measured``:
    the launch has the shape the rule was measured on (d = 128, 128-key tiles, a bf16 / fp16 cache)."""
    setting = env.get("FLASHTILE_DECODE_LONG_WARPS", "")
    if setting not in ("", "0", "4", "8"):  # checked on every call, not only on the long ones it would change
        raise ValueError(f"FLASHTILE_DECODE_LONG_WARPS must be 4 or 8 (or 0: the table's; unset: the measured "
                         f"rule), got {setting!r}")
    if setting == "0" or paged or blocks_per_program < LONG_PROGRAM_BLOCKS:
        return num_warps
    if setting == "":
        return LONG_PROGRAM_WARPS if arch == "sm90" and measured else num_warps
    return int(setting)


# Pipeline depth of grids of more than one wave, unsplit (programs = b * kv heads * query-row blocks >
# SMs, e.g. b = 32 with 8 kv heads: 256 programs on 132 SMs). At the table's 3 stages a program holds
# 139 KB of shared memory, one CTA per SM, so such a grid runs in two waves; at 2 stages two or three
# fit per SM (as cuDNN's 86 KB decode kernel, 256 CTAs at b = 32, Nsight Compute:
# ncu_decode_h200_2026-11-30_session12.txt). In 8-layer graphs beside cuDNN, two runs alternated
# (decode_b32_stages_h200_2026-11-30_session12.json): b = 32 at 8k 240.9 / 240.7 -> 238.8 / 238.8 us,
# 32k 937.6 / 938.4 -> 931.9 / 931.8, 128k (8 warps) 3723.9 / 3726.0 -> 3708.0 / 3708.6; single-call
# graphs (tune_decode_occupancy_h200_2026-11-30_session12.json) 252.2 / 252.6 -> 250.6 / 250.7 at 8k.
# A grid of one wave or less gains no CTAs per SM from it, only a shallower pipeline: at b = 1 (128
# programs, split) 2 stages lost at every split count (decode_b1_occupancy_h200_2026-11-30_session12.json).
# So on sm_90, unsplit launches of more programs than SMs on a contiguous cache take GRID_FULL_STAGES,
# in the measured shape only (``measured``: d = 128, 128-key tiles, 16-row query tiles, a 2-byte cache
# that is not fp8); paged launches were not measured with it, and of the grids it takes only 256
# programs (b = 32, 8 kv heads) were. FLASHTILE_DECODE_STAGES, when set,
# replaces the table's stages in launch_config and turns this rule off.
GRID_FULL_STAGES = 2


def grid_full_stages(programs: int, sms: int, num_splits: int, paged: bool, num_stages: int,
                     arch: str = "default", measured: bool = False) -> int:
    """The pipeline stages of a decode launch of ``programs`` programs per split on ``sms`` SMs (see
    GRID_FULL_STAGES)."""
    # the cheap refusals first: split and paged launches (most of a server's) pay no second env lookup
    if paged or num_splits != 1 or programs <= sms or arch != "sm90" or not measured:
        return num_stages
    return num_stages if env.get("FLASHTILE_DECODE_STAGES", "") else GRID_FULL_STAGES


# Programmatic dependent launch (sm_90+): the decode and merge kernels are launched with CUDA's
# programmatic-stream-serialisation attribute and wait (griddepcontrol.wait) before their first
# read, so each can be scheduled while the kernel before it drains; within a CUDA graph of decode
# calls that hides part of every launch gap. Bitwise equal to ordinary launches on the H200
# (tests/test_gpu_decode_pdl.py, session 7). In 8-layer graphs it took 6% off b = 1 at 8k and 4% at
# 16k, nothing at 64k, and cost about 1% from b = 1 at 128k and b = 8 at 32k
# (benchmarks/results/decode_layers8_pdl_{off,on}_h200_2026-11-30.json), so by default it is on while
# the K and V a call reads (at the cache's capacity) are at most PDL_MAX_KV_BYTES: b = 1 up to 64k and
# b = 8 at 8k for 8 kv heads of d = 128 in bf16. fp8 caches were not run with it on a GPU, so they
# take it only when forced. FLASHTILE_DECODE_PDL=1 / 0 forces it on / off; tests pin PDL_OVERRIDE.
PDL_OVERRIDE: bool | None = None
PDL_MAX_KV_BYTES = 256 << 20
# Calls whose new keys the separate append kernel wrote just before (a serving step) on at most PDL_APPEND_MAX_ROWS
# (batch row, kv head) pairs take it up to PDL_APPEND_MAX_KV_BYTES: the append and decode kernels then both launch as
# dependents. Session 28, 8-layer graphs of serving steps (bench decode --new-tokens 1), us a call:
# - lease A28 (pdl_append_leaseA28_h200_2026-12-02_session28.json), the rule before / both forced, twice: b = 1, 128k
#   128.6 / 126.5 (H27 too: 128.4 / 126.5); b = 2, 64k 128.1 / 126.7-126.8, 128k even (245.9 / 245.8); but b = 4
#   (32 pairs) 245.9 / 249.0 at 64k and 479.3 / 488.2-488.7 at 128k, and b = 8 1.2%-2% slower from 32k. The decode
#   kernels alone forced gained nothing (b = 1, 128k 128.2), nor did the append alone (F27).
# - lease B28 (pdl_append_rule_leaseB28_...json), this rule without the byte bound / FLASHTILE_DECODE_PDL=0, twice,
#   contiguous and 16- / 256-key pages: b = 1 126.3-126.4 / 128.4-128.5 at 128k (pages 129.9-130.1 / 131.9-132.0 and
#   127.9-128.0 / 129.8-129.9), 244.0-244.1 / 246.1 at 256k; b = 2 126.8-126.9 / 128.0-128.1 at 64k, even at 128k
#   (1 GB), but 482.7-482.9 / 479.7-479.8 at 256k (2 GB; pages 0.4%-0.7% slower too), hence the bound.
PDL_APPEND_MAX_ROWS = 16
PDL_APPEND_MAX_KV_BYTES = 1 << 30
# Split calls that use_pdl leaves on ordinary launches still launch their merge as a programmatic dependent (since
# session 30): the split kernel, built with its release after the key loop but launched in order, lets the merge land
# while its last tiles drain. Only the merge lands early, so the next call's split grid is placed as usual (the
# suspected cost of PDL on large grids, session 28). In 8-layer graphs, against ordinary launches, 0 1 0 1, the mean
# of each pair's two runs, us a call:
# - lease B30, a normal board (merge_pdl{,_pages}_leaseB30_h200_2026-12-02_session30.json): 0.05-0.23 faster on the
#   contiguous cache (b = 1, 128k; b = 2, 4, 8 at 16k-128k), 0.0-0.8 with 16- / 256-key pages, slower in no row but
#   b = 8, 128k, which moved within its spread between processes (940.9-967.6 either way; cuDNN spreads as much:
#   cache_placement_leaseC30_...json);
# - lease C30, a full-grid board (merge_pdl_leaseC30_...json): b = 4 0.23 / 0.47 faster at 32k / 128k (b = 1 and 8
#   took PDL there already: row kernels, or b = 1's 128 MB at 32k; their rows moved by up to 0.2, the noise these
#   gains sit at).
# fp8 caches were not measured: only when forced. FLASHTILE_DECODE_MERGE_PDL=0 / 1 turns it off / forces it; unset,
# FLASHTILE_DECODE_PDL=0 (no programmatic dependent launch at all) and a PDL_OVERRIDE of False turn it off too.


def merge_pdl(device: torch.device, pdl_on: bool, num_splits: int, fused_merge: bool, fp8: bool = False) -> bool:
    """Launch this call's merge kernel as a programmatic dependent? Where the whole call is (``pdl_on``); on other
    split calls merged by the merge kernel (not ``fused_merge``) by default (fp8 caches only when forced)."""
    forced = env.switch("FLASHTILE_DECODE_MERGE_PDL")  # read on every call: a bad value raises wherever it is set
    if pdl_on:
        return True
    if num_splits <= 1 or fused_merge or PDL_OVERRIDE is False:
        return False
    if forced is None:
        forced = not fp8 and pdl_forced() is not False
    return forced and pdl_capable(device)


def capacity_of(k_cache, block_table) -> int:
    """Keys a row can hold: the cache's second dimension, or a paged row's pages x the page size."""
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


def cache_bytes(b: int, capacity: int, k_cache) -> int:
    """The K and V bytes of ``b`` rows of ``capacity`` keys in ``k_cache``'s dtype (what use_pdl's rule is keyed on)."""
    return 2 * b * capacity * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()


def use_pdl(device: torch.device, kv_bytes: int, fp8: bool = False, appended_rows: int = 0) -> bool:
    """Launch this call's decode (and merge) kernels as programmatic dependents? ``kv_bytes``: the K
    and V bytes of the cache the call may read (batch x capacity x kv heads x head dim x 2 x itemsize);
    ``fp8``: an e4m3 cache (not measured with it: only when forced); ``appended_rows``: batch x kv heads
    of a call whose new keys the separate append kernel writes first (0: no such append), which takes
    it on at most PDL_APPEND_MAX_ROWS of them up to PDL_APPEND_MAX_KV_BYTES."""
    on = pdl_forced()
    if on is None:
        serving_step = 0 < appended_rows <= PDL_APPEND_MAX_ROWS and kv_bytes <= PDL_APPEND_MAX_KV_BYTES
        on = (kv_bytes <= PDL_MAX_KV_BYTES or serving_step) and not fp8
    return bool(on) and pdl_capable(device)


def pdl_forced() -> bool | None:
    """PDL_OVERRIDE, else FLASHTILE_DECODE_PDL (0: off, anything else set: on); None: the measured rules decide."""
    if PDL_OVERRIDE is not None:
        return PDL_OVERRIDE
    setting = env.get("FLASHTILE_DECODE_PDL", "")
    return None if setting == "" else setting != "0"


def pdl_capable(device: torch.device) -> bool:
    """Can kernels on ``device`` be launched as programmatic dependents? griddepcontrol is NVIDIA's, from sm_90
    (a ROCm MI300 also reports capability 9.x)."""
    return device.type == "cuda" and torch.version.hip is None and capability(device) >= (9, 0)

# Per-device int32 counters of the fused merge, zero between calls (each merger resets its own).
# Grown, never freed: a captured CUDA graph keeps the address it was captured with.
_COUNTERS: dict = {}
_RETIRED: list = []


def _merge_counters(device: torch.device, n: int) -> torch.Tensor | None:
    # one set per stream: calls running concurrently on two streams must not share counters
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # no allocation inside a capture: that call uses the combine kernel
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 1024), device=device, dtype=torch.int32)
        _COUNTERS[key] = buf
    return buf
# A split of fewer key blocks than this costs more in the combine than it gains in parallelism.
MIN_BLOCKS_PER_SPLIT = 2
MAX_SPLITS = 128
# A program's start-up (its first loads' latency, before the pipeline streams) in key-block loads,
# for num_splits_heuristic's time model: it makes a second wave cost more than halving the blocks.
START_BLOCKS = 1
SPLIT_SLACK = 0.03
# A grid of at least this many programs per SM is not split.
SPLIT_FREE_FILL = 0.8


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return H200_SMS
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _arch(device: torch.device) -> str:
    if device.type != "cuda":
        return "interpret"
    return "sm90" if capability(device)[0] == 9 else "default"


@functools.lru_cache(maxsize=4096)  # pure function of a few ints, called on every decode step
def num_splits_heuristic(programs: int, key_blocks: int, sms: int, max_splits: int = MAX_SPLITS) -> int:
    """How many ways to split the keys: the count whose slowest SM has the least to do.

    ``programs`` = batch * kv heads * query-row blocks; ``key_blocks`` = cache capacity / BLOCK_N (an
    upper bound on a row's key blocks: actual lengths live on the device and are not read). Split s
    gives every program cdiv(key_blocks, s) key blocks (the kernel cuts a row's blocks into equal,
    block-aligned shares) and the grid cdiv(programs * s, sms) waves (a 128-key launch holds one CTA
    per SM). The time is modelled as waves * (blocks per program + START_BLOCKS), START_BLOCKS being
    a program's start-up (its first loads' latency) in block loads; the fewest splits within
    SPLIT_SLACK of the least time win. A grid that already fills most SMs is not split.

    The old rule (fewest splits within 85% of the best wave efficiency) took 15 splits for 8 kv heads
    on 132 SMs: 5 blocks for the slowest program at 8k keys where 16 splits give every program 4.
    """
    if programs <= 0 or programs >= SPLIT_FREE_FILL * sms:
        return 1
    limit = max(1, min(max_splits, sms, key_blocks // MIN_BLOCKS_PER_SPLIT))
    costs = [cdiv(programs * s, sms) * (cdiv(key_blocks, s) + START_BLOCKS) for s in range(1, limit + 1)]
    least = min(costs)
    # the fewest splits within SPLIT_SLACK of the least: many-wave grids round their way to near ties
    # that more partial results and merge work would lose
    return next(s for s, c in enumerate(costs, 1) if c <= least * (1 + SPLIT_SLACK))


def _table_knob(name: str, allowed: tuple[str, ...], table: int) -> int:
    """An A/B knob replacing a value of the decode config table: unset, the table's ``table``."""
    setting = env.get(name, "")
    if not setting:
        return table
    if setting not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)} (unset: the table's), got {setting!r}")
    return int(setting)


def launch_config(arch: str, block_d: int, paged: bool, cache_elem_bytes: int, page_size: int = 0,
                  grid_full: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of a decode launch: the table's row, adjusted for the layout.

    The table is tuned for 2-byte caches; fp32 caches halve BLOCK_N so a pipeline stage holds as
    many bytes (and fits sm_90's shared memory; tests/test_sm90_compile.py checks these configs).
    Small pages (< 64 tokens) on a grid that fills the GPU unsplit take 64-key tiles: measured
    (tune_decode_b32_h200_2026-11-29.json, b=32, 16-token pages) 1.08x of contiguous at 64 keys
    against 1.20x at 128, while split launches (b <= 8) ran faster with 128.
    FLASHTILE_DECODE_STAGES=1..4 replaces the table's stages (for A/B runs in ``bench decode``); set, it
    also turns grid_full_stages' rule off. FLASHTILE_DECODE_BLOCK_N=32 / 64 / 128 replaces the table's
    key tile (an A/B knob too; the layout adjustments below still apply). FLASHTILE_DECODE_PAGED_STAGES=1..7
    replaces a paged launch's final depth (after the two stages added below).
    """
    block_n, num_warps, num_stages = decode_config(arch, block_d)
    # experiment knobs: the table's key tile / pipeline depth replaced (paged launches still add two to a
    # depth above 1, and a set depth turns grid_full_stages' rule off)
    block_n = _table_knob("FLASHTILE_DECODE_BLOCK_N", ("32", "64", "128"), block_n)
    num_stages = _table_knob("FLASHTILE_DECODE_STAGES", ("1", "2", "3", "4"), num_stages)
    if cache_elem_bytes >= 4:
        block_n = max(16, block_n // 2)
    if paged and grid_full and page_size < 64 < block_n:
        block_n = 64
    if paged and num_stages > 1:
        # Triton's pipeliner gives the block-table load its own stage ahead of the K/V loads that
        # depend on it: at the contiguous path's depth the K/V tiles got one smem buffer instead of
        # two (sm_90 TTGIR), so half as many bytes in flight. Two more stages restore two buffers.
        num_stages += 2
    if paged:
        # experiment knob: a paged launch's whole depth (sm_90, 128-key bf16 tiles: 5 and 6 give the K/V
        # tiles two smem buffers, 7 gives three, 206 KB; tests/test_sm90_compile.py)
        num_stages = _table_knob("FLASHTILE_DECODE_PAGED_STAGES", ("1", "2", "3", "4", "5", "6", "7"), num_stages)
    return block_n, num_warps, num_stages


def _block_m(rows: int) -> int:
    return min(MAX_BLOCK_M, max(16, next_pow2(rows)))


def kv_append(k_cache, v_cache, k, v, cache_seqlens, cache_len_const, cache_batch_idx, block_table,
              rotary_cos, rotary_sin, rotary_interleaved):
    """Write new k (rotated when cos/sin are given) and v (b, s_new, h_k, d) into the cache in place."""
    b, s_new, h_k, d = k.shape
    if b == 0 or s_new == 0:
        return
    is_fp8 = k.dtype == FP8_DTYPE
    if is_fp8:  # appending e4m3 values is a byte copy (fp8 takes no rotary)
        k_cache, v_cache, k, v = (x.view(torch.uint8) for x in (k_cache, v_cache, k, v))
    paged = block_table is not None
    page_size = k_cache.shape[1]
    capacity = capacity_of(k_cache, block_table)
    rotary_dim = 0 if rotary_cos is None else 2 * rotary_cos.shape[1]
    cos = rotary_cos if rotary_cos is not None else k
    sin = rotary_sin if rotary_sin is not None else k
    dummy = k
    # the bytes the decode kernel after it reads, and its (row, kv head) pairs: the append comes first
    pdl = append_pdl(k, cache_bytes(b, capacity, k_cache), is_fp8, b * h_k)
    with device_guard(k):
        run_kernel(_kv_append_kernel, (s_new * b,),  # flat grid: axis 1 would cap the batch at 65535
            k, v, k_cache, v_cache,
            cache_seqlens if cache_seqlens is not None else dummy,
            cache_batch_idx if cache_batch_idx is not None else dummy,
            block_table if paged else dummy, cos, sin,
            cache_len_const, s_new, h_k, page_size, capacity, cos.shape[0] if rotary_dim else 0,
            *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
            block_table.stride(0) if paged else 0, cos.stride(0) if rotary_dim else 0,
            HEAD_DIM=d, BLOCK_H=next_pow2(h_k), BLOCK_D=max(16, next_pow2(d)),
            HAS_SEQLENS=cache_seqlens is not None, HAS_BATCH_IDX=cache_batch_idx is not None, PAGED=paged,
            ROTARY_DIM=rotary_dim, INTERLEAVED=bool(rotary_interleaved),
            num_warps=4 if h_k * d >= 1024 else 1, **(dict(USE_PDL=True, launch_pdl=True) if pdl else {}),
        )


def append_pdl(k: torch.Tensor, kv_bytes: int, fp8: bool, rows: int) -> bool:
    """Launch the append kernel as a programmatic dependent of the kernel before it? As the decode kernels do
    (use_pdl: caches of at most PDL_MAX_KV_BYTES or appends on at most PDL_APPEND_MAX_ROWS ``rows``, batch x kv
    heads; or FLASHTILE_DECODE_PDL), unless FLASHTILE_DECODE_APPEND_PDL=0 / 1 says. Session 27, 8-layer graphs of
    serving steps that append a key a row (bench decode --new-tokens 1):
    forced on (lease F27, append_pdl_ab_leaseF27_h200_2026-12-02_session27.json) b = 1 6.3%-6.5% faster at 8k / 16k,
    3.8% at 32k, 2.1% at 64k, b = 8 0.9% at 8k, but 0.7%-1.2% slower at b = 32 from 64k (the whole-row kernel), as the
    decode kernels' own PDL costs about 1% on large caches; by this rule (G27, append_pdl_rule_leaseG27_...json) b = 1
    5.9% / 5.9% / 3.7% / 2.3% faster at 8k-64k, b = 8 0.7% at 8k, every other row within 0.1%."""
    forced = env.switch("FLASHTILE_DECODE_APPEND_PDL")
    if forced is not None:
        return forced and pdl_capable(k.device)
    return use_pdl(k.device, kv_bytes, fp8, appended_rows=rows)


def decode_attn(q, k_cache, v_cache, *, s_new, cache_seqlens, cache_len_const, cache_batch_idx, cache_leftpad,
                block_table, rotary_cos, rotary_sin, rotary_interleaved, rotary_per_token, softmax_scale,
                window_left, window_right, softcap, alibi_slopes, num_splits, descales=(None, None, None),
                k_new=None, v_new=None, appended=False):
    """Attention of q (b, sq, h, d) over the (already updated) cache; returns out (b, sq, h, d), lse (b, h, sq).

    fp8 (e4m3) q and caches take ``descales`` = (q, k, v) fp32 (b, h_k) tensors or None (= 1); the
    output is then bf16. ``k_new``/``v_new`` (b, s_new, h_k, d): this call's new keys/values, appended
    by the kernel itself (the cache then is not yet updated when this is called). ``appended``: the separate
    append kernel wrote this call's new keys just before (use_pdl's rule for serving steps).
    """
    b, sq, h, d = q.shape
    h_k = k_cache.shape[2]
    group = h // h_k
    paged = block_table is not None
    page_size = k_cache.shape[1]
    capacity = capacity_of(k_cache, block_table)
    block_d = max(16, next_pow2(d))
    block_m = _block_m(sq * group)
    m_blocks = cdiv(sq * group, block_m)
    arch = _arch(q.device)
    programs, sms = b * h_k * m_blocks, num_sms(q.device)  # programs per split
    # (a grid of at least 0.8 x SMs is not split; grid_full_stages asks for more than 1 x SMs)
    grid_full = programs >= SPLIT_FREE_FILL * sms
    block_n, num_warps, num_stages = CONFIG_OVERRIDE or launch_config(
        arch, block_d, paged, k_cache.element_size(), page_size, grid_full)

    is_fp8 = q.dtype == FP8_DTYPE
    out = torch.empty(q.shape, device=q.device, dtype=torch.bfloat16) if is_fp8 else torch.empty_like(q)
    lse = torch.empty(b, h, sq, device=q.device, dtype=torch.float32)
    if b == 0 or sq == 0:
        return out, lse
    if is_fp8:
        ones = None
        ds = []
        for x in descales:
            if x is None:
                ones = ones if ones is not None else torch.ones(b, h_k, device=q.device, dtype=torch.float32)
                x = ones
            ds.append(x.contiguous())  # one (h_k, 1) stride pair serves all three in the kernel
        q_ds, k_ds, v_ds = ds
    else:
        q_ds = k_ds = v_ds = lse
    key_blocks = cdiv(max(capacity, 1), block_n)
    if num_splits <= 0:
        num_splits = num_splits_heuristic(programs, key_blocks, sms)
    num_splits = max(1, min(num_splits, MAX_SPLITS, key_blocks))
    blocks_per_program = cdiv(key_blocks, num_splits)
    if CONFIG_OVERRIDE is None:
        measured = d == 128 and block_n == 128 and k_cache.element_size() == 2 and not is_fp8
        num_warps = long_program_warps(blocks_per_program, paged, num_warps, arch, measured)
        num_stages = grid_full_stages(programs, sms, num_splits, paged, num_stages, arch, measured and block_m == 16)
    counters = None
    if num_splits > 1 and FUSED_COMBINE:
        counters = _merge_counters(q.device, programs)
    if num_splits > 1:
        o_part, lse_part = split_partials(num_splits, b, sq, h, d, q.device)
        ops = o_part.stride()[:4]
        lps = lse_part.stride()[:3]
    else:
        o_part, lse_part = out, lse
        ops, lps = (0, 0, 0, 0), (0, 0, 0)

    rotary_dim = 0 if rotary_cos is None else 2 * rotary_cos.shape[1]
    fused = k_new is not None and k_new.shape[1] > 0
    qk_scale = softmax_scale / softcap if softcap > 0 else softmax_scale * LOG2E
    alibi = alibi_slopes
    dummy = lse
    # the interior of a tile lies in one page only when pages are whole tiles and nothing shifts them
    page_aligned = paged and page_size % block_n == 0 and cache_leftpad is None
    # flat grid: batch * kv heads on axis 1 or 2 would be capped at 65535
    grid = (num_splits * programs,)
    pdl_on = use_pdl(q.device, cache_bytes(b, capacity, k_cache), is_fp8, appended_rows=b * h_k if appended else 0)
    merge_early = merge_pdl(q.device, pdl_on, num_splits, counters is not None, is_fp8)
    # a kernel built with USE_PDL but launched in order waits on nothing at its top (griddepcontrol.wait returns at
    # once) and still releases its merge after its key loop
    pdl = dict(USE_PDL=True, launch_pdl=True) if pdl_on else dict(USE_PDL=True) if merge_early else {}
    tma = use_decode_tma(k_cache, v_cache, paged, blocks_per_program=blocks_per_program, d_fills_block=block_d == d,
                         page_aligned=page_aligned)
    desc_k, desc_v = ((cache_descriptor(k_cache, block_n, block_d), cache_descriptor(v_cache, block_n, block_d))
                      if tma else (k_cache, v_cache))
    # FLASHTILE_DECODE_PIPELINE_EDGES=1: the masked edge loops software-pipelined as the interior is (the
    # kernel's behaviour before session 15; an A/B knob)
    edges = {"PIPELINE_EDGES": True} if env.switch("FLASHTILE_DECODE_PIPELINE_EDGES") else {}
    with device_guard(q):
        launch(
            _decode_kernel, grid,
            q, k_cache, v_cache, out, lse, o_part, lse_part,
            cache_seqlens if cache_seqlens is not None else dummy,
            cache_batch_idx if cache_batch_idx is not None else dummy,
            cache_leftpad if cache_leftpad is not None else dummy,
            block_table if paged else dummy,
            alibi if alibi is not None else dummy,
            rotary_cos if rotary_dim else dummy, rotary_sin if rotary_dim else dummy,
            q_ds, k_ds, v_ds, k_new if fused else dummy, v_new if fused else dummy,
            counters if counters is not None else dummy, desc_k, desc_v,
            qk_scale, softcap, window_left, window_right,
            cache_len_const, s_new, sq, h_k, group, page_size, rotary_cos.shape[0] if rotary_dim else 0, m_blocks,
            capacity,
            # one stride() call per tensor: each stride(i) call costs host time on every decode step
            *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:3], *lse.stride()[:2],
            *ops, *lps,
            block_table.stride(0) if paged else 0,
            0 if alibi is None or alibi.dim() == 1 else alibi.stride(0),
            rotary_cos.stride(0) if rotary_dim else 0, q_ds.stride(0) if is_fp8 else 0,
            *(k_new.stride()[:3] if fused else (0, 0, 0)), *(v_new.stride()[:3] if fused else (0, 0, 0)),
            HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            PAGED=paged, PAGE_ALIGNED=page_aligned,
            PAGES_PER_TILE=pages_per_tile(paged, page_size, block_n, cache_leftpad is not None),
            PAGE_SHIFT=page_size.bit_length() - 1 if paged and page_size & (page_size - 1) == 0 else -1,
            HAS_SEQLENS=cache_seqlens is not None,
            HAS_BATCH_IDX=cache_batch_idx is not None, HAS_LEFTPAD=cache_leftpad is not None,
            HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, HAS_SOFTCAP=softcap > 0,
            HAS_ALIBI=alibi is not None, ROTARY_DIM=rotary_dim, ROTARY_INTERLEAVED=bool(rotary_interleaved),
            ROTARY_PER_TOKEN=bool(rotary_per_token),
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", IS_FP8=is_fp8, FUSED_NEW=fused,
            FUSED_COMBINE=counters is not None,
            num_warps=num_warps, num_stages=num_stages, **pdl, **({"USE_TMA": True} if tma else {}), **edges,
            **decode_rows.seqlens_policy(cache_seqlens),
        )
    if num_splits > 1 and counters is None:
        combine(o_part, lse_part, out, lse, pdl=merge_early)
    return out, lse


def split_partials(num_splits: int, b: int, sq: int, h: int, d: int, device: torch.device):
    """Unfilled fp32 partial results of a split launch, as ``combine`` merges them: out_partial
    (num_splits, b, sq, h, d) and lse_partial (num_splits, b, h, sq)."""
    return (torch.empty(num_splits, b, sq, h, d, device=device, dtype=torch.float32),
            torch.empty(num_splits, b, h, sq, device=device, dtype=torch.float32))


def combine(out_partial, lse_partial, out, lse, pdl: bool = False):
    """Merge splits: out_partial (ns, b, sq, h, d), lse_partial (ns, b, h, sq) -> out (b, sq, h, d), lse (b, h, sq).

    ``pdl``: launch it as a programmatic dependent of the split kernel just launched (see use_pdl)."""
    ns, b, sq, h, d = out_partial.shape
    if b * sq * h == 0:
        return out, lse
    extra = dict(USE_PDL=True, launch_pdl=True) if pdl else {}
    with device_guard(out):
        run_kernel(_combine_kernel, (b * sq * h,),  # flat grid: the batch on axis 1 would be capped at 65535
            out_partial, lse_partial, out, lse,
            ns, sq, h,
            *out_partial.stride()[:4],
            *lse_partial.stride()[:4],
            *out.stride()[:3],
            *lse.stride(),
            HEAD_DIM=d, BLOCK_S=max(2, next_pow2(ns)), BLOCK_D=max(16, next_pow2(d)),
            num_warps=combine_warps(ns, d), **extra,
        )
    return out, lse


# One warp a merge program while its partials are at most 1024 values (at d = 128: up to 8 splits). With more warps
# the reduction over the splits crosses warps through shared memory: at b = 32 with 4 splits (1024 programs of 4
# warps) Nsight Compute found L1 / shared memory 70% busy, and inside 8-layer graphs one warp took the merge from
# 4.4 to 2.0 us, and from 1.7 to 1.5 at b = 8 with 2 splits (lease D21, session 21; scripts/probe_decode_timeline.py,
# benchmarks/results/decode_timeline_combine_warps_leaseD21_*.json). As calls in 8-layer graphs it was 0.8%-1.4%
# faster at b = 2 / 8 with 8k-32k keys and even from there (decode_combine_warps_ab_leaseE21_*.json). Larger merges
# (b = 1's 16-132 splits) keep the warps they had, as they would hold too many values a thread.
COMBINE_ONE_WARP_VALUES = 1024


def combine_warps(num_splits: int, d: int) -> int:
    """The merge kernel's warps for ``num_splits`` partials of head dim ``d`` (FLASHTILE_DECODE_COMBINE_WARPS=N
    forces N, for experiments)."""
    forced = env.count("FLASHTILE_DECODE_COMBINE_WARPS", 1, 8)
    if forced is not None:
        return forced
    if max(2, next_pow2(num_splits)) * max(16, next_pow2(d)) <= COMBINE_ONE_WARP_VALUES:
        return 1
    return 4 if d >= 128 else 2


def _aliases_cache(new: tuple, caches: tuple) -> bool:
    """Whether any new k/v tensor lives in a cache's storage (a host-side pointer compare)."""
    cache_ptrs = {c.untyped_storage().data_ptr() for c in caches}
    return any(x.untyped_storage().data_ptr() in cache_ptrs for x in new)


def _gluon_decode_route(q, k_cache, v_cache, k, v, rotary_cos, cache_seqlens, cache_len_const, cache_batch_idx,
                        cache_leftpad, block_table, softmax_scale, window_left, softcap, alibi_slopes, num_splits,
                        s_new, forced, splits):
    """The call on the Gluon warps-along-keys kernel when it covers it and the rule (or ``forced``, the knob set
    to 1) picks it (backends/triton/decode_gluon.py); None otherwise. ``splits``: the split rule's answer for this
    call (decode_gluon.requested_splits, asked once by the caller; None unsplit)."""
    arch = _arch(q.device)
    if arch != "sm90" and not forced:  # most calls off Hopper stop here, before any other host work
        return None
    b, sq, h, d = q.shape
    h_k = k_cache.shape[2]
    sms = num_sms(q.device)
    # a heuristic call whose unsplit grid is too small for the rule runs split where the split rule (or
    # FLASHTILE_DECODE_GLUON_SPLITS) says so, and the rule and the coverage see the split grid
    programs = b * h_k * (splits or 1)
    rule = dict(capacity=k_cache.shape[1], programs=programs, sms=sms, d=d)
    appending = decode_gluon.FUSED_APPEND and k is not None and s_new > 0 and not splits
    # the rule next: a few integer compares, where small grids and short caches stop
    if not forced and not decode_gluon.by_rule(**rule, appends=appending):
        return None
    # the kernel appends the new keys itself (decode_gluon.FUSED_APPEND), unless they share the
    # caches' storage (then one program's writes could land in slots another reads as new keys: the separate
    # kernel reads and writes each slot once, one launch more, and the rule's bound is the one without appends)
    fused = appending and not _aliases_cache((k, v), (k_cache, v_cache))
    if not forced and appending and not fused and not decode_gluon.by_rule(**rule):
        return None
    why = decode_gluon.refusal(
        arch=arch, dtype=q.dtype, cache_dtype=k_cache.dtype, d=d, sq=sq, group=h // h_k,
        paged=block_table is not None, batch_idx=cache_batch_idx is not None, leftpad=cache_leftpad is not None,
        window_left=window_left, softcap=softcap, alibi=alibi_slopes is not None, rotary=rotary_cos is not None,
        num_splits=num_splits, grid_full=programs >= SPLIT_FREE_FILL * sms,
        aligned=decode_gluon.aligned(k_cache, v_cache))
    if why is not None:
        return None
    if not fused:
        _append_first(k_cache, v_cache, k, v, cache_seqlens, cache_len_const, s_new)
    return decode_gluon.gluon_decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                     cache_len_const=cache_len_const, s_new=s_new, softmax_scale=softmax_scale,
                                     k_new=k if fused else None, v_new=v if fused else None, splits=splits or 1)


def _append_first(k_cache, v_cache, k, v, cache_seqlens, cache_len_const, s_new, block_table=None) -> None:
    """The separate append kernel, for the kernels that read the new keys from the cache (caches without rotary or
    batch index, paged through ``block_table`` or not: the routes that call this cover nothing else)."""
    if k is not None and s_new > 0:
        kv_append(k_cache, v_cache, k, v, cache_seqlens, cache_len_const, None, block_table, None, None, False)


def _plain_call(cache_batch_idx, cache_leftpad, block_table, window_left, softcap, alibi_slopes, rotary_cos) -> bool:
    """No batch index, left padding, paging, left window edge, softcap, ALiBi or rotary."""
    return (cache_batch_idx is None and cache_leftpad is None and block_table is None and window_left < 0
            and softcap <= 0 and alibi_slopes is None and rotary_cos is None)


def kvcache_fwd(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len_const, cache_batch_idx,
                cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap,
                rotary_interleaved, alibi_slopes, num_splits, descales=(None, None, None)):
    """The whole call on the Triton kernels: append (+ rotary on k), then split-KV attention (+ rotary on q)."""
    s_new = 0 if k is None else k.shape[1]
    # the whole-row kernel (contiguous or paged caches): FLASHTILE_DECODE_ROWS=H every covered call, 0 none, unset
    # its rule
    plain_or_paged = _plain_call(cache_batch_idx, cache_leftpad, None, window_left, softcap, alibi_slopes, rotary_cos)
    plain = plain_or_paged and block_table is None
    rows = decode_rows.requested()
    sms = num_sms(q.device)
    streamk = False
    gluon = decode_gluon.requested()  # FLASHTILE_DECODE_GLUON_WARP_KEYS: 1 every covered call, 0 none, unset the rule
    # the split Gluon rule (decode_gluon.requested_splits) comes before the whole-row kernels' rule: it was faster
    # on every grid it takes (b = 4-16 with 8 kv heads from 32k keys); what its kernel does not cover goes on below,
    # without asking the Gluon route again (it would refuse the same call the same way)
    # asked once a call, and only where a Gluon route can take the call (Hopper, or the kernel forced): both route
    # calls below take this answer
    splits = (decode_gluon.requested_splits(q.shape[0] * k_cache.shape[2], sms, k_cache.shape[1])
              if num_splits <= 0 and gluon is not False and (gluon or _arch(q.device) == "sm90") else None)
    split_first = rows is None and plain and gluon is None and bool(splits)
    if split_first:
        done = _gluon_decode_route(q, k_cache, v_cache, k, v, rotary_cos, cache_seqlens, cache_len_const,
                                   cache_batch_idx, cache_leftpad, block_table, softmax_scale, window_left, softcap,
                                   alibi_slopes, num_splits, s_new, forced=False, splits=splits)
        if done is not None:
            return done
    if rows is None and plain_or_paged:
        arch = _arch(q.device)
        rule = dict(arch=arch, b=q.shape[0], h_k=k_cache.shape[2], d=q.shape[3],
                    capacity=capacity_of(k_cache, block_table), num_splits=num_splits, sms=sms,
                    page_size=0 if block_table is None else k_cache.shape[1])
        # H100s (132 SMs: the SXM, as measured) have their own b = 32 bounds (decode_rows.H100_BAND); the name is
        # read once per device
        h100 = arch == "sm90" and sms == board.MEASURED_SMS and board.h100(q.device)
        rows = decode_rows.by_rule(**rule, h100=h100)
        # boards where grids that leave SMs idle read slower take their own rule; the board is measured (once,
        # board.py) only for calls whose kernel it changes
        if plain and sms == board.MEASURED_SMS:
            full = decode_rows.full_grid_rule(normal=rows, **rule)
            if full != (rows, False) and board.full_grid_board(q.device):
                rows, streamk = full
    if rows and plain_or_paged and decode_rows.covers(q, k_cache, v_cache, rows, block_table):
        _append_first(k_cache, v_cache, k, v, cache_seqlens, cache_len_const, s_new, block_table)
        return decode_rows.rows_decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                       cache_len_const=cache_len_const, s_new=s_new, softmax_scale=softmax_scale,
                                       heads=rows, sms=sms, block_table=block_table, streamk=streamk)
    # FLASHTILE_DECODE_GLUON_ROWS=1: the whole-row Gluon kernels, an experiment (off by default)
    if decode_gluon_rows.requested() and plain \
            and decode_gluon_rows.refusal(q, k_cache, v_cache, _arch(q.device)) is None:
        _append_first(k_cache, v_cache, k, v, cache_seqlens, cache_len_const, s_new)
        return decode_gluon_rows.gluon_rows_decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                                   cache_len_const=cache_len_const, s_new=s_new,
                                                   softmax_scale=softmax_scale, sms=num_sms(q.device))
    if gluon is not False and not split_first:
        done = _gluon_decode_route(q, k_cache, v_cache, k, v, rotary_cos, cache_seqlens, cache_len_const,
                                   cache_batch_idx, cache_leftpad, block_table, softmax_scale, window_left, softcap,
                                   alibi_slopes, num_splits, s_new, forced=bool(gluon), splits=splits)
        if done is not None:
            return done
    # With FUSED_APPEND (off by default) the decode kernel appends by itself, unless it has no program to do it
    # (no query rows), or the new k/v share storage with the caches: then the kernel's writer could rotate slots
    # that other programs still read as new keys (the separate kernel reads and writes each slot in one program).
    fused = (FUSED_APPEND and s_new > 0 and q.numel() > 0
             and not _aliases_cache((k, v), (k_cache, v_cache)))
    appended = k is not None and s_new > 0 and not fused  # the separate append kernel writes the new keys first
    if appended:
        kv_append(k_cache, v_cache, k, v, cache_seqlens, cache_len_const, cache_batch_idx, block_table,
                  rotary_cos, rotary_sin, rotary_interleaved)
    rotary_per_token = causal or window_left >= 0 or window_right >= 0
    return decode_attn(q, k_cache, v_cache, s_new=s_new, cache_seqlens=cache_seqlens,
                       cache_len_const=cache_len_const, cache_batch_idx=cache_batch_idx,
                       cache_leftpad=cache_leftpad, block_table=block_table, rotary_cos=rotary_cos,
                       rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                       rotary_per_token=rotary_per_token, softmax_scale=softmax_scale,
                       window_left=window_left, window_right=window_right, softcap=softcap,
                       alibi_slopes=alibi_slopes, num_splits=num_splits, descales=descales,
                       k_new=k if fused else None, v_new=v if fused else None, appended=appended)
