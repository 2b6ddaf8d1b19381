"""The bf16 attention kernels must compile for Hopper (sm_90) through ptxas, with their dots on
warp-group MMA, on both load paths. No GPU is needed: Triton compiles for a named target. This
catches GPU-only compile errors (the interpreter executes Python and misses them) in CI."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("aot_sm90.py")
# sm_90's largest shared-memory allocation per block (227 KiB); a kernel past it compiles but
# fails at launch with OutOfResources, which only the GPU run would otherwise show
SM90_MAX_SHARED = 232448
FLAGS = dict(IS_VARLEN=False, HAS_SEQUSED_Q=False, HAS_SEQUSED_K=False, HAS_LEFT=False, HAS_RIGHT=True,
             HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_DROPOUT=False, DOT_PRECISION="tf32")


def _desc(block_rows, d, varlen=False):
    return f"tensordesc<bf16[{block_rows},1,{d}]>" if varlen else f"tensordesc<bf16[1,{block_rows},1,{d}]>"


def _compile(tmp_path, kernel, module, constexprs, types, warps, stages, gdc=None, bulk=None, fields_out=None):
    """Compile; returns the number of warp-group dots. ``gdc``: which griddepcontrol instructions
    (wait, launch_dependents) the build must carry; by default both with USE_PDL, else none.
    ``bulk``: whether the PTX must (True) or must not (False) hold TMA bulk-tensor copies.
    ``fields_out``: a dict that receives every count the compile script printed."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    res = subprocess.run([sys.executable, str(SCRIPT), module, kernel, json.dumps(constexprs), json.dumps(types),
                          str(warps), str(stages)], capture_output=True, text=True, env=env, timeout=600)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    fields = res.stdout.split()
    if fields_out is not None:
        fields_out.update((k, v if k.startswith("LOOP") else int(v)) for k, v in zip(fields[::2], fields[1::2]))
    shared = int(fields[fields.index("SHARED") + 1])
    assert shared <= SM90_MAX_SHARED, f"{kernel} {constexprs} needs {shared} bytes of shared memory"
    # no griddepcontrol unless programmatic dependent launch is asked for
    counts = [int(fields[fields.index(name) + 1]) for name in ("GDC_WAIT", "GDC_LAUNCH")]
    want = list(gdc) if gdc is not None else [bool(constexprs.get("USE_PDL"))] * 2
    assert [n > 0 for n in counts] == want, f"{kernel}: griddepcontrol wait / launch_dependents {counts}"
    if bulk is not None:
        n_bulk = int(fields[fields.index("BULK") + 1])
        assert (n_bulk > 0) == bulk, f"{kernel}: {n_bulk} bulk-tensor copies"
    return int(fields[fields.index("WGMMA") + 1])


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "ptr"])
def test_forward_compiles_for_sm90(tmp_path, tma):
    bm, bn, d = 128, 128, 128
    cx = dict(FLAGS, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d, RETURN_PROBS=False, USE_TMA=tma)
    types = dict(desc_q=_desc(bm, d), desc_k=_desc(bn, d), desc_v=_desc(bn, d)) if tma else {}
    # two dots in each of the three key ranges
    assert _compile(tmp_path, "_attn_fwd_kernel", "flashtile.kernels.attn_fwd", cx, types, 8, 3) == 6


def test_backward_compiles_for_sm90(tmp_path):
    d = 128
    (bm_kv, bn_kv), (bm_q, bn_q) = (64, 128), (128, 64)
    cx = dict(FLAGS, HEAD_DIM=d, BLOCK_M=bm_kv, BLOCK_N=bn_kv, BLOCK_D=d)
    # dK/dV: QK^T, dO V^T, P^T dO, dS^T Q in each of three query ranges
    assert _compile(tmp_path, "_attn_bwd_dkdv_kernel", "flashtile.kernels.attn_bwd", cx, {}, 8, 2) == 12
    cx.update(BLOCK_M=bm_q, BLOCK_N=bn_q)
    # dQ: QK^T, dO V^T, dS K in each of three key ranges
    assert _compile(tmp_path, "_attn_bwd_dq_kernel", "flashtile.kernels.attn_bwd", cx, {}, 8, 2) == 9


