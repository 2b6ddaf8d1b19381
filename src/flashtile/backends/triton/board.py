"""Which kind of H200 is this? Some boards read memory slower when a grid leaves a few SMs idle.

On most H200 boards a streaming read on 128 programs (one an SM, 4 of the 132 SMs idle) takes what 132 programs take
(within 0.2%-0.3%). On some (leases J24, E26, C29) it takes 1.9%-2.5% longer, and every decode grid of 128 programs
(b = 1, 8 and 32 at 8 kv heads) loses that much: those boards want kernels that use every SM (the stream-K row
kernel, half-row programs in 132-program grids). Nothing static tells the two kinds apart (same clocks, power limits
and SM count), so ``full_grid_board`` times it: a 1 GiB read (kernels/grid_read.py, probe_sm_balance.py's even read)
on 132 and on 128 programs, each as CUDA-graph replays of 4 chained reads, alternated over rounds, the median of
each. With that read at 1 GiB, P128 / P132 was 1.0024-1.0033 on six normal boards (sm_balance_lease{A,B,C,D,E}28,
_leaseC27_...json) and 1.0199 on C29 (sm_balance_leaseC29_h200_2026-12-02_session29.json): FULL_GRID_RATIO sits
between them. The numbers are the H200's; an H100 SXM (also 132 SMs) is measured the same way, unvalidated.

When: on a device's first decode call whose kernel the class changes (kvcache_fwd: the full-grid rule and the normal
one differ), outside CUDA-graph capture; or when called (``full_grid_board(device)`` before capturing decode graphs
makes them take the board's kernels). It compiles one small kernel, needs 1 GiB for a moment (left in PyTorch's
caching allocator for the process's tensors) and waits for the device: about a second with the compile, some 0.15 s
without. The captures it times are its own stream's (thread-local mode: other threads' CUDA calls go on). A call
captured into a graph before any eager call cannot measure: it takes the normal boards' kernels and measures
nothing, so a later eager call may pick others. Without 1 GiB free, or if the measurement fails, one warning and the
normal boards' rule. The class found is logged (logger ``flashtile``, INFO). ``h100`` tells an H100 from an H200 by
its name: the two want different kernels at b = 32 (decode_rows.H100_BAND).
``FLASHTILE_DECODE_BOARD`` skips the measurement: ``normal``, ``full-grid``, or unset / ``auto`` (measure).
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import warnings

import torch

from flashtile import env

# The measurement and the full-grid rule are for GPUs of this many SMs (H200 / H100 SXM); others never ask
MEASURED_SMS = 132
# P128 / P132 above this: a board whose idle SMs cost bandwidth (normal boards 1.002-1.0035, C29 1.020 at 1 GiB)
FULL_GRID_RATIO = 1.01
READ_BYTES = 1 << 30  # both buffers together
BLOCK = 16384  # int16 words a tile: 32 KB
STAGES = 3
ROUNDS = 3
REPLAYS = 20  # a variant's replays a round (4 reads of 1 GiB each: about 1 ms a replay)
CHAINED = 4
SETTINGS = ("", "auto", "normal", "full-grid")

_KNOWN: dict[int, bool] = {}  # device index -> full-grid board
_RATIOS: dict[int, float] = {}  # device index -> the measured P128 / P132 (diagnostics, tests)
# device index -> the 132-program read's rate in TB/s at the last measure_ratio call (diagnostics: bench decode's meta
# records it; probe_sm_balance.py's 8 GiB read ran at 4.70 TB/s on the fast boards of sessions 28-30 and at 4.59 on the
# others; this 1 GiB read's rates are not yet measured). A direct measure_ratio call (probe_board_ratio.py, other
# sizes) overwrites it.
_RATES: dict[int, float] = {}
_LOCK = threading.Lock()  # one measurement at a time: two would share the bandwidth they time
_LOG = logging.getLogger("flashtile")


def setting() -> str:
    """FLASHTILE_DECODE_BOARD, checked: '' / 'auto' measure, 'normal' / 'full-grid' decide."""
    value = env.get("FLASHTILE_DECODE_BOARD", "") or ""
    if value not in SETTINGS:
        raise ValueError(f"FLASHTILE_DECODE_BOARD must be normal, full-grid, auto or unset, got {value!r}")
    return value


def known(device: torch.device) -> dict:
    """What the decode rules use on ``device`` now, without measuring: the setting, the class ('normal',
    'full-grid'; None while unmeasured, and off CUDA, where no rule asks), the measured P128 / P132 and the
    132-program read's rate in TB/s (None if not measured)."""
    value = setting()
    if device.type != "cuda":
        return {"setting": value, "class": None, "ratio": None, "read_tb_s": None}
    index = _index(device)
    full = value == "full-grid" if value in ("normal", "full-grid") else _KNOWN.get(index)
    return {"setting": value, "class": None if full is None else "full-grid" if full else "normal",
            "ratio": _RATIOS.get(index), "read_tb_s": _RATES.get(index)}


