"""Compile the Gluon flex kernels (kernels/gluon_flex_fwd.py, the dK/dV one in kernels/gluon_flex_bwd.py) with
generated mods for sm_90 through ptxas, without a GPU.

Run as a script in a subprocess (TRITON_INTERPRET must be unset there):
    python tests/aot_gluon_flex.py OUT SPEC [SPEC ...]      SPEC: KERNEL,MODS,D,BLOCK_M,BLOCK_N,NUM_BUFFERS,WARPS,EVEN
KERNEL: fwd, dkdv, or dkdvq (dK/dV's fused dQ build: dQ added into an fp32 buffer by TMA reduce-add).
MODS: ``rel_bias`` (a learned relative-position table under a causal mask, the heaviest of the tests), ``softcap``
(tanh on every score, no mask), ``causal`` (mask_mod only) or ``document`` (a captured document-id tensor read
twice per element). EVEN 0 builds the ragged-length copy (index bounds, end masks). Writes TTGIR / SASS / ptxas
log under OUT and prints one JSON line a spec: its tag, shared memory, registers, spill stores, whether ptxas
serialised the wgmmas, the most exp2 under an in-flight wgmma in the SASS, and the PTX's TMA reduce-adds.
"""

import json
import pathlib
import re
import sys

import torch

from flashtile.flex import registry
from flashtile.kernels.gluon_flex_bwd import _gluon_flex_bwd_dkdv_kernel
from flashtile.kernels.gluon_flex_fwd import _gluon_flex_fwd_kernel
from gluon_aot import compile_for_sm90, max_ex2_under_wgmma  # run from tests/ (its folder is on sys.path)

S = 4096
TABLE = torch.zeros(2 * S, requires_grad=True)
DOCS = torch.zeros(S, dtype=torch.int32)


def rel_bias(score, b, h, q_idx, kv_idx):
    return score + TABLE[q_idx - kv_idx + S]


def softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document(b, h, q_idx, kv_idx):
    return DOCS[q_idx] == DOCS[kv_idx]


MODS = {"rel_bias": (rel_bias, causal, ("*fp32",)), "softcap": (softcap, None, ("*fp32",)),
        "causal": (None, causal, ("*fp32",)), "document": (None, document, ("*i32",))}


def main(out, kind, mods, d, bm, bn, nb, warps, even):
    import triton.experimental.gluon.language as gl

    score_mod, mask_mod, bufs = MODS[mods]
    kernels = registry.entry_for(score_mod, mask_mod).kernels()

    def desc(block, name="bf16", dtype=gl.bfloat16):
        layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
        return f"tensordesc<{name}[{','.join(map(str, block))}],{layout!r}>"

    cx = dict(SCORE_MOD=kernels.score_mod, MASK_MOD=kernels.mask_mod, HAS_SCORE_MOD=score_mod is not None,
              HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, NUM_BUFFERS=nb, SPARSE_Q=128, SPARSE_KV=128, EVEN_M=bool(even),
              EVEN_N=bool(even))
    if kind == "fwd":
        kernel = _gluon_flex_fwd_kernel
        types = dict(desc_q=desc([1, 1, bm, d]), desc_o=desc([1, 1, bm, d]), desc_k=desc([1, 1, bn, d]),
                     desc_v=desc([1, 1, bn, d]), OUT="*bf16", LSE="*fp32", KV_NUM="*i32", KV_IDX="*i32",
                     FULL_NUM="*i32", FULL_IDX="*i32", BUFS=bufs, sm_scale="fp32")
    else:  # the learned table's gradient is added atomically (HAS_BUFFER_GRADS) where the mod has one
        kernel = _gluon_flex_bwd_dkdv_kernel
        grads = mods == "rel_bias"
        fused = kind == "dkdvq"
        cx.update(SCORE_GRAD=kernels.score_grad, HAS_BUFFER_GRADS=grads, FUSED_DQ=fused)
        types = dict(desc_q=desc([1, 1, bm, d]), desc_do=desc([1, 1, bm, d]), desc_k=desc([1, 1, bn, d]),
                     desc_v=desc([1, 1, bn, d]), desc_dk=desc([1, 1, bn, d]), desc_dv=desc([1, 1, bn, d]),
                     LSE="*fp32", DELTA="*fp32", Q_NUM="*i32", Q_IDX="*i32", FULL_Q_NUM="*i32", FULL_Q_IDX="*i32",
                     BUFS=bufs, GRADS=("*fp32",) if grads else bufs, sm_scale="fp32",
                     desc_dq=desc([1, 1, bm, d], "fp32", gl.float32) if fused else desc([1, 1, bn, d]))
    tag = f"{kind}_{mods}_d{d}_m{bm}n{bn}b{nb}w{warps}_{'even' if even else 'ragged'}"
    got = compile_for_sm90(kernel, cx, types, warps, pathlib.Path(out), tag, aligned_ints=("stride",))
    log = got["ptxas_log"]
    regs, spill = (re.search(pat, log) for pat in (r"Used (\d+) registers", r"(\d+) bytes spill stores"))
    ptx = (pathlib.Path(out) / f"{tag}.ptx").read_text()
    return dict(tag=tag, shared=got["shared"], registers=int(regs.group(1)) if regs else -1,
                spill=int(spill.group(1)) if spill else -1, serialized="serialized" in log,
                ex2=max_ex2_under_wgmma(got["sass"]), tma_reduce=ptx.count("cp.reduce.async.bulk.tensor"))


if __name__ == "__main__":
    for spec in sys.argv[2:]:
        kind, mods, *nums = spec.split(",")
        print(json.dumps(main(sys.argv[1], kind, mods, *(int(a) for a in nums))), flush=True)
