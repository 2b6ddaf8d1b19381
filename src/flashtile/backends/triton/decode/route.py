"""Which decode kernel runs a ``flash_attn_with_kvcache`` call, and with which knobs: ``select_route``, the one
place a decode route is decided.

A route depends on the call's shape and dtype, the cache's layout and the device's properties (``DeviceProps``:
compute capability, SM count, memory), never on a measurement made at run time. The first row of ``ROUTES`` whose
rule takes the call wins; every bound below is data, and docs/inference.md, 'Routes' says what measured it.

On an H200 (132 SMs, 141 GB), 32 query / 8 kv heads of d = 128 in bf16, one query token, the default split count:

=======================  ==========  ===============  ===========  =================  ===========  ===========
cache (8k keys and up)   b = 1, 2    b = 4, 8         b = 16       b = 32             b = 64       b = 128
=======================  ==========  ===============  ===========  =================  ===========  ===========
contiguous, < 32k keys   split       split            split        gluon              half rows    rows
contiguous, 32k-64k      split       gluon x8 / x4    gluon x2     gluon              half rows    rows
contiguous, >= 64k       split       gluon x8 / x4    gluon x2     half rows          half rows    rows
16-key pages             split       split            rows         rows               rows         rows
256-key pages            split       split            split        rows               rows         rows
fp8, other features      split       split            split        split              split        split
=======================  ==========  ===============  ===========  =================  ===========  ===========

("gluon x4": the Gluon kernel split 4 ways; "rows": whole rows, 8 kv heads a program; "half rows": 4.)
An H100 SXM (132 SMs, 80 GB) differs in one cell: b = 32 on a contiguous cache takes the Gluon kernel below 96k keys
and whole rows from there (``WHOLE_ROW_BAND``). Other GPUs (and Triton's interpreter) take the split kernel. The
split kernel's own knobs (tiles, split count, 8 warps for long programs, 2 stages for grids of more than one wave,
TMA, the by-page gather, programmatic dependent launch) follow the rules in ``split``.

Calls with ``qv`` (multi-head latent attention) or a value head dim of their own (v_cache's last dim differs from
k_cache's) take the MLA kernel on every device, and only it (``mla``): the other kernels read K and V with one head
dim and no ``qv`` term.

A learnable sink changes no cell: every route whose kernel is merged by the combine kernel (rows, Gluon split, and
the split and MLA kernels when split) has the merge add it, and the unsplit split and MLA kernels start their
softmax from it; only the unsplit Gluon kernel has none, so such calls go on down the table (to the split kernel).
An attention chunk is a bound of each row's keys that only the split and MLA kernels apply: chunked calls skip the
rows and Gluon routes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch

from flashtile.backends.triton.host import SM90_SHARED_PER_SM, cdiv, next_pow2
from flashtile.kernels.decode import MAX_BLOCK_M, decode_config
from flashtile.kernels.decode_mla import MLA_MAX_BLOCK_M, mla_config

FP8 = torch.float8_e4m3fn
ROUTE_NAMES = ("split", "rows", "gluon", "mla")
SETTING = "FLASHTILE_DECODE_ROUTE"


@dataclasses.dataclass(frozen=True)
class DeviceProps:
    """What a route may depend on about the device. ``capability`` (0, 0) stands for Triton's interpreter."""

    capability: tuple[int, int]
    sm_count: int
    total_memory_gib: float
    nvidia: bool = True  # programmatic dependent launch and TMA are NVIDIA's (a ROCm MI300 reports 9.x too)


# CPU tensors (Triton's interpreter): the split heuristic plans for an H200's 132 SMs
INTERPRETER = DeviceProps(capability=(0, 0), sm_count=132, total_memory_gib=0.0, nvidia=False)


@functools.cache  # the driver is asked once per device
def _cuda_props(index: int) -> DeviceProps:
    p = torch.cuda.get_device_properties(index)
    return DeviceProps((p.major, p.minor), p.multi_processor_count, p.total_memory / 2**30, torch.version.hip is None)


def device_props(device: torch.device) -> DeviceProps:
    if device.type != "cuda":
        return INTERPRETER
    return _cuda_props(device.index if device.index is not None else torch.cuda.current_device())


def arch(props: DeviceProps) -> str:
    """The key of the kernels' tile tables: "interpret", "sm90" (Hopper) or "default"."""
    if props.capability == (0, 0):
        return "interpret"
    return "sm90" if props.capability[0] == 9 else "default"


