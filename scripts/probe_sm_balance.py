"""Is a read's time set by its slowest SMs? Does giving each SM work by its own speed beat the flat read? (session 27)

Usage: PYTHONPATH=src python scripts/probe_sm_balance.py --out sm_balance.json [--gib 8 1] [--rounds 3]

Session 27's stamps (lease A27, b = 32, 64k) showed the row kernels' programs end their loops at times set by the SM
they run on, the same SMs in every layer and kernel: about 24 SMs end 170-200 us before the rest (1670 against 1860
us), and the SMs of one group end 130 us early only when the split kernel leaves 4 of its SMs idle. So bandwidth is
shared within groups of SMs, and a static even split waits for the slowest group. This probe measures what an
uneven split is worth, on a plain read (no attention), one program an SM (a 3-stage ring of two 32 KB tiles):
- ``even``: 132 programs, equal tile ranges by program id (the flat read of probe_read_ceiling);
- ``by_sm``: each program reads its SM id (%smid) and takes the range of a table indexed by it, weighted by
  1 / (the SM's loop time in ``even``): faster SMs read more;
- ``by_sm2``: the table refined once more from ``by_sm``'s own per-SM times;
- ``idle_hw_four`` / ``idle_fastest_four``: 132 programs by SM id with 4 empty ranges, on the SMs a 128-program read
  leaves idle or on the 4 fastest, the rest even (added after session 27's runs, for boards like E26 where 128
  programs read 1.9% slower: does it matter which SMs idle?).
Every variant's lane-wise XOR over all programs must equal ``even``'s (each tile read once, whatever the split), and
the SM ids of a launch must be distinct (one program an SM), or the table would read a range twice; both are
checked. Timings are CUDA-graph replays of 4 chained reads, the variants alternating in rounds.
"""

import argparse
import json
import sys

import torch
import triton
import triton.language as tl
from probe_read_ceiling import _globaltimer

from flashtile.bench.report import collect_meta
from flashtile.bench.timing import bench_graph

BLOCK = 16384  # int16 words a tile: 32 KB
STAGES = 3


@triton.jit
def _read_ranges(k_ptr, v_ptr, out_ptr, bounds_ptr, stamps_ptr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
                 BY_SM: tl.constexpr):
    pid = tl.program_id(0)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
    t_start = _globaltimer()
    if BY_SM:
        slot = sm
    else:
        slot = pid
    t0 = tl.load(bounds_ptr + slot)
    t1 = tl.load(bounds_ptr + slot + 1)
    offs = t0.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    kp = k_ptr + offs
    vp = v_ptr + offs
    acc = tl.zeros([BLOCK], tl.int16)
    for _ in tl.range(t0, t1, num_stages=STAGES):
        acc ^= tl.load(kp)
        acc ^= tl.load(vp)
        kp += BLOCK
        vp += BLOCK
    tl.store(out_ptr + pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK), acc)
    t_end = _globaltimer()
    if stamps_ptr is not None:
        tl.store(stamps_ptr + pid * 3, t_start)
        tl.store(stamps_ptr + pid * 3 + 1, t_end)
        tl.store(stamps_ptr + pid * 3 + 2, sm.to(tl.int64))


def bounds_from(weights: torch.Tensor, n_tiles: int) -> torch.Tensor:
    """Slot i reads tiles [b[i], b[i + 1]): shares proportional to ``weights`` (float, one a slot), int32 on GPU."""
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), weights.double().cumsum(0)])
    b = torch.round(cum / cum[-1] * n_tiles).to(torch.int64)
    b[-1] = n_tiles
    return b.to(torch.int32).cuda()


def launch(k16, v16, out, bounds, stamps, programs, by_sm):
    _read_ranges[(programs,)](k16, v16, out, bounds, stamps, BLOCK=BLOCK, STAGES=STAGES, BY_SM=by_sm,
                              num_warps=8, num_stages=1)


def per_sm_times(k16, v16, out, bounds, programs, by_sm, sms, repeats=5):
    """Median over ``repeats`` eager launches of each SM's loop time (us), and whether every launch put its
    programs on distinct SMs; also the lane XOR of the last launch (the coverage check)."""
    stamps = torch.full((programs, 3), -1, dtype=torch.int64, device="cuda")
    times = []
    distinct = True
    for _ in range(repeats):
        stamps.fill_(-1)
        launch(k16, v16, out, bounds, stamps, programs, by_sm)
        torch.cuda.synchronize()
        st = stamps.cpu()
        distinct &= len(set(st[:, 2].tolist())) == programs
        t = torch.full((sms,), float("nan"), dtype=torch.float64)
        t[st[:, 2]] = (st[:, 1] - st[:, 0]).double() / 1e3
        times.append(t)
    med = torch.stack(times).median(0).values
    xor = out[:programs * BLOCK].view(programs, BLOCK)
    lane = xor[0].clone()
    for i in range(1, programs):
        lane ^= xor[i]
    return med, distinct, lane


