"""Dense attention benchmarks: ``fwd``, ``bwd`` and ``fwdbwd`` of flashtile beside its peers."""

from __future__ import annotations

import argparse
import math
import time
import warnings

import torch

from flashtile.bench import paths, report
from flashtile.bench.peers import FLASHTILE, FLASHTILE_BF16, FLASHTILE_FP8, PEERS, Impl, reference_attention
from flashtile.bench.shapes import (
    DEFAULT_DIMS,
    DEFAULT_SEQLENS,
    HIDDEN,
    QUICK_DIMS,
    QUICK_HIDDEN,
    QUICK_SEQLENS,
    QUICK_TOKENS,
    TOKENS,
    Shape,
    attention_flops,
    make_shapes,
    tflops,
)
from flashtile.bench.timing import bench, bench_graph

# Input dtype per --dtype. fp8 rows draw bf16 inputs; flashtile quantises them (forward only).
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
# Max |flashtile - SDPA| on outputs above which a row is flagged. Inputs are randn, outputs O(1):
# a correct kernel differs from SDPA by a few ulps of the dtype. Gradients get 3x (DESIGN.md).
# fp8 rows are checked against the dequantised inputs (what the kernel computes on); what is left is
# P's e4m3 rounding and the fp8 MMA's accumulation. Against the unquantised inputs the causal first
# rows (one key each: the output is that key's e4m3-rounded v) reach 0.305 on the H200 (docs/fp8.md).
TOLERANCE = {"bf16": 0.05, "fp16": 0.01, "fp8": 0.25}
GRAD_FACTOR = 3.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shapes (hidden and tokens fixed: h = hidden // d, b = tokens // s)")
    g.add_argument("--d", type=int, nargs="+", metavar="D", help=f"head dims (default {DEFAULT_DIMS})")
    g.add_argument("--seqlens", type=int, nargs="+", metavar="S",
                   help=f"sequence lengths (default {DEFAULT_SEQLENS})")
    g.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    g.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    g.add_argument("--hidden", type=int, help=f"h * d (default {HIDDEN})")
    g.add_argument("--tokens", type=int, help=f"b * s (default {TOKENS})")
    g.add_argument("--quick", action="store_true",
                   help=f"tiny smoke-test shapes: d {QUICK_DIMS}, s {QUICK_SEQLENS}, "
                        f"hidden {QUICK_HIDDEN}, tokens {QUICK_TOKENS} (explicit options win)")
    r = p.add_argument_group("run")
    r.add_argument("--peers", nargs="*", choices=tuple(PEERS), default=list(PEERS), metavar="PEER",
                   help=f"peers beside flashtile, any of {' '.join(PEERS)} "
                        "(default: all; given with no names: flashtile only)")
    r.add_argument("--device", choices=("cuda", "cpu"),
                   help="default: cuda when available (CPU is for smoke tests)")
    # 100 ms: after a peer's compile pause the GPU clocks need time to ramp back up
    r.add_argument("--warmup", type=float, default=100, metavar="MS", help="warmup per measurement, ms")
    r.add_argument("--rep", "--reps", dest="rep", type=float, default=100, metavar="MS",
                   help="measured time per measurement, ms")
    r.add_argument("--cuda-graph", action="store_true",
                   help="time CUDA-graph replays for every implementation (kernel time without the host "
                        "launch path; the default timing includes it, as users see it); in bwd/fwdbwd modes "
                        "the captured step is forward + autograd.grad")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-check", dest="check", action="store_false",
                   help="skip comparing flashtile's output to SDPA before timing")
    r.add_argument("--fail-on-mismatch", action="store_true", help="exit 1 if any row is a MISMATCH")
    r.add_argument("--ceilings", action="store_true",
                   help="measure bf16 matmul TFLOP/s and copy TB/s first (CUDA) and record them in meta")
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="PATH.json",
                   help="JSON results (default: <mode>_<gpu>_<date>.json under ~/.cache/flashtile/bench, "
                        "or $XDG_CACHE_HOME/flashtile/bench; never the working directory)")
    o.add_argument("--plot", metavar="PATH.png", help="also draw a grouped bar chart of TFLOP/s")


def _resolve_shapes(args) -> list[Shape]:
    q = args.quick
    dims = args.d or (QUICK_DIMS if q else DEFAULT_DIMS)
    seqlens = args.seqlens or (QUICK_SEQLENS if q else DEFAULT_SEQLENS)
    hidden = args.hidden or (QUICK_HIDDEN if q else HIDDEN)
    tokens = args.tokens or (QUICK_TOKENS if q else TOKENS)
    return make_shapes(dims, seqlens, args.causal, hidden=hidden, tokens=tokens)


