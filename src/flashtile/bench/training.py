"""``train``: a training step's attention on the two shapes the training bars name beyond dense MHA.

- ``gqa``: 32 query heads over 8 kv heads, d = 128, causal, 16,384 tokens a batch (b = tokens / s).
  Columns: ``flashtile`` (the subject); ``flashtile-mha``, the same queries over 32 kv heads (the same FLOPs:
  the bar "GQA within 5% of flashtile's own MHA"); torch SDPA's backends with ``enable_gqa=True``.
- ``varlen``: causal packed documents, h = 16, d = 128: 16,384 tokens in 33 documents (4096 x 1, 2048 x 2,
  1024 x 2, 512 x 4, 256 x 8, 128 x 16) in a shuffled order through ``flash_attn_varlen_func`` (the subject);
  ``flashtile-buckets``, the documents of each length as one padded batch through ``flash_attn_func`` (the
  same work without padding: the bar "varlen within 5% of flashtile's padded throughput"); SDPA's backends on
  those buckets (what a user without varlen runs).

Each row holds two verdicts: ``own`` (subject / flashtile's own baseline within 5%, every mode) and ``sdpa``
(the subject at least as fast as SDPA's fastest backend of the same round; the bar is for the training
step, mode ``fwdbwd``, and is reported for every mode). Columns are timed in alternated rounds; a ratio is
the median over rounds of that round's ``baseline / subject`` times.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flashtile.bench import paths, report
from flashtile.bench.attention import GRAD_FACTOR, TOLERANCE, _describe, _max_err
from flashtile.bench.models import NOISE, judge
from flashtile.bench.peers import _sdpa_context, _sdpa_unavailable
from flashtile.bench.shapes import attention_flops, tflops
from flashtile.bench.timing import bench, bench_graph, time_in_rounds

GROUPS = ("gqa", "varlen")
MODES = ("fwd", "bwd", "fwdbwd")
SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
OWN_MIN, SDPA_MIN = 1 / 1.05, 1.0
GQA_HEADS, GQA_D, GQA_SEQLENS = (32, 8), 128, (4096, 8192)
VARLEN_H, VARLEN_D = 16, 128
# (length, count): 16,384 tokens, lengths 128-4096
VARLEN_DOCS = ((4096, 1), (2048, 2), (1024, 2), (512, 4), (256, 8), (128, 16))
TOKENS = 16384
QUICK = dict(gqa_heads=(4, 1), d=32, gqa_seqlens=(64,), tokens=128, varlen_h=2, varlen_docs=((64, 1), (32, 2)),
             rounds=2)
DEFAULT_ROUNDS = 3
CHECK_ROWS = 256


@dataclass
class Column:
    """One timed implementation: ``forward()`` returns its outputs from its own leaves; ``grads`` are the
    outputs' gradients (one per output)."""

    name: str
    forward: Callable[[], list[torch.Tensor]]
    leaves: list[torch.Tensor]
    grads: list[torch.Tensor]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    unavailable: str | None = None


