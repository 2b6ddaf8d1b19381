"""A plain streaming read of two buffers, split evenly among a grid's programs: the board probe's kernel
(backends/triton/board.py times it on 128 and 132 programs). Its shape is scripts/probe_sm_balance.py's even read
(32 KB tiles of int16 words, a 3-deep copy ring, 8 warps), whose 128- and 132-program times the board classes were
told apart by (session 29)."""

import triton
import triton.language as tl


@triton.jit
def _grid_read_kernel(a_ptr, b_ptr, out_ptr, tiles, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    # program p reads tiles [p * tiles / P, (p + 1) * tiles / P) of both buffers, BLOCK words a tile; the XOR keeps
    # the loads live (nothing reads ``out``)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    t0 = ((pid.to(tl.int64) * tiles) // programs).to(tl.int32)
    t1 = (((pid.to(tl.int64) + 1) * tiles) // programs).to(tl.int32)
    offs = t0.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int16)
    for _ in tl.range(t0, t1, num_stages=STAGES):
        acc ^= tl.load(a_ptr + offs)
        acc ^= tl.load(b_ptr + offs)
        offs += BLOCK
    tl.store(out_ptr + pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK), acc)