def _describe(e: BaseException, caught: list | None = None) -> str:
    # One line, whole: dispatch errors put the per-backend reasons on the lines after the first.
    msg = f"{type(e).__name__}: {' '.join(str(e).split())}".strip()
    # SDPA says only "No available kernel"; its reasons arrive as warnings, so keep them.
    reasons = [" ".join(str(w.message).split()) for w in caught or ()]
    if reasons:
        msg += " (" + "; ".join(dict.fromkeys(reasons)) + ")"
    return msg[:600]


def _free_cached_memory(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class _Inputs:
    """One row's q, k, v and output gradient, in both layouts; copies are made once, untimed."""

    def __init__(self, shape: Shape, dtype: torch.dtype, device: str, needs_grad: bool, seed: int):
        g = torch.Generator(device=device).manual_seed(seed)
        size = (shape.b, shape.s, shape.h, shape.d)
        v_size = (shape.b, shape.s, shape.h, shape.dv or shape.d)  # v and dout carry v's head dim
        # Fresh randn per row: a kernel that is only right on stale data or zeros must not pass.
        self.bshd = [torch.randn(sz, generator=g, device=device, dtype=dtype)
                     for sz in (size, size, v_size, v_size)]
        self.bhsd = [t.transpose(1, 2).contiguous() for t in self.bshd]
        for t in self.bshd[:3] + self.bhsd[:3]:
            t.requires_grad_(needs_grad)

    def get(self, layout: str):
        return self.bshd if layout == "bshd" else self.bhsd


def _to_bshd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "bshd" else t.transpose(1, 2)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _dequantized_bhsd(inputs: _Inputs) -> list[torch.Tensor]:
    """q, k, v as the fp8 row's kernel sees them: quantised (as the fp8 peer does) and dequantised
    back, in bf16 and (b, h, s, d), so the check measures the kernel and not e4m3's rounding of the
    inputs (a causal first row sees one key: its output is that key's rounded v, up to 1/16 off)."""
    from flashtile.fp8 import dequantize, quantize_qkv

    q, k, v = (t.detach() for t in inputs.bshd[:3])
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    return [dequantize(x, ds, dtype=q.dtype).transpose(1, 2) for x, ds in ((q8, qd), (k8, kd), (v8, vd))]


def _reference(inputs: _Inputs, shape: Shape, needs_grad: bool, fp8: bool = False):
    """SDPA's output (and dq, dk, dv in backward modes), in (b, s, h, d); fp8 rows attend over the
    dequantised inputs."""
    if fp8:
        with torch.no_grad():
            return reference_attention(*_dequantized_bhsd(inputs), shape.causal).transpose(1, 2), []
    qt, kt, vt, dot = inputs.bhsd
    with torch.set_grad_enabled(needs_grad):
        ref = reference_attention(qt, kt, vt, shape.causal)
    grads = torch.autograd.grad(ref, (qt, kt, vt), dot) if needs_grad else ()
    return ref.detach().transpose(1, 2), [g.transpose(1, 2) for g in grads]


def _check(attn, inputs: _Inputs, ref, needs_grad: bool) -> tuple[float, float | None]:
    """Max |flashtile - SDPA| over the output and, in backward modes, over dq, dk, dv."""
    q, k, v, do = inputs.bshd
    ref_out, ref_grads = ref
    with torch.set_grad_enabled(needs_grad):
        out = attn(q, k, v)
    if isinstance(out, tuple):  # tolerate return_attn_probs-style tuples
        out = out[0]
    if not torch.isfinite(out).all():
        raise FloatingPointError("flashtile output has NaN/Inf")
    err = _max_err(out, ref_out)
    if not needs_grad:
        return err, None
    grads = torch.autograd.grad(out, (q, k, v), do)
    grad_err = max(_max_err(g, r) for g, r in zip(grads, ref_grads))
    if not math.isfinite(grad_err):
        raise FloatingPointError("flashtile gradients have NaN/Inf")
    return err, grad_err


def _time_parts(attn, tensors, mode: str, device: str, args) -> dict[str, float]:
    """The medians a mode's time is made of: ``{"fwd"}``, ``{"fwdbwd"}``, or both for ``bwd``."""
    q, k, v, do = tensors
    one = lambda: attn(q, k, v)
    step = lambda: attn(q, k, v).backward(do)
    if mode == "fwd":
        with torch.no_grad():  # inference forward: nothing saved for backward
            timer = bench_graph if getattr(args, "cuda_graph", False) else bench
            return {"fwd": timer(one, device, args.warmup, args.rep)}
    if getattr(args, "cuda_graph", False):
        # graph replays time the kernels alone; autograd.grad leaves no .grad to accumulate across replays
        grad_step = lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), do)
        step_ms = bench_graph(grad_step, device, args.warmup, args.rep)
        if mode == "fwdbwd":
            return {"fwdbwd": step_ms}
        fwd_ms = bench_graph(one, device, args.warmup, args.rep)
    else:
        step_ms = bench(step, device, args.warmup, args.rep, grad_to_none=[q, k, v])
        if mode == "fwdbwd":
            return {"fwdbwd": step_ms}
        fwd_ms = bench(one, device, args.warmup, args.rep)  # grad-enabled: the forward half of the step
    return {"fwd": fwd_ms, "fwdbwd": step_ms}


