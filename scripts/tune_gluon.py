"""Time the Gluon forward kernels' candidate configs on this GPU and write the best one per shape.

Usage (H200, after `gpu_check.sh tests-gluon` passed; run it under a timeout: an untested config
that deadlocks on a barrier hangs instead of failing):
    PYTHONPATH=src timeout 900 python scripts/tune_gluon.py --out tune_gluon.json
    PYTHONPATH=src python scripts/tune_gluon.py --dtypes fp8 --d 128 --seqlens 4096   # a subset

Candidates: ``TUNE_CANDIDATES`` in kernels/gluon_fwd.py (the table's entry first, at most 6 per head
dim, each compiled for sm_90 without spills by tests/test_gluon_compile.py). Shapes as
scripts/bench_gluon.py (16k tokens, hidden 2048: b = 16384 / s, h = 2048 / d). For every candidate
the output is first checked against the table config's output (and that one against flashtile's
Triton kernel of the same dtype), then timed with triton.testing.do_bench (median ms). The JSON
holds every timing, the best config per (dtype, d, causal, s) with the Triton kernel's time on the same inputs,
and the run's metadata; copy the
winners into FWD_CONFIGS by hand (with the JSON cited), the table is not rewritten.
"""

import argparse
import functools
import json
import math
import sys
import time

import torch
import triton

# max |candidate - table config| allowed: a config only changes accumulation order (and for fp8
# which P values round which way), not the math
TOL = {"16bit": 2e-2, "fp8": 6e-2}


def _inputs(dtype_cls: str, b: int, s: int, h: int, d: int, dv: int):
    q, k = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
    if dtype_cls == "16bit":
        return dict(q=q, k=k, v=v)
    from flashtile.backends.triton.attn_fwd_fp8 import transpose_v
    from flashtile.fp8 import quantize_qkv

    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    return dict(q=q8, k=k8, v=v8, v_t=transpose_v(v8, varlen=False), qd=qd, kd=kd, vd=vd)


def _runner(dtype_cls: str, x: dict, causal: bool, config):
    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd, gluon_attn_fwd_fp8

    if dtype_cls == "16bit":
        return lambda: gluon_attn_fwd(x["q"], x["k"], x["v"], None, causal, config=config)
    return lambda: gluon_attn_fwd_fp8(x["q"], x["k"], x["v_t"], x["qd"], x["kd"], x["vd"], None, causal,
                                      config=config)


def _triton_out(dtype_cls: str, x: dict, causal: bool) -> torch.Tensor:
    """flashtile's Triton kernel of the same dtype: the sanity check of the table config."""
    import flashtile
    from flashtile.backends.triton.attn_fwd_fp8 import attn_fwd_fp8
    from flashtile.params import AttnParams

    if dtype_cls == "16bit":
        from flashtile import config

        with config.override(gluon_fwd=False):  # dispatch may route bf16 to the Gluon kernel: keep Triton here
            return flashtile.flash_attn_func(x["q"], x["k"], x["v"], causal=causal)
    p = AttnParams(softmax_scale=1.0 / math.sqrt(x["q"].shape[-1]), causal=causal,
                   window_right=0 if causal else -1, q_descale=x["qd"], k_descale=x["kd"], v_descale=x["vd"])
    return attn_fwd_fp8(x["q"], x["k"], x["v"], p)[0]


def main():
    from flashtile.backends.triton.gluon_fwd import V_HEAD_DIMS
    from flashtile.bench.shapes import attention_flops
    from flashtile.kernels.gluon_fwd import CONFIG_KEYS, TUNE_CANDIDATES

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_gluon.json")
    ap.add_argument("--dtypes", nargs="+", default=["16bit", "fp8"], choices=["16bit", "fp8"])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128, 192, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_gluon.py needs a GPU")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    results, best = [], {}
    for dtype_cls in args.dtypes:
        for d in args.d:
            cands = TUNE_CANDIDATES.get((dtype_cls, d))
            if not cands:
                continue
            h = 2048 // d
            # v's head dim: the 16-bit kernel's pair for d (192 takes v of 128), fp8's is d
            dv = V_HEAD_DIMS[d][0] if dtype_cls == "16bit" else d
            for s in args.seqlens:
                b = max(1, 16384 // s)
                x = _inputs(dtype_cls, b, s, h, d, dv)
                for causal in causals:
                    flops = attention_flops(b, h, s, d, causal, dv=dv)
                    key = f"{dtype_cls} d={d} causal={causal} s={s}"
                    base = None
                    for cand in cands:
                        config = dict(zip(CONFIG_KEYS, cand))
                        row = dict(dtype=dtype_cls, d=d, s=s, b=b, h=h, causal=causal, config=config)
                        try:
                            fn = _runner(dtype_cls, x, causal, config)
                            out = fn()[0].float()
                            torch.cuda.synchronize()
                            if base is None:  # the table's config: checked against the Triton kernel
                                base = out
                                ref = _triton_out(dtype_cls, x, causal).float()
                                row["max_abs_diff_vs_triton"] = (out - ref).abs().max().item()
                            diff = (out - base).abs().max().item()
                            row["max_abs_diff_vs_table"] = diff
                            if not math.isfinite(diff) or diff > TOL[dtype_cls]:
                                row["error"] = f"output differs from the table config's by {diff:.3e}"
                            else:
                                ms = triton.testing.do_bench(fn, warmup=25, rep=args.rep, return_mode="median")
                                row.update(ms=ms, tflops=flops / ms / 1e9)
                        except Exception as exc:  # a config that does not compile / launch here: record, go on
                            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        results.append(row)
                        cell = f"{row['tflops']:7.1f} TFLOP/s" if "tflops" in row else row["error"][:60]
                        print(f"{key:34s} {str(cand):20s} {cell}", flush=True)
                        if "tflops" in row and (key not in best or row["tflops"] > best[key]["tflops"]):
                            best[key] = dict(config=config, tflops=row["tflops"], ms=row["ms"])
                    if key in best:
                        # beside flashtile's Triton kernel on the same inputs: whether the route should take Gluon
                        # here at all (a hint only: a route change needs scripts/ab_routes.py's alternated rounds)
                        t_ms = triton.testing.do_bench(functools.partial(_triton_out, dtype_cls, x, causal), warmup=25,
                                                       rep=args.rep, return_mode="median")
                        best[key].update(triton_ms=t_ms, triton_over_best=t_ms / best[key]["ms"])
                        print(f"  best {best[key]['config']} {best[key]['tflops']:.1f}, Triton kernel {t_ms:.3f} ms "
                              f"({t_ms / best[key]['ms']:.3f}x the best's time)", flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%S"), command=" ".join(sys.argv),
                unit="TFLOP/s (flashtile.bench.shapes.attention_flops), median ms of triton.testing.do_bench")
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, best=best, results=results), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