def memory_class(props: DeviceProps) -> str:
    """Hopper boards of 132 SMs told apart by memory: "80GB" (an H100 SXM; an H100 NVL's 94 GB too) or "141GB" (an
    H200); "" for every other device."""
    if arch(props) != "sm90" or props.sm_count != 132:
        return ""
    return "80GB" if props.total_memory_gib < 100 else "141GB"


class DecodeShape(NamedTuple):
    """The call as the route sees it (a cheap, hashable tuple built on every call)."""

    batch: int
    seqlen_q: int
    heads: int
    kv_heads: int
    head_dim: int
    capacity: int  # keys a row can hold: the lengths live on the device and are not read
    new_tokens: int = 0  # keys this call appends
    num_splits: int = 0  # the caller's: 0 = the heuristic
    plain: bool = True  # no cache_batch_idx, cache_leftpad, left window edge, softcap, ALiBi or rotary
    leftpad: bool = False
    aligned: bool = True  # caches with 16-byte bases and outer strides multiples of 16 elements (Gluon's copies)
    tma_ok: bool = True  # caches a tensor descriptor can address (tma.tma_ok)
    head_dim_v: int = 0  # v_cache's head dim; 0: the same as head_dim
    qv: bool = False  # the call passes qv (multi-head latent attention)
    sink: bool = False  # the call passes a learnable sink
    chunk: bool = False  # the call passes attention_chunk > 0


def is_mla(s: DecodeShape) -> bool:
    """A call only the MLA kernel computes: it passes qv, or its values have a head dim of their own."""
    return s.qv or s.head_dim_v not in (0, s.head_dim)


@dataclasses.dataclass(frozen=True)
class Route:
    """A decode kernel and its launch knobs."""

    kernel: str  # "split", "rows", "gluon" or "mla"
    splits: int = 1  # key splits, merged by the combine kernel when more than one ("rows": always merged)
    block_m: int = 16  # query rows a program ("split", "mla")
    block_n: int = 16  # keys a tile
    warps: int = 4
    stages: int = 1  # as launched
    heads: int = 0  # "rows": adjacent kv heads a program
    tma: bool = False  # "split": interior key tiles by tensor descriptor
    pages_per_tile: int = 0  # "split": table entries an unmasked tile reads (the by-page gather)
    pdl: bool = False  # the decode kernel launched as a programmatic dependent of the kernel before it
    merge_pdl: bool = False  # the merge launched as a programmatic dependent of the decode kernel
    append_pdl: bool = False  # the separate append kernel launched as a programmatic dependent
    append_in_kernel: bool = False  # "gluon" unsplit: the kernel writes the call's new keys itself


# ---------------------------------------------------------------------------------------------------------------
# The Gluon warps-along-keys kernel (kernels/gluon_decode_warp_keys.py): about two programs on every SM
GLUON_PROGRAMS_PER_SM = 1.9  # batch rows x kv heads (x splits) an SM, at least: b = 32 with 8 kv heads on 132 SMs
GLUON_MIN_CAPACITY = 8192
GLUON_HEAD_DIMS = (64, 128)  # covered; the rule takes the measured d = 128 only
GLUON_RULE_HEAD_DIM = 128
GLUON_MAX_GROUP = 16  # the kernel's 16 query rows
# smaller grids split into the fewest powers of two that reach the bound above, from this capacity, at most this many
GLUON_SPLIT_MIN_CAPACITY = 32768
GLUON_MAX_SPLITS = 8
GLUON_FORCED_MAX_SPLITS = 16