@dataclass
class Case:
    group: str
    h: int
    h_k: int
    d: int
    docs: tuple[tuple[int, int], ...]  # (length, count): gqa rows are one length, b documents
    seed: int = 0
    order: list[int] = field(default_factory=list)

    @property
    def lengths(self) -> list[int]:
        return [n for n, c in self.docs for _ in range(c)]

    def label(self) -> str:
        if self.group == "gqa":
            (s, b), = self.docs
            return f"gqa h={self.h}/{self.h_k} d={self.d} s={s} b={b} causal"
        return f"varlen h={self.h} d={self.d} docs={len(self.lengths)} tokens={sum(self.lengths)} causal"

    def flops(self, mode: str) -> float:
        return sum(attention_flops(c, self.h, n, self.d, True, mode) for n, c in self.docs)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rows")
    g.add_argument("--groups", nargs="+", choices=GROUPS, default=list(GROUPS),
                   help="gqa: 32/8 heads against flashtile's MHA and SDPA; varlen: packed documents against "
                        "flashtile and SDPA on length buckets (default: both)")
    g.add_argument("--modes", nargs="+", choices=MODES, default=["fwd", "fwdbwd"],
                   help="fwd, bwd ((fwd+bwd) - fwd), fwdbwd (a training step; default: fwd fwdbwd)")
    g.add_argument("--seqlens", type=int, nargs="+", metavar="S", help=f"gqa rows' lengths (default {GQA_SEQLENS})")
    g.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    g.add_argument("--quick", action="store_true", help="tiny smoke-test shapes")
    r = p.add_argument_group("run")
    r.add_argument("--peers", nargs="*", choices=tuple(SDPA_BACKENDS), default=list(SDPA_BACKENDS),
                   help="SDPA backends timed beside flashtile (default: all three)")
    r.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    r.add_argument("--rounds", type=int, metavar="R", help=f"alternated rounds (default {DEFAULT_ROUNDS})")
    r.add_argument("--warmup", type=float, default=100, metavar="MS")
    r.add_argument("--rep", type=float, default=100, metavar="MS")
    r.add_argument("--cuda-graph", action="store_true",
                   help="time CUDA-graph replays (the varlen buckets are several small launches: host time)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-check", dest="check", action="store_false", help="skip the subject's check")
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="PATH.json", help="JSON results (default: under ~/.cache/flashtile/bench)")


