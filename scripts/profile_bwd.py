"""Where does an eager training step's time go? (GPU; diagnoses eager-vs-graph backward gaps)

Usage: PYTHONPATH=src python scripts/profile_bwd.py [--rows 128,512,32,16,0 ...] [--out f.json]

A row is d,s,b,h,causal. For each row the same flashtile forward + backward step is timed five ways:
  backward   attn(q, k, v).backward(do) through do_bench (what `bench bwd` times, L2 flushed), first
             right after compilation, again at the end of the row
  grad       torch.autograd.grad(attn(q, k, v), (q, k, v), do): no AccumulateGrad into .grad
  graph      the grad step replayed as a CUDA graph: kernels alone, no host path
  enqueue    host time to enqueue one step (perf_counter, no sync, averaged over 20 steps after a
             sync): if it exceeds the graph time, the step is host-bound
  kernels    torch.profiler's sum of CUDA kernel time for one step, and the kernels by name
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime

import torch
from torch.profiler import ProfilerActivity, profile

import flashtile
from flashtile.bench.timing import bench, bench_graph

DEFAULT_ROWS = ["64,512,32,32,0", "128,512,32,16,0", "128,512,32,16,1", "256,512,32,8,1", "256,512,32,8,0"]


def _inputs(d, s, b, h):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    return q, k, v, do


def _enqueue_us(step, n=20) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def _kernels(step):
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        cuda_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if cuda_us and e.key and not e.key.startswith(("aten::", "cudaLaunch", "cuLaunch")):
            rows.append((e.key[:90], e.count, round(cuda_us, 1)))
    rows.sort(key=lambda r: -r[2])
    return rows


def _profile_row(d, s, b, h, causal) -> dict:
    q, k, v, do = _inputs(d, s, b, h)

    def attn():
        return flashtile.flash_attn_func(q, k, v, causal=bool(causal))

    def step_backward():
        attn().backward(do)

    def step_grad():
        return torch.autograd.grad(attn(), (q, k, v), do)

    row = {"d": d, "s": s, "b": b, "h": h, "causal": bool(causal)}
    row["backward_ms"] = bench(step_backward, "cuda", grad_to_none=[q, k, v])
    row["grad_ms"] = bench(step_grad, "cuda")
    row["graph_ms"] = bench_graph(step_grad, "cuda")
    row["enqueue_us"] = _enqueue_us(step_grad)
    row["enqueue_backward_us"] = _enqueue_us(step_backward)
    # again, last: a first timing right after compilation can catch the GPU at idle clocks
    row["backward_again_ms"] = bench(step_backward, "cuda", grad_to_none=[q, k, v])
    kern = _kernels(step_grad)
    row["kernels"] = kern
    row["kernel_sum_ms"] = round(sum(r[2] for r in kern) / 1e3, 4)
    print(f"d={d} s={s} b={b} h={h} causal={causal}: backward {row['backward_ms']:.3f} ms "
          f"(again {row['backward_again_ms']:.3f}) | grad {row['grad_ms']:.3f} | graph {row['graph_ms']:.3f} | "
          f"enqueue {row['enqueue_us']:.0f} us (.backward {row['enqueue_backward_us']:.0f}) | "
          f"kernels {row['kernel_sum_ms']:.3f} ms", flush=True)
    for name, count, us in kern[:8]:
        print(f"    {us:9.1f} us  x{count}  {name}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=DEFAULT_ROWS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = [_profile_row(*(int(x) for x in spec.split(","))) for spec in args.rows]
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "date": datetime.now().isoformat(timespec="seconds"), "command": "scripts/profile_bwd.py"}
        import triton

        meta["triton"] = triton.__version__
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