# The whole-row Triton kernel (kernels/decode_rows.py), in the shape it was measured on: Hopper, 8 kv heads of d = 128,
# the heuristic's split count. Bounds: (programs a per-head kernel would have an SM, b x h_k / SMs, at least; capacity
# at least), any of them.
ROWS_KV_HEADS = 8
ROWS_HEAD_DIM = 128
ROW_BOUNDS = {
    "contiguous": ((3.8, 8192), (1.9, 65536)),  # b = 64 and 128 from 8k keys, b = 32 from 64k
    "small pages": ((0.95, 8192),),  # pages of one 16-key tile: b = 16 and up
    "pages": ((1.9, 8192),),  # pages of 32 keys and more: b = 32 and up
}
# contiguous caches the whole-row kernel takes only as half rows: (per SM at least, below, capacity at least)
HALF_ROW_ONLY = ((0.95, 1.0, 131072),)
# Per memory class of 132-SM Hopper boards: (per SM at least, below, capacity) where a contiguous cache takes whole
# rows from that capacity and another kernel (the Gluon one) below it. The H100 SXM's b = 32.
WHOLE_ROW_BAND = {"80GB": (1.9, 2.0, 98304)}
HALF_ROW_HEADS = 4  # contiguous caches, where programs of 4 heads fill the SMs in one wave (b = 32, 64)
ONE_WAVE_SLACK = 8  # idle SMs one wave may leave
# (BLOCK_N, warps, stages) by heads a program; paged caches at 8 heads keep a third buffer of K and V
ROW_CONFIGS = {1: (64, 4, 3), 2: (32, 4, 3), 4: (32, 4, 3), 8: (16, 8, 3)}
PAGED_ROW_CONFIGS = {8: (16, 8, 4), 4: (16, 4, 3)}
ROW_HEAD_DIMS = (16, 32, 64, 128)

# The Triton split-KV kernel (kernels/decode.py): everything else. Its split heuristic's model:
MAX_SPLITS = 128
MIN_BLOCKS_PER_SPLIT = 2  # a split of fewer key blocks costs more in the merge than it gains
START_BLOCKS = 1  # a program's start-up, in key-block loads
SPLIT_SLACK = 0.03  # the fewest splits within this of the least modelled time
SPLIT_FREE_FILL = 0.8  # a grid of at least this many programs an SM is not split
# sm_90, d = 128, 128-key tiles of a 2-byte cache (the measured shape):
LONG_PROGRAM_BLOCKS = 256  # contiguous-cache programs of this many key blocks and more take 8 warps
LONG_PROGRAM_WARPS = 8
GRID_FULL_STAGES = 2  # unsplit contiguous grids of more programs than SMs: 2 stages (2-3 programs an SM)
# interior key tiles by tensor descriptor (sm_90) while a program reads at most this many key blocks
TMA_MAX_BLOCKS_PER_PROGRAM = 64
PAGED_TMA_MAX_BLOCKS_PER_PROGRAM = 32  # pages of whole tiles, 2-byte caches
# Programmatic dependent launch (sm_90+): calls that read at most PDL_MAX_KV_BYTES of K and V, or that append to at
# most PDL_APPEND_MAX_ROWS (batch row, kv head) pairs and read at most PDL_APPEND_MAX_KV_BYTES; not fp8 caches. Split
# calls outside it still launch their merge as a dependent.
PDL_MAX_KV_BYTES = 256 << 20
PDL_APPEND_MAX_ROWS = 16
PDL_APPEND_MAX_KV_BYTES = 1 << 30


# ---------------------------------------------------------------------------------------------------------------
def _gluon_covers(s: DecodeShape, dtype, paged: bool, props: DeviceProps) -> bool:
    """Calls the Gluon kernel computes (whatever the split count): Hopper, one query token of at most 16 query
    heads a kv head, a plain contiguous bf16 / fp16 cache with aligned rows, d = 64 or 128, no chunk (a learnable
    sink only split: the merge adds it)."""
    return (arch(props) == "sm90" and dtype in (torch.bfloat16, torch.float16) and s.head_dim in GLUON_HEAD_DIMS
            and s.seqlen_q == 1 and s.heads // s.kv_heads <= GLUON_MAX_GROUP and not paged and s.plain
            and s.aligned and not is_mla(s) and not s.chunk)


def _gluon_rule(s: DecodeShape, programs: int, props: DeviceProps) -> bool:
    return (s.head_dim == GLUON_RULE_HEAD_DIM and programs >= GLUON_PROGRAMS_PER_SM * props.sm_count
            and s.capacity >= GLUON_MIN_CAPACITY)


def _fewest_gluon_splits(pairs: int, props: DeviceProps) -> int:
    return next_pow2(math.ceil(GLUON_PROGRAMS_PER_SM * props.sm_count / pairs))