def make_cases(args) -> list[Case]:
    q = QUICK if args.quick else {}
    tokens = q.get("tokens", TOKENS)
    d = q.get("d", GQA_D)
    cases = []
    for i, group in enumerate(dict.fromkeys(args.groups)):
        if group == "gqa":
            h, h_k = q.get("gqa_heads", GQA_HEADS)
            for s in args.seqlens or q.get("gqa_seqlens", GQA_SEQLENS):
                cases.append(Case("gqa", h, h_k, d, ((s, max(1, tokens // s)),), seed=args.seed + s))
        else:
            h = q.get("varlen_h", VARLEN_H)
            cases.append(Case("varlen", h, h, q.get("d", VARLEN_D), tuple(q.get("varlen_docs", VARLEN_DOCS)),
                              seed=args.seed + i))
    return cases


def _randn(shape, dtype, device, gen, grad=True) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype).requires_grad_(grad)


def _sdpa(name: str, device: str):
    """(context, reason it cannot run here or None) of SDPA's backend ``name`` (the dense modes' peers' rules)."""
    backend = SDPA_BACKENDS[name]
    return _sdpa_context(backend), _sdpa_unavailable(backend, cuda_only=name != "flash")(device)


def _gqa_columns(case: Case, dtype, device, peers) -> tuple[list[Column], dict]:
    from flashtile import flash_attn_func

    (s, b), = case.docs
    gen = torch.Generator(device=device).manual_seed(case.seed)
    mk = lambda heads: _randn((b, s, heads, case.d), dtype, device, gen)
    q, k, v = mk(case.h), mk(case.h_k), mk(case.h_k)
    do = _randn((b, s, case.h, case.d), dtype, device, gen, grad=False)
    cols = [Column("flashtile", lambda: [flash_attn_func(q, k, v, causal=True)], [q, k, v], [do])]
    qm, km, vm = mk(case.h), mk(case.h), mk(case.h)
    cols.append(Column("flashtile-mha", lambda: [flash_attn_func(qm, km, vm, causal=True)], [qm, km, vm], [do]))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for name in peers:
        # each peer its own (b, h, s, d) leaves, so no column's .grad is another's
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        dot = do.transpose(1, 2).contiguous()
        cols.append(Column(f"sdpa-{name}", lambda qt=qt, kt=kt, vt=vt: [sdpa(qt, kt, vt, is_causal=True,
                                                                            enable_gqa=True)],
                           [qt, kt, vt], [dot], *_sdpa(name, device)))
    return cols, dict(q=q, k=k, v=v, do=do)


def _varlen_columns(case: Case, dtype, device, peers) -> tuple[list[Column], dict]:
    from flashtile import flash_attn_func, flash_attn_varlen_func

    gen = torch.Generator(device=device).manual_seed(case.seed)
    lengths = case.lengths
    random.Random(case.seed).shuffle(lengths)
    total, h, d = sum(lengths), case.h, case.d
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    q, k, v = (_randn((total, h, d), dtype, device, gen) for _ in range(3))
    do = _randn((total, h, d), dtype, device, gen, grad=False)
    longest = max(lengths)
    cols = [Column("flashtile", lambda: [flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)],
                   [q, k, v], [do])]
    buckets = [(n, c) for n, c in case.docs]
    bq, bk, bv, bdo = ([_randn((c, n, h, d), dtype, device, gen, grad=g) for n, c in buckets]
                       for g in (True, True, True, False))

    def run_buckets():
        return [flash_attn_func(a, b_, c, causal=True) for a, b_, c in zip(bq, bk, bv)]
    cols.append(Column("flashtile-buckets", run_buckets, [*bq, *bk, *bv], bdo))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for name in peers:
        tq, tk, tv = ([t.detach().transpose(1, 2).contiguous().requires_grad_() for t in ts] for ts in (bq, bk, bv))
        tdo = [t.transpose(1, 2).contiguous() for t in bdo]

        def run_sdpa(tq=tq, tk=tk, tv=tv):
            return [sdpa(a, b_, c, is_causal=True) for a, b_, c in zip(tq, tk, tv)]
        cols.append(Column(f"sdpa-{name}", run_sdpa, [*tq, *tk, *tv], tdo, *_sdpa(name, device)))
    return cols, dict(q=q, k=k, v=v, do=do, cu=cu, lengths=lengths)


def _parts(col: Column, mode: str, device: str, args) -> dict[str, float]:
    """The medians a mode's time is made of (the dense modes' rule): fwd, fwdbwd, or both for bwd."""
    def step():
        torch.autograd.backward(col.forward(), col.grads)

    def grad_step():
        return torch.autograd.grad(col.forward(), col.leaves, col.grads)
    with col.context():
        if mode == "fwd":
            with torch.no_grad():
                timer = bench_graph if args.cuda_graph else bench
                return {"fwd": timer(col.forward, device, args.warmup, args.rep)}
        if args.cuda_graph:
            out = {"fwdbwd": bench_graph(grad_step, device, args.warmup, args.rep)}
            if mode == "bwd":
                out["fwd"] = bench_graph(col.forward, device, args.warmup, args.rep)
            return out
        out = {"fwdbwd": bench(step, device, args.warmup, args.rep, grad_to_none=col.leaves)}
        if mode == "bwd":
            out["fwd"] = bench(col.forward, device, args.warmup, args.rep)
        return out


def _mode_ms(parts: dict[str, float], mode: str) -> float:
    return parts["fwdbwd"] - parts["fwd"] if mode == "bwd" else parts[mode]


def _check(case: Case, data: dict, subject: Column, needs_grad: bool) -> tuple[float, float | None]:
    """Max |subject - attention_ref| (fp32): gqa on the last CHECK_ROWS rows of batch entry 0 for the query
    heads of kv head 0; varlen on the whole of the shortest and the last document. Gradients flow from an
    output gradient that is zero elsewhere, so the checked rows' dq and their keys' dk, dv are the reference's."""
    from flashtile.backends.reference import attention_ref

    q, k, v, do = data["q"], data["k"], data["v"], data["do"]
    with torch.set_grad_enabled(needs_grad):
        out = subject.forward()[0]
    if case.group == "gqa":
        s = q.shape[1]
        r0, g = max(0, s - CHECK_ROWS), case.h // case.h_k
        pick_q = lambda t: t[:1, r0:, :g]
        pick_k = lambda t: t[:1, :, :1]
    else:
        cu, lengths = data["cu"].tolist(), data["lengths"]
        i = min(range(len(lengths)), key=lambda j: (lengths[j], j))
        spans = [(cu[i], cu[i + 1]), (cu[-2], cu[-1])]
        pick_q = pick_k = lambda t: torch.cat([t[a:b] for a, b in spans])[None]
    subs = [pick_q(q), pick_k(k), pick_k(v)]
    subs = [t.detach().float().requires_grad_(needs_grad) for t in subs]
    kw = dict(causal=True)
    if case.group == "varlen":
        n = [b - a for a, b in spans]
        cu_sub = torch.tensor([0, n[0], n[0] + n[1]], dtype=torch.int32, device=q.device)
        subs = [t[0].detach().requires_grad_(needs_grad) for t in subs]
        kw.update(cu_seqlens_q=cu_sub, cu_seqlens_k=cu_sub)
    with torch.set_grad_enabled(needs_grad):
        ref, _ = attention_ref(*subs, **kw)
    got = pick_q(out) if case.group == "gqa" else pick_q(out)[0]
    err = _max_err(got, ref)
    if not needs_grad:
        return err, None
    do_masked = torch.zeros_like(do)
    if case.group == "gqa":
        do_masked[:1, r0:, :g] = do[:1, r0:, :g]
    else:
        for a, b in spans:
            do_masked[a:b] = do[a:b]
    grads = torch.autograd.grad(out, [q, k, v], do_masked)
    ref_do = pick_q(do).float() if case.group == "gqa" else pick_q(do)[0].float()
    ref_grads = torch.autograd.grad(ref, subs, ref_do)
    if case.group == "gqa":
        mine = [pick_q(grads[0]), pick_k(grads[1]), pick_k(grads[2])]
    else:
        mine = [pick_q(t)[0] for t in grads]
    return err, max(_max_err(a, b) for a, b in zip(mine, ref_grads))


def run_row(case: Case, mode: str, args, device: str, rounds: int) -> dict:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    row = {"group": case.group, "label": case.label(), "mode": mode, "h": case.h, "h_k": case.h_k, "d": case.d,
           "docs": [list(x) for x in case.docs], "dtype": args.dtype, "flops": case.flops(mode), "ms": {},
           "tflops": {}, "rounds_ms": {}, "errors": {}, "max_err": None, "mismatch": False,
           "own": {"baseline": "flashtile-mha" if case.group == "gqa" else "flashtile-buckets",
                   "min_ratio": OWN_MIN, "ratio": None, "verdict": "not measured"},
           "sdpa": {"baseline": "fastest sdpa-* of each round", "min_ratio": SDPA_MIN, "ratio": None,
                    "verdict": "not measured", "bar_mode": "fwdbwd"}}
    try:
        build = _gqa_columns if case.group == "gqa" else _varlen_columns
        cols, data = build(case, dtype, device, args.peers)
    except torch.cuda.OutOfMemoryError as e:
        row["errors"]["all"] = _describe(e)
        return row
    needs_grad = mode != "fwd"
    if args.check:
        try:
            row["max_err"], grad_err = _check(case, data, cols[0], needs_grad)
            tol = TOLERANCE[args.dtype]
            row["mismatch"] = row["max_err"] > tol
            if grad_err is not None:
                row["max_err_grad"] = grad_err
                row["mismatch"] |= grad_err > GRAD_FACTOR * tol
        except Exception as e:  # no check is reported, not fatal to the timings
            row["check_error"] = _describe(e)
    timers = []
    for col in cols:
        if col.unavailable:
            row["errors"][col.name] = col.unavailable
            continue
        try:  # an untimed first call compiles and surfaces refusals
            with col.context():
                if needs_grad:
                    torch.autograd.grad(col.forward(), col.leaves, col.grads)
                else:
                    with torch.no_grad():
                        col.forward()
            timers.append((col.name, lambda col=col: _parts(col, mode, device, args)))
        except Exception as e:
            row["errors"][col.name] = _describe(e)
    results, failed = time_in_rounds(timers, rounds)
    for name, e in failed.items():
        row["errors"][name] = _describe(e)
    summarize(row, {n: [_mode_ms(p, mode) for p in r] for n, r in results.items()})
    return row


def summarize(row: dict, per_round: dict[str, list[float]]) -> None:
    """Medians, TFLOP/s and both verdicts from each column's per-round times (round order)."""
    for name, times in per_round.items():
        if min(times) <= 0:
            row["errors"][name] = "fwd+bwd not above fwd: timing noise"
            continue
        row["ms"][name] = statistics.median(times)
        row["rounds_ms"][name] = times
        row["tflops"][name] = tflops(row["flops"], row["ms"][name])
    sub = row["rounds_ms"].get("flashtile")
    if not sub:
        return
    base = row["rounds_ms"].get(row["own"]["baseline"])
    if base:
        row["own"]["ratio"] = statistics.median(b / s for b, s in zip(base, sub))
    peers = [t for n, t in row["rounds_ms"].items() if n.startswith("sdpa-")]
    if peers:
        best = [min(ts) for ts in zip(*peers)]
        row["sdpa"]["ratio"] = statistics.median(b / s for b, s in zip(best, sub))
    for bar in ("own", "sdpa"):
        row[bar]["passes"], row[bar]["verdict"] = judge(row[bar]["ratio"], row[bar]["min_ratio"], NOISE)


def _bar_cell(bar: dict) -> str:
    return report.MISSING if bar["ratio"] is None else f"{bar['ratio']:.3f} ({bar['verdict']})"


def format_table(rows: list[dict], meta: dict) -> str:
    where = meta.get("gpu") or f"CPU ({meta.get('cpu')})"
    out = [f"train  ms (median of {meta['timing']['rounds']} alternated rounds)  {meta['dtype']}  {where}",
           f"own: flashtile within 5% of its own MHA / length buckets (ratio >= {OWN_MIN:.3f}); sdpa: at least "
           f"SDPA's fastest backend (>= {SDPA_MIN:.2f}, the bar on fwdbwd); {NOISE:.0%} noise either side", ""]
    for r in rows:
        cols = "  ".join(f"{n} {report.MISSING if ms is None else format(ms, '.3f')}" for n, ms in r["ms"].items())
        err = "" if r["max_err"] is None else f"  err {r['max_err']:.1e}"
        if r.get("max_err_grad") is not None:
            err += f" grad {r['max_err_grad']:.1e}"
        bars = f"own {_bar_cell(r['own'])}  sdpa {_bar_cell(r['sdpa'])}"
        out.append(f"{r['label']:<48} {r['mode']:<6} {cols}  {bars}{err}" + ("  MISMATCH" if r["mismatch"] else ""))
        for name, reason in r["errors"].items():
            out.append(f"    {name}: {' '.join(reason.split())[:200]}")
        if r.get("check_error"):
            out.append(f"    check: {r['check_error'][:200]}")
    return "\n".join(out)


def run(args) -> int:
    device = report.resolve_device(args.device)
    if device is None:
        return 2
    rounds = args.rounds or (QUICK["rounds"] if args.quick else DEFAULT_ROUNDS)
    cases = make_cases(args)
    meta = report.collect_meta(getattr(args, "argv", []), device)
    meta.update(mode="train", dtype=args.dtype, groups=list(dict.fromkeys(args.groups)), modes=list(args.modes))
    meta["timing"] = {"rounds": rounds, "warmup_ms": args.warmup, "rep_ms": args.rep, "stat": "median",
                      "cuda_graph": bool(args.cuda_graph), "bwd": "(fwd+bwd) - fwd, per round"}
    out_path = args.out or paths.default_out_path("train", meta)
    rows, jobs = [], [(c, m) for c in cases for m in dict.fromkeys(args.modes)]
    for i, (case, mode) in enumerate(jobs, 1):
        t0 = time.perf_counter()
        rows.append(run_row(case, mode, args, device, rounds))
        r = rows[-1]
        report.eprint(f"[{i}/{len(jobs)}] {r['label']} {mode}: own {r['own']['verdict']}, sdpa {r['sdpa']['verdict']}"
                      f" ({time.perf_counter() - t0:.1f}s)")
        report.write_json(out_path, meta, rows)
    print(format_table(rows, meta))
    print(f"\nwrote {out_path}")
    return 1 if any(r["mismatch"] for r in rows) else 0