@pytest.mark.parametrize("dv", [128, 192])
def test_backward_dq_head_dim_tail_compiles_for_sm90(tmp_path, dv):
    # q / k of 192 as a 128-wide tile and a 64-wide tail (attn_bwd.dq_head_dims), causal, at the sm_90 table's dQ
    # tile for that bucket (256) with the split's own pipeline depth (SPLIT_DQ_STAGES: 3 beside v of 128, 2 beside
    # v of 192), which must fit sm_90's shared memory (_compile checks)
    from flashtile.backends.triton.attn_bwd import dq_head_dims
    from flashtile.kernels.attn_bwd import BWD_CONFIGS, split_dq_stages

    _, (bm, bn, warps, stages) = BWD_CONFIGS[("sm90", 256)]
    dims = dq_head_dims(192, dv)
    stages = split_dq_stages("sm90", dims["BLOCK_DV"], stages)
    assert stages == (3 if dv == 128 else 2)
    cx = dict(FLAGS, BLOCK_M=bm, BLOCK_N=bn, **dims)
    # QK^T (lead and tail), dO V^T, dS K (lead and tail) in each of three key ranges
    assert _compile(tmp_path, "_attn_bwd_dq_kernel", "flashtile.kernels.attn_bwd", cx, {}, warps, stages) == 15


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
def test_backward_table_configs_compile_for_sm90(tmp_path, dropout):
    # the sm_90 table's d = 128 tiles, causal, as short varlen calls take them (the Triton kernels)
    from flashtile.kernels.attn_bwd import BWD_CONFIGS

    (bm_kv, bn_kv, w_kv, s_kv), (bm_q, bn_q, w_q, s_q) = BWD_CONFIGS[("sm90", 128)]
    cx = dict(FLAGS, HEAD_DIM=128, BLOCK_D=128, IS_VARLEN=True, HAS_DROPOUT=dropout)
    assert _compile(tmp_path, "_attn_bwd_dkdv_kernel", "flashtile.kernels.attn_bwd",
                    dict(cx, BLOCK_M=bm_kv, BLOCK_N=bn_kv), {}, w_kv, s_kv) == 12
    assert _compile(tmp_path, "_attn_bwd_dq_kernel", "flashtile.kernels.attn_bwd",
                    dict(cx, BLOCK_M=bm_q, BLOCK_N=bn_q, HEAVY_FIRST=True), {}, w_q, s_q) == 9


def test_backward_pdl_builds_compile_for_sm90(tmp_path):
    # attn_bwd.use_bwd_pdl: the dK/dV kernel only signals (launch_dependents), the dQ kernel launched
    # behind it only waits (at its end)
    d = 128
    cx = dict(FLAGS, HEAD_DIM=d, BLOCK_M=64, BLOCK_N=128, BLOCK_D=d, LAUNCH_DEPENDENTS=True)
    assert _compile(tmp_path, "_attn_bwd_dkdv_kernel", "flashtile.kernels.attn_bwd", cx, {}, 8, 2,
                    gdc=(False, True)) == 12
    cx = dict(FLAGS, HEAD_DIM=d, BLOCK_M=128, BLOCK_N=64, BLOCK_D=d, WAIT_AT_END=True)
    assert _compile(tmp_path, "_attn_bwd_dq_kernel", "flashtile.kernels.attn_bwd", cx, {}, 8, 2,
                    gdc=(True, False)) == 9


def test_forward_unpipelined_edges_compile_for_sm90(tmp_path):
    # PIPELINE_EDGES=False (the launcher's choice on sm_90 at BLOCK_D 64 up to 1024 keys, or forced by
    # config.pipeline_edges=False): the causal right edge loads its blocks directly, so its pipelined
    # copies (prologue and loop, 40 of the pipelined build's 64 16-byte copies here) are gone
    cx = dict(FLAGS, HEAD_DIM=64, BLOCK_M=128, BLOCK_N=64, BLOCK_D=64, RETURN_PROBS=False, USE_TMA=False)
    default, unpipelined = {}, {}
    _compile(tmp_path, "_attn_fwd_kernel", "flashtile.kernels.attn_fwd", cx, {}, 4, 3, fields_out=default)
    _compile(tmp_path, "_attn_fwd_kernel", "flashtile.kernels.attn_fwd", dict(cx, PIPELINE_EDGES=False), {}, 4, 3,
             fields_out=unpipelined)
    assert default["CP_ASYNC_16"] == 64 and unpipelined["CP_ASYNC_16"] == 24, (default, unpipelined)
    assert unpipelined["PIPELINE_BUFFERS"] < default["PIPELINE_BUFFERS"], (default, unpipelined)


