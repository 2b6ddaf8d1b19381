"""Why is the fp8 row of `bench fwd --dtype fp8` slower than the Gluon kernel alone? (GPU diagnosis)

Usage: PYTHONPATH=src python scripts/probe_fp8_route.py [--out f.json]
For BASELINES shapes at d = 128 / 256, s = 4096 / 16384: whether the call takes the Gluon route, whether V^T
is a view, CUDA-graph timings of the public call, the Gluon launcher (table config and the old
128-row one), the Triton fp8 path and bf16, and the kernels one public call runs (torch.profiler).
"""

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

import flashtile
from flashtile.backends.triton import gluon_route
from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd_fp8
from flashtile.bench.timing import bench, bench_graph
from flashtile.fp8 import quantize_qkv, v_keys_major
from flashtile.params import AttnParams


def _row(d: int, s: int, causal: bool) -> dict:
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    vt = v_keys_major(v8, varlen=False)
    p = AttnParams(softmax_scale=d ** -0.5, causal=causal, window_right=0 if causal else -1,
                   q_descale=qd, k_descale=kd, v_descale=vd)
    kw = dict(causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    fns = {
        "public_fp8": lambda: flashtile.flash_attn_func(q8, k8, v8, **kw),
        "gluon_table": lambda: gluon_attn_fwd_fp8(q8, k8, vt, qd, kd, vd, None, causal),
        "gluon_128x128": lambda: gluon_attn_fwd_fp8(q8, k8, vt, qd, kd, vd, None, causal,
                                                    config=dict(BLOCK_M=128, BLOCK_N=128, NUM_BUFFERS=3, num_warps=8)),
        "public_bf16": lambda: flashtile.flash_attn_func(q, k, v, causal=causal),
    }
    row = dict(d=d, s=s, b=b, h=h, causal=causal, route=gluon_route.use_gluon(q8, k8, v8, p),
               vt_is_view=vt.data_ptr() == v8.data_ptr(), v8_strides=list(v8.stride()))
    tf = {}
    with torch.no_grad():
        for name, fn in fns.items():
            tf[name] = flops / bench_graph(fn, "cuda") / 1e9
        # as users see it: eager calls, host path included
        tf["public_fp8_eager"] = flops / bench(fns["public_fp8"], "cuda") / 1e9
        tf["public_bf16_eager"] = flops / bench(fns["public_bf16"], "cuda") / 1e9
        gluon_route.OVERRIDE = False
        tf["public_fp8_triton"] = flops / bench_graph(fns["public_fp8"], "cuda") / 1e9
        gluon_route.OVERRIDE = None
        fns["public_fp8"]()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fns["public_fp8"]()
            torch.cuda.synchronize()
    # "_eager" entries are do_bench of plain calls; the rest are CUDA-graph replays
    row["tflops"] = {n: round(x, 1) for n, x in tf.items()}
    row["fp8_over_bf16"] = dict(graph=round(tf["public_fp8"] / tf["public_bf16"], 3),
                                eager=round(tf["public_fp8_eager"] / tf["public_bf16_eager"], 3))
    row["kernels"] = [(e.key[:80], round(getattr(e, "device_time_total", 0), 1)) for e in prof.key_averages()
                      if getattr(e, "device_time_total", 0)]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [_row(d, s, c) for s in (4096, 16384) for d in (128, 256) for c in (False, True)]
    if args.out:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, command="scripts/probe_fp8_route.py")
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
