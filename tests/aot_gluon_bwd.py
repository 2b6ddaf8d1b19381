"""Compile the Gluon dK/dV kernel (kernels/gluon_bwd.py) for sm_90 without a GPU; used by
tests/test_gluon_bwd_compile.py in a subprocess (TRITON_INTERPRET must be unset there).

    python tests/aot_gluon_bwd.py OUT '[["bf16", 128, true, [32, 64, 4, 4]], ["bf16", 256, true, [64, 64, 2, 8, 2, 0]]]'

A case's optional fifth element names the kernel: "dkdv" (the only one). A config's optional fifth and
sixth numbers are WARPS_N (two warpgroups side by side at d = 256) and ROTATED (0: the plain order); a
seventh, LAUNCH_DEPENDENTS (1: programmatic dependent launch of the dQ kernel); an eighth, LOCAL (1: a causal
sliding window); a ninth, VARLEN (1: packed sequences); a tenth, SOFTCAP (1); an eleventh, ALIBI (1: causal
ALiBi); a twelfth, UNEQUAL (1: q and k of different lengths); a thirteenth, VARLEN_K (1: packed k with its own
sequences, with VARLEN); a fourteenth, FUSED_DQ (1: dQ added by TMA reduce-add into an fp32 buffer).

Writes <tag>.ttgir / .sass / .ptxas.log per case and prints one JSON line per case:
{"tag", "shared", "regs", "spill_bytes", "serialized", "gdc_launch", "tma_reduce"} (griddepcontrol.launch_dependents
and cp.reduce.async.bulk.tensor instructions in the PTX).
"""

import json
import pathlib
import re
import sys

KINDS = {"bf16": ("bf16", "bfloat16"), "fp16": ("fp16", "float16")}


def tag_of(kind, d, causal, cfg, which="dkdv") -> str:
    split = "".join(f"{name}{val}" for name, val in zip(("x", "r", "p", "l", "v", "c", "a", "u", "k", "q"), cfg[4:]))
    return f"{which}_{kind}_d{d}_{'causal' if causal else 'full'}_m{cfg[0]}n{cfg[1]}b{cfg[2]}w{cfg[3]}{split}"


def compile_case(kind, d, causal, cfg, out: pathlib.Path, which="dkdv") -> dict:
    import triton.experimental.gluon.language as gl

    assert which == "dkdv", f"unknown kernel {which!r}"
    from flashtile.kernels.gluon_bwd import _gluon_attn_bwd_dkdv_kernel as kernel

    bm, bn, nb, nw, *rest = cfg  # then WARPS_N and ROTATED of the dK/dV kernel (defaults 1, 1)
    type_name, gl_name = KINDS[kind]

    def desc(block, type_name=type_name, gl_name=gl_name):
        layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, gl_name))
        return f"tensordesc<{type_name}[{','.join(map(str, block))}],{layout!r}>"

    from flashtile.backends.triton.gluon_bwd import V_HEAD_DIM
    from flashtile.backends.triton.gluon_fwd import head_dim_split

    # q / k of 192 columns arrive as 128 + 64; v has its own head dim (V_HEAD_DIM)
    lead, tail = head_dim_split(d)
    dv = V_HEAD_DIM[d]
    constexprs = dict(HEAD_DIM=lead, BLOCK_M=bm, BLOCK_N=bn, NUM_BUFFERS=nb, CAUSAL=causal, HEAD_DIM_TAIL=tail,
                      HEAD_DIM_V=dv)
    constexprs["WARPS_N"] = rest[0] if rest else 1
    constexprs["ROTATED"] = bool(rest[1]) if len(rest) > 1 else True
    if len(rest) > 2:
        constexprs["LAUNCH_DEPENDENTS"] = bool(rest[2])
    if len(rest) > 3:
        constexprs["LOCAL"] = bool(rest[3])
    if len(rest) > 4:
        constexprs["VARLEN"] = bool(rest[4])
    if len(rest) > 5:
        constexprs["SOFTCAP"] = bool(rest[5])
    if len(rest) > 6:
        constexprs["ALIBI"] = bool(rest[6])
    if len(rest) > 7:
        constexprs["UNEQUAL"] = bool(rest[7])
    if len(rest) > 8:
        constexprs["VARLEN_K"] = bool(rest[8])
    if len(rest) > 9:
        constexprs["FUSED_DQ"] = bool(rest[9])
    rows_m, rows_n = desc([1, bm, 1, lead]), desc([1, bn, 1, lead])
    rows_mv, rows_nv = desc([1, bm, 1, dv]), desc([1, bn, 1, dv])
    tail_m, tail_n = desc([1, bm, 1, tail or lead]), desc([1, bn, 1, tail or lead])
    types = dict(desc_q=rows_m, desc_do=rows_mv, desc_k=rows_n, desc_v=rows_nv, desc_dk=rows_n, desc_dv=rows_nv,
                 desc_q2=tail_m, desc_k2=tail_n, desc_dk2=tail_n, LSE="*fp32", DELTA="*fp32", qk_scale="fp32",
                 grad_scale="fp32", softcap_log2e="fp32", CU_SEQLENS="*i32", DK_OUT=f"*{type_name}",
                 DV_OUT=f"*{type_name}", ALIBI_SLOPES="*fp32", CU_SEQLENS_K="*i32", KV_LENS="*i32",
                 desc_dq=desc([1, bm, 1, lead], "fp32", "float32"), desc_dq2=desc([1, bm, 1, tail or lead], "fp32",
                                                                                 "float32"))
    from gluon_aot import compile_for_sm90

    row = compile_for_sm90(kernel, constexprs, types, nw, out, tag_of(kind, d, causal, cfg, which))
    log = row.pop("ptxas_log")
    regs = re.findall(r"Used (\d+) registers", log)
    spill = re.findall(r"(\d+) bytes spill stores", log)
    ptx = (out / f"{row['tag']}.ptx").read_text()
    return dict(row, num_warps=nw, regs=int(regs[0]) if regs else None, spill_bytes=int(spill[0]) if spill else None,
                serialized="serializ" in log.lower(), gdc_launch=ptx.count("griddepcontrol.launch_dependents"),
                tma_reduce=ptx.count("cp.reduce.async.bulk.tensor"))


if __name__ == "__main__":
    folder = pathlib.Path(sys.argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    for kind, d, causal, cfg, *which in json.loads(sys.argv[2]):
        print(json.dumps(compile_case(kind, d, causal, tuple(cfg), folder, *which)), flush=True)