def test_backward_unpipelined_edges_compile_for_sm90(tmp_path):
    # config.pipeline_edges=False: the causal edge ranges of the dK/dV and dQ kernels load directly, so their
    # pipelined copies go (d = 64 at the sm_90 table's tiles)
    cx = dict(FLAGS, HEAD_DIM=64, BLOCK_D=64)
    kernels = [("_attn_bwd_dkdv_kernel", dict(BLOCK_M=32, BLOCK_N=128), 2, (24, 8)),
               ("_attn_bwd_dq_kernel", dict(BLOCK_M=128, BLOCK_N=64), 3, (64, 24))]
    for name, tiles, stages, (pipelined, direct) in kernels:
        counts = []
        for extra in ({}, dict(PIPELINE_EDGES=False)):
            fields = {}
            _compile(tmp_path, name, "flashtile.kernels.attn_bwd", dict(cx, **tiles, **extra), {}, 4, stages,
                     fields_out=fields)
            counts.append(fields["CP_ASYNC_16"])
        assert counts == [pipelined, direct], (name, counts)


DECODE_INTS = {"SEQLENS": "*i32", "BATCH_IDX": "*i32", "LEFTPAD": "*i32", "BLOCK_TABLE": "*i32",
               "LSE_PART": "*fp32", "O_PART": "*fp32", "COS": "*fp32", "SIN": "*fp32", "Q_DESCALE": "*fp32",
               "K_DESCALE": "*fp32", "V_DESCALE": "*fp32"}


def _decode_config(d, paged, dtype="bf16"):
    """(BLOCK_N, warps, stages) the split-KV route takes on an H200 for a one-row call of d (paged: 16-key pages)."""
    import torch

    from flashtile.backends.triton.decode import route

    shape = route.DecodeShape(1, 1, 8, 8, d, 8192, plain=False)  # a call only the split kernel takes
    r = route.select_route(shape, torch.float32 if dtype == "fp32" else torch.bfloat16, paged, 16 if paged else 0,
                           route.DeviceProps((9, 0), 132, 139.8))
    return r.block_n, r.warps, r.stages


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_kernels_compile_for_sm90(tmp_path, paged):
    d = 128
    cx = dict(HEAD_DIM=d, BLOCK_M=16, BLOCK_N=64, BLOCK_D=d, NUM_SPLITS=4, PAGED=paged, PAGE_ALIGNED=paged,
              PAGE_SHIFT=8, HAS_SEQLENS=True, HAS_BATCH_IDX=not paged, HAS_LEFTPAD=not paged, HAS_LEFT=False,
              HAS_RIGHT=True,
              HAS_SOFTCAP=False, HAS_ALIBI=False, ROTARY_DIM=d, ROTARY_INTERLEAVED=False, ROTARY_PER_TOKEN=True,
              DOT_PRECISION="tf32", IS_FP8=False)
    # 16-row tiles (one token's GQA group) are below warp-group MMA's 64 rows: Triton uses mma.sync
    # there, fine for a memory-bound kernel. The check is that it compiles through ptxas.
    # paged launches pipeline two stages deeper (the block-table load takes one of its own)
    # with programmatic dependent launch (Route.pdl); the fp8 test below compiles the decode kernel with it too
    _compile(tmp_path, "_decode_kernel", "flashtile.kernels.decode", dict(cx, USE_PDL=True), DECODE_INTS, 4,
             5 if paged else 3)
    cx = dict(HEAD_DIM=d, BLOCK_S=4, BLOCK_D=d)
    _compile(tmp_path, "_combine_kernel", "flashtile.kernels.decode", cx, {"O_PART": "*fp32", "LSE_PART": "*fp32"},
             4, 1)
    # Route.pdl / merge_pdl: both kernels with their griddepcontrol waits
    _compile(tmp_path, "_combine_kernel", "flashtile.kernels.decode", dict(cx, USE_PDL=True),
             {"O_PART": "*fp32", "LSE_PART": "*fp32"}, 4, 1)
    cx = dict(HEAD_DIM=d, BLOCK_H=8, BLOCK_D=d, HAS_SEQLENS=True, HAS_BATCH_IDX=False, PAGED=paged, ROTARY_DIM=64,
              INTERLEAVED=True)
    _compile(tmp_path, "_kv_append_kernel", "flashtile.kernels.kv_append", cx, DECODE_INTS, 4, 1)


