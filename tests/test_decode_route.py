"""Decode routing, one table: ``select_route`` against fake device properties (backends/triton/decode/route.py).

Each row is a call (device, batch, cache capacity, cache layout, dtype, new tokens, other shape fields) and the route
it takes, written as ``kernel`` and its knobs. The H200 and H100 rows are the routes the kernels were measured on
(32 query / 8 kv heads of d = 128 unless a row says otherwise; docs/inference.md, 'Routes'); an A100 stands for
GPUs without Hopper's kernels, and the interpreter for the CPU suite. Calls with ``qv`` or a value head dim of their own
(``MLA``: DeepSeek's latent head, one kv head of d = 64 and dv = 512 for 128 query heads) take the MLA kernel.
"""

import pytest
import torch

from flashtile import config
from flashtile.backends.triton.decode import route as R

PROPS = {
    "H200": R.DeviceProps(capability=(9, 0), sm_count=132, total_memory_gib=139.8),
    "H100": R.DeviceProps(capability=(9, 0), sm_count=132, total_memory_gib=79.6),
    "A100": R.DeviceProps(capability=(8, 0), sm_count=108, total_memory_gib=79.2),
    "interp": R.INTERPRETER,
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
KEYS = {"4k": 4096, "8k": 8192, "16k": 16384, "32k": 32768, "64k": 65536, "96k": 98304, "128k": 131072}
MLA = {"h": 128, "h_k": 1, "d": 64, "dv": 512, "qv": True}


def describe(r: R.Route) -> str:
    parts = [r.kernel] + [f"heads={r.heads}"] * (r.kernel == "rows") + [f"splits={r.splits}"]
    parts += [f"m={r.block_m}"] * (r.kernel in ("split", "mla"))
    parts += [f"n={r.block_n}", f"warps={r.warps}", f"stages={r.stages}"]
    parts += [f for f in ("tma", "pdl", "merge_pdl", "append_pdl", "append_in_kernel") if getattr(r, f)]
    return " ".join(parts + [f"gather={r.pages_per_tile}"] * bool(r.pages_per_tile))


def route_of(device, b, keys, cache="contig", dtype="bf16", new=0, extra=None, **settings):
    extra = dict(extra or {})
    page = 0 if cache == "contig" else int(cache[1:])
    shape = R.DecodeShape(b, extra.pop("sq", 1), extra.pop("h", 32), extra.pop("h_k", 8), extra.pop("d", 128),
                          KEYS.get(keys, keys), new, extra.pop("num_splits", 0), extra.pop("plain", True),
                          extra.pop("leftpad", False), head_dim_v=extra.pop("dv", 0), qv=extra.pop("qv", False))
    assert not extra, extra
    return R.select_route(shape, DTYPES[dtype], page > 0, page, PROPS[device], **settings)


# device, b, keys, cache ("contig" or "p<page size>"), dtype, new tokens, other DecodeShape fields: the route
TABLE = [
    ('H200', 1, '8k', 'contig', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=3 tma pdl merge_pdl'),
    ('H200', 1, '32k', 'contig', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=3 tma pdl merge_pdl'),
    ('H200', 1, '128k', 'contig', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=3 tma merge_pdl'),
    ('H200', 8, '8k', 'contig', 'bf16', 0, {}, 'split splits=2 m=16 n=128 warps=4 stages=3 tma pdl merge_pdl'),
    ('H200', 8, '32k', 'contig', 'bf16', 0, {}, 'gluon splits=4 n=64 warps=4 stages=1 merge_pdl'),
    ('H200', 8, '128k', 'contig', 'bf16', 0, {}, 'gluon splits=4 n=64 warps=4 stages=1 merge_pdl'),
    ('H200', 16, '8k', 'contig', 'bf16', 0, {}, 'split splits=1 m=16 n=128 warps=4 stages=3 tma'),
    ('H200', 16, '32k', 'contig', 'bf16', 0, {}, 'gluon splits=2 n=64 warps=4 stages=1 merge_pdl'),
    ('H200', 16, '128k', 'contig', 'bf16', 0, {}, 'gluon splits=2 n=64 warps=4 stages=1 merge_pdl'),
    ('H200', 32, '8k', 'contig', 'bf16', 0, {}, 'gluon splits=1 n=64 warps=4 stages=1'),
    ('H200', 32, '32k', 'contig', 'bf16', 0, {}, 'gluon splits=1 n=64 warps=4 stages=1'),
    ('H200', 32, '128k', 'contig', 'bf16', 0, {}, 'rows heads=4 splits=2 n=32 warps=4 stages=3 pdl merge_pdl'),
    ('H200', 64, '8k', 'contig', 'bf16', 0, {}, 'rows heads=4 splits=1 n=32 warps=4 stages=3 pdl merge_pdl'),
    ('H200', 64, '32k', 'contig', 'bf16', 0, {}, 'rows heads=4 splits=1 n=32 warps=4 stages=3 pdl merge_pdl'),
    ('H200', 64, '128k', 'contig', 'bf16', 0, {}, 'rows heads=4 splits=1 n=32 warps=4 stages=3 pdl merge_pdl'),
    ('H200', 1, '8k', 'p16', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=5 pdl merge_pdl gather=8'),
    ('H200', 1, '32k', 'p16', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=5 pdl merge_pdl gather=8'),
    ('H200', 1, '128k', 'p16', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=5 merge_pdl gather=8'),
    ('H200', 8, '8k', 'p16', 'bf16', 0, {}, 'split splits=2 m=16 n=128 warps=4 stages=5 pdl merge_pdl gather=8'),
    ('H200', 8, '32k', 'p16', 'bf16', 0, {}, 'split splits=2 m=16 n=128 warps=4 stages=5 merge_pdl gather=8'),
    ('H200', 8, '128k', 'p16', 'bf16', 0, {}, 'split splits=2 m=16 n=128 warps=4 stages=5 merge_pdl gather=8'),
    ('H200', 16, '8k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=8 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H200', 16, '32k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=8 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H200', 16, '128k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=8 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H200', 32, '8k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=4 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H200', 32, '32k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=4 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H200', 32, '128k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=4 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H200', 64, '8k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=2 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H200', 64, '32k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=2 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H200', 64, '128k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=2 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H200', 1, '8k', 'p256', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=5 tma pdl merge_pdl'),
    ('H200', 1, '32k', 'p256', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=5 tma pdl merge_pdl'),
    ('H200', 1, '128k', 'p256', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=5 merge_pdl'),
    ('H200', 8, '8k', 'p256', 'bf16', 0, {}, 'split splits=2 m=16 n=128 warps=4 stages=5 tma pdl merge_pdl'),
    ('H200', 8, '32k', 'p256', 'bf16', 0, {}, 'split splits=2 m=16 n=128 warps=4 stages=5 merge_pdl'),
    ('H200', 8, '128k', 'p256', 'bf16', 0, {}, 'split splits=2 m=16 n=128 warps=4 stages=5 merge_pdl'),
    ('H200', 16, '8k', 'p256', 'bf16', 0, {}, 'split splits=1 m=16 n=128 warps=4 stages=5'),
    ('H200', 16, '32k', 'p256', 'bf16', 0, {}, 'split splits=1 m=16 n=128 warps=4 stages=5'),
    ('H200', 16, '128k', 'p256', 'bf16', 0, {}, 'split splits=1 m=16 n=128 warps=4 stages=5'),
    ('H200', 32, '8k', 'p256', 'bf16', 0, {}, 'rows heads=8 splits=4 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H200', 32, '32k', 'p256', 'bf16', 0, {}, 'rows heads=8 splits=4 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H200', 32, '128k', 'p256', 'bf16', 0, {}, 'rows heads=8 splits=4 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H200', 64, '8k', 'p256', 'bf16', 0, {}, 'rows heads=8 splits=2 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H200', 64, '32k', 'p256', 'bf16', 0, {}, 'rows heads=8 splits=2 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H200', 64, '128k', 'p256', 'bf16', 0, {}, 'rows heads=8 splits=2 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H200', 2, '64k', 'contig', 'bf16', 0, {}, 'split splits=8 m=16 n=128 warps=4 stages=3 tma merge_pdl'),
    ('H200', 4, '64k', 'contig', 'bf16', 0, {}, 'gluon splits=8 n=64 warps=4 stages=1 merge_pdl'),
    ('H200', 32, '64k', 'contig', 'bf16', 0, {}, 'rows heads=4 splits=2 n=32 warps=4 stages=3 pdl merge_pdl'),
    ('H200', 32, '96k', 'contig', 'bf16', 0, {}, 'rows heads=4 splits=2 n=32 warps=4 stages=3 pdl merge_pdl'),
    ('H200', 128, '8k', 'contig', 'bf16', 0, {}, 'rows heads=8 splits=1 n=16 warps=8 stages=3 pdl merge_pdl'),
    ('H200', 1, '8k', 'contig', 'bf16', 1, {},
     'split splits=16 m=16 n=128 warps=4 stages=3 tma pdl merge_pdl append_pdl'),
    ('H200', 1, '128k', 'contig', 'bf16', 1, {},
     'split splits=16 m=16 n=128 warps=4 stages=3 tma pdl merge_pdl append_pdl'),
    ('H200', 32, '8k', 'contig', 'bf16', 1, {}, 'gluon splits=1 n=64 warps=4 stages=1 append_in_kernel'),
    ('H200', 32, '128k', 'contig', 'bf16', 1, {}, 'rows heads=4 splits=2 n=32 warps=4 stages=3 pdl merge_pdl'),
    ('H200', 8, '32k', 'contig', 'bf16', 1, {}, 'gluon splits=4 n=64 warps=4 stages=1 merge_pdl'),
    ('H200', 1, '8k', 'contig', 'fp8', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=3'),
    ('H200', 1, '128k', 'contig', 'fp8', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=3'),
    ('H200', 32, '8k', 'contig', 'fp8', 0, {}, 'split splits=1 m=16 n=128 warps=4 stages=3'),
    ('H200', 32, '128k', 'contig', 'fp8', 0, {}, 'split splits=1 m=16 n=128 warps=4 stages=3'),
    ('H200', 32, '32k', 'contig', 'bf16', 0, {'plain': False}, 'split splits=1 m=16 n=128 warps=8 stages=2'),
    ('H200', 32, '32k', 'contig', 'bf16', 0, {'d': 64}, 'split splits=1 m=16 n=128 warps=4 stages=3'),
    ('H200', 32, '32k', 'contig', 'bf16', 0, {'num_splits': 1}, 'gluon splits=1 n=64 warps=4 stages=1'),
    ('H100', 1, '8k', 'contig', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=3 tma pdl merge_pdl'),
    ('H100', 1, '32k', 'contig', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=3 tma pdl merge_pdl'),
    ('H100', 1, '128k', 'contig', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=3 tma merge_pdl'),
    ('H100', 8, '8k', 'contig', 'bf16', 0, {}, 'split splits=2 m=16 n=128 warps=4 stages=3 tma pdl merge_pdl'),
    ('H100', 8, '32k', 'contig', 'bf16', 0, {}, 'gluon splits=4 n=64 warps=4 stages=1 merge_pdl'),
    ('H100', 8, '128k', 'contig', 'bf16', 0, {}, 'gluon splits=4 n=64 warps=4 stages=1 merge_pdl'),
    ('H100', 16, '8k', 'contig', 'bf16', 0, {}, 'split splits=1 m=16 n=128 warps=4 stages=3 tma'),
    ('H100', 16, '32k', 'contig', 'bf16', 0, {}, 'gluon splits=2 n=64 warps=4 stages=1 merge_pdl'),
    ('H100', 16, '128k', 'contig', 'bf16', 0, {}, 'gluon splits=2 n=64 warps=4 stages=1 merge_pdl'),
    ('H100', 32, '8k', 'contig', 'bf16', 0, {}, 'gluon splits=1 n=64 warps=4 stages=1'),
    ('H100', 32, '32k', 'contig', 'bf16', 0, {}, 'gluon splits=1 n=64 warps=4 stages=1'),
    ('H100', 32, '128k', 'contig', 'bf16', 0, {}, 'rows heads=8 splits=4 n=16 warps=8 stages=3 pdl merge_pdl'),
    ('H100', 64, '8k', 'contig', 'bf16', 0, {}, 'rows heads=4 splits=1 n=32 warps=4 stages=3 pdl merge_pdl'),
    ('H100', 64, '32k', 'contig', 'bf16', 0, {}, 'rows heads=4 splits=1 n=32 warps=4 stages=3 pdl merge_pdl'),
    ('H100', 64, '128k', 'contig', 'bf16', 0, {}, 'rows heads=4 splits=1 n=32 warps=4 stages=3 pdl merge_pdl'),
    ('H100', 1, '8k', 'p16', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=5 pdl merge_pdl gather=8'),
    ('H100', 1, '32k', 'p16', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=5 pdl merge_pdl gather=8'),
    ('H100', 1, '128k', 'p16', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=5 merge_pdl gather=8'),
    ('H100', 8, '8k', 'p16', 'bf16', 0, {}, 'split splits=2 m=16 n=128 warps=4 stages=5 pdl merge_pdl gather=8'),
    ('H100', 8, '32k', 'p16', 'bf16', 0, {}, 'split splits=2 m=16 n=128 warps=4 stages=5 merge_pdl gather=8'),
    ('H100', 8, '128k', 'p16', 'bf16', 0, {}, 'split splits=2 m=16 n=128 warps=4 stages=5 merge_pdl gather=8'),
    ('H100', 16, '8k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=8 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H100', 16, '32k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=8 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H100', 16, '128k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=8 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H100', 32, '8k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=4 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H100', 32, '32k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=4 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H100', 32, '128k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=4 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H100', 64, '8k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=2 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H100', 64, '32k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=2 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H100', 64, '128k', 'p16', 'bf16', 0, {}, 'rows heads=8 splits=2 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H100', 1, '8k', 'p256', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=5 tma pdl merge_pdl'),
    ('H100', 1, '32k', 'p256', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=5 tma pdl merge_pdl'),
    ('H100', 1, '128k', 'p256', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=5 merge_pdl'),
    ('H100', 8, '8k', 'p256', 'bf16', 0, {}, 'split splits=2 m=16 n=128 warps=4 stages=5 tma pdl merge_pdl'),
    ('H100', 8, '32k', 'p256', 'bf16', 0, {}, 'split splits=2 m=16 n=128 warps=4 stages=5 merge_pdl'),
    ('H100', 8, '128k', 'p256', 'bf16', 0, {}, 'split splits=2 m=16 n=128 warps=4 stages=5 merge_pdl'),
    ('H100', 16, '8k', 'p256', 'bf16', 0, {}, 'split splits=1 m=16 n=128 warps=4 stages=5'),
    ('H100', 16, '32k', 'p256', 'bf16', 0, {}, 'split splits=1 m=16 n=128 warps=4 stages=5'),
    ('H100', 16, '128k', 'p256', 'bf16', 0, {}, 'split splits=1 m=16 n=128 warps=4 stages=5'),
    ('H100', 32, '8k', 'p256', 'bf16', 0, {}, 'rows heads=8 splits=4 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H100', 32, '32k', 'p256', 'bf16', 0, {}, 'rows heads=8 splits=4 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H100', 32, '128k', 'p256', 'bf16', 0, {}, 'rows heads=8 splits=4 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H100', 64, '8k', 'p256', 'bf16', 0, {}, 'rows heads=8 splits=2 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H100', 64, '32k', 'p256', 'bf16', 0, {}, 'rows heads=8 splits=2 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H100', 64, '128k', 'p256', 'bf16', 0, {}, 'rows heads=8 splits=2 n=16 warps=8 stages=7 pdl merge_pdl'),
    ('H100', 2, '64k', 'contig', 'bf16', 0, {}, 'split splits=8 m=16 n=128 warps=4 stages=3 tma merge_pdl'),
    ('H100', 4, '64k', 'contig', 'bf16', 0, {}, 'gluon splits=8 n=64 warps=4 stages=1 merge_pdl'),
    ('H100', 32, '64k', 'contig', 'bf16', 0, {}, 'gluon splits=1 n=64 warps=4 stages=1'),
    ('H100', 32, '96k', 'contig', 'bf16', 0, {}, 'rows heads=8 splits=4 n=16 warps=8 stages=3 pdl merge_pdl'),
    ('H100', 128, '8k', 'contig', 'bf16', 0, {}, 'rows heads=8 splits=1 n=16 warps=8 stages=3 pdl merge_pdl'),
    ('H100', 1, '8k', 'contig', 'bf16', 1, {},
     'split splits=16 m=16 n=128 warps=4 stages=3 tma pdl merge_pdl append_pdl'),
    ('H100', 1, '128k', 'contig', 'bf16', 1, {},
     'split splits=16 m=16 n=128 warps=4 stages=3 tma pdl merge_pdl append_pdl'),
    ('H100', 32, '8k', 'contig', 'bf16', 1, {}, 'gluon splits=1 n=64 warps=4 stages=1 append_in_kernel'),
    ('H100', 32, '128k', 'contig', 'bf16', 1, {}, 'rows heads=8 splits=4 n=16 warps=8 stages=3 pdl merge_pdl'),
    ('H100', 8, '32k', 'contig', 'bf16', 1, {}, 'gluon splits=4 n=64 warps=4 stages=1 merge_pdl'),
    ('H100', 1, '8k', 'contig', 'fp8', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=3'),
    ('H100', 1, '128k', 'contig', 'fp8', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=3'),
    ('H100', 32, '8k', 'contig', 'fp8', 0, {}, 'split splits=1 m=16 n=128 warps=4 stages=3'),
    ('H100', 32, '128k', 'contig', 'fp8', 0, {}, 'split splits=1 m=16 n=128 warps=4 stages=3'),
    ('H100', 32, '32k', 'contig', 'bf16', 0, {'plain': False}, 'split splits=1 m=16 n=128 warps=8 stages=2'),
    ('H100', 32, '32k', 'contig', 'bf16', 0, {'d': 64}, 'split splits=1 m=16 n=128 warps=4 stages=3'),
    ('H100', 32, '32k', 'contig', 'bf16', 0, {'num_splits': 1}, 'gluon splits=1 n=64 warps=4 stages=1'),
    ('A100', 1, '8k', 'contig', 'bf16', 0, {}, 'split splits=13 m=16 n=64 warps=4 stages=2'),
    ('A100', 1, '8k', 'p16', 'bf16', 0, {}, 'split splits=13 m=16 n=64 warps=4 stages=4 gather=4'),
    ('A100', 1, '128k', 'contig', 'bf16', 0, {}, 'split splits=27 m=16 n=64 warps=4 stages=2'),
    ('A100', 1, '128k', 'p16', 'bf16', 0, {}, 'split splits=27 m=16 n=64 warps=4 stages=4 gather=4'),
    ('A100', 32, '8k', 'contig', 'bf16', 0, {}, 'split splits=1 m=16 n=64 warps=4 stages=2'),
    ('A100', 32, '8k', 'p16', 'bf16', 0, {}, 'split splits=1 m=16 n=64 warps=4 stages=4 gather=4'),
    ('A100', 32, '128k', 'contig', 'bf16', 0, {}, 'split splits=1 m=16 n=64 warps=4 stages=2'),
    ('A100', 32, '128k', 'p16', 'bf16', 0, {}, 'split splits=1 m=16 n=64 warps=4 stages=4 gather=4'),
    ('A100', 1, '8k', 'contig', 'bf16', 1, {}, 'split splits=13 m=16 n=64 warps=4 stages=2'),
    ('interp', 1, 64, 'contig', 'bf16', 0, {}, 'split splits=2 m=16 n=16 warps=4 stages=1'),
    ('interp', 1, 64, 'p16', 'bf16', 0, {}, 'split splits=2 m=16 n=16 warps=4 stages=1'),
    ('interp', 1, 64, 'p4', 'bf16', 0, {}, 'split splits=2 m=16 n=16 warps=4 stages=1 gather=4'),
    ('interp', 8, 64, 'contig', 'bf16', 0, {}, 'split splits=2 m=16 n=16 warps=4 stages=1'),
    ('interp', 8, 64, 'p16', 'bf16', 0, {}, 'split splits=2 m=16 n=16 warps=4 stages=1'),
    ('interp', 8, 64, 'p4', 'bf16', 0, {}, 'split splits=2 m=16 n=16 warps=4 stages=1 gather=4'),
    ('interp', 2, 64, 'contig', 'bf16', 5, {'sq': 5}, 'split splits=2 m=32 n=16 warps=4 stages=1'),
    ('interp', 1, 48, 'contig', 'fp32', 0, {}, 'split splits=1 m=16 n=16 warps=4 stages=1'),
    # the split kernel's stage, warp, tile and PDL rules
    ('H200', 32, '8k', 'contig', 'bf16', 0, {'plain': False}, 'split splits=1 m=16 n=128 warps=4 stages=2 tma'),
    ('H200', 16, '8k', 'contig', 'bf16', 0, {'plain': False}, 'split splits=1 m=16 n=128 warps=4 stages=3 tma'),
    ('H200', 32, '8k', 'contig', 'bf16', 8, {'sq': 8}, 'split splits=1 m=32 n=128 warps=4 stages=3 tma'),
    ('H200', 32, '8k', 'p256', 'bf16', 0, {'plain': False}, 'split splits=1 m=16 n=128 warps=4 stages=5'),
    ('H200', 32, '8k', 'contig', 'fp32', 0, {}, 'split splits=1 m=16 n=64 warps=4 stages=3'),
    ('H200', 8, '128k', 'contig', 'bf16', 0, {'plain': False}, 'split splits=2 m=16 n=128 warps=8 stages=3 merge_pdl'),
    ('H200', 8, '128k', 'p16', 'bf16', 0, {'plain': False},
     'split splits=2 m=16 n=128 warps=4 stages=5 merge_pdl gather=8'),
    ('H200', 32, '8k', 'p16', 'bf16', 0, {'plain': False}, 'split splits=1 m=16 n=64 warps=4 stages=5 gather=4'),
    ('H200', 2, '128k', 'contig', 'bf16', 1, {}, 'split splits=8 m=16 n=128 warps=4 stages=3 pdl merge_pdl append_pdl'),
    ('H200', 4, '128k', 'contig', 'bf16', 1, {}, 'gluon splits=8 n=64 warps=4 stages=1 merge_pdl'),
    ('H200', 1, 262144, 'contig', 'bf16', 1, {},
     'split splits=16 m=16 n=128 warps=4 stages=3 pdl merge_pdl append_pdl'),
    ('H200', 1, 524288, 'contig', 'bf16', 1, {}, 'split splits=16 m=16 n=128 warps=8 stages=3 merge_pdl'),
    ('H200', 4, '64k', 'contig', 'fp8', 0, {}, 'split splits=4 m=16 n=128 warps=4 stages=3'),
    ('H200', 1, '64k', 'p48', 'bf16', 0, {}, 'split splits=16 m=16 n=128 warps=4 stages=5 pdl merge_pdl'),
    ('H200', 1, '64k', 'p16', 'bf16', 0, {'leftpad': True, 'plain': False},
     'split splits=16 m=16 n=128 warps=4 stages=5 pdl merge_pdl'),
    ('H200', 32, '8k', 'contig', 'bf16', 0, {'d': 64, 'h': 16, 'h_k': 4},
     'split splits=1 m=16 n=128 warps=4 stages=3 tma pdl merge_pdl'),
    # MLA: every device, 64 rows a program (128 heads: two programs side by side), tiles within shared memory
    ('H200', 32, '4k', 'contig', 'bf16', 0, MLA, 'mla splits=2 m=64 n=64 warps=8 stages=2 pdl merge_pdl'),
    ('H200', 32, '32k', 'contig', 'bf16', 0, MLA, 'mla splits=2 m=64 n=64 warps=8 stages=2 merge_pdl'),
    ('H200', 32, '32k', 'p64', 'bf16', 0, MLA, 'mla splits=2 m=64 n=64 warps=8 stages=2 merge_pdl'),
    ('H200', 32, '8k', 'contig', 'bf16', 1, MLA, 'mla splits=2 m=64 n=64 warps=8 stages=2 merge_pdl'),
    ('H200', 64, '8k', 'contig', 'bf16', 0, MLA, 'mla splits=1 m=64 n=64 warps=8 stages=2'),
    ('H200', 128, '32k', 'p64', 'bf16', 0, MLA, 'mla splits=1 m=64 n=64 warps=8 stages=2'),
    ('H200', 1, '32k', 'contig', 'bf16', 0, MLA, 'mla splits=32 m=64 n=64 warps=8 stages=2 pdl merge_pdl'),
    ('H200', 32, '8k', 'contig', 'bf16', 2, dict(MLA, sq=2), 'mla splits=1 m=64 n=64 warps=8 stages=2'),
    ('H200', 32, '8k', 'contig', 'bf16', 0, dict(MLA, h=16), 'mla splits=4 m=16 n=64 warps=4 stages=2 merge_pdl'),
    ('H200', 32, '8k', 'contig', 'bf16', 0, dict(MLA, h=32), 'mla splits=4 m=32 n=64 warps=4 stages=2 merge_pdl'),
    ('H200', 32, '8k', 'contig', 'fp32', 0, MLA, 'mla splits=2 m=64 n=16 warps=8 stages=2 merge_pdl'),
    ('H100', 32, '16k', 'p64', 'bf16', 0, MLA, 'mla splits=2 m=64 n=64 warps=8 stages=2 merge_pdl'),
    ('A100', 32, '8k', 'contig', 'bf16', 0, MLA, 'mla splits=5 m=64 n=32 warps=8 stages=2'),
    ('A100', 32, '8k', 'p64', 'bf16', 0, dict(MLA, h=16), 'mla splits=10 m=16 n=32 warps=4 stages=2'),
    ('A100', 32, '8k', 'contig', 'fp32', 0, MLA, 'mla splits=1 m=32 n=16 warps=8 stages=1'),
    ('H200', 32, '8k', 'contig', 'bf16', 0, {'d': 192, 'dv': 128}, 'mla splits=1 m=16 n=64 warps=4 stages=2'),
    ('H200', 32, '8k', 'contig', 'bf16', 0, {'qv': True}, 'mla splits=1 m=16 n=64 warps=4 stages=2'),
    ('interp', 3, 64, 'contig', 'fp32', 0, dict(MLA, h=16, d=16, dv=64), 'mla splits=2 m=16 n=16 warps=4 stages=1'),
    ('interp', 3, 64, 'p4', 'fp32', 0, dict(MLA, h=16, d=16, dv=64),
     'mla splits=2 m=16 n=16 warps=4 stages=1 gather=4'),
    ('H200', 32, '8k', 'p16', 'bf16', 0, MLA, 'mla splits=2 m=64 n=64 warps=8 stages=2 merge_pdl'),
    ('H200', 32, '8k', 'p16', 'bf16', 0, dict(MLA, h=16), 'mla splits=4 m=16 n=64 warps=4 stages=2 merge_pdl gather=4'),
]


@pytest.mark.parametrize("device,b,keys,cache,dtype,new,extra,expected", TABLE)
def test_default_route(device, b, keys, cache, dtype, new, extra, expected):
    assert describe(route_of(device, b, keys, cache, dtype, new, extra)) == expected


def test_every_kernel_is_on_a_default_route():
    assert {expected.split()[0] for *_, expected in TABLE} == set(R.ROUTE_NAMES)
    assert {name for name, _ in R.ROUTES} == set(R.ROUTE_NAMES)


def test_device_classes():
    assert R.device_props(torch.device("cpu")) is R.INTERPRETER
    assert R.arch(R.INTERPRETER) == "interpret" and R.arch(PROPS["A100"]) == "default"
    assert R.memory_class(PROPS["H100"]) == "80GB" and R.memory_class(PROPS["H200"]) == "141GB"
    assert R.memory_class(PROPS["A100"]) == ""
    # an H100 PCIe (114 SMs) keeps the 132-SM boards' bands out of its rules
    assert R.memory_class(R.DeviceProps((9, 0), 114, 79.6)) == ""


def test_split_heuristic():
    """One row of 8 kv heads on 132 SMs: 16 splits (one wave of 128 programs); eight rows: 2; a full grid: 1."""
    assert R.num_splits_heuristic(8, 64, 132) == 16
    assert R.num_splits_heuristic(64, 64, 132) == 2
    assert R.num_splits_heuristic(256, 64, 132) == 1
    assert route_of("H200", 1, "8k", extra={"num_splits": 4}).splits == 4


@pytest.mark.parametrize("name,device,b,cache,expected", [
    ("split", "H200", 32, "contig", "split"),
    ("rows", "H200", 8, "contig", "rows"),
    ("rows", "interp", 1, "p16", "rows"),
    ("gluon", "H200", 1, "contig", "gluon"),
    ("gluon", "H200", 64, "contig", "gluon"),
])
def test_forced_route(name, device, b, cache, expected):
    r = route_of(device, b, "32k", cache, forced=name)
    assert r.kernel == expected
    if name == "rows":
        assert r.heads == 8  # whole rows where the rule takes no rows
    if name == "gluon":
        assert r.splits == (16 if b == 1 else 1)  # small grids split up to the rule's grid


@pytest.mark.parametrize("name,device,cache,dtype,match", [
    ("gluon", "H200", "p16", "bf16", "cannot take this call; routes for this call: split, rows "),
    ("gluon", "interp", "contig", "bf16", "cannot take this call; routes for this call: split, rows "),
    ("rows", "H200", "contig", "fp8", "routes for this call: split "),
    ("whole-rows", "H200", "contig", "bf16", "is not a decode route"),
])
def test_forced_route_refusals_name_the_setting(name, device, cache, dtype, match):
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_ROUTE") as info:
        route_of(device, 32, "32k", cache, dtype, forced=name)
    assert match in str(info.value) and "split, rows, gluon" in str(info.value)


def test_other_routes_refuse_mla_calls():
    """A forced route other than mla refuses a call with qv or a value head dim of its own, naming mla; mla refuses
    every other call."""
    shape = R.DecodeShape(32, 1, 128, 1, 64, 32768, head_dim_v=512, qv=True)
    props = PROPS["H200"]
    for name in ("split", "rows", "gluon"):
        with pytest.raises(ValueError, match=f"{name}' cannot take this call .*routes for this call: mla "):
            R.select_route(shape, torch.bfloat16, False, 0, props, forced=name)
    assert R.select_route(shape, torch.bfloat16, False, 0, props, forced="mla").kernel == "mla"
    assert R.select_route(shape._replace(qv=False), torch.bfloat16, True, 64, props).kernel == "mla"
    plain = R.DecodeShape(32, 1, 32, 8, 128, 32768)
    with pytest.raises(ValueError, match="'mla' cannot take this call; routes for this call: split, "):
        R.select_route(plain, torch.bfloat16, False, 0, props, forced="mla")


def test_settings_the_tests_pin():
    """decode_tiles: every split launch's (largest BLOCK_M, BLOCK_N, warps, stages), splits counted on them;
    decode_pdl: every decode-side launch a dependent or none; tma: descriptor loads on (interpreter too) or off."""
    r = route_of("H200", 1, "8k", tiles=(16, 32, 2, 1))
    assert (r.block_m, r.block_n, r.warps, r.stages, r.splits) == (16, 32, 2, 1, 16)
    assert route_of("interp", 2, 64, extra={"h": 64, "h_k": 1}, tiles=(16, 16, 4, 1)).block_m == 16
    assert route_of("interp", 2, 64, extra={"h": 64, "h_k": 1}).block_m == 64
    off = route_of("H200", 1, "8k", new=1, pdl=False)
    assert not (off.pdl or off.merge_pdl or off.append_pdl)
    on = route_of("H200", 1, "128k", pdl=True)
    assert on.pdl and on.merge_pdl
    assert not route_of("interp", 1, 64, pdl=True).pdl  # no programmatic dependent launch off NVIDIA's GPUs
    assert route_of("interp", 1, 64, tma=True).tma and not route_of("H200", 1, "8k", tma=False).tma
    assert not route_of("H200", 1, "8k", "p16", tma=True).tma  # a tile spans pages: no descriptor


def test_the_setting_reaches_the_launcher(monkeypatch):
    """kvcache_fwd passes config.get().decode_route to select_route."""
    from flashtile.backends.triton import decode

    seen = []
    real = decode.select_route
    monkeypatch.setattr(decode, "select_route", lambda *a, **k: seen.append(k) or real(*a, **k))
    q = torch.randn(1, 1, 4, 16)
    cache = torch.randn(1, 32, 2, 16)
    with config.override(interpret=True, decode_route="split"):
        decode.kvcache_fwd(q, cache, cache.clone(), None, None, None, None, None, 32, None, None, None, 0.25, False,
                           -1, -1, 0.0, False, None, 0)
    assert seen[-1]["forced"] == "split"
    with config.override(interpret=True, decode_route="gluon"), pytest.raises(ValueError, match="FLASHTILE_DECODE"):
        decode.kvcache_fwd(q, cache, cache.clone(), None, None, None, None, None, 32, None, None, None, 0.25, False,
                           -1, -1, 0.0, False, None, 0)


def test_launchers_follow_the_route(monkeypatch):
    """kvcache_fwd on a stand-in H200 (launches recorded, not run): a serving step at b = 1 launches the append,
    split and merge kernels as programmatic dependents; b = 2 at 64k (over the size rule) only the merge, the split
    kernel built to let it launch early; the Gluon and row routes take their kernels."""
    from flashtile.backends.triton import decode
    from flashtile.backends.triton.decode import append, common, gluon, rows, split

    launches = []

    def record(kernel, grid, *args, **meta):
        launches.append((getattr(kernel, "__name__", None) or kernel.fn.__name__, meta))

    for module in (split, rows):
        monkeypatch.setattr(module, "launch", record)
    for module in (common, append, gluon):
        monkeypatch.setattr(module, "run_kernel", record)
    monkeypatch.setattr(decode, "device_props", lambda device: PROPS["H200"])
    monkeypatch.setattr(decode, "_aliases_cache", lambda new, caches: False)  # meta tensors share no storage

    def call(b, cap, new=0, h=32):
        q = torch.empty(b, 1, h, 128, device="meta", dtype=torch.bfloat16)
        cache = torch.empty(b, cap, 8, 128, device="meta", dtype=torch.bfloat16)
        k = torch.empty(b, new, 8, 128, device="meta", dtype=torch.bfloat16) if new else None
        launches.clear()
        decode.kvcache_fwd(q, cache, torch.empty_like(cache), k, k if k is None else torch.empty_like(k), None, None,
                           torch.empty(b, device="meta", dtype=torch.int32), -1, None, None, None, 0.1, True, -1, 0,
                           0.0, False, None, 0)
        return [(name, bool(m.get("USE_PDL")), bool(m.get("launch_pdl"))) for name, m in launches]

    assert call(1, 131072, new=1) == [("_kv_append_kernel", True, True), ("_decode_kernel", True, True),
                                      ("_combine_kernel", True, True)]
    assert call(8, 8192) == [("_decode_kernel", True, True), ("_combine_kernel", True, True)]
    assert call(2, 65536) == [("_decode_kernel", True, False), ("_combine_kernel", True, True)]
    assert call(32, 8192, new=1) == [("_gluon_decode_warp_keys_kernel", False, False)]  # appends by itself
    assert call(64, 8192) == [("_decode_rows_kernel", True, True), ("_combine_kernel", True, True)]
