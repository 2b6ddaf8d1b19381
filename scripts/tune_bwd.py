"""Sweep backward tile configs on the GPU; print, save and optionally emit the winners.

Usage (H200): PYTHONPATH=src python scripts/tune_bwd.py --out $OUT/tune_bwd.json --emit-table $OUT/bwd_table.json
then FLASHTILE_BWD_CONFIGS=$OUT/bwd_table.json python -m flashtile.bench bwd ... measures with the winners,
which go into BWD_CONFIGS in src/flashtile/kernels/attn_bwd.py with the JSON committed.

The sweep is greedy, not a product: dK/dV candidates are timed with the current dQ config, then dQ
candidates with the best dK/dV one (the two kernels run one after the other and share nothing, so
their times add). The Triton dK/dV kernel is timed even where the Gluon one is the default route.
Compiling is most of a sweep's time and is CPU work: ``--jobs N`` first compiles every candidate
in N worker processes (same TRITON_CACHE_DIR), then one process times them all from the cache.
Time is the backward alone: one forward, then autograd.grad with retain_graph, median of do_bench.
"""

import argparse
import json
import subprocess
import sys
import time

import torch
import triton

import flashtile
from flashtile import config
from flashtile.kernels.attn_bwd import SHORT_SEQLEN, bwd_configs

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


def candidates(d, causal=False, s=0):
    """(dkdv cfg or None, dq cfg) in sweep order; None = the winner of the dK/dV phase."""
    _, cur_q = bwd_configs("sm90", max(16, triton.next_power_of_2(d)), None, causal, s)
    return [(kv, tuple(cur_q)) for kv in DKDV[d]] + [(None, q) for q in DQ[d]]


def time_one(q, k, v, g, out, kv_cfg, q_cfg, bench):
    fn = lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)  # noqa: E731
    # the Triton kernels' configs (d = 128 / 256 take the Gluon dK/dV kernel by default); a config that
    # does not fit is recorded as failing, never run as another
    pin = dict(bwd_tiles=(tuple(kv_cfg), tuple(q_cfg)), gluon_bwd=False, reduce_stages_on_oor=False)
    try:
        with config.override(**pin):
            if not bench:
                fn()
                torch.cuda.synchronize()
                return None, None
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), None
    except Exception as exc:  # shared-memory or register limits: record and go on
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


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
            for kv, qc in candidates(d, causal, args.s):
                # dQ phase: the dK/dV config is unknown yet; the dQ kernel compiles the same for any
                jobs.append((d, causal, kv or DKDV[d][0], qc))
    for i, (d, causal, kv, qc) in enumerate(jobs):
        if i % nshards != shard:
            continue
        q, k, v, g, out, _ = inputs(d, args.s, causal)
        time_one(q, k, v, g, out, kv, qc, bench=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_bwd.json")
    ap.add_argument("--emit-table", default=None)
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--jobs", type=int, default=0, help="precompile in this many worker processes first")
    ap.add_argument("--shard", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
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
            win_kv, win_ms = None, float("inf")
            for kv, qc in candidates(d, causal, args.s):
                phase = "dkdv" if kv is not None else "dq"
                if phase == "dq":
                    kv = win_kv or DKDV[d][0]
                ms, err = time_one(q, k, v, g, out, kv, qc, bench=True)
                tf = flops / ms / 1e9 if ms else None
                row = dict(d=d, s=args.s, causal=causal, phase=phase, dkdv=kv, dq=qc, ms=ms, tflops=tf, error=err)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                if phase == "dkdv" and ms and ms < win_ms:
                    win_kv, win_ms = kv, ms
                if tf and tf > best.get((d, causal), (0,))[0]:
                    best[(d, causal)] = (tf, kv, qc)
            del q, k, v, g, out
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%S"), command=" ".join(sys.argv))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("best per (d, causal): TFLOP/s, dkdv cfg, dq cfg")
    for key, val in sorted(best.items()):
        print(key, f"{val[0]:.0f}", *val[1:])
    if args.emit_table:
        # one split-kernel row per (head dim, causal): the dK/dV config with the least time (dQ fixed),
        # then the dQ config likewise (its kernel's time does not depend on dK/dV's); rows from a
        # sweep at s <= SHORT_SEQLEN are "short" rows, used only for sequences that short
        table = {}
        short = ",short" if args.s <= SHORT_SEQLEN else ""
        for d in args.d:
            for causal in (False, True):
                pick = []
                for phase in ("dkdv", "dq"):
                    ok = {tuple(r[phase]): r["ms"] for r in rows
                          if r["d"] == d and r["causal"] == causal and r["phase"] == phase and r["ms"]}
                    pick.append(list(min(ok, key=ok.get)) if ok else None)
                if all(pick):
                    table[f"sm90,{d},{causal}{short}"] = pick
        with open(args.emit_table, "w") as f:
            json.dump(table, f, indent=1)
        print("table:", json.dumps(table))


if __name__ == "__main__":
    main()