def _time(attn, tensors, mode: str, device: str, args) -> tuple[float, dict]:
    parts = _time_parts(attn, tensors, mode, device, args)
    if mode != "bwd":
        return parts[mode], {}
    step_ms, fwd_ms = parts["fwdbwd"], parts["fwd"]
    if step_ms <= fwd_ms:
        raise RuntimeError(f"fwd+bwd ({step_ms:.3f} ms) not above fwd ({fwd_ms:.3f} ms): timing noise")
    return step_ms - fwd_ms, parts


def run_row(shape: Shape, mode: str, impls: list[Impl], unavailable: dict[str, str], args,
            device: str, seed: int) -> dict:
    """Check flashtile against SDPA, then time every implementation on one shape."""
    flops = attention_flops(shape.b, shape.h, shape.s, shape.d, shape.causal, mode)
    row = {"mode": mode, "d": shape.d, "s": shape.s, "b": shape.b, "h": shape.h, "causal": shape.causal,
           "dtype": args.dtype, "flops": flops, "ms": {}, "tflops": {}, "ratios": {}, "errors": {},
           "max_err": None, "mismatch": False}
    needs_grad = mode != "fwd"
    if needs_grad:
        row["max_err_grad"] = None
        row["ms_parts"] = {}
    try:
        inputs = _Inputs(shape, DTYPES[args.dtype], device, needs_grad, seed)
    except torch.cuda.OutOfMemoryError as e:
        _free_cached_memory(device)
        for impl in impls:
            row["ms"][impl.name] = row["tflops"][impl.name] = None
            row["errors"][impl.name] = _describe(e)
        return row
    tol = TOLERANCE[args.dtype]
    ref = None
    if args.check:
        try:
            ref = _reference(inputs, shape, needs_grad, fp8=args.dtype == "fp8")
        except Exception as e:  # no reference means no check, not no timings
            row["check_error"] = "SDPA reference failed: " + _describe(e)
            _free_cached_memory(device)
    for impl in impls:
        ms = None
        caught: list = []
        if impl.name in unavailable:
            row["errors"][impl.name] = unavailable[impl.name]
        else:
            try:
                with warnings.catch_warnings(record=True) as caught, impl.context():
                    warnings.simplefilter("always")
                    attn = impl.build(shape, device)
                    if impl.name == "flashtile" and ref is not None:
                        try:
                            err, grad_err = _check(attn, inputs, ref, needs_grad)
                            row["max_err"] = err
                            row["mismatch"] = err > tol
                            if needs_grad:
                                row["max_err_grad"] = grad_err
                                row["mismatch"] |= grad_err > GRAD_FACTOR * tol
                        except FloatingPointError as e:
                            row["check_error"] = str(e)
                            row["mismatch"] = True
                    tensors = inputs.get(impl.layout)
                    # An untimed first call: compiles (FlexAttention) and surfaces refusals early.
                    if needs_grad:
                        attn(*tensors[:3]).backward(tensors[3])
                        for t in tensors[:3]:
                            t.grad = None
                    else:
                        with torch.no_grad():
                            attn(*tensors[:3])
                    caught.clear()
                    ms, parts = _time(attn, tensors, mode, device, args)
                    if parts:
                        row["ms_parts"][impl.name] = parts
            except Exception as e:
                row["errors"][impl.name] = _describe(e, caught)
                if isinstance(e, torch.cuda.OutOfMemoryError):
                    _free_cached_memory(device)
        row["ms"][impl.name] = ms
        row["tflops"][impl.name] = tflops(flops, ms)
    ft = row["ms"].get("flashtile")
    for impl in impls[1:]:
        peer = row["ms"].get(impl.name)
        # Same work on both sides, so the TFLOP/s ratio is the inverse time ratio.
        row["ratios"][impl.name] = peer / ft if ft and peer else None
    del inputs, ref
    return row


