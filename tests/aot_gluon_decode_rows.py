"""Compile the whole-row Gluon decode kernel (kernels/gluon_decode_rows.py) for sm_90 without a GPU (run as a
script in a subprocess, TRITON_INTERPRET unset):
    python tests/aot_gluon_decode_rows.py HEADS HEAD_DIM
Prints SHARED <bytes> REGISTERS <n> SPILL_STORES <bytes> LDGSTS <n> HMMA <n> LOOP_BARRIERS <n>: CTA barriers in
the SASS between the key loop's first copy wait (DEPBAR) and its back edge."""

import pathlib
import sys
import tempfile

from gluon_aot import compile_for_sm90, decode_build_summary  # this script runs from tests/ (on sys.path)

TYPES = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O_PART": "*fp32", "LSE_PART": "*fp32", "SEQLENS": "*i32",
         "qk_scale": "fp32"}


def main(heads: int, head_dim: int):
    from flashtile.kernels.gluon_decode_rows import _gluon_decode_rows_kernel as kernel

    cx = dict(HEADS=heads, HEAD_DIM=head_dim, HAS_SEQLENS=True)
    with tempfile.TemporaryDirectory() as tmp:
        got = compile_for_sm90(kernel, cx, TYPES, heads, pathlib.Path(tmp), "kernel", aligned_ints=("stride",))
    print(decode_build_summary(got))

if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
