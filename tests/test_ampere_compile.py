"""The kernels that Ampere (sm_80, A100) and Ada (sm_89, L4 / RTX 40) calls route to compile there through ptxas, at
the tile configs the launchers pick for them, within the GPU's shared memory (issue 48: FlashAttention 2's home).

No such GPU is lent, so this is what is checked: every call on a GPU other than sm_90 routes to the Triton
kernels (the Gluon kernels, TMA and programmatic dependent launch are Hopper's), with the "default" rows of
the tile tables (kernels/attn_fwd.py, kernels/attn_bwd.py, decode/route.py). A config past the GPU's shared
memory would still run, one pipeline stage shallower at a time (host.launch), but slower; here it must fit.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).with_name("aot_sm90.py")
# the largest shared-memory allocation per block: 163 KiB on sm_80, 99 KiB on sm_86 / sm_89
MAX_SHARED = {80: 166912, 89: 101376}
ARCHS = sorted(MAX_SHARED)
FLAGS = dict(IS_VARLEN=False, HAS_SEQUSED_Q=False, HAS_SEQUSED_K=False, HAS_LEFT=False, HAS_RIGHT=True,
             HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_DROPOUT=False, DOT_PRECISION="tf32")
DECODE_INTS = {"SEQLENS": "*i32", "BATCH_IDX": "*i32", "LEFTPAD": "*i32", "BLOCK_TABLE": "*i32",
               "LSE_PART": "*fp32", "O_PART": "*fp32", "COS": "*fp32", "SIN": "*fp32", "Q_DESCALE": "*fp32",
               "K_DESCALE": "*fp32", "V_DESCALE": "*fp32"}


def _compile(tmp_path, arch, kernel, module, constexprs, types, warps, stages) -> dict:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    res = subprocess.run([sys.executable, str(SCRIPT), module, kernel, json.dumps(constexprs), json.dumps(types),
                          str(warps), str(stages), str(arch)], capture_output=True, text=True, env=env, timeout=600)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    words = res.stdout.split()
    fields = dict(zip(words[::2], words[1::2]))
    shared = int(fields["SHARED"])
    assert shared <= MAX_SHARED[arch], f"sm_{arch} {kernel} {constexprs}: {shared} bytes of shared memory"
    assert int(fields["WGMMA"]) == 0 and int(fields["BULK"]) == 0, "Hopper-only instructions in an sm_8x build"
    return fields


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward_and_backward_tables_compile(tmp_path, arch, d):
    from flashtile.backends.triton.host import arch_of
    from flashtile.kernels.attn_bwd import bwd_configs
    from flashtile.kernels.attn_fwd import fwd_config

    arch_name = _arch_name(arch, arch_of)
    for causal in (False, True):
        bm, bn, warps, stages = fwd_config(arch_name, d, causal, 4096)
        cx = dict(FLAGS, HAS_RIGHT=causal, HAS_DROPOUT=causal, IS_VARLEN=causal, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
                  BLOCK_D=d, RETURN_PROBS=False, USE_TMA=False)
        _compile(tmp_path, arch, "_attn_fwd_kernel", "flashtile.kernels.attn_fwd", cx, {}, warps, stages)
    (bm_kv, bn_kv, w_kv, s_kv), (bm_q, bn_q, w_q, s_q) = bwd_configs(arch_name, d, causal=True, max_seqlen=4096)
    cx = dict(FLAGS, HAS_DROPOUT=True, IS_VARLEN=True, HEAD_DIM=d, BLOCK_D=d)
    _compile(tmp_path, arch, "_attn_bwd_dkdv_kernel", "flashtile.kernels.attn_bwd",
             dict(cx, BLOCK_M=bm_kv, BLOCK_N=bn_kv), {}, w_kv, s_kv)
    _compile(tmp_path, arch, "_attn_bwd_dq_kernel", "flashtile.kernels.attn_bwd",
             dict(cx, BLOCK_M=bm_q, BLOCK_N=bn_q), {}, w_q, s_q)


def _arch_name(arch: int, arch_of) -> str:
    """The tile tables' key a device of this capability gets (host.arch_of, on a faked device)."""
    import flashtile.backends.triton.host as host

    real = host._capability
    host._capability = lambda index: (arch // 10, arch % 10)
    try:
        return arch_of(torch.device("cuda", 0))
    finally:
        host._capability = real


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_route_and_kernels_compile(tmp_path, arch, paged):
    from flashtile.backends.triton.decode import route

    d = 128
    props = route.DeviceProps((arch // 10, arch % 10), 108 if arch == 80 else 58, 40.0)
    for b in (1, 32):  # a small and a large grid: both on the split kernel off Hopper
        r = route.select_route(route.DecodeShape(b, 1, 32, 8, d, 8192), torch.bfloat16, paged, 16 if paged else 0,
                               props)
        assert r.kernel == "split" and not r.tma and not r.pdl, (arch, b, r)
    cx = dict(HEAD_DIM=d, BLOCK_M=64, BLOCK_N=r.block_n, BLOCK_D=d, NUM_SPLITS=4, PAGED=paged, PAGE_ALIGNED=False,
              PAGE_SHIFT=4, PAGES_PER_TILE=r.pages_per_tile, HAS_SEQLENS=True, HAS_BATCH_IDX=False, HAS_LEFTPAD=False,
              HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=True, HAS_ALIBI=True, ROTARY_DIM=d, ROTARY_INTERLEAVED=False,
              ROTARY_PER_TOKEN=True, DOT_PRECISION="tf32", IS_FP8=False)
    _compile(tmp_path, arch, "_decode_kernel", "flashtile.kernels.decode", cx, DECODE_INTS, r.warps, r.stages)
    _compile(tmp_path, arch, "_combine_kernel", "flashtile.kernels.decode", dict(HEAD_DIM=d, BLOCK_S=4, BLOCK_D=d),
             {"O_PART": "*fp32", "LSE_PART": "*fp32"}, 4, 1)
    cx = dict(HEAD_DIM=d, BLOCK_H=8, BLOCK_D=d, HAS_SEQLENS=True, HAS_BATCH_IDX=False, PAGED=paged, ROTARY_DIM=64,
              INTERLEAVED=True)
    _compile(tmp_path, arch, "_kv_append_kernel", "flashtile.kernels.kv_append", cx, DECODE_INTS, 4, 1)


@pytest.mark.parametrize("kernel", ["_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"])
def test_head_dim_of_v_sink_and_chunk_compile(tmp_path, kernel):
    """DeepSeek-V3's head dims (q/k 192, v 128) with a learnable sink and attention_chunk, causal, at the tiles
    the launchers pick off Hopper (the "default" rows, the bucket of the wider tile: 256). sm_80 and sm_89 take
    the same tiles and the same build (mma.sync, cp.async), so one sm_80 build is checked against both GPUs'
    shared memory."""
    from flashtile.backends.triton.host import arch_of
    from flashtile.kernels.attn_bwd import bwd_configs
    from flashtile.kernels.attn_fwd import fwd_config

    assert {_arch_name(arch, arch_of) for arch in ARCHS} == {"default"}
    d, dv, block_d, block_dv = 192, 128, 256, 128
    new = dict(HEAD_DIM=d, BLOCK_D=block_d, HEAD_DIM_V=dv, BLOCK_DV=block_dv, HAS_CHUNK=True)
    if kernel == "_attn_fwd_kernel":
        bm, bn, warps, stages = fwd_config("default", max(block_d, block_dv), True, 4096)
        cx = dict(FLAGS, **new, BLOCK_M=bm, BLOCK_N=bn, RETURN_PROBS=False, USE_TMA=False, HAS_SINK=True)
        module = "flashtile.kernels.attn_fwd"
    else:
        from flashtile.backends.triton.attn_bwd import dq_head_dims

        kv_cfg, q_cfg = bwd_configs("default", max(block_d, block_dv), causal=True, max_seqlen=4096)
        bm, bn, warps, stages = kv_cfg if kernel == "_attn_bwd_dkdv_kernel" else q_cfg
        if kernel == "_attn_bwd_dq_kernel":  # the dQ kernel runs 192 as 128 + 64 columns, as the launcher builds it
            new.update(dq_head_dims(d, dv))
        cx = dict(FLAGS, **new, BLOCK_M=bm, BLOCK_N=bn)
        module = "flashtile.kernels.attn_bwd"
    fields = _compile(tmp_path, 80, kernel, module, cx, {}, warps, stages)
    assert int(fields["SHARED"]) <= min(MAX_SHARED.values()), fields
