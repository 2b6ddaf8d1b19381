"""``python -m flashtile.bench cp``: context-parallel attention across the ranks of a torchrun launch.

    torchrun --nproc-per-node 8 -m flashtile.bench cp --seqlens 32768 131072 1048576 --out cp.json
    python -m flashtile.bench cp --device cpu --quick          # smoke run: one gloo rank

Per sequence length (the whole sequence, split over the ranks) and scheme (ring, zigzag, Ulysses, hybrid,
K/V all-gather): the step's wall time (slowest rank), TFLOP/s per GPU, and the scaling efficiency against
one GPU running flash_attn_func on the whole sequence (capped at ``--baseline-max`` tokens, beyond which
one GPU's throughput no longer changes). Ring schemes also report overlap: the same kernels with no
communication, the K/V hops alone, and the share of the hops hidden under the kernels. Causal bf16, d = 128,
h = 2048 // d by default. Every rank runs the same timers in the same order (collectives must match).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from flashtile.bench.report import collect_meta, eprint, write_json
from flashtile.bench.shapes import attention_flops

SCHEMES = ("ring", "zigzag", "ulysses", "hybrid", "allgather")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072, 524288, 1048576],
                   help="whole-sequence lengths (split over the ranks)")
    p.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--heads", type=int, default=None, help="query heads (default 2048 // d)")
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default: the query heads)")
    p.add_argument("--causal", choices=("yes", "no"), default="yes")
    p.add_argument("--modes", nargs="+", choices=("fwd", "fwdbwd"), default=["fwd", "fwdbwd"])
    p.add_argument("--ulysses-size", type=int, default=None,
                   help="hybrid: ranks per Ulysses group (default: the largest power of 2 <= sqrt(world))")
    p.add_argument("--baseline-max", type=int, default=131072, help="longest one-GPU baseline sequence")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes, one round (CPU smoke test)")
    p.add_argument("--out", default=None, help="write the rows and metadata as JSON here (rank 0)")


class _NoComm:
    """A ring whose exchanges return what they are given: the ring's kernels with no communication."""

    def __init__(self, world: int, rank: int):
        self.world, self.rank = world, rank

    def exchange(self, tensors, tag):
        from flashtile.distributed.comm import Pending

        return Pending([], list(tensors))


