"""Compile the warp-specialised Gluon forward (kernels/gluon_fwd_ws.py) for sm_90 without a GPU, at the launcher's
register cap (run as a script in a subprocess, TRITON_INTERPRET unset):
    python tests/aot_gluon_fwd_ws.py HEAD_DIM BLOCK_N NUM_BUFFERS CAUSAL [BLOCK_M]
Prints SHARED <bytes> REGISTERS <n> SPILL_STORES <bytes> CONSUMER_REGS <n> LOADER_REGS <n> EX2_UNDER_WGMMA <n>
C7512 <0/1> C7514 <0/1>: the setmaxnreg counts the two partitions take, the most exp2 between a wgmma and the wait
that retires it (the softmax under the tensor cores), and ptxas's two wgmma-serialisation warnings."""

import pathlib
import re
import sys
import tempfile

from gluon_aot import compile_for_sm90  # this script runs from tests/ (on sys.path)


def main(d: int, block_n: int, buffers: int, causal: bool, block_m: int = 64):
    import triton.experimental.gluon.language as gl

    from flashtile.backends.triton.gluon_fwd import WS_MAXNREG
    from flashtile.kernels.gluon_fwd_ws import _gluon_attn_fwd_ws_kernel as kernel

    def desc(block):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        return f"tensordesc<bf16[{','.join(map(str, block))}],{layout!r}>"

    types = dict(desc_q=desc([1, block_m, 1, d]), desc_o=desc([1, block_m, 1, d]), desc_k=desc([1, block_n, 1, d]),
                 desc_v=desc([1, block_n, 1, d]), LSE="*fp32", qk_scale="fp32")
    cx = dict(HEAD_DIM=d, BLOCK_N=block_n, NUM_BUFFERS=buffers, CAUSAL=causal)
    with tempfile.TemporaryDirectory() as tmp:
        got = compile_for_sm90(kernel, cx, types, block_m // 16, pathlib.Path(tmp), "kernel",
                               maxnreg=WS_MAXNREG[block_m])
        ptx = (pathlib.Path(tmp) / "kernel.ptx").read_text()
    log, sass = got["ptxas_log"], got["sass"]
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    counts = [int(x) for x in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)]
    lows = [int(x) for x in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx)]
    best, live, count = 0, False, 0
    for line in sass.splitlines():
        if "HGMMA" in line:
            live = True
        elif "WARPGROUP.DEPBAR" in line:
            best, live, count = max(best, count), False, 0
        elif "MUFU.EX2" in line and live:
            count += 1
    print(f"SHARED {got['shared']} REGISTERS {regs.group(1) if regs else -1} "
          f"SPILL_STORES {spill.group(1) if spill else 0} CONSUMER_REGS {max(counts, default=-1)} "
          f"LOADER_REGS {min(lows, default=-1)} EX2_UNDER_WGMMA {best} "
          f"C7512 {int('C7512' in log)} C7514 {int('C7514' in log)}")


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), int(a[2]), a[3] == "1", *(int(x) for x in a[4:5]))
