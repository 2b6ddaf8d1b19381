"""Compile the Gluon warps-along-keys decode kernel for sm_90 without a GPU (run as a script in a subprocess,
TRITON_INTERPRET unset): python tests/aot_gluon_decode.py HEAD_DIM BLOCK_N NUM_BUFFERS HAS_SEQLENS [EARLY_REFILL]
Prints SHARED <bytes> REGISTERS <n> SPILL_STORES <bytes> LDGSTS <n> HMMA <n> LOOP_BARRIERS <n>: CTA barriers in
the SASS between the key loop's first copy wait (DEPBAR) and its back edge."""

import pathlib
import re
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from gluon_aot import ptxas_log  # this script runs from tests/ (its folder is on sys.path)

TYPES = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "SEQLENS": "*i32", "qk_scale": "fp32"}


def main(head_dim: int, block_n: int, buffers: int, has_seqlens: bool, early_refill: bool = False):
    from flashtile.kernels.gluon_decode_warp_keys import _gluon_decode_warp_keys_kernel as kernel

    cx = dict(HEAD_DIM=head_dim, BLOCK_N=block_n, NUM_BUFFERS=buffers, HAS_SEQLENS=has_seqlens,
              EARLY_REFILL=early_refill)
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in cx:
            sig[name] = "constexpr"
            consts[(i,)] = cx[name]
        else:
            sig[name] = TYPES.get(name, "i32")
        # as the JIT specialises aligned tensors and strides (16-byte copies need both)
        if sig[name].startswith("*") or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(GluonASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4))
    with tempfile.TemporaryDirectory() as tmp:
        log = ptxas_log(compiled.asm["ptx"], pathlib.Path(tmp), "kernel")
    regs, spill = (re.search(pat, log) for pat in (r"Used (\d+) registers", r"(\d+) bytes spill stores"))
    sass = compiled.asm["sass"]
    loop = sass[sass.find("DEPBAR"):]
    loop = loop[:loop.find("BRA", loop.find("HMMA"))] if "HMMA" in loop else loop
    print("SHARED", compiled.metadata.shared, "REGISTERS", regs.group(1) if regs else -1,
          "SPILL_STORES", spill.group(1) if spill else 0, "LDGSTS", sass.count("LDGSTS"), "HMMA", sass.count("HMMA"),
          "LOOP_BARRIERS", loop.count("BAR.SYNC"))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5:6] == ["1"])
