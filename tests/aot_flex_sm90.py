"""Compile a flex kernel with generated mods for Hopper (sm_90) through ptxas, without a GPU.

Run as a script in a subprocess (TRITON_INTERPRET must be unset there):
    python tests/aot_flex_sm90.py KERNEL BLOCK_M BLOCK_N WARPS STAGES
KERNEL: fwd, dkdv or dq. The mods are a relative-position bias from a learnable table (score_mod, so the
backward carries atomic adds) under a causal mask_mod, at d = 128, bf16, block mask 128 x 128.
Prints ``WGMMA <n> SHARED <bytes> REGISTERS <n> SPILL_STORES <n>``.
"""

import pathlib
import re
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashtile.flex import registry
from flashtile.kernels.flex_bwd import _flex_bwd_dkdv_kernel, _flex_bwd_dq_kernel
from flashtile.kernels.flex_fwd import _flex_fwd_kernel
from gluon_aot import ptxas_log  # this script runs from tests/ (its folder is on sys.path)

S = 4096
TABLE = torch.zeros(2 * S, requires_grad=True)


def rel_bias(score, b, h, q_idx, kv_idx):
    return score + TABLE[q_idx - kv_idx + S]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def main(which, bm, bn, warps, stages, tma=0):
    kernels = registry.entry_for(rel_bias, causal).kernels()
    kern = {"fwd": _flex_fwd_kernel, "dkdv": _flex_bwd_dkdv_kernel, "dq": _flex_bwd_dq_kernel}[which]
    cx = dict(SCORE_MOD=kernels.score_mod, SCORE_GRAD=kernels.score_grad, MASK_MOD=kernels.mask_mod,
              HAS_SCORE_MOD=True, HAS_BUFFER_GRADS=True, HEAD_DIM=128, HEAD_DIM_V=128, BLOCK_M=bm, BLOCK_N=bn,
              BLOCK_D=128, BLOCK_DV=128, SPARSE_Q=128, SPARSE_KV=128, EVEN_M=True, EVEN_N=True,
              DOT_PRECISION="tf32")
    if which == "fwd":  # tma: the forward's tensor-descriptor build, K and V boxes of bn rows of one (b, kv head)
        cx["USE_TMA"] = bool(tma)
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(kern.arg_names):
        if name in cx:
            sig[name], consts[(i,)] = "constexpr", cx[name]
            continue
        if name in ("desc_k", "desc_v") and tma:
            sig[name] = f"tensordesc<bf16[1,1,{bn},128]>"
            continue
        if name == "BUFS":
            sig[name] = ("*fp32",)
        elif name == "GRADS":
            sig[name] = ("*fp32",)
        elif name in ("LSE", "DELTA"):
            sig[name] = "*fp32"
        elif "NUM" in name or "IDX" in name:
            sig[name] = "*i32"
        elif name == "sm_scale":
            sig[name] = "fp32"
        elif name.isupper():
            sig[name] = "*bf16"
        else:
            sig[name] = "i32"
        if isinstance(sig[name], str) and (sig[name].startswith("*") or name.startswith("stride")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kern, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    dots = [ln for ln in compiled.asm["ttgir"].splitlines() if "ttng.warp_group_dot " in ln]
    with tempfile.TemporaryDirectory() as tmp:
        log = ptxas_log(compiled.asm["ptx"], pathlib.Path(tmp), "kernel", "sm_90a")
    regs, spill = (re.search(pat, log) for pat in (r"Used (\d+) registers", r"(\d+) bytes spill stores"))
    print("WGMMA", len(dots), "SHARED", compiled.metadata.shared, "REGISTERS", regs.group(1) if regs else -1,
          "SPILL_STORES", spill.group(1) if spill else -1)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:7]))
