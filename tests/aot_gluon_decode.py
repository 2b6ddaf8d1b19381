"""Compile the Gluon warps-along-keys decode kernel for sm_90 without a GPU (run as a script in a subprocess,
TRITON_INTERPRET unset):
    python tests/aot_gluon_decode.py HEAD_DIM BLOCK_N NUM_BUFFERS HAS_SEQLENS [FUSED_NEW [GROUP_ROWS [EARLY_TILES
        [NUM_SPLITS]]]]
Prints SHARED <bytes> REGISTERS <n> SPILL_STORES <bytes> LDGSTS <n> HMMA <n> LOOP_BARRIERS <n> GDC <n>: CTA barriers
in the SASS between the key loop's first copy wait (DEPBAR) and its back edge, and griddepcontrol instructions in
the PTX."""

import pathlib
import sys
import tempfile

from gluon_aot import compile_for_sm90, decode_build_summary  # this script runs from tests/ (on sys.path)

TYPES = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "SEQLENS": "*i32", "K_NEW": "*bf16",
         "V_NEW": "*bf16", "qk_scale": "fp32"}


def main(head_dim: int, block_n: int, buffers: int, has_seqlens: bool, fused_new: bool = False,
         group_rows: int = 16, early_tiles: bool = False, splits: int = 1):
    from flashtile.kernels.gluon_decode_warp_keys import _gluon_decode_warp_keys_kernel as kernel

    cx = dict(HEAD_DIM=head_dim, BLOCK_N=block_n, NUM_BUFFERS=buffers, HAS_SEQLENS=has_seqlens,
              FUSED_NEW=fused_new, GROUP_ROWS=group_rows, EARLY_TILES=early_tiles, NUM_SPLITS=splits,
              MERGE_EARLY=splits > 1)
    with tempfile.TemporaryDirectory() as tmp:
        # strides marked aligned as the JIT does for multiples of 16 (16-byte copies need it)
        got = compile_for_sm90(kernel, cx, TYPES, 4, pathlib.Path(tmp), "kernel", aligned_ints=("stride",))
        ptx = (pathlib.Path(tmp) / "kernel.ptx").read_text()
    print(decode_build_summary(got), "GDC", ptx.count("griddepcontrol."))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5:6] == ["1"],
         int(sys.argv[6]) if len(sys.argv) > 6 else 16, sys.argv[7:8] == ["1"],
         int(sys.argv[8]) if len(sys.argv) > 8 else 1)