def run(args) -> int:
    mode = args.command
    device = report.resolve_device(args.device)
    if device is None:
        return 2
    if device == "cpu":
        report.eprint("note: CPU timings are for smoke tests only; "
                      "peers run torch's CPU kernels where any exist")
    shapes = _resolve_shapes(args)
    meta = report.collect_meta(args.argv, device)
    meta["mode"] = mode
    meta["dtype"] = args.dtype
    meta["timing"] = {"warmup_ms": args.warmup, "rep_ms": args.rep, "stat": "median",
                      "method": "triton.testing.do_bench" if device == "cuda" else "time.perf_counter"}
    if mode == "bwd":
        meta["timing"]["bwd"] = "(fwd+bwd) - fwd"
    if getattr(args, "cuda_graph", False):
        meta["timing"]["cuda_graph"] = True
    if args.dtype == "fp8" and mode != "fwd":
        report.eprint("error: --dtype fp8 is forward only (fp8 attention has no backward)")
        return 2
    if args.dtype == "fp8":
        impls = [FLASHTILE_FP8, FLASHTILE_BF16] + [PEERS[p] for p in dict.fromkeys(args.peers)]
    else:
        impls = [FLASHTILE] + [PEERS[p] for p in dict.fromkeys(args.peers)]
    meta["impls"] = {i.name: i.description for i in impls}
    tol = TOLERANCE[args.dtype]
    reference = "torch SDPA (backend of torch's choice)"
    if args.dtype == "fp8":
        reference += " on the inputs quantised by flashtile.fp8.quantize_qkv and dequantised (bf16)"
    meta["check"] = {"reference": reference, "tolerance": tol,
                     "grad_tolerance": round(GRAD_FACTOR * tol, 6)} if args.check else None
    meta["ceilings"] = None
    if args.ceilings:
        if device == "cuda":
            from flashtile.bench.ceilings import measure_ceilings

            report.eprint("measuring ceilings (bf16 matmul 8192^3, device copy)...")
            try:
                meta["ceilings"] = measure_ceilings(device, warmup_ms=args.warmup, rep_ms=args.rep)
            except Exception as e:
                meta["ceilings"] = {"error": _describe(e)}
            report.eprint(f"ceilings: {meta['ceilings']}")
        else:
            report.eprint("note: --ceilings needs CUDA; skipped")
    unavailable = {i.name: r for i in impls if (r := i.unavailable(device))}
    for name, reason in unavailable.items():
        report.eprint(f"note: {name} unavailable: {reason}")
    out_path = args.out or paths.default_out_path(mode, meta)
    rows = []
    t_start = time.perf_counter()
    for i, shape in enumerate(shapes, 1):
        t0 = time.perf_counter()
        row = run_row(shape, mode, impls, unavailable, args, device, seed=args.seed + i)
        rows.append(row)
        names = [x.name for x in impls]
        report.eprint(report.progress_line(i, len(shapes), row, names, time.perf_counter() - t0))
        report.write_json(out_path, meta, rows)  # after every row: a long run killed midway keeps its rows
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    report.write_json(out_path, meta, rows)
    print(report.format_table(rows, [x.name for x in impls], meta))
    print(f"\nwrote {out_path}")
    if args.plot:
        from flashtile.bench.plot import plot_results

        try:
            plot_results({"meta": meta, "rows": rows}, args.plot)
            print(f"wrote {args.plot}")
        except ImportError as e:  # the numbers are already saved; a plot can be made later
            report.eprint(f"note: no plot ({e}); later: "
                          f"python -m flashtile.bench plot {out_path} {args.plot}")
    mismatches = sum(r["mismatch"] for r in rows)
    if mismatches:
        report.eprint(f"WARNING: {mismatches} row(s) where flashtile disagrees with SDPA (MISMATCH)")
    return 1 if mismatches and args.fail_on_mismatch else 0