def test_decode_pipelines_only_the_interior_loop(tmp_path):
    # b = 1's split launch on 16-token pages (the by-page gather, 5 stages): the pipeliner's buffers are
    # the interior loop's block-table entries, K and V; the masked edge loops (at most two blocks) load
    # directly. Pipelined edges added three buffers per edge loop, whose prologues ran even when the edge
    # was empty: 3.5 us of b = 1, 8k's 18.7 on the H200.
    d = 128
    cx = dict(HEAD_DIM=d, BLOCK_M=16, BLOCK_N=128, BLOCK_D=d, NUM_SPLITS=16, PAGED=True, PAGE_ALIGNED=False,
              PAGE_SHIFT=4, PAGES_PER_TILE=8, HAS_SEQLENS=True, HAS_BATCH_IDX=False, HAS_LEFTPAD=False,
              HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_ALIBI=False, ROTARY_DIM=0,
              ROTARY_INTERLEAVED=False, ROTARY_PER_TOKEN=False, DOT_PRECISION="tf32", IS_FP8=False,
              USE_PDL=True)
    fields = {}
    _compile(tmp_path, "_decode_kernel", "flashtile.kernels.decode", cx, DECODE_INTS, 4, 5, fields_out=fields)
    assert fields["PIPELINE_BUFFERS"] == 3, fields  # 9 with pipelined edges
    assert fields["CP_ASYNC_16"] == 3 * 32, fields  # 32 16-byte copies a tile: two in the prologue, one a step


def test_fp8_cache_decode_compiles_for_sm90(tmp_path):
    # e4m3 q and caches, bf16 output, descales; the tiles are upcast to fp16 for the dots
    d = 128
    cx = dict(HEAD_DIM=d, BLOCK_M=16, BLOCK_N=64, BLOCK_D=d, NUM_SPLITS=1, PAGED=True, PAGE_ALIGNED=False, PAGE_SHIFT=4,
              HAS_SEQLENS=True, HAS_BATCH_IDX=False, HAS_LEFTPAD=False, HAS_LEFT=False, HAS_RIGHT=True,
              HAS_SOFTCAP=False, HAS_ALIBI=False, ROTARY_DIM=0, ROTARY_INTERLEAVED=False, ROTARY_PER_TOKEN=True,
              DOT_PRECISION="tf32", IS_FP8=True,
              PAGES_PER_TILE=4)  # 16-token pages read by page in unmasked tiles (the default)
    types = dict(DECODE_INTS, Q="*fp8e4nv", K="*fp8e4nv", V="*fp8e4nv")
    _compile(tmp_path, "_decode_kernel", "flashtile.kernels.decode", cx, types, 4, 2)
    # and with programmatic dependent launch, which fp8 caches take when forced
    _compile(tmp_path, "_decode_kernel", "flashtile.kernels.decode", dict(cx, USE_PDL=True), types, 4, 2)


@pytest.mark.parametrize("d,paged,dtype", [(128, False, "bf16"), (128, True, "bf16"), (256, True, "bf16"),
                                           (128, True, "fp32")])  # paged: 2 stages deeper, the largest
