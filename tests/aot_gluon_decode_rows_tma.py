"""Compile the whole-row Gluon decode kernel with TMA copies (kernels/gluon_decode_rows_tma.py) for sm_90 without a
GPU (run as a script in a subprocess, TRITON_INTERPRET unset):
    python tests/aot_gluon_decode_rows_tma.py HEADS HEAD_DIM K_SLOTS V_SLOTS
Prints the build summary of gluon_aot.decode_build_summary (shared memory, registers, spills, ...) and the
SASS's LDSM (ldmatrix) and UTMALDG (TMA copy) counts."""

import pathlib
import re
import sys
import tempfile

from gluon_aot import compile_for_sm90, decode_build_summary  # this script runs from tests/ (on sys.path)


def main(heads: int, head_dim: int, k_slots: int, v_slots: int):
    import triton.experimental.gluon.language as gl

    from flashtile.kernels.gluon_decode_rows_tma import _gluon_decode_rows_tma_kernel as kernel

    block = [1, heads, 16, 64]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    desc = f"tensordesc<bf16[{','.join(map(str, block))}],{layout!r}>"
    types = {"Q": "*bf16", "desc_k": desc, "desc_v": desc, "O_PART": "*fp32", "LSE_PART": "*fp32",
             "SEQLENS": "*i32", "qk_scale": "fp32"}
    cx = dict(HEADS=heads, HEAD_DIM=head_dim, K_SLOTS=k_slots, V_SLOTS=v_slots, HAS_SEQLENS=True)
    with tempfile.TemporaryDirectory() as tmp:
        got = compile_for_sm90(kernel, cx, types, heads, pathlib.Path(tmp), "kernel", aligned_ints=("stride",))
    sass = got["sass"]
    print(decode_build_summary(got), "LDSM", len(re.findall(r"\bLDSM", sass)), "UTMALDG",
          len(re.findall(r"\bUTMALDG", sass)))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]))