def gluon_split(s: DecodeShape, dtype, paged: bool, page_size: int, props: DeviceProps,
                pdl: bool | None = None) -> Route | None:
    """Grids below the Gluon rule's (b = 4-16 with 8 kv heads on 132 SMs) from 32k keys, split up to it."""
    pairs = s.batch * s.kv_heads
    if s.num_splits > 0 or pairs == 0 or pairs >= GLUON_PROGRAMS_PER_SM * props.sm_count:
        return None
    splits = _fewest_gluon_splits(pairs, props)
    if s.capacity < GLUON_SPLIT_MIN_CAPACITY or splits > GLUON_MAX_SPLITS:
        return None
    if not (_gluon_covers(s, dtype, paged, props) and _gluon_rule(s, pairs * splits, props)):
        return None
    return _gluon_route(s, dtype, splits, props, pdl)


def gluon_unsplit(s: DecodeShape, dtype, paged: bool, page_size: int, props: DeviceProps,
                  pdl: bool | None = None) -> Route | None:
    """Grids of about two programs an SM (b = 32 and up with 8 kv heads) from 8k keys, unsplit (no learnable sink:
    the unsplit kernel has no merge to add it in)."""
    if (s.num_splits > 1 or s.sink or not _gluon_covers(s, dtype, paged, props)
            or not _gluon_rule(s, s.batch * s.kv_heads, props)):
        return None
    return _gluon_route(s, dtype, 1, props, pdl)


def _gluon_route(s: DecodeShape, dtype, splits: int, props: DeviceProps, pdl: bool | None = None) -> Route:
    return Route("gluon", splits=splits, block_n=64, warps=4, append_in_kernel=splits == 1 and s.new_tokens > 0,
                 merge_pdl=splits > 1 and _merge_pdl(False, splits, False, props, pdl),
                 append_pdl=_append_pdl(s, dtype, props, pdl))


