"""The Gluon Hopper forward kernels (bf16 / fp16 and fp8) must compile for sm_90 through ptxas, fit
shared memory, and keep the intra-warpgroup overlap they were written for all the way down to SASS,
for every config of the table and every tuning candidate. No GPU needed.

The compile runs in a subprocess (TRITON_INTERPRET must be unset there): this file run as a script
compiles the configs named on its command line and writes TTGIR, ptxas's log and SASS to a folder.
The checks, in order of how close they are to the hardware:
  * TTGIR: inside the key loop the QK^T wgmma of block j+1 is issued (async) before the softmax
    exp2 of block j with no wgmma wait in between, and the PV wgmma is still in flight at the back
    edge (its result goes into scf.yield unwaited);
  * ptxas: no "wgmma ... serialized" performance warning (C7514 and friends: ptxas then waits
    after every wgmma, whatever the source says), no spills;
  * SASS: at least half a key block's MUFU.EX2 (the softmax) execute between an HGMMA (16-bit) or
    QGMMA (fp8) and the next WARPGROUP.DEPBAR that waits for it.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from gluon_aot import max_ex2_under_wgmma as _max_ex2_under_wgmma

SM90_MAX_SHARED = 232448  # 227 KiB, the most one block may allocate on sm_90
# "bf16sink": the bf16 kernel with a learnable sink (HAS_SINK), whose only extra code is after the key loop
# "bf16local": with a causal sliding window (LOCAL: a third copy of the key loop, masked, for the window's left edge)
# "bf16softcap": scores capped through tanh before the mask (SOFTCAP: two more MUFU ops per score)
# "bf16alibi": causal, every score biased by -slope * |row - key| (ALIBI: one add per score in every block)
KINDS = {"bf16": ("bf16", "bfloat16"), "bf16sink": ("bf16", "bfloat16"), "bf16local": ("bf16", "bfloat16"),
         "bf16softcap": ("bf16", "bfloat16"), "bf16varlen": ("bf16", "bfloat16"), "bf16alibi": ("bf16", "bfloat16"),
         "bf16unequal": ("bf16", "bfloat16"), "bf16varlenk": ("bf16", "bfloat16"),
         "bf16varlenksoftcap": ("bf16", "bfloat16"),
         "fp16": ("fp16", "float16"),
         "fp8": ("fp8e4nv", "float8e4nv")}


def _cases():
    """(kind, d, causal, (BLOCK_M, BLOCK_N, NUM_BUFFERS, num_warps)): every table entry in both
    causal modes (bf16 for the 16-bit rows, plus one fp16 compile), then every tuning candidate
    that is not a table entry, causal only (the masked loop copy is the larger one)."""
    from flashtile.kernels.gluon_fwd import CONFIG_KEYS, FWD_CONFIGS, TUNE_CANDIDATES

    table, extra = [], []
    for (cls, d), cfg in FWD_CONFIGS.items():
        cfg = tuple(cfg[key] for key in CONFIG_KEYS)
        kind = "fp8" if cls == "fp8" else "bf16"
        table += [(kind, d, causal, cfg) for causal in (False, True)]
        extra += [(kind, d, True, c) for c in TUNE_CANDIDATES[(cls, d)] if c != cfg]
    table.append(("fp16", 128, True, tuple(FWD_CONFIGS[("16bit", 128)][key] for key in CONFIG_KEYS)))
    table.append(("bf16sink", 128, True, tuple(FWD_CONFIGS[("16bit", 128)][key] for key in CONFIG_KEYS)))
    table += [("bf16local", d, True, tuple(FWD_CONFIGS[("16bit", d)][key] for key in CONFIG_KEYS))
              for d in (128, 192)]
    table.append(("bf16softcap", 128, True, tuple(FWD_CONFIGS[("16bit", 128)][key] for key in CONFIG_KEYS)))
    def cfg16(d):
        return tuple(FWD_CONFIGS[("16bit", d)][key] for key in CONFIG_KEYS)

    table += [("bf16alibi", d, True, cfg16(d)) for d in (128, 192)]
    # "bf16unequal": k longer or shorter than q (padded), the diagonal aligned bottom-right
    table += [("bf16unequal", 128, False, cfg16(128))] + [("bf16unequal", d, True, cfg16(d)) for d in (128, 192)]
    # "bf16varlen": packed sequences (an early exit for tiles past a sequence, a row-by-row store for its last)
    table += [("bf16varlen", 128, causal, tuple(FWD_CONFIGS[("16bit", 128)][key] for key in CONFIG_KEYS))
              for causal in (False, True)]
    # "bf16varlenk": packed k with sequences of its own (rows above k's diagonal see no key)
    table += [("bf16varlenk", 128, causal, cfg16(128)) for causal in (False, True)] + [("bf16varlenk", 192, True,
                                                                                          cfg16(192))]
    table += [("bf16varlenksoftcap", d, True, cfg16(d)) for d in (128, 192)]
    return table, extra


TABLE_CASES, CANDIDATE_CASES = _cases()
# ALiBi's column bias, and k's own sequences with a softcap, push the d = 128 builds past 255 registers
MAX_SPILL_BYTES = {("bf16alibi", 128): 64, ("bf16varlenksoftcap", 128): 32}


def _tag(kind, d, causal, cfg) -> str:
    return f"{kind}_d{d}_{'causal' if causal else 'full'}_m{cfg[0]}n{cfg[1]}b{cfg[2]}w{cfg[3]}"


def _min_overlapped_ex2(cfg) -> int:
    # exponentials per thread and key block (BLOCK_M x BLOCK_N over the CTA's threads); ask for half
    # (the d = 128 bf16 kernel of the first version: 64 per block, 61 to 65 measured, 32 asked)
    bm, bn, _, nw = cfg
    return bm * bn // (32 * nw) // 2


def _compile(kind: str, d: int, causal: bool, cfg, out: pathlib.Path) -> dict:
    import triton.experimental.gluon.language as gl

    if kind == "fp8":
        from flashtile.kernels.gluon_fwd_fp8 import _gluon_attn_fwd_fp8_kernel as kernel
    else:
        from flashtile.kernels.gluon_fwd import _gluon_attn_fwd_kernel as kernel

    bm, bn, nb, nw = cfg
    type_name, gl_name = KINDS[kind]

    def desc(block, type_name=type_name, gl_name=gl_name):  # what the JIT derives from a gluon TensorDescriptor
        layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, gl_name))
        return f"tensordesc<{type_name}[{','.join(map(str, block))}],{layout!r}>"

    from flashtile.backends.triton.gluon_fwd import V_HEAD_DIMS, head_dim_split

    # the 16-bit kernel takes q / k as a leading and a tail column range (192 = 128 + 64), and v's own head dim
    lead, tail = (d, 0) if kind == "fp8" else head_dim_split(d)
    dv = d if kind == "fp8" else V_HEAD_DIMS[d][0]
    constexprs = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, NUM_BUFFERS=nb, CAUSAL=causal, HAS_Q_DESCALE=True,
                      HAS_K_DESCALE=True, HAS_V_DESCALE=True, HAS_SINK=kind == "bf16sink")
    if kind != "fp8":
        constexprs.update(HEAD_DIM=lead, HEAD_DIM_TAIL=tail, HEAD_DIM_V=dv, LOCAL=kind == "bf16local",
                          SOFTCAP=kind in ("bf16softcap", "bf16varlenksoftcap"), VARLEN=kind.startswith("bf16varlen"),
                          ALIBI=kind == "bf16alibi", UNEQUAL=kind == "bf16unequal",
                          VARLEN_K=kind.startswith("bf16varlenk"))
    types = dict(desc_q=desc([1, bm, 1, lead]), desc_k=desc([1, bn, 1, lead]), desc_v=desc([1, bn, 1, dv]),
                 desc_q2=desc([1, bm, 1, tail or lead]), desc_k2=desc([1, bn, 1, tail or lead]),
                 desc_vt=desc([1, 1, d, bn]), LSE="*fp32", Q_DESCALE="*fp32", K_DESCALE="*fp32",
                 V_DESCALE="*fp32", SINK="*fp32", qk_scale="fp32", softcap_log2e="fp32", CU_SEQLENS="*i32",
                 OUT="*bf16", ALIBI_SLOPES="*fp32", CU_SEQLENS_K="*i32", KV_LENS="*i32")
    # the fp8 kernel writes bf16
    types["desc_o"] = desc([1, bm, 1, d], *KINDS["bf16"]) if kind == "fp8" else desc([1, bm, 1, dv])
    from gluon_aot import compile_for_sm90

    row = compile_for_sm90(kernel, constexprs, types, nw, out, _tag(kind, d, causal, cfg))
    return dict(tag=row["tag"], shared=row["shared"])


def _compile_spec(args) -> dict:
    folder, spec = args
    kind, d, causal, cfg = json.loads(spec)
    return _compile(kind, d, causal, tuple(cfg), pathlib.Path(folder))


def _loop_bodies(ttgir: str) -> list[list[str]]:
    """The lines of every scf.for body (the printer indents a region two spaces past its op)."""
    lines, bodies = ttgir.splitlines(), []
    for i, line in enumerate(lines):
        if "scf.for" in line:
            indent = len(line) - len(line.lstrip())
            end = next(k for k in range(i + 1, len(lines))
                       if lines[k].strip().startswith("}") and len(lines[k]) - len(lines[k].lstrip()) == indent)
            bodies.append(lines[i + 1:end])
    return bodies


def _check_ttgir_overlap(ttgir: str, qk_dots: int = 1) -> None:
    """qk_dots: wgmmas per QK^T (2 where the head dim arrives as two column ranges)."""
    bodies = _loop_bodies(ttgir)
    assert bodies, "no key loop in the TTGIR"
    for body in bodies:
        ops = [("dot" if "ttng.warp_group_dot " in ln else "wait" if "ttng.warp_group_dot_wait" in ln
                else "exp2" if "math.exp2" in ln else "yield" if "scf.yield" in ln else None, ln) for ln in body]
        ops = [(kind, ln) for kind, ln in ops if kind]
        kinds = [kind for kind, _ in ops]
        assert kinds.count("dot") == qk_dots + 1, f"expected QK^T and PV wgmmas in the loop, got {kinds}"
        first_dot, first_exp = kinds.index("dot"), kinds.index("exp2")
        # QK^T of the next block is issued before this block's softmax, and nothing waits for it first
        assert first_dot < first_exp and "wait" not in kinds[first_dot:first_exp], kinds
        assert kinds[:first_exp].count("dot") == qk_dots, kinds
        assert "isAsync = true" in ops[first_dot][1]
        # PV is the last wgmma and nothing waits for it before the back edge
        last_dot = len(kinds) - 1 - kinds[::-1].index("dot")
        assert "wait" not in kinds[last_dot:], kinds
        pv = re.match(r"\s*(%[\w#]+) = ttng.warp_group_dot ", ops[last_dot][1]).group(1)
        assert pv in ops[-1][1] and kinds[-1] == "yield", "PV's in-flight result must be loop-carried"


def _ptxas_ok(log: str, max_spill: int = 0) -> None:
    assert "serialized" not in log, f"ptxas serialised the wgmma pipeline:\n{log}"
    spill = re.search(r"\b(\d+) bytes spill stores", log)
    assert spill and int(spill.group(1)) <= max_spill, f"register spills:\n{log}"


def _run_compiles(tmp_path_factory, cases, name):
    pytest.importorskip("triton.backends.nvidia")
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    out = tmp_path_factory.mktemp(name)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(out / "cache")
    args = [json.dumps(list(case)) for case in cases]
    res = subprocess.run([sys.executable, __file__, str(out), *args], capture_output=True, text=True, env=env,
                         timeout=1800)
    if res.returncode != 0 and ("ptxas" in res.stderr or "cuobjdump" in res.stderr) and "not found" in res.stderr:
        pytest.skip("no ptxas / cuobjdump in this triton install")
    assert res.returncode == 0, res.stderr[-4000:]
    summary = {r["tag"]: r for r in json.loads(res.stdout.strip().splitlines()[-1])}
    return out, summary


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return _run_compiles(tmp_path_factory, TABLE_CASES, "gluon_sm90")


@pytest.fixture(scope="module")
def compiled_candidates(tmp_path_factory):
    return _run_compiles(tmp_path_factory, CANDIDATE_CASES, "gluon_sm90_tune")


def _check_compiled(out, summary, case):
    tag = _tag(*case)
    shared = summary[tag]["shared"]
    assert shared <= SM90_MAX_SHARED, f"{tag} needs {shared} bytes of shared memory"
    from flashtile.backends.triton.gluon_fwd import head_dim_split

    split = case[0] != "fp8" and head_dim_split(case[1])[1] > 0
    _check_ttgir_overlap((out / f"{tag}.ttgir").read_text(), 2 if split else 1)
    # ALiBi's column bias (a float per key column and thread) costs the d = 128 build 15 registers past the
    # 255 the plain one already uses: 60 bytes of spills, accepted, its speed measured against the Triton kernel
    _ptxas_ok((out / f"{tag}.ptxas.log").read_text(), MAX_SPILL_BYTES.get((case[0], case[1]), 0))
    ex2 = _max_ex2_under_wgmma((out / f"{tag}.sass").read_text())
    need = _min_overlapped_ex2(case[3])
    assert ex2 >= need, f"{tag}: only {ex2} exp2 (< {need}) run while a wgmma is in flight: not overlapped"


@pytest.mark.parametrize("case", TABLE_CASES, ids=[_tag(*c) for c in TABLE_CASES])
def test_gluon_fwd_compiles_for_sm90_with_overlap(compiled, case):
    _check_compiled(*compiled, case)


@pytest.mark.parametrize("case", CANDIDATE_CASES, ids=[_tag(*c) for c in CANDIDATE_CASES])
def test_tuning_candidates_compile_without_spills(compiled_candidates, case):
    # scripts/tune_gluon.py times these on the GPU: each must be a valid, overlapped kernel
    _check_compiled(*compiled_candidates, case)


def test_config_table_and_candidates_agree():
    from flashtile.kernels.gluon_fwd import CONFIG_KEYS, FWD_CONFIGS, TUNE_CANDIDATES, fwd_config

    assert set(FWD_CONFIGS) == set(TUNE_CANDIDATES)
    for (cls, d), cfg in FWD_CONFIGS.items():
        # the table's entry is the first candidate: the tuner's baseline
        assert TUNE_CANDIDATES[(cls, d)][0] == tuple(cfg[key] for key in CONFIG_KEYS)
        assert len(TUNE_CANDIDATES[(cls, d)]) <= 6
        dtype = "float8_e4m3fn" if cls == "fp8" else "bfloat16"
        assert fwd_config(d, True, dtype) == cfg and fwd_config(d, False, dtype) is not FWD_CONFIGS[(cls, d)]
    assert fwd_config(128, False, "float16") == FWD_CONFIGS[("16bit", 128)]
    with pytest.raises(ValueError, match="no config"):
        fwd_config(96, False)


@pytest.mark.parametrize("config,match", [
    (dict(BLOCK_M=96), "invalid config"),
    (dict(BLOCK_M=64), "invalid config"),  # 8 warps for 64 rows
    (dict(NUM_BUFFERS=1), "invalid config"),
    (dict(BLOCK_N=48), "invalid config"),
    (dict(stages=3), "unknown config keys"),
])
def test_config_overrides_are_checked(config, match):
    from flashtile.backends.triton.gluon_fwd import _resolve_config

    with pytest.raises(ValueError, match=match):
        _resolve_config(128, False, "bfloat16", config)
    assert _resolve_config(64, True, "float8_e4m3fn", dict(BLOCK_M=64, num_warps=4))["BLOCK_M"] == 64


def test_overlap_checks_catch_a_serialised_kernel():
    # the SASS check must fail on the shape of a non-overlapped loop: wait right after the MMA
    for mma in ("HGMMA.64x128x16.F32.BF16 R88", "QGMMA.64x128x32.F32.E4M3.E4M3 R88"):
        sass = "\n".join([mma, "WARPGROUP.DEPBAR.LE gsb0, 0x0"] + ["MUFU.EX2 R1, R1"] * 64)
        assert _max_ex2_under_wgmma(sass) == 0
        overlapped = "\n".join([mma] + ["MUFU.EX2 R1, R1"] * 64 + ["WARPGROUP.DEPBAR.LE gsb0, 0x0"])
        assert _max_ex2_under_wgmma(overlapped) == 64
    with pytest.raises(AssertionError):
        _ptxas_ok("ptxas info : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized")


def _qkv(b=1, s=16, h=2, d=64, dtype=None, sk=None):
    import torch

    dtype = dtype or torch.bfloat16
    sk = s if sk is None else sk
    return (torch.randn(b, s, h, d).to(dtype), torch.randn(b, sk, h, d).to(dtype), torch.randn(b, sk, h, d).to(dtype))


@pytest.mark.parametrize("case,match", [
    (dict(dtype="float32"), "bf16 or fp16 only"),
    (dict(d=96), "head_dim"),
    (dict(sk=24), "CUDA tensors only"),  # unequal lengths are taken: only the device is wrong
    (dict(), "CUDA tensors only"),
    (dict(dtype="float16"), "CUDA tensors only"),  # fp16 is supported: only the device is wrong
    (dict(d=256), "CUDA tensors only"),
])
def test_launcher_refuses_unsupported_inputs(case, match):
    import torch

    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd

    if "dtype" in case:
        case = dict(case, dtype=getattr(torch, case["dtype"]))
    q, k, v = _qkv(**case)
    with pytest.raises(ValueError, match=match):
        gluon_attn_fwd(q, k, v, 0.125, causal=False)


def _fp8_inputs(b=2, s=40, h=4, h_k=2, d=64):
    import torch

    from flashtile.backends.triton.attn_fwd_fp8 import transpose_v

    e4m3 = torch.float8_e4m3fn
    q = torch.randn(b, s, h, d).to(e4m3)
    k = torch.randn(b, s, h_k, d).to(e4m3)
    v = torch.randn(b, s, h_k, d).to(e4m3)
    return q, k, v, transpose_v(v, varlen=False)


@pytest.mark.parametrize("case,match", [
    ("q_bf16", "q must be float8_e4m3fn"),
    ("v_not_transposed", "v_t must be V transposed"),
    ("d96", "head_dim"),
    ("descale_shape", "q_descale must be fp32 of shape"),
    ("descale_dtype", "v_descale must be fp32 of shape"),
    ("ok_on_cpu", "CUDA tensors only"),
])
def test_fp8_launcher_refuses_unsupported_inputs(case, match):
    import torch

    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd_fp8

    q, k, v, vt = _fp8_inputs(d=96 if case == "d96" else 64)
    kw = {}
    if case == "q_bf16":
        q = q.to(torch.bfloat16)
    elif case == "v_not_transposed":
        vt = v
    elif case == "descale_shape":
        kw["q_descale"] = torch.ones(2, 4)  # (b, h) instead of (b, h_k)
    elif case == "descale_dtype":
        kw["v_descale"] = torch.ones(2, 2, dtype=torch.float64)
    else:
        kw = dict(q_descale=torch.ones(2, 2), k_descale=torch.ones(2, 2), v_descale=torch.ones(2, 2))
    # transpose_v pads the key dim to 16: the view has the true length, strides of the padded buffer
    assert case == "v_not_transposed" or (vt.shape[-1] == 40 and vt.stride(-2) == 48)
    with pytest.raises(ValueError, match=match):
        gluon_attn_fwd_fp8(q, k, vt, softmax_scale=0.125, causal=True, **kw)


if __name__ == "__main__":
    # argv: output folder, then one JSON [kind, d, causal, [BLOCK_M, BLOCK_N, NUM_BUFFERS, num_warps]]
    # per kernel; compiled in parallel (each compile is single-threaded)
    from concurrent.futures import ProcessPoolExecutor

    folder = sys.argv[1]
    with ProcessPoolExecutor(max_workers=max(1, min(len(sys.argv) - 2, os.cpu_count() or 1))) as pool:
        results = list(pool.map(_compile_spec, [(folder, spec) for spec in sys.argv[2:]]))
    print(json.dumps(results))