def h100(device: torch.device) -> bool:
    """Is ``device`` an H100 (its name says so)? Its decode rule differs at b = 32 (decode_rows.H100_BAND,
    measured on H100 SXM boards); False off CUDA. Read once per device."""
    return device.type == "cuda" and _named_h100(_index(device))


@functools.cache  # as decode._num_sms and host._capability: the driver is asked once per device
def _named_h100(index: int) -> bool:
    return "H100" in torch.cuda.get_device_name(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def full_grid_board(device: torch.device) -> bool:
    """True on a board where 128 programs read measurably slower than 132 (measured once per device, see the module
    docstring); False on normal boards, off CUDA, and inside a graph capture before any measurement."""
    value = setting()
    if value in ("normal", "full-grid"):
        return value == "full-grid"
    if device.type != "cuda":
        return False
    index = _index(device)
    known = _KNOWN.get(index)
    if known is not None:
        return known
    with _LOCK:
        if index in _KNOWN:  # another thread measured it meanwhile
            return _KNOWN[index]
        with torch.cuda.device(index):
            if torch.cuda.is_current_stream_capturing():
                return False  # no timing inside a capture: the normal kernels, measured at the next eager call
            _KNOWN[index] = _measure_class(index)
    return _KNOWN[index]


def _measure_class(index: int) -> bool:
    """The measured class of cuda:index; the normal class, with a warning, when it cannot be measured."""
    device = torch.device("cuda", index)
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    problem = None
    if free + cached < READ_BYTES + (64 << 20):
        problem = f"no {READ_BYTES >> 20} MiB free"  # a serving process whose caches hold the GPU's memory
    else:
        try:
            _RATIOS[index] = measure_ratio(device)
        except Exception as e:  # noqa: BLE001 - decoding must go on whatever the probe met; the warning says what
            problem = f"the measurement failed ({type(e).__name__}: {e})"
    if problem is not None:
        warnings.warn(f"flashtile: {problem} on cuda:{index} to tell the board's class; decoding with the normal "
                      "boards' kernels (FLASHTILE_DECODE_BOARD=normal or full-grid sets the class)", stacklevel=3)
        return False
    full = _RATIOS[index] > FULL_GRID_RATIO
    _LOG.info("flashtile: cuda:%d reads %.4fx as long on 128 programs as on 132 (%.2f TB/s on 132): %s board", index,
              _RATIOS[index], _RATES.get(index, float("nan")), "a full-grid" if full else "a normal")
    return full


def measure_ratio(device: torch.device, read_bytes: int = READ_BYTES) -> float:
    """P128 / P132: the median time of a read split evenly among 128 programs over the median on 132. Also records
    the 132-program read's rate (``known``'s read_tb_s)."""
    words = read_bytes // 4  # int16 words a buffer (two buffers)
    with torch.cuda.device(device):
        a = torch.empty(words // BLOCK * BLOCK, device=device, dtype=torch.int16)
        b = torch.empty_like(a)
        out = torch.empty(132 * BLOCK, device=device, dtype=torch.int16)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            times = _replay_times(a, b, out, stream)
        torch.cuda.current_stream(device).wait_stream(stream)
    p132_ms = statistics.median(times[132])
    _RATES[_index(device)] = CHAINED * 2 * a.numel() * a.element_size() / (p132_ms * 1e-3) / 1e12
    return statistics.median(times[128]) / p132_ms


def _replay_times(a, b, out, stream) -> dict[int, list[float]]:
    """ms of each replay of CHAINED reads on 132 and on 128 programs, the two alternated over ROUNDS (each first in
    every other round)."""
    from flashtile.kernels.grid_read import _grid_read_kernel

    tiles = a.numel() // BLOCK
    graphs = {}
    for programs in (132, 128):
        def reads(p=programs):
            for _ in range(CHAINED):
                _grid_read_kernel[(p,)](a, b, out, tiles, BLOCK=BLOCK, STAGES=STAGES, num_warps=8, num_stages=1)
        reads()  # compile and warm outside the capture
        stream.synchronize()
        # captured by hand, not with torch.cuda.graph, whose entry synchronizes the device and empties the caching
        # allocator; thread-local mode leaves other threads' CUDA calls alone
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            reads()
        finally:
            graph.capture_end()
        graphs[programs] = graph
    times = {p: [] for p in graphs}
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPLAYS)]
    for round_ in range(ROUNDS):
        for programs in (132, 128) if round_ % 2 == 0 else (128, 132):
            graph = graphs[programs]
            graph.replay()  # a warm replay first
            for start, end in events:
                start.record(stream)
                graph.replay()
                end.record(stream)
            events[-1][1].synchronize()
            times[programs] += [start.elapsed_time(end) for start, end in events]
    return times


def forget() -> None:
    """Drop the measured classes (tests; a process that wants to measure again)."""
    with _LOCK:
        _KNOWN.clear()
        _RATIOS.clear()
        _RATES.clear()