def _row_heads(s: DecodeShape, paged: bool, page_size: int, props: DeviceProps) -> int:
    """Heads a program where the whole-row kernel's rule takes the call; 0 where it does not."""
    if (arch(props) != "sm90" or s.kv_heads != ROWS_KV_HEADS or s.head_dim != ROWS_HEAD_DIM or s.num_splits != 0
            or not s.plain or is_mla(s)):
        return 0
    per_sm = s.batch * s.kv_heads / props.sm_count
    band = WHOLE_ROW_BAND.get(memory_class(props))
    if band is not None and not paged and band[0] <= per_sm < band[1]:
        return s.kv_heads if s.capacity >= band[2] else 0
    bounds = ROW_BOUNDS["contiguous" if not paged else "small pages" if page_size <= 16 else "pages"]
    whole = any(per_sm >= least and s.capacity >= shortest for least, shortest in bounds)
    half_only = not paged and any(least <= per_sm < most and s.capacity >= shortest
                                  for least, most, shortest in HALF_ROW_ONLY)
    if not (whole or half_only):
        return 0
    if not paged and _one_wave(s.batch * s.kv_heads // HALF_ROW_HEADS, props.sm_count):
        return HALF_ROW_HEADS
    return s.kv_heads if whole else 0


def _rows_cover(s: DecodeShape, dtype, paged: bool, page_size: int, heads: int) -> bool:
    """Calls the whole-row kernel computes with ``heads`` kv heads a program (pages of whole tiles only; no chunk,
    while a learnable sink is the merge's)."""
    if (heads not in ROW_CONFIGS or s.kv_heads % heads or (paged and page_size % _row_config(heads, True)[0])
            or is_mla(s)):
        return False
    return (s.seqlen_q == 1 and s.heads // s.kv_heads <= 16 and s.head_dim in ROW_HEAD_DIMS and s.plain
            and not s.chunk and dtype in (torch.bfloat16, torch.float16))


def rows(s: DecodeShape, dtype, paged: bool, page_size: int, props: DeviceProps,
         pdl: bool | None = None) -> Route | None:
    """Long caches on large batches: a program reads whole key rows (all 8 kv heads) or half rows (4)."""
    heads = _row_heads(s, paged, page_size, props)
    if not heads or not _rows_cover(s, dtype, paged, page_size, heads):
        return None
    return _rows_route(s, dtype, paged, heads, props, pdl)


def _row_config(heads: int, paged: bool) -> tuple[int, int, int]:
    return PAGED_ROW_CONFIGS.get(heads, ROW_CONFIGS[heads]) if paged else ROW_CONFIGS[heads]


def _programs_per_sm(per_stage: int, stages: int) -> int:
    """Programs an SM holds at once, from the shared memory their stages of K and V take."""
    return max(1, SM90_SHARED_PER_SM // max(1, per_stage * stages))


def _filling_splits(programs: int, per_sm: int, sms: int) -> int:
    """The split count that gives ``sms`` SMs ``per_sm`` programs each, nearest."""
    return max(1, round(per_sm * sms / max(1, programs)))


def _one_wave(units: int, sms: int) -> bool:
    """Do ``units`` programs of HALF_ROW_HEADS heads, split to fill the SMs, fill them once within ONE_WAVE_SLACK?"""
    block_n, _, stages = ROW_CONFIGS[HALF_ROW_HEADS]
    per_sm = _programs_per_sm(2 * HALF_ROW_HEADS * block_n * ROWS_HEAD_DIM * 2, stages)
    programs = units * _filling_splits(units, per_sm, sms)
    return sms - ONE_WAVE_SLACK <= programs <= per_sm * sms


def _rows_route(s: DecodeShape, dtype, paged: bool, heads: int, props: DeviceProps, pdl: bool | None = None) -> Route:
    block_n, warps, stages = _row_config(heads, paged)
    units = s.batch * (s.kv_heads // heads)
    per_stage = 2 * heads * block_n * s.head_dim * dtype.itemsize
    splits = _filling_splits(units, _programs_per_sm(per_stage, stages), props.sm_count)
    splits = max(1, min(splits, MAX_SPLITS, cdiv(max(s.capacity, 1), block_n)))
    # a paged build keeps (stages - 1) // 2 buffers of K and V (the block-table load takes its own stages)
    launch_stages = 2 * stages - 1 if paged else stages
    on = _pdl_capable(props) and pdl is not False
    return Route("rows", splits=splits, block_n=block_n, warps=warps, stages=launch_stages, heads=heads, pdl=on,
                 merge_pdl=on, append_pdl=_append_pdl(s, dtype, props, pdl))


@functools.lru_cache(maxsize=4096)  # a pure function of a few ints, called on every decode step
def num_splits_heuristic(programs: int, key_blocks: int, sms: int, max_splits: int = MAX_SPLITS) -> int:
    """How many ways the split kernel cuts the keys: the count whose slowest SM has the least to do.

    ``programs`` = batch x kv heads x query-row blocks; ``key_blocks`` = capacity / BLOCK_N. Split s gives every
    program cdiv(key_blocks, s) blocks and the grid cdiv(programs * s, sms) waves; the time is modelled as waves x
    (blocks a program + START_BLOCKS), and the fewest splits within SPLIT_SLACK of the least time win. A grid that
    already fills most SMs is not split."""
    if programs <= 0 or programs >= SPLIT_FREE_FILL * sms:
        return 1
    limit = max(1, min(max_splits, sms, key_blocks // MIN_BLOCKS_PER_SPLIT))
    costs = [cdiv(programs * s, sms) * (cdiv(key_blocks, s) + START_BLOCKS) for s in range(1, limit + 1)]
    least = min(costs)
    return next(s for s, c in enumerate(costs, 1) if c <= least * (1 + SPLIT_SLACK))


def launch_config(arch_: str, block_d: int, paged: bool, cache_elem_bytes: int, page_size: int = 0,
                  grid_full: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of a split-kernel launch: the table's row (kernels/decode.py), adjusted for
    the layout."""
    block_n, warps, stages = decode_config(arch_, block_d)
    if cache_elem_bytes >= 4:
        block_n = max(16, block_n // 2)  # fp32 caches: a stage holds as many bytes
    if paged and grid_full and page_size < 64 < block_n:
        block_n = 64  # small pages on a grid that fills the GPU unsplit (1.08x contiguous against 1.20x at 128)
    if paged and stages > 1:
        stages += 2  # the block-table load takes a stage ahead of the K / V loads that depend on it
    return block_n, warps, stages


def split(s: DecodeShape, dtype, paged: bool, page_size: int, props: DeviceProps, pdl: bool | None = None, *,
          tiles: tuple | None = None, tma: bool | None = None) -> Route:
    """The Triton split-KV kernel: every call (all features, fp8, any page size, any GPU)."""
    a = arch(props)
    fp8 = dtype == FP8
    itemsize = dtype.itemsize
    block_d = max(16, next_pow2(s.head_dim))
    rows_ = s.seqlen_q * (s.heads // s.kv_heads)
    block_m = min(tiles[0] if tiles else MAX_BLOCK_M, max(16, next_pow2(rows_)))
    programs = s.batch * s.kv_heads * cdiv(rows_, block_m)  # a split's
    sms = props.sm_count
    grid_full = programs >= SPLIT_FREE_FILL * sms
    block_n, warps, stages = tiles[1:] if tiles else launch_config(a, block_d, paged, itemsize, page_size, grid_full)
    key_blocks = cdiv(max(s.capacity, 1), block_n)
    splits = s.num_splits if s.num_splits > 0 else num_splits_heuristic(programs, key_blocks, sms)
    splits = max(1, min(splits, MAX_SPLITS, key_blocks))
    per_program = cdiv(key_blocks, splits)
    measured = a == "sm90" and s.head_dim == 128 and block_n == 128 and itemsize == 2 and not fp8
    if not tiles and measured and not paged:
        if per_program >= LONG_PROGRAM_BLOCKS:
            warps = LONG_PROGRAM_WARPS
        if splits == 1 and programs > sms and block_m == 16:
            stages = GRID_FULL_STAGES
    page_aligned = paged and page_size % block_n == 0 and not s.leftpad
    pdl_on = _use_pdl(s, dtype, props, pdl, appending=s.new_tokens > 0)
    return Route("split", splits=splits, block_m=block_m, block_n=block_n, warps=warps, stages=stages,
                 tma=_use_tma(s, dtype, paged, page_aligned, per_program, block_d == s.head_dim, props, tma),
                 pages_per_tile=_pages_per_tile(s, paged, page_size, block_n),
                 pdl=pdl_on, merge_pdl=_merge_pdl(pdl_on, splits, fp8, props, pdl),
                 append_pdl=_append_pdl(s, dtype, props, pdl))


def _pages_per_tile(s: DecodeShape, paged: bool, page_size: int, block_n: int) -> int:
    """Table entries an unmasked tile reads (the by-page gather): power-of-two pages smaller than a tile, no left
    padding (which would shift tiles off pages); 0 otherwise."""
    if paged and not s.leftpad and 0 < page_size < block_n and page_size & (page_size - 1) == 0:
        return block_n // page_size
    return 0


def _use_tma(s: DecodeShape, dtype, paged: bool, page_aligned: bool, per_program: int, d_fills_block: bool,
             props: DeviceProps, forced: bool | None) -> bool:
    """Interior key tiles by tensor descriptor: contiguous or page-aligned caches on sm_90, where a program reads
    few key blocks and the head dim fills its tile (``forced``: on wherever a descriptor works, sm_90+ or the
    interpreter; off)."""
    if (paged and not page_aligned) or forced is False or dtype == FP8 or not s.tma_ok:
        return False
    if forced:
        return arch(props) == "interpret" or (props.nvidia and props.capability >= (9, 0))
    most = PAGED_TMA_MAX_BLOCKS_PER_PROGRAM if paged else TMA_MAX_BLOCKS_PER_PROGRAM
    return (per_program <= most and d_fills_block and not (paged and dtype.itemsize != 2) and props.nvidia
            and props.capability[0] == 9)


def _pdl_capable(props: DeviceProps) -> bool:
    return props.nvidia and props.capability >= (9, 0)


def _kv_bytes(s: DecodeShape, dtype) -> int:
    return s.batch * s.capacity * s.kv_heads * (s.head_dim + (s.head_dim_v or s.head_dim)) * dtype.itemsize


def _use_pdl(s: DecodeShape, dtype, props: DeviceProps, forced: bool | None, appending: bool) -> bool:
    on = forced
    if on is None:
        kv = _kv_bytes(s, dtype)
        serving_step = appending and 0 < s.batch * s.kv_heads <= PDL_APPEND_MAX_ROWS and kv <= PDL_APPEND_MAX_KV_BYTES
        on = (kv <= PDL_MAX_KV_BYTES or serving_step) and dtype != FP8
    return on and _pdl_capable(props)


def _merge_pdl(pdl_on: bool, splits: int, fp8: bool, props: DeviceProps, forced: bool | None) -> bool:
    if pdl_on:
        return True
    if splits <= 1 or forced is False:
        return False
    return (forced or not fp8) and _pdl_capable(props)


def _append_pdl(s: DecodeShape, dtype, props: DeviceProps, forced: bool | None) -> bool:
    return s.new_tokens > 0 and _use_pdl(s, dtype, props, forced, appending=True)


# ---------------------------------------------------------------------------------------------------------------
# The MLA kernel (kernels/decode_mla.py): calls with qv or a value head dim of their own. A program covers at most
# MLA_MAX_BLOCK_M query rows of one kv head (all 64 heads of a latent head in one program; 128 in two, side by side);
# its tiles come from the kernel's table, shrunk until K, V and the query block fit the device's shared memory:
# the largest allocation a block may make, by compute capability (Hopper and datacenter Blackwell, the A100), and
# the least (sm_86 / sm_89 / sm_120's) on any other device.
MLA_SHARED_BYTES = {(9, 0): SM90_SHARED_PER_SM, (10, 0): SM90_SHARED_PER_SM, (8, 0): 163 * 1024}
MLA_SHARED_LEAST = 99 * 1024
# The merge holds splits x dv fp32 partials in registers: 32 x 512 is 128 a thread on its 4 warps
MLA_MAX_SPLITS = 32


def mla_shared_bytes(block_m: int, block_n: int, stages: int, block_d: int, block_dv: int, itemsize: int) -> int:
    """Shared memory of an MLA launch, at most: ``stages`` buffers of BLOCK_N keys of K and V, and the query block
    (q and qv), which Hopper's warp-group dots read from shared memory."""
    return (stages * block_n + block_m) * (block_d + block_dv) * itemsize


def _mla_tiles(block_m: int, block_d: int, block_dv: int, itemsize: int, props: DeviceProps) -> tuple:
    """(BLOCK_M, BLOCK_N, warps, stages): the table's row for ``block_m`` rows, with fewer keys a tile, then fewer
    stages, then fewer rows, until it fits the device's shared memory (wide heads, fp32 caches)."""
    a = arch(props)
    block_n, warps, stages = mla_config(a, block_m)
    if a == "interpret":
        return block_m, block_n, warps, stages
    budget = MLA_SHARED_BYTES.get(props.capability, MLA_SHARED_LEAST)
    while mla_shared_bytes(block_m, block_n, stages, block_d, block_dv, itemsize) > budget:
        if block_n > 16:
            block_n //= 2
        elif stages > 1:
            stages -= 1
        elif block_m > 16:
            block_m //= 2
        else:
            break
    return block_m, block_n, warps, stages


def mla(s: DecodeShape, dtype, paged: bool, page_size: int, props: DeviceProps, pdl: bool | None = None, *,
        tiles: tuple | None = None) -> Route | None:
    """Calls with qv or a value head dim of their own, on every device: one program per (batch row, kv head, key
    split, block of at most MLA_MAX_BLOCK_M query rows). ``tiles``: the test setting decode_tiles (largest BLOCK_M,
    BLOCK_N, warps, stages)."""
    if not is_mla(s):
        return None
    block_d = max(16, next_pow2(s.head_dim))
    block_dv = max(16, next_pow2(s.head_dim_v or s.head_dim))
    rows_ = s.seqlen_q * (s.heads // s.kv_heads)
    block_m = min(tiles[0] if tiles else MLA_MAX_BLOCK_M, max(16, next_pow2(rows_)))
    if tiles:
        block_n, warps, stages = tiles[1:]
    else:
        block_m, block_n, warps, stages = _mla_tiles(block_m, block_d, block_dv, dtype.itemsize, props)
    programs = s.batch * s.kv_heads * cdiv(rows_, block_m)  # a split's
    key_blocks = cdiv(max(s.capacity, 1), block_n)
    splits = s.num_splits if s.num_splits > 0 else num_splits_heuristic(programs, key_blocks, props.sm_count,
                                                                        MLA_MAX_SPLITS)
    splits = max(1, min(splits, MAX_SPLITS, key_blocks))
    # the by-page gather's registers would make the 64-row Hopper build (8 warps at 255 registers) spill inside its
    # key loop (ptxas: 20 stores and 58 loads a tile at 16-token pages), so it looks each key's page up instead
    gather = 0 if arch(props) == "sm90" and block_m == 64 else _pages_per_tile(s, paged, page_size, block_n)
    pdl_on = _use_pdl(s, dtype, props, pdl, appending=s.new_tokens > 0)
    return Route("mla", splits=splits, block_m=block_m, block_n=block_n, warps=warps, stages=stages,
                 pages_per_tile=gather, pdl=pdl_on,
                 merge_pdl=_merge_pdl(pdl_on, splits, False, props, pdl), append_pdl=_append_pdl(s, dtype, props, pdl))


# The routes, in order: the first that takes the call runs it.
ROUTES = (
    ("mla", mla),  # every device: calls with qv or a value head dim of their own, and only those
    ("gluon", gluon_split),  # Hopper, plain contiguous d = 128, b x h_k below ~2 an SM, >= 32k keys: split to it
    ("rows", rows),  # Hopper, 8 kv heads of d = 128, long caches on large batches (ROW_BOUNDS, WHOLE_ROW_BAND)
    ("gluon", gluon_unsplit),  # Hopper, plain contiguous d = 128, b x h_k >= ~2 an SM, >= 8k keys
    ("split", split),  # everything
)


@functools.lru_cache(maxsize=4096)
def select_route(shape: DecodeShape, dtype: torch.dtype, paged: bool, page_size: int, props: DeviceProps, *,
                 forced: str | None = None, tiles: tuple | None = None, pdl: bool | None = None,
                 tma: bool | None = None) -> Route:
    """The route of a decode call. ``page_size``: 0 for a contiguous cache. ``forced``: a route name
    (FLASHTILE_DECODE_ROUTE) that must take the call; ``tiles``, ``pdl``, ``tma``: the test settings
    ``decode_tiles``, ``decode_pdl`` and ``tma`` (None: the rules')."""
    if forced:
        return _forced(forced, shape, dtype, paged, page_size, props, pdl, tiles, tma)
    if is_mla(shape):
        return mla(shape, dtype, paged, page_size, props, pdl, tiles=tiles)
    for _, rule in ROUTES[1:-1]:
        route = rule(shape, dtype, paged, page_size, props, pdl)
        if route is not None:
            return route
    return split(shape, dtype, paged, page_size, props, pdl, tiles=tiles, tma=tma)


def _forced(name: str, s: DecodeShape, dtype, paged: bool, page_size: int, props: DeviceProps, pdl: bool | None,
            tiles: tuple | None, tma: bool | None) -> Route:
    """The route ``name`` for this call: rows with the rule's heads (else whole rows), Gluon split to its rule's
    grid where the grid is smaller; ValueError where it cannot take the call. A call with qv or a value head dim
    of its own takes the MLA route only, and only such a call does."""
    if is_mla(s):
        if name == "mla":
            return mla(s, dtype, paged, page_size, props, pdl, tiles=tiles)
        what = "is not a decode route" if name not in ROUTE_NAMES else \
            "cannot take this call (it has qv or a value head dim of its own)"
        raise ValueError(f"{SETTING}={name!r} {what}; routes for this call: mla (all routes: {', '.join(ROUTE_NAMES)})")
    pairs = s.batch * s.kv_heads
    small = s.num_splits == 0 and 0 < pairs < GLUON_PROGRAMS_PER_SM * props.sm_count
    gluon_splits = min(GLUON_FORCED_MAX_SPLITS, _fewest_gluon_splits(pairs, props)) if small else 1
    # a learnable sink needs the merge (a split launch)
    gluon_ok = _gluon_covers(s, dtype, paged, props) and s.num_splits <= 1 and not (s.sink and gluon_splits == 1)
    heads = _row_heads(s, paged, page_size, props) or s.kv_heads
    rows_ok = _rows_cover(s, dtype, paged, page_size, heads)
    if name == "gluon" and gluon_ok:
        return _gluon_route(s, dtype, gluon_splits, props, pdl)
    if name == "rows" and rows_ok:
        return _rows_route(s, dtype, paged, heads, props, pdl)
    if name == "split":
        return split(s, dtype, paged, page_size, props, pdl, tiles=tiles, tma=tma)
    allowed = ["split"] + ["rows"] * rows_ok + ["gluon"] * gluon_ok
    what = "is not a decode route" if name not in ROUTE_NAMES else "cannot take this call"
    raise ValueError(f"{SETTING}={name!r} {what}; routes for this call: {', '.join(allowed)} "
                     f"(all routes: {', '.join(ROUTE_NAMES)})")