def _init(device: str) -> bool:
    """Join torchrun's group, or make a one-rank group; True when this call created it."""
    if dist.is_initialized():
        return False
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if device == "cuda" else "gloo"
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(backend)
    else:  # a one-rank group through a fresh rendezvous file (a port picked free could be taken meanwhile)
        rendezvous = os.path.join(tempfile.mkdtemp(prefix="flashtile-cp-"), "rendezvous")
        dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=0, world_size=1)
    return True


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str, iters: int) -> float:
    """Milliseconds per call of ``fn`` on the slowest rank (every rank calls it ``iters + 1`` times)."""
    fn()
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    ms = torch.tensor([(time.perf_counter() - t0) * 1e3 / iters], dtype=torch.float64,
                      device="cuda" if device == "cuda" else "cpu")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def _hybrid_groups(world: int, u: int):
    """Ulysses rows of ``u`` consecutive ranks and ring columns across them (every rank makes every group)."""
    rank = dist.get_rank()
    rows = [dist.new_group(list(range(i, i + u))) for i in range(0, world, u)]
    cols = [dist.new_group(list(range(j, world, u))) for j in range(u)]
    return rows[rank // u], cols[rank % u]


def _scheme_fn(name: str, world: int, groups):
    import flashtile.distributed as cp

    if name == "ring":
        return lambda q, k, v, c: cp.ring_flash_attn_func(q, k, v, causal=c)
    if name == "zigzag":
        return lambda q, k, v, c: cp.zigzag_ring_flash_attn_func(q, k, v, causal=c)
    if name == "ulysses":
        return lambda q, k, v, c: cp.ulysses_flash_attn_func(q, k, v, causal=c)
    if name == "allgather":
        return lambda q, k, v, c: cp.kv_allgather_flash_attn_func(q, k, v, causal=c, layout="zigzag")
    ug, rg = groups
    return lambda q, k, v, c: cp.hybrid_flash_attn_func(q, k, v, causal=c, ulysses_group=ug, ring_group=rg,
                                                        layout="zigzag")


def _step(fn, q, k, v, causal, mode):
    def run():
        out = fn(q, k, v, causal)
        if mode == "fwdbwd":
            out.backward(torch.ones_like(out))
    return run


def _overlap(q, k, v, causal, layout, device, iters):
    """Ring forward: (kernels alone, hops alone) in ms, the kernels through a ring that does not communicate."""
    from flashtile.distributed.blocks import Options, bind
    from flashtile.distributed.comm import Ring
    from flashtile.distributed.ring import RingAttention, ring_plan

    ring = Ring(dist.group.WORLD)
    total = q.shape[1] * ring.world
    plan = ring_plan(layout, total, ring.world, ring.rank, -1, 0 if causal else -1, None)
    steps = [bind(list(c), q.shape[0], q.shape[1], q.shape[1], q.device) for c in plan]
    opt = Options(q.shape[-1] ** -0.5)
    no_comm = _NoComm(ring.world, ring.rank)
    kernels = _timed(lambda: RingAttention.apply(q, k, v, None, no_comm, steps, opt), device, iters)

    def hops():
        kb, vb = k, v
        for _ in range(ring.world - 1):
            kb, vb = ring.exchange([kb, vb], tag=0).wait()
    return kernels, _timed(hops, device, iters)


def _baseline(s, h, hk, d, causal, mode, device, dtype, iters) -> float | None:
    """One GPU (rank 0) on the whole sequence: TFLOP/s; the other ranks wait."""
    from flashtile import flash_attn_func

    tf = None
    if dist.get_rank() == 0:
        q = torch.randn(1, s, h, d, device=device, dtype=dtype, requires_grad=mode == "fwdbwd")
        k, v = (torch.randn(1, s, hk, d, device=device, dtype=dtype, requires_grad=mode == "fwdbwd")
                for _ in range(2))
        run = _step(lambda q_, k_, v_, c: flash_attn_func(q_, k_, v_, causal=c), q, k, v, causal, mode)
        run()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        _sync(device)
        ms = (time.perf_counter() - t0) * 1e3 / iters
        tf = attention_flops(1, h, s, d, causal, mode="fwd") * (3.5 if mode == "fwdbwd" else 1.0) / ms / 1e9
    dist.barrier()
    return tf


def run(args) -> int:
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        eprint("cp: no CUDA device; use --device cpu")
        return 2
    created = _init(device)
    try:
        return _run(args, device)
    finally:
        if created:
            dist.destroy_process_group()


def _run(args, device: str) -> int:
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    d = 32 if args.quick else args.d
    h = args.heads or (4 if args.quick else 2048 // d)
    hk = args.kv_heads or h
    seqlens = [64 * world] if args.quick else args.seqlens
    rounds, iters = (1, 1) if args.quick else (args.rounds, args.iters)
    causal = args.causal == "yes"
    u = args.ulysses_size or max(1, 2 ** (int(world ** 0.5).bit_length() - 1))
    groups = _hybrid_groups(world, u) if "hybrid" in args.schemes and world % u == 0 else None
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    rows = []
    for s in seqlens:
        n = s // world
        g = torch.Generator(device="cpu").manual_seed(s + rank)
        q, k, v = (torch.randn(1, n, m, d, generator=g).to(dev, dtype).requires_grad_() for m in (h, hk, hk))
        for mode in args.modes:
            flops = attention_flops(1, h, s, d, causal, mode="fwd") * (3.5 if mode == "fwdbwd" else 1.0)
            base = _baseline(min(s, args.baseline_max), h, hk, d, causal, mode, dev, dtype, iters)
            for name in args.schemes:
                row = {"seqlen": s, "world": world, "scheme": name, "mode": mode, "causal": causal, "d": d,
                       "heads": h, "kv_heads": hk, "dtype": str(dtype).replace("torch.", "")}
                if name == "hybrid" and groups is None:
                    row["error"] = f"world {world} not divisible by --ulysses-size {u}"
                    rows.append(row)
                    continue
                row["ulysses_size"] = u if name == "hybrid" else None
                fn = _scheme_fn(name, world, groups)
                try:
                    times = [_timed(_step(fn, q, k, v, causal, mode), device, iters) for _ in range(rounds)]
                except (ValueError, RuntimeError) as e:  # e.g. heads not divisible for Ulysses
                    row["error"] = str(e)
                    rows.append(row)
                    continue
                ms = statistics.median(times)
                row["ms"] = ms
                row["tflops_per_gpu"] = flops / world / ms / 1e9
                row["baseline_tflops"] = base
                if base is not None:
                    row["efficiency"] = row["tflops_per_gpu"] / base
                if name in ("ring", "zigzag") and mode == "fwd":
                    with torch.no_grad():
                        kernels, hops = _overlap(q, k, v, causal, "zigzag" if name == "zigzag" else "contiguous",
                                                 device, iters)
                    row.update(kernels_ms=kernels, comm_ms=hops,
                               hidden_comm=max(0.0, min(1.0, (kernels + hops - ms) / hops)) if hops > 0 else None)
                rows.append(row)
                if rank == 0:
                    eprint(_line(row))
    if rank == 0:
        if args.out:
            meta = collect_meta(getattr(args, "argv", []), device)
            meta["world_size"] = world
            write_json(args.out, meta, rows)
    return 0


def _line(r: dict) -> str:
    if "error" in r:
        return f"s={r['seqlen']:>8} {r['scheme']:<9} {r['mode']:<6} error: {r['error']}"
    eff = r.get("efficiency")
    extra = ""
    if r.get("kernels_ms") is not None:
        hidden = r["hidden_comm"]
        extra = f"  kernels {r['kernels_ms']:.2f} ms, hops {r['comm_ms']:.2f} ms, hidden " + \
                ("-" if hidden is None else f"{hidden:.0%}")
    return (f"s={r['seqlen']:>8} W={r['world']} {r['scheme']:<9} {r['mode']:<6} {r['ms']:9.2f} ms "
            f"{r['tflops_per_gpu']:8.3g} TFLOP/s/GPU  eff {'-' if eff is None else f'{eff:.0%}'}{extra}")
