"""Timing: Triton's do_bench (median) on CUDA, a perf_counter median on CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

# CPU timing exists for smoke tests, so it trades precision for a bounded run time.
_CPU_MIN_RUNS = 3
_CPU_MAX_RUNS = 50

T = TypeVar("T")


def _clear_grads(tensors: Sequence[torch.Tensor] | None) -> None:
    for t in tensors or ():
        t.grad = None


def _cuda_events(fn, warmup_ms, rep_ms, grad_to_none):
    # Only used when Triton is missing; do_bench also flushes L2, this does not.
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        _clear_grads(grad_to_none)
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    times = []
    for _ in range(max(1, int(rep_ms / est))):
        _clear_grads(grad_to_none)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _cpu(fn, warmup_ms, rep_ms, grad_to_none):
    deadline = time.perf_counter() + warmup_ms / 1e3
    while True:  # at least one warm call: first calls pay for allocation and lazy init
        _clear_grads(grad_to_none)
        fn()
        if time.perf_counter() >= deadline:
            break
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < _CPU_MAX_RUNS and (len(times) < _CPU_MIN_RUNS or time.perf_counter() < deadline):
        _clear_grads(grad_to_none)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench(fn: Callable[[], object], device: str, warmup_ms: float = 25, rep_ms: float = 100,
          grad_to_none: Sequence[torch.Tensor] | None = None) -> float:
    """Median milliseconds of ``fn()``; ``.grad`` of ``grad_to_none`` is reset before each run."""
    if torch.device(device).type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            return _cuda_events(fn, warmup_ms, rep_ms, grad_to_none)
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                              return_mode="median"))
    return _cpu(fn, warmup_ms, rep_ms, grad_to_none)


def bench_graph(fn: Callable[[], object], device: str, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of replaying a CUDA graph of ``fn()``: the kernels' time without the host
    launch path (Python, argument checks, launch latency). Falls back to :func:`bench` off CUDA."""
    if torch.device(device).type != "cuda":
        return bench(fn, device, warmup_ms, rep_ms)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # capture on the warm-up stream: per-stream state made during warm-up (the fused decode merge's
    # counters, backends/triton/decode.py) must be there in the capture, or the captured call takes
    # another path (torch.cuda.graph otherwise captures on a stream of its own)
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return bench(graph.replay, device, warmup_ms, rep_ms)


def time_in_rounds(timers: Sequence[tuple[str, Callable[[], T]]], rounds: int
                   ) -> tuple[dict[str, list[T]], dict[str, Exception]]:
    """Call every ``(name, timer)`` ``rounds`` times, round r starting at timer r (mod their number), so
    that an order effect (heat, clocks, memory state) lands on each in turn instead of always on the
    last. Returns each name's results in round order, and the exception of each timer that raised
    (it is dropped from then on, results and all, so every name kept has one result per round)."""
    results: dict[str, list[T]] = {name: [] for name, _ in timers}
    failed: dict[str, Exception] = {}
    for r in range(rounds):
        start = r % len(timers) if timers else 0
        for name, timer in [*timers[start:], *timers[:start]]:
            if name in failed:
                continue
            try:
                results[name].append(timer())
            except Exception as e:
                failed[name] = e
                results.pop(name)
                if isinstance(e, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
    return results, failed
