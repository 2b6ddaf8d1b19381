"""Split or stream-K whole-row decode, measured once a board and shape (session 25).

The split row kernel (kernels/decode_rows.py) gives every (batch row, kv-head group) the same number of key splits,
so at b = 32 it runs 128 programs on the H200's 132 SMs, and at b = 64, 128 again. Stream-K
(kernels/decode_rows_streamk.py) runs one program on every SM. Which is faster depends on the board:
- on most H200s 128 streaming programs read as fast as 132, and stream-K's extra work (pipeline restarts where a
  program crosses into the next row, its merge's fixed slots) made it 0.2%-2% slower (leases K24, B25, D25);
- on some (lease J24) a plain read on 128 programs was 2.3% slower than on 132, and every 128-program kernel
  trailed cuDNN by 1.3%-1.6%.
Nothing static tells the two apart (J24 and K24 report the same clocks and power limits), so when the split grid
would leave SMs idle, the first call of a shape outside a CUDA graph capture times both kernels on the call's own
cache at its full capacity (the regime the rule is for; the lengths may be short now and grow), in alternating
bursts, and keeps stream-K only if it is MARGIN faster. The choice is kept per (device, shape) for the process. A
call captured before any eager call of its shape takes the split kernel and decides nothing.
``FLASHTILE_DECODE_ROWS_STREAMK`` =1 / 0 forces stream-K / the split kernel.
"""

from __future__ import annotations

import torch

# stream-K must be this much faster (relative) to be chosen: a J24-like board should gain about 2%; on normal boards
# stream-K was 0.3%-0.8% slower, and single eager launches misjudged the pair by up to 1.3% (lease E25)
MARGIN = 0.01
# samples of each kernel, alternating, each BURST launches back to back (the GPU never waits for the host), after
# one burst of each to warm up: at b = 32, 128k about 32 launches, 120 ms, once a shape
ROUNDS = 5
BURST = 3
# key -> True (stream-K) / False (split); MEASURED: key -> (split us, stream-K us), for reports
CHOICES: dict[tuple, bool] = {}
MEASURED: dict[tuple, tuple[float, float]] = {}


def choose(key: tuple, run_split, run_streamk) -> bool:
    """Whether calls of ``key`` take stream-K: the cached choice, or one measured now (each ``run_*()`` launches
    that kernel on scratch outputs); False without a measurement inside a graph capture."""
    hit = CHOICES.get(key)
    if hit is not None:
        return hit
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False  # no timing in a capture; the next eager call decides
    split_us, streamk_us = _time_both(run_split, run_streamk)
    MEASURED[key] = (split_us, streamk_us)
    CHOICES[key] = streamk_us < split_us * (1 - MARGIN)
    return CHOICES[key]


def _time_both(run_split, run_streamk) -> tuple[float, float]:
    """Median microseconds a launch of each, from bursts of BURST launches timed with CUDA events, alternating."""
    times = ([], [])
    runs = (run_split, run_streamk)
    for run in runs:
        run()  # compile and warm up
    for r in range(ROUNDS):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(BURST):
                runs[i]()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end) * 1e3 / BURST)
    return tuple(sorted(t)[len(t) // 2] for t in times)
