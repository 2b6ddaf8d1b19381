"""The decode kernel's sm_90 build per variant, on a machine without a GPU: shared memory, registers and
spill stores (ptxas -v), TMA bulk copies, 16-byte cp.async copies and the instruction count of each loop
body in the PTX (through tests/aot_sm90.py and ptxas). The split kernel of a b = 1 step (d = 128, bf16,
16 splits, 128-key tiles, 16-row query tiles, PDL), as the H200 runs it, and b = 32's unsplit 2-stage
launch at 128- and 64-key tiles; a loop's count is per tile, with its CTA barriers (bar.sync) in
brackets. (Session 16's warp-split interior, measured slower on the H200 in session 17 and removed, is in
git at be81282.)

Usage: python scripts/probe_decode_ptx.py [VARIANT ...]      (TRITON_INTERPRET unset; default: all)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = dict(HEAD_DIM=128, BLOCK_M=16, BLOCK_N=128, BLOCK_D=128, NUM_SPLITS=16, PAGED=False, PAGE_ALIGNED=False,
            PAGE_SHIFT=-1, HAS_SEQLENS=True, HAS_BATCH_IDX=False, HAS_LEFTPAD=False, HAS_LEFT=False,
            HAS_RIGHT=False, HAS_SOFTCAP=False, HAS_ALIBI=False, ROTARY_DIM=0, ROTARY_INTERLEAVED=False,
            ROTARY_PER_TOKEN=False, DOT_PRECISION="tf32", IS_FP8=False, FUSED_NEW=False, FUSED_COMBINE=False,
            USE_PDL=True)
P16 = dict(PAGED=True, PAGE_SHIFT=4, PAGES_PER_TILE=8)
# name: (constexprs over BASE, descriptor box rows or None, warps, stages): the launcher's choices
VARIANTS = {
    "contiguous_tma": (dict(USE_TMA=True), 128, 4, 3),
    "contiguous_pointer": ({}, None, 4, 3),
    "p256_tma": (dict(PAGED=True, PAGE_ALIGNED=True, PAGE_SHIFT=8, USE_TMA=True), 128, 4, 5),
    "p16_gather": (P16, None, 4, 5),
    # b = 32's unsplit 2-stage launch at 128- and 64-key tiles
    "b32_pointer": (dict(NUM_SPLITS=1, USE_PDL=False), None, 4, 2),
    "b32_n64_pointer": (dict(NUM_SPLITS=1, USE_PDL=False, BLOCK_N=64), None, 4, 2),
}
INTS = {"SEQLENS": "*i32", "BATCH_IDX": "*i32", "LEFTPAD": "*i32", "BLOCK_TABLE": "*i32", "O_PART": "*fp32",
        "LSE_PART": "*fp32", "COS": "*fp32", "SIN": "*fp32", "Q_DESCALE": "*fp32", "K_DESCALE": "*fp32",
        "V_DESCALE": "*fp32", "COUNTER": "*i32"}


def probe(name: str) -> dict:
    cx, box, warps, stages = VARIANTS[name]
    types = dict(INTS)
    if box is not None:
        types.update(DESC_K=f"tensordesc<bf16[1,{box},1,128]>", DESC_V=f"tensordesc<bf16[1,{box},1,128]>")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["PYTHONPATH"] = str(ROOT / "src")
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "aot_sm90.py"), "flashtile.kernels.decode",
                          "_decode_kernel", json.dumps(dict(BASE, **cx)), json.dumps(types), str(warps), str(stages)],
                         capture_output=True, text=True, env=env, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"{name}: {res.stderr[-2000:]}")
    f = res.stdout.split()
    return dict(zip(f[::2], f[1::2]))


def main():
    names = sys.argv[1:] or list(VARIANTS)
    head = f"{'variant':24} {'warps':>5} {'stages':>6} {'smem B':>7} {'regs':>5} {'spill':>5} {'bulk':>5} {'cp16':>5}"
    print(head + "  loop bodies (PTX instructions; bar.sync a trip)")
    for name in names:
        r = probe(name)
        _, _, warps, stages = VARIANTS[name]
        loops = f"{r['LOOPS']} ({r['LOOP_BARRIERS']})"
        print(f"{name:24} {warps:>5} {stages:>6} {r['SHARED']:>7} {r['REGISTERS']:>5} {r['SPILL_STORES']:>5} "
              f"{r['BULK']:>5} {r['CP_ASYNC_16']:>5}  {loops}",
              flush=True)


if __name__ == "__main__":
    main()
