"""Where a serving step's append costs time in flashtile's decode: the CUDA kernels one call launches and their
durations (torch.profiler), with and without one appended key, at b = 1 / 8 / 32 and 8k keys (GQA 32 / 8, d =
128, bf16). In session 19's 8-layer table (decode_graph_layers8_append_leaseB_fused_h200_2026-12-01_session19
.json) an append added a constant ~8 us a call at b = 1 and b = 8 up to 32k, on the Triton kernel's in-kernel
append (since then off by default: FLASHTILE_DECODE_FUSED_APPEND). At b = 32, 8k the two calls run different kernels
(the Gluon rule takes appending calls from 8k, reading ones from 16k), so that row is not an append's cost.

Usage (GPU): python scripts/probe_decode_append.py [--out PATH.json]
"""

import argparse
import json
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from flashtile import flash_attn_with_kvcache

H, H_K, D = 32, 8, 128


def kernels_of(fn, reps: int = 20) -> dict:
    """Median duration (us) and launches a call of every CUDA kernel ``fn`` launches."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(e.name, []).append(e.device_time)
    return {name: {"us": statistics.median(ts), "per_call": len(ts) / reps} for name, ts in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    results = []
    for b in (1, 8, 32):
        g = torch.Generator(device="cuda").manual_seed(b)
        sk = 8192
        q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        kc = torch.randn(b, sk, H_K, D, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn_like(kc)
        lens = torch.full((b,), sk, device="cuda", dtype=torch.int32)
        kn, vn, shorter = kc[:, -1:].clone(), vc[:, -1:].clone(), lens - 1
        read = lambda q=q, kc=kc, vc=vc, lens=lens: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,  # noqa: E731
                                                                             causal=True)
        append = lambda q=q, kc=kc, vc=vc, kn=kn, vn=vn, lens=shorter: flash_attn_with_kvcache(  # noqa: E731
            q, kc, vc, kn, vn, cache_seqlens=lens, causal=True)
        for name, fn in (("read", read), ("append", append)):
            ks = kernels_of(fn)
            results.append({"b": b, "seqlen_k": sk, "call": name, "kernels": ks})
            print(f"b={b} {name}: " + "; ".join(f"{k[:60]} {v['us']:.1f} us x{v['per_call']:g}" for k, v in ks.items()),
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