def test_decode_launch_configs_fit_sm90_shared_memory(tmp_path, d, paged, dtype):
    # the configs the route really picks on sm_90, at their largest shared-memory footprint: a
    # full 64-row query block, full rotary
    block_n, warps, stages = _decode_config(d, paged, dtype)
    # paged: 16-token pages, read by page in unmasked tiles (Route.pages_per_tile)
    cx = dict(HEAD_DIM=d, BLOCK_M=64, BLOCK_N=block_n, BLOCK_D=d, NUM_SPLITS=4, PAGED=paged, PAGE_ALIGNED=False,
              PAGE_SHIFT=4, PAGES_PER_TILE=block_n // 16 if paged else 0, HAS_SEQLENS=True, HAS_BATCH_IDX=False,
              HAS_LEFTPAD=False, HAS_LEFT=False,
              HAS_RIGHT=True, HAS_SOFTCAP=True, HAS_ALIBI=True, ROTARY_DIM=d, ROTARY_INTERLEAVED=False,
              ROTARY_PER_TOKEN=True, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", IS_FP8=False)
    types = dict(DECODE_INTS)
    if dtype == "fp32":
        types.update({name: "*fp32" for name in ("Q", "K", "V", "O")})
    _compile(tmp_path, "_decode_kernel", "flashtile.kernels.decode", cx, types, warps, stages)


@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_decode_tma_compiles_for_sm90(tmp_path, rotary):
    # Route.tma: the unmasked blocks' K / V tiles by descriptor, software-pipelined at the table's
    # config for d = 128 (128 keys, 4 warps, 3 stages), with PDL as the default b = 1 launch has it;
    # ptxas must not crash (it does on the backward's pipelined descriptor loads) and shared memory must fit
    d = 128
    block_n, warps, stages = _decode_config(d, False)
    cx = dict(HEAD_DIM=d, BLOCK_M=16, BLOCK_N=block_n, BLOCK_D=d, NUM_SPLITS=16, PAGED=False, PAGE_ALIGNED=False,
              PAGE_SHIFT=-1, HAS_SEQLENS=True, HAS_BATCH_IDX=False, HAS_LEFTPAD=False, HAS_LEFT=False,
              HAS_RIGHT=rotary, HAS_SOFTCAP=False, HAS_ALIBI=False, ROTARY_DIM=d if rotary else 0,
              ROTARY_INTERLEAVED=False, ROTARY_PER_TOKEN=True, DOT_PRECISION="tf32", IS_FP8=False,
              USE_PDL=True, USE_TMA=True)
    desc = f"tensordesc<bf16[1,{block_n},1,{d}]>"
    _compile(tmp_path, "_decode_kernel", "flashtile.kernels.decode", cx, dict(DECODE_INTS, DESC_K=desc, DESC_V=desc),
             warps, stages, bulk=True)
    # and the same build without descriptors has no bulk copies
    _compile(tmp_path, "_decode_kernel", "flashtile.kernels.decode", dict(cx, USE_TMA=False), DECODE_INTS, warps,
             stages, bulk=False)


def test_decode_long_program_warps_compile_for_sm90(tmp_path):
    # long programs' 8 warps (route.LONG_PROGRAM_WARPS): the table's d = 128 contiguous config on 8 warps,
    # unsplit as at b = 32, must compile and fit shared memory
    d = 128
    block_n, _, stages = _decode_config(d, False)
    cx = dict(HEAD_DIM=d, BLOCK_M=16, BLOCK_N=block_n, BLOCK_D=d, NUM_SPLITS=1, PAGED=False, PAGE_ALIGNED=False,
              PAGE_SHIFT=-1, HAS_SEQLENS=True, HAS_BATCH_IDX=False, HAS_LEFTPAD=False, HAS_LEFT=False,
              HAS_RIGHT=False, HAS_SOFTCAP=False, HAS_ALIBI=False, ROTARY_DIM=0, ROTARY_INTERLEAVED=False,
              ROTARY_PER_TOKEN=True, DOT_PRECISION="tf32", IS_FP8=False)
    _compile(tmp_path, "_decode_kernel", "flashtile.kernels.decode", cx, DECODE_INTS, 8, stages)


@pytest.mark.parametrize("page_shift,block_n", [(4, 128), (4, 64), (0, 128)])
def test_small_page_gather_by_page_compiles_and_pipelines_for_sm90(tmp_path, page_shift, block_n):
    # the by-page gather (Route.pages_per_tile): an unmasked tile reads one table entry
    # per page and spreads it to its keys (tl.gather); the K / V tiles must stay pipelined (a reshape
    # there compiled to unpipelined ld.global): as many 16-byte async tile copies as the per-key build
    d = 128
    cx = dict(HEAD_DIM=d, BLOCK_M=16, BLOCK_N=block_n, BLOCK_D=d, NUM_SPLITS=16, PAGED=True, PAGE_ALIGNED=False,
              PAGE_SHIFT=page_shift, HAS_SEQLENS=True, HAS_BATCH_IDX=False, HAS_LEFTPAD=False, HAS_LEFT=False,
              HAS_RIGHT=False, HAS_SOFTCAP=False, HAS_ALIBI=False, ROTARY_DIM=0, ROTARY_INTERLEAVED=False,
              ROTARY_PER_TOKEN=True, DOT_PRECISION="tf32", IS_FP8=False, USE_PDL=True)
    per_key, by_page = {}, {}
    _compile(tmp_path, "_decode_kernel", "flashtile.kernels.decode", cx, DECODE_INTS, 4, 5, fields_out=per_key)
    _compile(tmp_path, "_decode_kernel", "flashtile.kernels.decode", dict(cx, PAGES_PER_TILE=block_n >> page_shift),
             DECODE_INTS, 4, 5, fields_out=by_page)
    assert by_page["CP_ASYNC_16"] == per_key["CP_ASYNC_16"] > 0 and by_page["LD_GLOBAL"] <= per_key["LD_GLOBAL"]


def test_paged_decode_tma_compiles_for_sm90(tmp_path):
    # Route.tma on a page-aligned pool (256-token pages of 128-key tiles): the tile's page comes from
    # the table, then one descriptor load per tile from the (pages, page_size, kv heads, d) pool, at
    # the paged launch's depth (two stages more)
    d = 128
    block_n, warps, stages = _decode_config(d, True)
    cx = dict(HEAD_DIM=d, BLOCK_M=16, BLOCK_N=block_n, BLOCK_D=d, NUM_SPLITS=16, PAGED=True, PAGE_ALIGNED=True,
              PAGE_SHIFT=8, HAS_SEQLENS=True, HAS_BATCH_IDX=False, HAS_LEFTPAD=False, HAS_LEFT=False,
              HAS_RIGHT=False, HAS_SOFTCAP=False, HAS_ALIBI=False, ROTARY_DIM=0, ROTARY_INTERLEAVED=False,
              ROTARY_PER_TOKEN=True, DOT_PRECISION="tf32", IS_FP8=False, USE_PDL=True, USE_TMA=True)
    desc = f"tensordesc<bf16[1,{block_n},1,{d}]>"
    _compile(tmp_path, "_decode_kernel", "flashtile.kernels.decode", cx, dict(DECODE_INTS, DESC_K=desc, DESC_V=desc),
             warps, stages, bulk=True)


@pytest.mark.parametrize("block_s, warps", [(16, 4), (4, 1)])  # (4, 1): combine_warps's one-warp merges
def test_combine_issues_its_loads_before_reducing(tmp_path, block_s, warps):
    # the merge sits between a layer's decode and the next: its partial-output loads must not wait for
    # the lse reduction (they do not depend on it), so every global load precedes the first shuffle
    counts = {}
    _compile(tmp_path, "_combine_kernel", "flashtile.kernels.decode", dict(HEAD_DIM=128, BLOCK_S=block_s, BLOCK_D=128,
             USE_PDL=True), {"O_PART": "*fp32", "LSE_PART": "*fp32"}, warps, 1, fields_out=counts)
    assert counts["LOADS_AFTER_SHFL"] == 0, counts


@pytest.mark.parametrize("stages", [3, 4])
def test_row_decode_paged_build_keeps_the_contiguous_buffers(tmp_path, stages):
    """The whole-row kernel (kernels/decode_rows.py, 8 kv heads of d = 128, 16-key tiles): a paged launch takes
    2 x stages - 1 stages (route._rows_route) so that it keeps the contiguous build's K / V buffers (the block-table
    load splits the pipeliner's stages), within sm_90's shared memory, its tile copies 16 bytes wide."""
    cx = dict(HEADS=8, GROUPS=1, NUM_SPLITS=4, HEAD_DIM=128, BLOCK_M=16, BLOCK_N=16, HAS_SEQLENS=True, USE_PDL=True)
    types = {"O_PART": "*fp32", "LSE_PART": "*fp32", "SEQLENS": "*i32", "BLOCK_TABLE": "*i32"}
    got = {}
    for page in (0, 16, 256):
        fields = {}
        _compile(tmp_path, "_decode_rows_kernel", "flashtile.kernels.decode_rows", dict(cx, PAGE_SIZE=page), types,
                 8, 2 * stages - 1 if page else stages, gdc=(True, True), fields_out=fields)
        assert fields["CP_ASYNC_16"] > 0
        got[page] = fields["SHARED"]
    # K and V buffers of 8 x 16 x 128 bf16 (32 KB) each: the paged builds add only their block-table slots
    assert all(0 <= got[p] - got[0] < 64 for p in (16, 256)), got
    assert got[0] >= 2 * (stages - 1) * 32768, got


# the small kernels every default call path can reach, built for sm_90 (the interpreter runs them on CPU but
# compiles nothing: a build-only failure shows up here)
@pytest.mark.parametrize("kernel, module, cx, types, warps, stages", [
    ("_rotary_kernel", "flashtile.kernels.rotary",
     dict(ROTARY_DIM=128, BLOCK_M=32, BLOCK_K=64, INTERLEAVED=False, CONJUGATE=False, IS_VARLEN=True,
          HAS_OFFSET_TENSOR=True),
     dict(COS="*fp32", SIN="*fp32", CU_SEQLENS="*i32", SEQLEN_OFFSETS="*i32"), 4, 1),
    ("_attn_bwd_preprocess_kernel", "flashtile.kernels.attn_bwd",
     dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_D=128, IS_VARLEN=True, HAS_SEQUSED_Q=True), {}, 4, 1),
], ids=["rotary", "bwd_preprocess"])
def test_small_kernels_compile_for_sm90(tmp_path, kernel, module, cx, types, warps, stages):
    fields = {}
    _compile(tmp_path, kernel, module, cx, types, warps, stages, fields_out=fields)
    # it builds and loads
    assert fields["LD_GLOBAL"] + fields["CP_ASYNC_16"] > 0, fields


