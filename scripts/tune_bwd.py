"""Sweep backward tile configs on the GPU; print, save and optionally emit the winners.

Usage (H200): PYTHONPATH=src python scripts/tune_bwd.py --out $OUT/tune_bwd.json --emit-table $OUT/bwd_table.json
then FLASHTILE_BWD_CONFIGS=$OUT/bwd_table.json python -m flashtile.bench bwd ... measures with the winners,
which go into BWD_CONFIGS in src/flashtile/kernels/attn_bwd.py with the JSON committed.

The sweep is greedy, not a product: dK/dV candidates are timed with the current dQ config, then dQ
candidates with the best dK/dV one (the two kernels run one after the other and share nothing, so
their times add). ``--fused-dq`` also times the fused dK/dV + atomic-dQ variant (no dQ kernel).
Compiling is most of a sweep's time and is CPU work: ``--jobs N`` first compiles every candidate
in N worker processes (same TRITON_CACHE_DIR), then one process times them all from the cache.
Time is the backward alone: one forward, then autograd.grad with retain_graph, median of do_bench.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import triton

import flashtile
from flashtile.backends.triton import attn_bwd as launcher
from flashtile.backends.triton import gluon_bwd, host
from flashtile.kernels.attn_bwd import ONE_LAUNCH_CANDIDATES, SHORT_SEQLEN, bwd_configs

host.REDUCE_STAGES_ON_OOR = False  # a config that does not fit is recorded as failing, never run as another

# (BLOCK_M, BLOCK_N, num_warps, num_stages). dK/dV programs own BLOCK_N keys and stream BLOCK_M
# queries; dQ programs own BLOCK_M queries and stream BLOCK_N keys. Pruned on CPU first with ptxas -v
# for sm_90a (scripts/probe_registers.py): the configs that spill least are kept.
DKDV = {
    64: [(64, 128, 8, 2), (32, 128, 8, 2), (32, 128, 4, 2), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3)],
    128: [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 2)],
    256: [(64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 8, 3), (32, 32, 4, 2), (32, 64, 8, 2)],
}
DQ = {
    64: [(128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 8, 2), (128, 64, 4, 3)],
    128: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 2), (64, 128, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2)],
    256: [(128, 64, 8, 1), (128, 32, 8, 2), (128, 32, 8, 1), (64, 64, 4, 2), (64, 64, 8, 2)],
}
# --fused-only: dK/dV configs for the fused variant (dQ added inside the dK/dV kernel by a TMA
# reduce-add per tile), those with the fewest spills in scripts/probe_registers.py fused-tma ...
# (d=128: (32,128,8,2) 176 bytes, (64,64,8,2) 276, (64,128,8,2) 512, (64,64,4,2) 908).
FUSED = {
    64: [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2)],
    128: [(32, 128, 8, 2), (64, 64, 8, 2), (64, 128, 8, 2), (64, 64, 4, 2)],
    256: [(64, 64, 8, 2), (32, 64, 8, 2)],
}


def candidates(d, fused, causal=False, s=0, one_launch=False, fused_only=False):
    """(kind, dkdv cfg or None, dq cfg or None) in sweep order; None = the winner of the earlier phase.
    With one_launch: the table's split pair, then the one-launch candidates (nothing else). With
    fused_only: the table's split pair, the fused (TMA reduce-add) candidates, and the first of them
    with per-element atomics ("fused-atomic")."""
    cur_kv, cur_q = bwd_configs("sm90", max(16, triton.next_power_of_2(d)), None, causal, s)
    if fused_only:
        return ([("split", tuple(cur_kv), tuple(cur_q))] + [("fused", kv, None) for kv in FUSED[d]]
                + [("fused-atomic", FUSED[d][0], None)])
    if one_launch:
        return [("split", tuple(cur_kv), tuple(cur_q))] + [("one", (m1, n1, w, st), (m2, n2, w, st))
                                                          for m1, n1, m2, n2, w, st in ONE_LAUNCH_CANDIDATES[d]]
    out = [("split", kv, tuple(cur_q)) for kv in DKDV[d]]
    out += [("split", None, q) for q in DQ[d]]
    if fused:
        out += [("fused", kv, None) for kv in DKDV[d]]
    return out


def time_one(q, k, v, g, out, kind, kv_cfg, q_cfg, tma, bench):
    launcher.FUSED_OVERRIDE = kind.startswith("fused")
    launcher.FUSED_DQ_TMA_OVERRIDE = False if kind == "fused-atomic" else None
    launcher.ONE_LAUNCH_OVERRIDE = kind == "one"
    launcher.CONFIG_OVERRIDE = (tuple(kv_cfg), tuple(q_cfg or kv_cfg))
    launcher.TMA_OVERRIDE = tma
    gluon_bwd.OVERRIDE = False  # these are the Triton kernels' configs (d = 128 bf16 takes Gluon by default)
    fn = lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)  # noqa: E731
    try:
        if not bench:
            fn()
            torch.cuda.synchronize()
            return None, None
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        return ms, None
    except Exception as exc:  # shared-memory or register limits: record and go on
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        launcher.CONFIG_OVERRIDE = launcher.TMA_OVERRIDE = launcher.FUSED_OVERRIDE = None
        launcher.ONE_LAUNCH_OVERRIDE = launcher.FUSED_DQ_TMA_OVERRIDE = None
        gluon_bwd.OVERRIDE = None


def inputs(d, s, causal):
    h, b = 2048 // d, 16384 // s
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
    return q, k, v, g, out, flops


def compile_shard(args, shard, nshards):
    """Worker: run every candidate (phase-2 dQ ones with each dK/dV candidate's shape) once."""
    jobs = []
    for d in args.d:
        for causal in (False, True):
            for tma in args.tma_modes:
                for kind, kv, qc in candidates(d, args.fused_dq, causal, args.s, args.one_launch, args.fused_only):
                    # dQ phase: the dK/dV config is unknown yet; the dQ kernel compiles the same for any
                    kv = kv or DKDV[d][0]
                    jobs.append((d, causal, tma, kind, kv, qc))
    for i, (d, causal, tma, kind, kv, qc) in enumerate(jobs):
        if i % nshards != shard:
            continue
        q, k, v, g, out, _ = inputs(d, args.s, causal)
        time_one(q, k, v, g, out, kind, kv, qc, tma, bench=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_bwd.json")
    ap.add_argument("--emit-table", default=None)
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--tma", choices=("off", "on", "both"), default="off",
                    help="tensor-descriptor loads in the backward (FLASHTILE_BWD_TMA)")
    ap.add_argument("--fused-dq", action="store_true", help="also time the fused dK/dV + atomic-dQ variant")
    ap.add_argument("--one-launch", action="store_true",
                    help="time only the table's split pair and the one-launch candidates; --emit-table then "
                         "writes the best one-launch pair per (d, causal), for FLASHTILE_BWD_ONE_LAUNCH=1")
    ap.add_argument("--fused-only", action="store_true",
                    help="time only the table's split pair and the fused candidates (FUSED); --emit-table "
                         "then writes the best fused dK/dV config per (d, causal), for FLASHTILE_BWD_FUSED_DQ=1")
    ap.add_argument("--jobs", type=int, default=0, help="precompile in this many worker processes first")
    ap.add_argument("--shard", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.tma_modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.tma]
    if args.shard:
        i, n = map(int, args.shard.split("/"))
        compile_shard(args, i, n)
        return
    if args.jobs > 1:
        t0 = time.time()
        argv = [a for a in sys.argv[1:]]
        procs = [subprocess.Popen([sys.executable, __file__, *argv, "--shard", f"{i}/{args.jobs}"])
                 for i in range(args.jobs)]
        codes = [p.wait() for p in procs]
        print(f"precompiled in {time.time() - t0:.0f} s on {args.jobs} workers (exit codes {codes})",
              file=sys.stderr, flush=True)
    rows, best = [], {}
    for d in args.d:
        for causal in (False, True):
            q, k, v, g, out, flops = inputs(d, args.s, causal)
            for tma in args.tma_modes:
                win_kv, win_ms = None, float("inf")
                for kind, kv, qc in candidates(d, args.fused_dq, causal, args.s, args.one_launch, args.fused_only):
                    phase = kind if kind in ("fused", "fused-atomic", "one") else "dkdv" if kv is not None else "dq"
                    if phase == "dq":
                        kv = win_kv or DKDV[d][0]
                    ms, err = time_one(q, k, v, g, out, kind, kv, qc, tma, bench=True)
                    tf = flops / ms / 1e9 if ms else None
                    row = dict(d=d, s=args.s, causal=causal, tma=tma, kind=kind, phase=phase, dkdv=kv, dq=qc, ms=ms,
                               tflops=tf, error=err)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    if phase == "dkdv" and ms and ms < win_ms:
                        win_kv, win_ms = kv, ms
                    if tf and tf > best.get((d, causal), (0,))[0]:
                        best[(d, causal)] = (tf, kind, kv, qc, tma)
            del q, k, v, g, out
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%S"), command=" ".join(sys.argv))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("best per (d, causal): TFLOP/s, kind, dkdv cfg, dq cfg, tma")
    for key, val in sorted(best.items()):
        print(key, f"{val[0]:.0f}", *val[1:])
    if args.emit_table:
        # one split-kernel row per (head dim, causal): the dK/dV config with the least time (dQ fixed),
        # then the dQ config likewise (its kernel's time does not depend on dK/dV's); rows from a
        # sweep at s <= SHORT_SEQLEN are "short" rows, used only for sequences that short
        table = {}
        short = ",short" if args.s <= SHORT_SEQLEN else ""
        for d in args.d if args.one_launch else ():
            for causal in (False, True):
                ok = {(tuple(r["dkdv"]), tuple(r["dq"])): r["ms"] for r in rows if r["d"] == d
                      and r["causal"] == causal and r["phase"] == "one" and not r["tma"] and r["ms"]}
                if ok:  # a one-launch row: use it with FLASHTILE_BWD_ONE_LAUNCH=1
                    best_kv, best_q = min(ok, key=ok.get)
                    table[f"sm90,{d},{causal}{short}"] = [list(best_kv), list(best_q)]
        for d in args.d if args.fused_only else ():
            for causal in (False, True):
                ok = {tuple(r["dkdv"]): r["ms"] for r in rows if r["d"] == d and r["causal"] == causal
                      and r["phase"] == "fused" and not r["tma"] and r["ms"]}
                if ok:  # the dQ entry is unused by the fused variant: the table's, for the split
                    cur_q = bwd_configs("sm90", max(16, triton.next_power_of_2(d)), None, causal, args.s)[1]
                    table[f"sm90,{d},{causal}{short}"] = [list(min(ok, key=ok.get)), list(cur_q)]
        for d in () if args.fused_only or args.one_launch else args.d:
            for causal in (False, True):
                pick = []
                for phase in ("dkdv", "dq"):
                    ok = {tuple(r[phase]): r["ms"] for r in rows
                          if r["d"] == d and r["causal"] == causal and r["phase"] == phase and not r["tma"] and r["ms"]}
                    pick.append(list(min(ok, key=ok.get)) if ok else None)
                if all(pick):
                    table[f"sm90,{d},{causal}{short}"] = pick
        with open(args.emit_table, "w") as f:
            json.dump(table, f, indent=1)
        print("table:", json.dumps(table))
    os.environ.pop("FLASHTILE_BWD_FUSED_DQ", None)


if __name__ == "__main__":
    main()
