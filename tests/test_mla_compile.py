"""The MLA decode kernels compile through ptxas for Hopper (sm_90) and Ampere (sm_80) at the tiles the route picks for
DeepSeek's shape (one latent kv head, d = 64, dv = 512, bf16), within each GPU's shared memory and within the route's
own estimate of it (route.mla_shared_bytes, which sizes the tiles). No GPU is needed: Triton compiles for a named
target (tests/aot_sm90.py)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from flashtile.backends.triton.decode import route

SCRIPT = pathlib.Path(__file__).with_name("aot_sm90.py")
# the largest shared-memory allocation per block
MAX_SHARED = {90: 232448, 80: 166912}
PROPS = {90: route.DeviceProps((9, 0), 132, 139.8), 80: route.DeviceProps((8, 0), 108, 79.2)}
TYPES = {"SEQLENS": "*i32", "BATCH_IDX": "*i32", "LEFTPAD": "*i32", "BLOCK_TABLE": "*i32", "LSE_PART": "*fp32",
         "O_PART": "*fp32", "COS": "*fp32", "SIN": "*fp32", "ALIBI": "*fp32"}


def _compile(tmp_path, arch, module, kernel, constexprs, types, warps, stages) -> dict:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    res = subprocess.run([sys.executable, str(SCRIPT), module, kernel, json.dumps(constexprs), json.dumps(types),
                          str(warps), str(stages), str(arch)], capture_output=True, text=True, env=env, timeout=600)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    words = res.stdout.split()
    return {k: v if k.startswith("LOOP") else int(v) for k, v in zip(words[::2], words[1::2])}


# (arch, batch, query heads, cache: page size or 0)
# (64-token pages are whole tiles; 16-token pages take the by-page gather)
CALLS = [(90, 32, 128, 0), (90, 32, 16, 64), (80, 32, 128, 16)]


@pytest.mark.parametrize("arch,b,h,page", CALLS, ids=[f"sm{a}-b{b}-h{h}-p{p}" for a, b, h, p in CALLS])
def test_mla_kernel_compiles_within_shared_memory(tmp_path, arch, b, h, page):
    shape = route.DecodeShape(b, 1, h, 1, 64, 16384, 1, head_dim_v=512, qv=True)
    r = route.select_route(shape, torch.bfloat16, page > 0, page, PROPS[arch])
    assert r.kernel == "mla" and r.block_m == min(64, h) and r.pages_per_tile == (2 if page == 16 else 0)
    cx = dict(HEAD_DIM=64, HEAD_DIM_V=512, BLOCK_M=r.block_m, BLOCK_N=r.block_n, BLOCK_D=64, BLOCK_DV=512,
              NUM_SPLITS=max(2, r.splits), PAGED=page > 0, PAGE_ALIGNED=page > 0 and page % r.block_n == 0,
              PAGE_SHIFT=page.bit_length() - 1 if page else -1, PAGES_PER_TILE=r.pages_per_tile, HAS_QV=True,
              HAS_SEQLENS=True, HAS_BATCH_IDX=False, HAS_LEFTPAD=False, HAS_LEFT=False,
              HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_ALIBI=False, ROTARY_DIM=64, ROTARY_INTERLEAVED=False,
              ROTARY_PER_TOKEN=True, DOT_PRECISION="tf32", USE_PDL=arch == 90)
    got = _compile(tmp_path, arch, "flashtile.kernels.decode_mla", "_mla_decode_kernel", cx, TYPES, r.warps, r.stages)
    bound = route.mla_shared_bytes(r.block_m, r.block_n, r.stages, 64, 512, 2)
    assert got["SHARED"] <= min(bound, MAX_SHARED[arch]), (got["SHARED"], bound)
    # Hopper's warp-group MMA where a program holds 64 rows (three dots in each of the three key ranges), the
    # 16-row tile on mma.sync; griddepcontrol only in the programmatic-dependent build
    assert got["WGMMA"] == (9 if arch == 90 and r.block_m == 64 else 0)
    assert (got["GDC_WAIT"] > 0, got["GDC_LAUNCH"] > 0) == (arch == 90, arch == 90)
    assert got["CP_ASYNC_16"] > 0, "the key / value tiles must stream by 16-byte cp.async"
    if arch == 80:  # a few registers' worth at most (sm_90's 64-row build spills more, mostly in its edge loops)
        assert got["SPILL_STORES"] <= 32


def test_mla_merge_and_append_compile(tmp_path):
    """The merge of MLA_MAX_SPLITS partials of 512 values keeps them in registers (64 spilled); the append kernel
    of keys and values of different head dims compiles."""
    splits = route.MLA_MAX_SPLITS
    got = _compile(tmp_path, 90, "flashtile.kernels.decode", "_combine_kernel",
                   dict(HEAD_DIM=512, BLOCK_S=splits, BLOCK_D=512), {"O_PART": "*fp32", "LSE_PART": "*fp32"}, 4, 1)
    assert got["SPILL_STORES"] == 0
    got = _compile(tmp_path, 80, "flashtile.kernels.decode_mla", "_kv_append_dv_kernel",
                   dict(HEAD_DIM=64, HEAD_DIM_V=512, BLOCK_H=1, BLOCK_D=64, BLOCK_DV=512, HAS_SEQLENS=True,
                        HAS_BATCH_IDX=False, PAGED=True, ROTARY_DIM=64, INTERLEAVED=False), TYPES, 4, 1)
    assert got["SPILL_STORES"] == 0 and got["SHARED"] == 0
