"""Kernel timeline of decode calls inside a CUDA graph of layers: where does a call's time go beyond its kernels?

For each case (flashtile with the environment settings given, or SDPA's cuDNN backend on head-major copies, as
`bench decode` times them) at each batch / length, the script captures `--layers` calls on separate caches into
one graph, replays it under torch.profiler (CUPTI records every kernel inside a graph) and reports, per call:
the span from the first kernel's start to the last one's end divided by the layers, each kernel's mean duration
by name, and the mean gap between consecutive kernels. GQA 32 / 8, d = 128, bf16, one query token.

    PYTHONPATH=src python scripts/probe_decode_timeline.py --out timeline.json \\
        --case default: --case tma:FLASHTILE_DECODE_GLUON_ROWS=1 --case cudnn --batch 32 --seqlens 16384 131072
A case is NAME:VAR=VALUE,VAR=VALUE (flashtile under those settings, read by every call) or "cudnn".
"""

import argparse
import contextlib
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtile import flash_attn_with_kvcache
from flashtile.env import overrides

H, H_K, D = 32, 8, 128
LAYER_BYTES = 40 << 30  # caches of all layers together at most this


def layer_calls(case: str, b: int, sk: int, layers: int):
    """``layers`` zero-argument calls, one a layer with its own cache (and the settings they run under)."""
    g = torch.Generator(device="cuda").manual_seed(b * 7 + sk)
    q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((b,), sk, device="cuda", dtype=torch.int32)
    calls = []
    for _ in range(layers):
        kc = torch.randn(b, sk, H_K, D, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn_like(kc)
        if case == "cudnn":
            qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
            del kc, vc
            calls.append(lambda qt=qt, kt=kt, vt=vt: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
        else:
            calls.append(lambda kc=kc, vc=vc: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True))
    return calls


def timeline(case: str, env: dict, b: int, sk: int, layers: int, replays: int) -> dict:
    backend = sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if case == "cudnn" else contextlib.nullcontext()
    with overrides(env), backend:
        calls = layer_calls(case, b, sk, layers)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for c in calls:  # compile outside the capture
                c()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
                torch.cuda.synchronize()
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
                      and "memset" not in e.name.lower()), key=lambda k: k[0])
    per_replay = len(kernels) // replays
    spans, gaps, durations = [], [], {}
    for r in range(replays):
        ks = kernels[r * per_replay:(r + 1) * per_replay]
        spans.append((ks[-1][1] - ks[0][0]) / layers)
        gaps += [b_[0] - a[1] for a, b_ in zip(ks, ks[1:])]
        for s, e, name in ks:
            durations.setdefault(name[:90], []).append(e - s)
    return {"case": case, "env": env, "b": b, "seqlen_k": sk, "layers": layers, "kernels_per_call": per_replay / layers,
            "span_us_per_call": statistics.median(spans), "gap_us_mean": statistics.mean(gaps) if gaps else 0.0,
            "gaps_us": sorted(gaps)[:: max(1, len(gaps) // 16)],
            "kernel_us": {k: statistics.median(v) for k, v in durations.items()}}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", action="append", required=True, help="NAME:VAR=VALUE,... or cudnn")
    p.add_argument("--batch", type=int, nargs="+", default=[32])
    p.add_argument("--seqlens", type=int, nargs="+", default=[16384, 131072])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = []
    for b in args.batch:
        for sk in args.seqlens:
            layers = max(1, min(args.layers, LAYER_BYTES // (2 * b * sk * H_K * D * 2)))
            for spec in args.case:
                name, _, rest = spec.partition(":")
                env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
                row = timeline(name, env, b, sk, layers, args.replays)
                row["case"] = name
                rows.append(row)
                kern = "  ".join(f"{k[:40]} {v:.1f}" for k, v in row["kernel_us"].items())
                print(f"b={b} sk={sk} {name:10s} layers={layers} span/call {row['span_us_per_call']:.1f} us  "
                      f"gap {row['gap_us_mean']:.2f} us  {kern}", flush=True)
                torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "gpu_uuid": str(torch.cuda.get_device_properties(0).uuid)}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