def time_reads(k16, v16, out, bounds, programs, by_sm) -> float:
    """us a read, from CUDA-graph replays of 4 chained reads."""
    return bench_graph(lambda: [launch(k16, v16, out, bounds, None, programs, by_sm) for _ in range(4)],
                       "cuda", 25, 100) * 1e3 / 4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=float, nargs="+", default=[8.0, 1.0], help="bytes read a call (K + V), GiB")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    meta = collect_meta(sys.argv, "cuda")
    meta["command"] = "PYTHONPATH=src python scripts/probe_sm_balance.py " + " ".join(sys.argv[1:])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for gib in args.gib:
        n_tiles = int(gib * 2**30 / 2 / (2 * BLOCK))
        k16 = torch.randint(-2**15, 2**15, (n_tiles * BLOCK,), dtype=torch.int16, device="cuda")
        v16 = torch.randint(-2**15, 2**15, (n_tiles * BLOCK,), dtype=torch.int16, device="cuda")
        out = torch.zeros(sms * BLOCK, dtype=torch.int16, device="cuda")
        even = bounds_from(torch.ones(sms), n_tiles)
        even128 = bounds_from(torch.ones(128), n_tiles)
        launch(k16, v16, out, even, None, sms, False)  # compile
        t_even, _, lane_even = per_sm_times(k16, v16, out, even, sms, False, sms)
        w1 = 1.0 / t_even
        by_sm = bounds_from(w1, n_tiles)
        t_by, distinct1, lane1 = per_sm_times(k16, v16, out, by_sm, sms, True, sms)
        w2 = w1 * (t_by.mean() / t_by)
        by_sm2 = bounds_from(w2, n_tiles)
        t_by2, distinct2, lane2 = per_sm_times(k16, v16, out, by_sm2, sms, True, sms)
        # 128 programs: which 4 SMs the hardware leaves idle, and how the others of their group answer (NaN: idle)
        t_128, _, _ = per_sm_times(k16, v16, out, even128, 128, False, sms)
        # 4 SMs idle by choice (132 programs, 4 empty ranges): the hardware's idle four (is a 128-program read's time
        # about which SMs idle?) and the 4 fastest (idle SMs where bandwidth is left over): for boards like E26
        idle_hw = bounds_from(torch.where(torch.isnan(t_128), 0.0, 1.0), n_tiles)
        idle_fast = bounds_from(torch.ones(sms).index_fill_(0, torch.argsort(t_even)[:sms - 128], 0.0), n_tiles)
        _, distinct3, lane3 = per_sm_times(k16, v16, out, idle_hw, sms, True, sms)
        _, distinct4, lane4 = per_sm_times(k16, v16, out, idle_fast, sms, True, sms)
        row = {"gib": gib, "tiles": n_tiles,
               "coverage_ok": all(torch.equal(x, lane_even) for x in (lane1, lane2, lane3, lane4)),
               "distinct_sms": bool(distinct1 and distinct2 and distinct3 and distinct4),
               "per_sm_us": {"even": t_even.tolist(), "by_sm": t_by.tolist(), "by_sm2": t_by2.tolist(),
                             "even_P128": t_128.tolist()},
               "spread_us": {n: [t.min().item(), t.median().item(), t.max().item()]
                             for n, t in (("even", t_even), ("by_sm", t_by), ("by_sm2", t_by2))},
               "rounds_us": {}}
        variants = {"even_P132": (even, sms, False), "even_P128": (even128, 128, False),
                    "by_sm": (by_sm, sms, True), "by_sm2": (by_sm2, sms, True), "idle_hw_four": (idle_hw, sms, True),
                    "idle_fastest_four": (idle_fast, sms, True)}
        for r in range(args.rounds):
            names = list(variants)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                bounds, programs, flag = variants[name]
                us = time_reads(k16, v16, out, bounds, programs, flag)
                row["rounds_us"].setdefault(name, []).append(us)
        row["us"] = {n: sorted(v)[len(v) // 2] for n, v in row["rounds_us"].items()}
        row["tb_s"] = {n: 2 * n_tiles * BLOCK * 2 / (us * 1e-6) / 1e12 for n, us in row["us"].items()}
        rows.append(row)
        print(f"{gib} GiB: coverage {row['coverage_ok']}, distinct SMs {row['distinct_sms']}, per-SM loop us "
              f"(min / median / max) {({n: [round(x, 1) for x in v] for n, v in row['spread_us'].items()})}",
              flush=True)
        for n, us in sorted(row["us"].items(), key=lambda kv: kv[1]):
            print(f"  {n:12s} {us:9.1f} us  {row['tb_s'][n]:.3f} TB/s  rounds "
                  f"{[round(x, 1) for x in row['rounds_us'][n]]}", flush=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        del k16, v16
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
