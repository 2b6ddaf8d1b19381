"""Compile the Gluon MLA decode kernel (kernels/gluon_decode_mla.py) for sm_90 without a GPU; used by
tests/test_gluon_mla_compile.py in a subprocess (TRITON_INTERPRET must be unset there).

    python tests/aot_gluon_mla.py OUT BLOCK_N NUM_BUFFERS NUM_SPLITS PAGED CAUSAL

Prints one JSON line: {"tag", "shared", "regs", "spill_bytes", "serialized", "hgmma"}.
"""

import json
import pathlib
import re
import sys


def main():
    import triton.experimental.gluon.language as gl

    from flashtile.kernels.gluon_decode_mla import V_BOX_COLS, _gluon_mla_decode_kernel
    from gluon_aot import compile_for_sm90

    out = pathlib.Path(sys.argv[1])
    bn, nb, splits, paged, causal = (int(x) for x in sys.argv[2:7])

    def desc(block):  # what the JIT derives from a gluon TensorDescriptor of bf16 rows
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        return f"tensordesc<bf16[{','.join(map(str, block))}],{layout!r}>"

    types = dict(desc_k=desc([bn, 64]), desc_v=desc([bn, V_BOX_COLS]), Q="*bf16", QV="*bf16", O="*bf16",
                 LSE="*fp32", O_PART="*fp32", LSE_PART="*fp32", SEQLENS="*i32", BLOCK_TABLE="*i32", qk_scale="fp32")
    constexprs = dict(HEAD_DIM=64, HEAD_DIM_V=512, BLOCK_N=bn, NUM_BUFFERS=nb, NUM_SPLITS=splits, PAGED=bool(paged),
                      HAS_SEQLENS=True, CAUSAL=bool(causal))
    tag = f"mla_n{bn}_b{nb}_s{splits}_p{paged}_c{causal}"
    row = compile_for_sm90(_gluon_mla_decode_kernel, constexprs, types, 8, out, tag, aligned_ints=("stride",))
    log = row["ptxas_log"]
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    print(json.dumps(dict(tag=tag, shared=row["shared"], regs=regs, spill_bytes=spill,
                          serialized="serialized" in log, hgmma=row["sass"].count("HGMMA"))))


if __name__ == "__main__":
    main()
