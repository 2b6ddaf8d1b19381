"""``models``: the attention variants of newer models, each timed against the bar it is held to.

Three groups of rows (docs/models.md describes the features), each in the modes ``--modes`` names
(forward, and backward timed as the ``bwd`` mode does: (fwd+bwd) - fwd):

- ``dv``: q/k head dim 192, v's 128 (DeepSeek-V3), flashtile beside torch SDPA's cuDNN backend and
  SDPA's own backend choice. Bar: flashtile at >= 0.95x cuDNN's speed.
- ``sink``: flashtile with ``learnable_sink`` (gpt-oss) beside flashtile without it on the same
  inputs. Bar: the sink costs at most 5%.
- ``chunk``: flashtile with ``attention_chunk=c`` (Llama 4) beside plain flashtile on the same tokens
  cut into ``b * s / c`` sequences of length ``c``: the same keys visible to every query, so the same
  work. Bar: chunking costs at most 5%.

Every row times its implementations in ``--rounds`` alternated rounds (``timing.time_in_rounds``) and
holds the median over rounds of the baseline / subject time ratio to its bar, with ``NOISE`` allowed
either side (``verdict``: pass, within noise, fail). Before timing, the row's subject is checked: the
dv rows against SDPA on the whole output (and gradients), as the dense modes check; the sink and chunk
rows against ``attention_ref`` on the last query rows of one batch entry and a few heads, which is
cheap at any length.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashtile.bench import paths, report
from flashtile.bench.attention import (
    DTYPES,
    GRAD_FACTOR,
    TOLERANCE,
    _check,
    _describe,
    _free_cached_memory,
    _Inputs,
    _max_err,
    _reference,
    _time_parts,
)
from flashtile.bench.peers import FLASHTILE, PEERS, SDPA_DEFAULT, AttnFn, Impl
from flashtile.bench.shapes import HIDDEN, TOKENS, Shape, attention_flops, tflops
from flashtile.bench.timing import time_in_rounds

GROUPS = ("dv", "sink", "chunk")
MODES = ("fwd", "bwd", "fwdbwd")
# The allowance either side of a bar: alternated medians of one process still move by about this much
# from run to run (docs/benchmarking.md, "Rules").
NOISE = 0.01


@dataclass(frozen=True)
class Bar:
    """What a group's subject is held to: ``baseline_ms / subject_ms >= min_ratio``."""

    baseline: str
    min_ratio: float
    text: str


BARS = {
    "dv": Bar("cudnn", 0.95, "flashtile at >= 0.95x the speed of SDPA's cuDNN backend"),
    "sink": Bar("flashtile", 1 / 1.05, "flashtile with learnable_sink within 5% of its time without"),
    "chunk": Bar("flashtile-split", 1 / 1.05,
                 "attention_chunk=c within 5% of plain attention over the b*s/c sequences of length c"),
}
SUBJECTS = {"dv": "flashtile", "sink": "flashtile-sink", "chunk": "flashtile-chunk"}

# Default shapes. Tokens per batch and hidden size follow shapes.py: b = tokens // s, h = hidden // (v's
# head dim for dv rows, the head dim otherwise), so a dv row has h = 16 as DeepSeek-V3's 128-wide heads do.
DV_DIMS = (192, 128)  # (d, dv): DeepSeek-V3's q/k (nope 128 + rope 64) and v
DV_SEQLENS = (1024, 4096, 16384)
SINK_DIMS = (64, 128)  # gpt-oss has 64
SINK_SEQLENS = (4096, 16384)
CHUNK_D = 128
CHUNK_SEQLEN = 16384
CHUNKS = (2048, 8192)  # Llama 4 uses 8192
DEFAULT_ROUNDS = 5
# --quick: the CPU path runs every row in well under a second
QUICK = dict(hidden=256, tokens=128, dv_seqlens=(64,), sink_dims=(64,), sink_seqlens=(64,), chunk_d=64,
             chunk_seqlen=128, chunks=(64,), rounds=2)
