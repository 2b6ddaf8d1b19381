"""The backward with the Gluon dK/dV kernel against the all-Triton backward, in one process (H200).

Usage: PYTHONPATH=src python scripts/bench_gluon_bwd.py --out gluon_bwd.json [--d 64 128] [--dtype fp16]

Shapes follow BASELINES.md (b * s = 16k tokens, h * d = 2048), bf16 (or --dtype fp16). Time is the backward alone:
one forward, then autograd.grad with retain_graph, median of triton.testing.do_bench, for the
route off (Triton dK/dV + Triton dQ) and on (Gluon dK/dV + Triton dQ). Each row also records the
largest difference between the two runs' gradients relative to the largest gradient (two fp32
summation orders: about 1e-2 at bf16 is rounding; a wrong kernel shows as O(1)). GPU_VERIFIED is set
here; a row whose Gluon run did not launch the Gluon kernel is
recorded as an error, not as a Gluon number.
"""

import argparse
import json
import time

import torch
import triton

import flashtile
from flashtile.backends.triton import gluon_bwd


def _backward_ms(out, inputs, g) -> float:
    return triton.testing.do_bench(lambda: torch.autograd.grad(out, inputs, g, retain_graph=True), warmup=25,
                                   rep=100, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gluon_bwd.json")
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gluon_bwd.GPU_VERIFIED = True  # what is measured here
    gluon_bwd.GPU_VERIFIED_HEAD_DIMS = gluon_bwd.HEAD_DIMS
    calls = []
    real = gluon_bwd.gluon_attn_bwd_dkdv
    gluon_bwd.gluon_attn_bwd_dkdv = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
    rows = []
    for d in args.d:
        for s in args.seqlens:
            for causal in (False, True):
                b, h = max(1, 16384 // s), 2048 // d
                torch.manual_seed(0)
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True)
                           for _ in range(3))
                g = torch.randn_like(q)
                out = flashtile.flash_attn_func(q, k, v, causal=causal)
                flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
                row = dict(d=d, s=s, b=b, h=h, causal=causal, dtype=args.dtype)
                grads = {}
                for name, on in (("triton", False), ("gluon", True)):
                    gluon_bwd.OVERRIDE = on
                    try:
                        before = len(calls)
                        grads[name] = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
                        if (len(calls) > before) != on:
                            raise RuntimeError(f"the Gluon kernel {'did not run' if on else 'ran'} in the {name} run")
                        ms = _backward_ms(out, (q, k, v), g)
                        row[f"{name}_tflops"] = flops / ms / 1e9
                    except Exception as exc:  # record and go on: the other rows still measure
                        row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    finally:
                        gluon_bwd.OVERRIDE = None
                if len(grads) == 2:
                    row["max_rel_diff"] = max((a.float() - c.float()).abs().max().item() / c.float().abs().max().item()
                                              for a, c in zip(grads["gluon"], grads["triton"]))
                if row.get("gluon_tflops") and row.get("triton_tflops"):
                    row["gluon/triton"] = row["gluon_tflops"] / row["triton_tflops"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                del q, k, v, g, out, grads
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%S"), command="scripts/bench_gluon_bwd.py",
                config=__import__("flashtile.kernels.gluon_bwd", fromlist=["x"]).BWD_DKDV_CONFIGS)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
