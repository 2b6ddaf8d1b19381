"""Registers, spills and shared memory of backward kernel configs for sm_90a, on a machine without a GPU.

Usage: PYTHONPATH=src python scripts/probe_registers.py dkdv|dq|fused|fused-tma D,BLOCK_M,BLOCK_N,WARPS,STAGES ...
       PYTHONPATH=src python scripts/probe_registers.py one D,BLOCK_M1,BLOCK_N1,BLOCK_M2,BLOCK_N2,WARPS,STAGES ...
e.g.   PYTHONPATH=src python scripts/probe_registers.py dkdv 128,32,64,4,2 128,64,128,8,2
("one" is the one-launch kernel: dK/dV tiles BLOCK_M1 x BLOCK_N1, dQ tiles BLOCK_M2 x BLOCK_N2.)

Triton compiles the kernel for a named target (pointers and strides marked 16-divisible, as the JIT
specialises them for aligned inputs) and Triton's bundled ``ptxas -v`` reports registers and spill
bytes. Configs that spill heavily are not worth GPU time in scripts/tune_bwd.py.
"""

import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

FLOATS = {"qk_scale", "softcap", "dropout_p", "grad_scale"}
INT_POINTERS = {"CU_SEQLENS_Q", "CU_SEQLENS_K", "SEQUSED_Q", "SEQUSED_K"}
FP32_POINTERS = {"LSE", "DELTA", "ALIBI", "DQ_ACC"}
FLAGS = dict(IS_VARLEN=False, HAS_SEQUSED_Q=False, HAS_SEQUSED_K=False, HAS_LEFT=False, HAS_RIGHT=True,
             HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_DROPOUT=False, DOT_PRECISION="tf32", USE_TMA=False)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def probe(kernel_name: str, constexprs: dict, warps: int, stages: int, types: dict | None = None) -> dict:
    kern = getattr(importlib.import_module("flashtile.kernels.attn_bwd"), kernel_name)
    sig, consts, attrs = {}, {}, {}
    aligned = [["tt.divisibility", 16]]
    for i, name in enumerate(kern.arg_names):
        param = kern.params[i]
        if name not in constexprs and param.is_constexpr and param.default is not inspect.Parameter.empty:
            constexprs = dict(constexprs, **{name: param.default})  # e.g. HEAVY_FIRST = False
        if name in constexprs:
            sig[name], consts[(i,)] = "constexpr", constexprs[name]
        elif types and name in types:
            sig[name] = types[name]
        elif name in FLOATS:
            sig[name] = "fp32"
        elif name in INT_POINTERS or name in FP32_POINTERS or name.isupper() or name.startswith("desc"):
            sig[name] = "*i32" if name in INT_POINTERS else "*fp32" if name in FP32_POINTERS else "*bf16"
            attrs[(i,)] = aligned
        else:
            sig[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = aligned
    compiled = triton.compile(ASTSource(kern, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    res = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True)
    os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", res.stderr)
    spill = re.findall(r"(\d+) bytes spill stores", res.stderr)
    return dict(regs=int(regs[0]) if regs else None, spill_bytes=int(spill[0]) if spill else None,
                shared=compiled.metadata.shared)


def main(kind: str, specs: list[str]) -> None:
    kernel = "_attn_bwd_dq_kernel" if kind == "dq" else "_attn_bwd_dkdv_kernel"
    for spec in specs:
        if kind == "one":
            d, bm1, bn1, bm2, bn2, warps, stages = map(int, spec.split(","))
            cx = {k: v for k, v in FLAGS.items() if k != "USE_TMA"}
            cx.update(HEAD_DIM=d, BLOCK_M1=bm1, BLOCK_N1=bn1, BLOCK_M2=bm2, BLOCK_N2=bn2,
                      BLOCK_D=max(16, triton.next_power_of_2(d)), USE_TMA_DKDV=False, USE_TMA_DQ=False)
            print(kind, spec, probe("_attn_bwd_one_launch_kernel", cx, warps, stages), flush=True)
            continue
        d, bm, bn, warps, stages = map(int, spec.split(","))
        cx = dict(FLAGS, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(16, triton.next_power_of_2(d)))
        types = None
        if kind != "dq":
            cx["FUSED_DQ"] = {"dkdv": 0, "fused": 1, "fused-tma": 2}[kind]
        if kind == "fused-tma":  # dQ added by a bulk tensor reduce through a descriptor of the fp32 buffer
            types = dict(DQ_ACC=f"tensordesc<fp32[1,{bm},1,{cx['BLOCK_D']}]>")
        print(kind, spec, probe(kernel, cx, warps, stages, types), flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("dkdv", "dq", "fused", "fused-tma", "one"):
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