# the sink and chunk rows' check: the last CHECK_ROWS queries of batch entry 0 in its first CHECK_HEADS
# heads, against every key (attention_ref materialises the scores: a whole 16k row set would not fit)
CHECK_ROWS = 256
CHECK_HEADS = 2


@dataclass(frozen=True)
class Case:
    """One row's problem: q, k (b, s, h, d), v (b, s, h, dv) in flashtile's layout."""

    group: str
    b: int
    h: int
    s: int
    d: int
    causal: bool
    dv: int | None = None
    chunk: int = 0

    def shape(self) -> Shape:
        return Shape(b=self.b, h=self.h, s=self.s, d=self.d, causal=self.causal, dv=self.dv)

    def baseline_shape(self) -> Shape:
        """The chunk rows' baseline: the same tokens as ``b * s / chunk`` sequences of one chunk each."""
        if not self.chunk:
            return self.shape()
        return Shape(b=self.b * (self.s // self.chunk), h=self.h, s=self.chunk, d=self.d, causal=self.causal)

    def label(self) -> str:
        return self.shape().label() + (f" chunk={self.chunk}" if self.chunk else "")


def chunked_flops(b: int, h: int, s: int, d: int, chunk: int, causal: bool, mode: str = "fwd") -> float:
    """FLOPs of attention with ``attention_chunk=chunk`` over ``s`` tokens: each query sees the ``chunk``
    keys of its chunk (half of them on average when causal, as ``attention_flops`` counts causal)."""
    return attention_flops(b, h, s, d, causal, mode, s_k=min(chunk, s))


def case_flops(case: Case, mode: str) -> float:
    if case.chunk:
        return chunked_flops(case.b, case.h, case.s, case.d, case.chunk, case.causal, mode)
    return attention_flops(case.b, case.h, case.s, case.d, case.causal, mode, dv=case.dv)


def judge(ratio: float | None, min_ratio: float, noise: float = NOISE) -> tuple[bool | None, str]:
    """``(passes, verdict)`` of a measured ``baseline / subject`` ratio against ``min_ratio``: "pass" when it
    clears the bar by more than the noise, "within noise" when it is inside the allowance either side
    (which passes: the bar is not shown missed), "fail" below that; "not measured" without a ratio."""
    if ratio is None:
        return None, "not measured"
    if ratio >= min_ratio * (1 + noise):
        return True, "pass"
    if ratio >= min_ratio * (1 - noise):
        return True, "within noise"
    return False, "fail"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rows")
    g.add_argument("--groups", nargs="+", choices=GROUPS, default=list(GROUPS),
                   help="dv: q/k 192, v 128 vs cuDNN; sink: learnable_sink vs none; chunk: attention_chunk vs "
                        "plain attention over the chunks as sequences (default: all)")
    g.add_argument("--modes", nargs="+", choices=MODES, default=["fwd", "bwd"],
                   help="fwd, bwd ((fwd+bwd) - fwd, as the bwd mode times it), fwdbwd (default: fwd bwd)")
    g.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    g.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    g.add_argument("--seqlens", type=int, nargs="+", metavar="S",
                   help=f"dv and sink rows' sequence lengths (default dv {DV_SEQLENS}, sink {SINK_SEQLENS})")
    g.add_argument("--sink-d", type=int, nargs="+", metavar="D", help=f"sink rows' head dims (default {SINK_DIMS})")
    g.add_argument("--chunks", type=int, nargs="+", metavar="C", help=f"chunk sizes (default {CHUNKS})")
    g.add_argument("--chunk-seqlen", type=int, metavar="S",
                   help=f"chunk rows' sequence length, a multiple of every chunk (default {CHUNK_SEQLEN})")
    g.add_argument("--hidden", type=int, help=f"h * head dim (default {HIDDEN})")
    g.add_argument("--tokens", type=int, help=f"b * s (default {TOKENS})")
    g.add_argument("--quick", action="store_true", help="tiny smoke-test shapes (explicit options win)")
    r = p.add_argument_group("run")
    r.add_argument("--peers", nargs="*", choices=("sdpa", *PEERS), default=["cudnn", "sdpa"], metavar="PEER",
                   help="dv rows' peers: sdpa (torch's backend choice) or a fixed backend of "
                        f"{' '.join(PEERS)} (default: cudnn sdpa; cudnn is the bar's)")
    r.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    r.add_argument("--rounds", type=_positive_int, metavar="R",
                   help=f"alternated rounds per row, medians reported (default {DEFAULT_ROUNDS}; "
                        f"--quick {QUICK['rounds']})")
    r.add_argument("--warmup", type=float, default=100, metavar="MS", help="warmup per measurement, ms")
    r.add_argument("--rep", "--reps", dest="rep", type=float, default=100, metavar="MS",
                   help="measured time per measurement, ms")
    r.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays (as the dense modes do)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-check", dest="check", action="store_false", help="skip the correctness checks")
    r.add_argument("--fail-on-mismatch", action="store_true", help="exit 1 if any row is a MISMATCH")
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="PATH.json",
                   help="JSON results (default: models_<gpu>_<date>.json under ~/.cache/flashtile/bench, "
                        "or $XDG_CACHE_HOME/flashtile/bench; never the working directory)")
    o.add_argument("--plot", metavar="PATH.png", help="also draw each row's ratio against its bar")


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def make_cases(args) -> list[Case]:
    """Rows in group order, then head dim, causal (no before yes), then length or chunk."""
    q = QUICK if args.quick else {}
    hidden = args.hidden or q.get("hidden", HIDDEN)
    tokens = args.tokens or q.get("tokens", TOKENS)
    causal_opts = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    cases = []
    for group in dict.fromkeys(args.groups):
        if group == "dv":
            d, dv = DV_DIMS
            for causal in causal_opts:
                for s in args.seqlens or q.get("dv_seqlens", DV_SEQLENS):
                    cases.append(Case("dv", max(1, tokens // s), max(1, hidden // dv), s, d, causal, dv=dv))
        elif group == "sink":
            for d in args.sink_d or q.get("sink_dims", SINK_DIMS):
                for causal in causal_opts:
                    for s in args.seqlens or q.get("sink_seqlens", SINK_SEQLENS):
                        cases.append(Case("sink", max(1, tokens // s), max(1, hidden // d), s, d, causal))
        else:
            s = args.chunk_seqlen or q.get("chunk_seqlen", CHUNK_SEQLEN)
            d = q.get("chunk_d", CHUNK_D)
            for causal in causal_opts:
                for c in args.chunks or q.get("chunks", CHUNKS):
                    cases.append(Case("chunk", max(1, tokens // s), max(1, hidden // d), s, d, causal, chunk=c))
    return cases


@dataclass
class Variant:
    """One column of a row: how to build its ``attn(q, k, v)``, on which tensors, under which context."""

    name: str
    build: Callable[[], AttnFn]
    tensors: list[torch.Tensor]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    unavailable: str | None = None


def _flashtile(**kw) -> Callable[[], AttnFn]:
    def build():
        from flashtile import flash_attn_func

        return lambda q, k, v: flash_attn_func(q, k, v, **kw)

    return build


def _split_tensors(tensors: list[torch.Tensor], shape: Shape) -> list[torch.Tensor]:
    """The chunk baseline's q, k, v, dout: the same storage viewed as (b * s / c, c, h, d), as leaves of their
    own (so each implementation's .grad is its own and is cleared between timed steps)."""
    views = [t.detach().view(shape.b, shape.s, *t.shape[2:]) for t in tensors]
    for view, t in zip(views[:3], tensors[:3]):
        view.requires_grad_(t.requires_grad)
    return views


def _variants(case: Case, inputs: _Inputs, sink: torch.Tensor | None, peers: list[str], device: str) -> list[Variant]:
    """The row's columns, subject first and the bar's baseline second."""
    shape = case.shape()
    if case.group == "dv":
        out = [Variant("flashtile", lambda: FLASHTILE.build(shape, device), inputs.bshd)]
        impls: list[Impl] = [SDPA_DEFAULT if p == "sdpa" else PEERS[p] for p in dict.fromkeys(peers)]
        impls.sort(key=lambda i: i.name != BARS["dv"].baseline)  # the bar's peer first (a stable sort)
        for impl in impls:
            out.append(Variant(impl.name, lambda impl=impl: impl.build(shape, device), inputs.get(impl.layout),
                               impl.context, impl.unavailable(device)))
        return out
    if case.group == "sink":
        return [Variant("flashtile-sink", _flashtile(causal=case.causal, learnable_sink=sink), inputs.bshd),
                Variant("flashtile", _flashtile(causal=case.causal), inputs.bshd)]
    return [Variant("flashtile-chunk", _flashtile(causal=case.causal, attention_chunk=case.chunk), inputs.bshd),
            Variant("flashtile-split", _flashtile(causal=case.causal),
                    _split_tensors(inputs.bshd, case.baseline_shape()))]


def _check_subset(attn: AttnFn, inputs: _Inputs, case: Case, sink: torch.Tensor | None,
                  needs_grad: bool) -> tuple[float, float | None]:
    """Max |flashtile - attention_ref| over the last CHECK_ROWS query rows of batch entry 0 in the first
    CHECK_HEADS heads, against all keys: with sq < sk the reference aligns rows bottom-right, so those rows
    keep their causal and chunk masks. Gradients flow from an output gradient that is zero outside those
    rows, so dq there, dk, dv (and the sink's) of those heads are the reference's too. The sink's gradient
    sums over rows: its error is relative to its size."""
    from flashtile.backends.reference import attention_ref

    q, k, v, do = inputs.bshd
    with torch.set_grad_enabled(needs_grad):
        out = attn(q, k, v)
    if not torch.isfinite(out).all():
        raise FloatingPointError("flashtile output has NaN/Inf")
    m, hh = min(case.s, CHECK_ROWS), min(case.h, CHECK_HEADS)
    r0 = case.s - m
    subs = [q[:1, r0:, :hh], k[:1, :, :hh], v[:1, :, :hh]]
    subs = [t.detach().float().requires_grad_(needs_grad) for t in subs]
    sink_sub = None if sink is None else sink[:hh].detach().float().requires_grad_(needs_grad)
    with torch.set_grad_enabled(needs_grad):
        ref, _ = attention_ref(*subs, causal=case.causal, learnable_sink=sink_sub, attention_chunk=case.chunk)
    err = _max_err(out[:1, r0:, :hh], ref)
    if not needs_grad:
        return err, None
    do_sub = do[:1, r0:, :hh]
    do_masked = torch.zeros_like(do)
    do_masked[:1, r0:, :hh] = do_sub
    leaves = [q, k, v] + ([] if sink is None else [sink])
    grads = torch.autograd.grad(out, leaves, do_masked)
    ref_grads = torch.autograd.grad(ref, subs + ([] if sink is None else [sink_sub]), do_sub.float())
    errs = [_max_err(grads[0][:1, r0:, :hh], ref_grads[0]), _max_err(grads[1][:1, :, :hh], ref_grads[1]),
            _max_err(grads[2][:1, :, :hh], ref_grads[2])]
    if sink is not None:
        errs.append(_max_err(grads[3][:hh], ref_grads[3]) / max(1.0, ref_grads[3].abs().max().item()))
    grad_err = max(errs)
    if grad_err != grad_err or grad_err == float("inf"):
        raise FloatingPointError("flashtile gradients have NaN/Inf")
    return err, grad_err


def _measure(name: str, attn: AttnFn, tensors: list[torch.Tensor], context: Callable, mode: str, device: str,
             args) -> dict[str, float]:
    """One round's measurement of one column: the dense modes' timing (``attention._time_parts``). It takes
    the column's name so that a stand-in (the tests' fake timer) can answer per column."""
    with context():
        return _time_parts(attn, tensors, mode, device, args)


def _mode_ms(parts: dict[str, float], mode: str) -> float:
    return parts["fwdbwd"] - parts["fwd"] if mode == "bwd" else parts[mode]


def summarize(row: dict, results: dict[str, list[dict]], names: list[str], noise: float = NOISE) -> None:
    """Fill ``row``'s times, ratios and verdict from each column's per-round parts (``results``, in round
    order). A column's time is its median over rounds; a ratio is the median over rounds of that round's
    ``column / subject`` time, each round's pair measured next to each other."""
    mode, subject = row["mode"], row["subject"]
    per_round = {name: [_mode_ms(p, mode) for p in results[name]] for name in names if name in results}
    for name in names:
        if name not in per_round:
            row["ms"].setdefault(name, None)
            continue
        ms = statistics.median(per_round[name])
        if ms <= 0:  # (fwd+bwd) - fwd: a backward under the noise of its forward
            row["errors"][name] = f"fwd+bwd not above fwd over {len(per_round[name])} round(s): timing noise"
            row["ms"][name] = None
            continue
        row["ms"][name] = ms
        row["rounds_ms"][name] = per_round[name]
        if mode == "bwd":
            row["ms_parts"][name] = {k: statistics.median(p[k] for p in results[name]) for k in ("fwd", "fwdbwd")}
    for name in names:
        row["tflops"][name] = tflops(row["flops"], row["ms"].get(name))
    sub = per_round.get(subject) if row["ms"].get(subject) else None
    for name in names:
        if name == subject:
            continue
        pairs = [b / s for s, b in zip(sub or (), per_round.get(name, ())) if s > 0 and b > 0]
        row["ratios"][name] = statistics.median(pairs) if pairs and row["ms"].get(name) else None
    row["ratio"] = row["ratios"].get(row["bar"]["baseline"])
    row["passes"], row["verdict"] = judge(row["ratio"], row["bar"]["min_ratio"], noise)


def _new_row(case: Case, mode: str, dtype: str) -> dict:
    bar = BARS[case.group]
    base = case.baseline_shape()
    row = {"group": case.group, "mode": mode, "d": case.d, "dv": case.dv or case.d, "s": case.s, "b": case.b,
           "h": case.h, "causal": case.causal, "chunk": case.chunk, "dtype": dtype, "flops": case_flops(case, mode),
           "subject": SUBJECTS[case.group], "baseline": bar.baseline,
           "baseline_shape": {"b": base.b, "s": base.s},
           "bar": {"baseline": bar.baseline, "min_ratio": bar.min_ratio, "text": bar.text},
           "ms": {}, "tflops": {}, "ratios": {}, "rounds_ms": {}, "ratio": None, "passes": None,
           "verdict": "not measured", "errors": {}, "max_err": None, "mismatch": False}
    if mode != "fwd":
        row["max_err_grad"] = None
    if mode == "bwd":
        row["ms_parts"] = {}
    return row


def run_row(case: Case, mode: str, args, device: str, seed: int, rounds: int) -> dict:
    """Check the row's subject, then time its columns in alternated rounds."""
    row = _new_row(case, mode, args.dtype)
    needs_grad = mode != "fwd"
    try:
        inputs = _Inputs(case.shape(), DTYPES[args.dtype], device, needs_grad, seed)
        sink = None
        if case.group == "sink":
            g = torch.Generator(device=device).manual_seed(seed + 1)
            # float32 (h,) logits of the scores' size: a sink that takes a real share of each row. In backward
            # modes its .grad accumulates over the timed steps (one (h,) add a step, as gradient accumulation does).
            sink = torch.randn(case.h, generator=g, device=device).requires_grad_(needs_grad)
    except torch.cuda.OutOfMemoryError as e:
        _free_cached_memory(device)
        row["errors"]["all"] = _describe(e)
        return row
    variants = _variants(case, inputs, sink, args.peers, device)
    names = [v.name for v in variants]
    tol = TOLERANCE[args.dtype]
    timers = []
    for var in variants:
        if var.unavailable:
            row["errors"][var.name] = var.unavailable
            continue
        caught: list = []
        try:
            with warnings.catch_warnings(record=True) as caught, var.context():
                warnings.simplefilter("always")
                attn = var.build()
                if var.name == row["subject"] and args.check:
                    _check_row(row, attn, inputs, case, sink, needs_grad, tol)
                q, k, v, do = var.tensors
                # An untimed first call: compiles and surfaces refusals (a backend that rejects the shape).
                if needs_grad:
                    attn(q, k, v).backward(do)
                    for t in (q, k, v):
                        t.grad = None
                else:
                    with torch.no_grad():
                        attn(q, k, v)
            timers.append((var.name, lambda var=var, attn=attn: _measure(var.name, attn, var.tensors, var.context,
                                                                         mode, device, args)))
        except Exception as e:
            row["errors"][var.name] = _describe(e, caught)
            if isinstance(e, torch.cuda.OutOfMemoryError):
                _free_cached_memory(device)
    results, failed = time_in_rounds(timers, rounds)
    for name, e in failed.items():
        row["errors"][name] = _describe(e)
    summarize(row, results, names)
    row["ms"] = {name: row["ms"].get(name) for name in names}  # column order, measured or not
    row["tflops"] = {name: row["tflops"].get(name) for name in names}
    return row


def _check_row(row: dict, attn: AttnFn, inputs: _Inputs, case: Case, sink, needs_grad: bool, tol: float) -> None:
    try:
        if case.group == "dv":
            try:
                ref = _reference(inputs, case.shape(), needs_grad)
            except Exception as e:  # no reference means no check, not no timings
                row["check_error"] = "SDPA reference failed: " + _describe(e)
                return
            err, grad_err = _check(attn, inputs, ref, needs_grad)
        else:
            err, grad_err = _check_subset(attn, inputs, case, sink, needs_grad)
    except FloatingPointError as e:
        row["check_error"] = str(e)
        row["mismatch"] = True
        return
    row["max_err"] = err
    row["mismatch"] = err > tol
    if needs_grad:
        row["max_err_grad"] = grad_err
        row["mismatch"] |= grad_err > GRAD_FACTOR * tol


# -- output ----------------------------------------------------------------------------------------

def _num(x: float | None, fmt: str) -> str:
    return report.MISSING if x is None else format(x, fmt)


def _ms(x: float | None) -> str:
    return report.MISSING if x is None else format(x, ".3f" if x < 10 else ".2f")


def _shape_cells(r: dict) -> list[tuple[str, str]]:
    cells = [("mode", r["mode"]), ("d", str(r["d"]))]
    if r["group"] == "dv":
        cells.append(("dv", str(r["dv"])))
    cells += [("s", str(r["s"]))]
    if r["group"] == "chunk":
        cells += [("chunk", str(r["chunk"])), ("split", f"{r['baseline_shape']['b']}x{r['baseline_shape']['s']}")]
    cells += [("b", str(r["b"])), ("h", str(r["h"])), ("causal", "yes" if r["causal"] else "no")]
    return cells


def format_table(rows: list[dict], meta: dict) -> str:
    """One table per group: each column's median ms, the ratios to the subject, the verdict on the bar."""
    if not rows:
        return "(no rows)"
    where = meta.get("gpu") or f"CPU ({meta.get('cpu')})"
    rounds = meta.get("timing", {}).get("rounds")
    out = [f"models  ms (median of {rounds} alternated rounds)  {rows[0]['dtype']}  {where}   "
           f"(ratio = baseline / subject time; bars hold with {NOISE:.0%} noise either side)"]
    for group in dict.fromkeys(r["group"] for r in rows):
        rs = [r for r in rows if r["group"] == group]
        names = list(dict.fromkeys(n for r in rs for n in r["ms"]))
        subject = rs[0]["subject"]
        others = [n for n in names if n != subject]
        head = [h for h, _ in _shape_cells(rs[0])] + names + [f"/{n}" for n in others] + ["verdict", "max_err"]
        grads = any("max_err_grad" in r for r in rs)
        head += (["grad_err"] if grads else []) + ["flag"]
        body = []
        for r in rs:
            cells = [c for _, c in _shape_cells(r)] + [_ms(r["ms"].get(n)) for n in names]
            cells += [_num(r["ratios"].get(n), ".3f") for n in others] + [r["verdict"], _num(r["max_err"], ".1e")]
            if grads:
                cells.append(_num(r.get("max_err_grad"), ".1e"))
            cells.append("MISMATCH" if r["mismatch"] else "")
            body.append(cells)
        widths = [max(len(h), *(len(c[j]) for c in body)) for j, h in enumerate(head)]
        line = lambda cells, widths=widths: "  ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()
        bar = rs[0]["bar"]
        out += ["", f"[{group}] subject {subject}; bar: {bar['text']} (ratio /{bar['baseline']} >= "
                    f"{bar['min_ratio']:.3f})", line(head), line(["-" * w for w in widths])]
        out += [line(c) for c in body]
    notes = _error_notes(rows)
    if notes:
        out += ["", "not measured:", *notes]
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("pass", "within noise", "fail", "not measured")}
    out += ["", "bars: " + ", ".join(f"{n} {v}" for v, n in counts.items())]
    return "\n".join(out)


def _error_notes(rows: list[dict]) -> list[str]:
    # One line per (column, reason), naming the rows: a peer refusing every row should not print a line each.
    groups: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        errs = dict(r["errors"])
        if r.get("check_error"):
            errs["check"] = r["check_error"]
        for name, reason in errs.items():
            where = f"{r['group']} {r['mode']} s={r['s']}" + (f" c={r['chunk']}" if r["chunk"] else f" d={r['d']}")
            groups.setdefault((name, " ".join(reason.split())[:300]), []).append(
                where + (" causal" if r["causal"] else ""))
    lines = []
    for (name, reason), where in groups.items():
        scope = "all rows" if len(where) == len(rows) else ", ".join(where[:6]) + (
            f" (+{len(where) - 6})" if len(where) > 6 else "")
        lines.append(f"  {name}: {reason}  [{scope}]")
    return lines


def progress_line(i: int, n: int, row: dict, seconds: float) -> str:
    parts = " | ".join(f"{name} {_ms(ms)}" for name, ms in row["ms"].items())
    err = _num(row.get("max_err"), ".1e")
    if "max_err_grad" in row:
        err += f" grad {_num(row['max_err_grad'], '.1e')}"
    flag = "  MISMATCH" if row["mismatch"] else ""
    if row.get("check_error"):
        flag += f"  ({row['check_error']})"
    cells = " ".join(f"{h}={c}" for h, c in _shape_cells(row)[1:])
    return (f"[{i}/{n}] models {row['group']} {row['mode']} {cells}: {parts} ms  ratio "
            f"{_num(row['ratio'], '.3f')} ({row['verdict']})  err {err}{flag}  ({seconds:.1f}s)")


def _meta(args, device: str, rounds: int, cases: list[Case]) -> dict:
    meta = report.collect_meta(getattr(args, "argv", []), device)
    meta.update(mode="models", dtype=args.dtype, groups=list(dict.fromkeys(args.groups)), modes=list(args.modes))
    meta["timing"] = {"warmup_ms": args.warmup, "rep_ms": args.rep, "stat": "median", "rounds": rounds,
                      "order": "round r starts at column r (mod their number)",
                      "ratio": "median over rounds of (column ms / subject ms) of the same round",
                      "method": "triton.testing.do_bench" if device == "cuda" else "time.perf_counter"}
    if "bwd" in args.modes:
        meta["timing"]["bwd"] = "(fwd+bwd) - fwd, per round"
    if args.cuda_graph:
        meta["timing"]["cuda_graph"] = True
    meta["bars"] = {"noise": NOISE,
                    "rule": "ratio >= min_ratio * (1 + noise): pass; >= min_ratio * (1 - noise): within noise "
                            "(passes); below: fail",
                    **{g: {"subject": SUBJECTS[g], "baseline": b.baseline, "min_ratio": b.min_ratio, "text": b.text}
                       for g, b in BARS.items() if g in meta["groups"]}}
    impls = {"flashtile": "flashtile.flash_attn_func",
             "flashtile-sink": "flashtile.flash_attn_func with learnable_sink, float32 (h,) randn",
             "flashtile-chunk": "flashtile.flash_attn_func with attention_chunk",
             "flashtile-split": "flashtile.flash_attn_func on the chunk row's tokens as b*s/c sequences of length c"}
    for p in dict.fromkeys(args.peers):
        impls[p] = (SDPA_DEFAULT if p == "sdpa" else PEERS[p]).description
    meta["impls"] = impls
    tol = TOLERANCE[args.dtype]
    meta["check"] = {
        "dv": "torch SDPA (backend of torch's choice) on the whole output and dq, dk, dv",
        "sink, chunk": f"flashtile.backends.reference.attention_ref (fp32) on the last {CHECK_ROWS} query rows "
                       f"of batch entry 0, heads < {CHECK_HEADS}, every key; gradients from an output gradient "
                       "zero elsewhere (the sink's relative to its size)",
        "baselines": "not checked here (the fwd/bwd modes check plain flashtile)",
        "tolerance": tol, "grad_tolerance": round(GRAD_FACTOR * tol, 6)} if args.check else None
    meta["rows"] = len(cases) * len(args.modes)
    return meta


def run(args) -> int:
    device = report.resolve_device(args.device)
    if device is None:
        return 2
    if device == "cpu":
        report.eprint("note: CPU timings are for smoke tests only")
    cases = make_cases(args)
    for case in cases:
        if case.chunk and (case.chunk > case.s or case.s % case.chunk):
            report.eprint(f"error: chunk {case.chunk} must divide the chunk rows' length {case.s}")
            return 2
    rounds = args.rounds or (QUICK["rounds"] if args.quick else DEFAULT_ROUNDS)
    meta = _meta(args, device, rounds, cases)
    out_path = args.out or paths.default_out_path("models", meta)
    rows = []
    jobs = [(case, mode) for case in cases for mode in dict.fromkeys(args.modes)]
    t_start = time.perf_counter()
    for i, (case, mode) in enumerate(jobs, 1):
        t0 = time.perf_counter()
        row = run_row(case, mode, args, device, seed=args.seed + i, rounds=rounds)
        rows.append(row)
        report.eprint(progress_line(i, len(jobs), row, time.perf_counter() - t0))
        report.write_json(out_path, meta, rows)  # after every row: a long run killed midway keeps its rows
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    report.write_json(out_path, meta, rows)
    print(format_table(rows, meta))
    print(f"\nwrote {out_path}")
    if args.plot:
        from flashtile.bench.plot import plot_models

        try:
            plot_models({"meta": meta, "rows": rows}, args.plot)
            print(f"wrote {args.plot}")
        except ImportError as e:  # the numbers are already saved; a plot can be made later
            report.eprint(f"note: no plot ({e}); later: python -m flashtile.bench plot {out_path} {args.plot}")
    mismatches = sum(r["mismatch"] for r in rows)
    if mismatches:
        report.eprint(f"WARNING: {mismatches} row(s) where flashtile disagrees with its reference (MISMATCH)")
    return 1 if mismatches and args.fail_on_mismatch else 0