@pytest.mark.parametrize("kernel", ["_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"])
def test_head_dim_of_v_sink_and_chunk_compile_for_sm90(tmp_path, kernel):
    """DeepSeek-V3's head dims (q/k 192, v 128) with a learnable sink and attention_chunk, causal, at the tiles
    the launchers pick on sm_90 (the tables' bucket of the wider tile, 256): they build through ptxas with
    their dots on warp-group MMA, within shared memory; the forward on tensor descriptors, v's its own width."""
    from flashtile.kernels.attn_bwd import bwd_configs
    from flashtile.kernels.attn_fwd import fwd_config

    d, dv, block_d, block_dv = 192, 128, 256, 128
    new = dict(HEAD_DIM=d, BLOCK_D=block_d, HEAD_DIM_V=dv, BLOCK_DV=block_dv, HAS_CHUNK=True)
    if kernel == "_attn_fwd_kernel":
        bm, bn, warps, stages = fwd_config("sm90", max(block_d, block_dv), True, 4096)
        cx = dict(FLAGS, **new, BLOCK_M=bm, BLOCK_N=bn, RETURN_PROBS=False, USE_TMA=True, HAS_SINK=True)
        types = dict(desc_q=_desc(bm, block_d), desc_k=_desc(bn, block_d), desc_v=_desc(bn, block_dv))
        assert _compile(tmp_path, kernel, "flashtile.kernels.attn_fwd", cx, types, warps, stages, bulk=True) == 6
        return
    kv_cfg, q_cfg = bwd_configs("sm90", max(block_d, block_dv), causal=True, max_seqlen=4096)
    bm, bn, warps, stages = kv_cfg if kernel == "_attn_bwd_dkdv_kernel" else q_cfg
    dots = 12 if kernel == "_attn_bwd_dkdv_kernel" else 9
    cx = dict(FLAGS, **new, BLOCK_M=bm, BLOCK_N=bn)
    assert _compile(tmp_path, kernel, "flashtile.kernels.attn_bwd", cx, {}, warps, stages) == dots
