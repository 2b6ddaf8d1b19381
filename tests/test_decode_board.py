"""The board class (backends/triton/board.py) and the full-grid boards' decode rule (decode_rows.full_grid_rule):
the setting is checked by name, CPU tensors never measure, the rule's table, and kvcache_fwd's wiring (the rule
consulted only for its shape, its heads and stream-K reaching the row kernel). GPU: tests/test_gpu_decode_board.py."""

import pytest
import torch

from flashtile.backends.triton import board, decode_rows
from test_kvcache import _run_and_check, make_case

RULE = dict(arch="sm90", h_k=8, d=128, num_splits=0, sms=132)


def test_setting_is_checked_by_name(monkeypatch):
    monkeypatch.setenv("FLASHTILE_DECODE_BOARD", "fullgrid")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_BOARD"):
        board.full_grid_board(torch.device("cpu"))
    monkeypatch.setenv("FLASHTILE_DECODE_BOARD", "full-grid")
    assert board.full_grid_board(torch.device("cpu"))
    monkeypatch.setenv("FLASHTILE_DECODE_BOARD", "normal")
    assert not board.full_grid_board(torch.device("cpu"))


@pytest.mark.parametrize("value", ["", "auto"])
def test_cpu_tensors_never_measure(monkeypatch, value):
    monkeypatch.setenv("FLASHTILE_DECODE_BOARD", value)
    monkeypatch.setattr(board, "measure_ratio", lambda *a, **k: pytest.fail("measured on a CPU tensor"))
    assert not board.full_grid_board(torch.device("cpu"))


def test_full_grid_rule():
    def rule(**kw):
        return decode_rows.full_grid_rule(normal=decode_rows.by_rule(**kw), **kw)

    # the normal rule's calls up to b = 64: whole rows on stream-K
    assert rule(b=32, capacity=65536, **RULE) == (8, True)
    assert rule(b=64, capacity=8192, **RULE) == (8, True)
    assert rule(b=16, capacity=131072, **RULE) == (8, True)
    assert rule(b=128, capacity=8192, **RULE) == (8, False)  # unmeasured on these boards: the normal rule
    # the table: b = 16 from 64k on stream-K, half rows at b = 1 / 2 / 8 from 128k / 64k / 32k
    assert rule(b=16, capacity=65536, **RULE) == (8, True)
    assert rule(b=1, capacity=131072, **RULE) == (4, False)
    assert rule(b=1, capacity=65536, **RULE) == (0, False)
    assert rule(b=2, capacity=65536, **RULE) == (4, False)
    assert rule(b=2, capacity=32768, **RULE) == (0, False)
    assert rule(b=8, capacity=32768, **RULE) == (4, False)
    assert rule(b=8, capacity=65536, **RULE) == (4, False)
    assert rule(b=8, capacity=131072, **RULE) == (8, True)  # from 128k whole rows on stream-K
    assert rule(b=8, capacity=16384, **RULE) == (0, False)
    assert rule(b=4, capacity=131072, **RULE) == (4, False)  # half rows from 128k (A31)
    assert rule(b=4, capacity=65536, **RULE) == (0, False)  # unmeasured
    assert rule(b=32, capacity=32768, **RULE) == (0, False)  # the per-head kernel is ahead there already
    # only the measured shape, and contiguous caches
    assert rule(b=1, capacity=131072, **dict(RULE, arch="default")) == (0, False)
    assert rule(b=1, capacity=131072, **dict(RULE, h_k=4)) == (0, False)
    assert rule(b=1, capacity=131072, **dict(RULE, num_splits=2)) == (0, False)
    assert rule(b=32, capacity=65536, page_size=16, **RULE) == (decode_rows.by_rule(
        b=32, capacity=65536, page_size=16, **RULE), False)
    assert rule(b=8, capacity=131072, page_size=256, **RULE) == (0, False)


@pytest.fixture
def routes(monkeypatch):
    """The interpreter posing as Hopper on 16-key tiles; a list of (heads, streamk) of every row-kernel call, and
    the board class asked for through a counter."""
    from flashtile.backends.triton import decode

    monkeypatch.setenv("FLASHTILE_INTERPRET", "1")
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_CFG", "16,4,2")
    monkeypatch.delenv("FLASHTILE_DECODE_ROWS", raising=False)
    monkeypatch.delenv("FLASHTILE_DECODE_ROWS_STREAMK", raising=False)
    monkeypatch.setattr(decode, "_arch", lambda device: "sm90")
    calls, asked = [], []
    real = decode_rows.rows_decode
    monkeypatch.setattr(decode_rows, "rows_decode",
                        lambda *a, **k: (calls.append((k["heads"], k["streamk"])), real(*a, **k))[1])
    real_board = board.full_grid_board
    monkeypatch.setattr(board, "full_grid_board", lambda device: (asked.append(1), real_board(device))[1])
    return calls, asked


def test_full_grid_boards_take_their_rule(routes, monkeypatch):
    calls, asked = routes
    monkeypatch.setattr(decode_rows, "FULL_GRID_CALLS", {2: ((0, 4, False),)})  # b = 2 at any capacity: half rows
    q, kc, vc, args = make_case(dtype=torch.float16, h=16, h_k=8, d=128, cap=40, s_new=1, b=2)
    monkeypatch.setenv("FLASHTILE_DECODE_BOARD", "full-grid")
    _run_and_check(q, kc, vc, args)
    assert calls == [(4, False)] and asked == [1]
    # the normal rule's calls go to stream-K, whole rows
    monkeypatch.setattr(decode_rows, "RULE_BOUNDS", ((0.0, 0),))
    _run_and_check(q, kc, vc, args)
    assert calls[1:] == [(8, True)]
    # a normal board: the normal rule (4 heads: the interpreter's 2 x 2 units split to fill its SMs)
    monkeypatch.setenv("FLASHTILE_DECODE_BOARD", "normal")
    _run_and_check(q, kc, vc, args)
    assert calls[2:] == [(4, False)]


def test_an_h100_takes_its_own_bounds(routes, monkeypatch):
    """kvcache_fwd hands the GPU's name to the rule (on 132 SMs only): on an H100 the calls in H100_BAND take whole
    rows from H100_WHOLE_FROM keys where an H200 takes half rows, and another kernel below."""
    from flashtile.backends.triton import decode

    calls, asked = routes
    monkeypatch.setenv("FLASHTILE_DECODE_BOARD", "normal")
    monkeypatch.setattr(decode_rows, "RULE_BOUNDS", ((0.0, 0),))
    monkeypatch.setattr(decode_rows, "H100_BAND", (0.0, 1e9))
    monkeypatch.setattr(decode_rows, "H100_WHOLE_FROM", 0)
    q, kc, vc, args = make_case(dtype=torch.float16, h=16, h_k=8, d=128, cap=40, s_new=1, b=2)
    _run_and_check(q, kc, vc, args)
    assert calls == [(4, False)]  # not an H100 (CPU tensors): half rows
    monkeypatch.setattr(board, "h100", lambda device: True)
    _run_and_check(q, kc, vc, args)  # CPU tensors count as 132 SMs (decode.num_sms), the measured H100's
    assert calls[1:] == [(8, False)]  # whole rows
    monkeypatch.setattr(decode_rows, "H100_WHOLE_FROM", 41)
    _run_and_check(q, kc, vc, args)
    assert calls[2:] == []  # below the H100's bound: the per-head kernels
    # an H100 of another SM count (the PCIe's 114) keeps the H200's bounds: half rows, where its band would say none
    monkeypatch.setattr(decode, "num_sms", lambda device: 114)
    _run_and_check(q, kc, vc, args)
    assert calls[2:] == [(4, False)]


def test_h100_is_read_from_the_name_once(monkeypatch):
    assert board.h100(torch.device("cpu")) is False
    names = []
    monkeypatch.setattr(board, "_index", lambda device: device.index)
    board._named_h100.cache_clear()
    try:
        for index, name in ((0, "NVIDIA H100 80GB HBM3"), (1, "NVIDIA H200")):
            monkeypatch.setattr(torch.cuda, "get_device_name", lambda i, n=name: (names.append(i), n)[1])
            assert board.h100(torch.device("cuda", index)) is (index == 0)
            assert board.h100(torch.device("cuda", index)) is (index == 0)
    finally:
        board._named_h100.cache_clear()  # the fake names must not outlive the test
    assert names == [0, 1]


def test_the_board_is_asked_only_where_it_changes_the_kernel(routes, monkeypatch):
    calls, asked = routes
    monkeypatch.setenv("FLASHTILE_DECODE_BOARD", "full-grid")
    q, kc, vc, args = make_case(dtype=torch.float16, h=16, h_k=8, d=128, cap=40, s_new=1)
    _run_and_check(q, kc, vc, args)  # the rule's shape, but both rules pick the per-head kernel (b = 3, 40 keys)
    for kw in (dict(h_k=4, d=128), dict(h_k=8, d=64)):
        q, kc, vc, args = make_case(dtype=torch.float16, h=16, s_new=1, cap=40, **kw)
        _run_and_check(q, kc, vc, args)
    q, kc, vc, args = make_case(dtype=torch.float16, h=16, h_k=8, d=128, cap=40, s_new=1)
    _run_and_check(q, kc, vc, args, num_splits=2)  # an explicit split count
    q, kc, vc, args = make_case(dtype=torch.float16, h=16, h_k=8, d=128, cap=64, s_new=1, page=16)
    _run_and_check(q, kc, vc, args)  # a paged cache
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS", "0")
    q, kc, vc, args = make_case(dtype=torch.float16, h=16, h_k=8, d=128, cap=40, s_new=1)
    _run_and_check(q, kc, vc, args)  # the row kernel set by hand
    monkeypatch.delenv("FLASHTILE_DECODE_ROWS")
    from flashtile.backends.triton import decode

    monkeypatch.setattr(decode, "num_sms", lambda device: 114)
    _run_and_check(q, kc, vc, args)  # a GPU of another SM count (the rule's tables are for 132)
    assert asked == [] and calls == []


def test_no_memory_to_measure_means_the_normal_rule(monkeypatch):
    """A process whose caches took the GPU's memory, or a measurement that fails: one warning, the normal class,
    kept (no second attempt)."""
    free = _fake_cuda(monkeypatch)
    attempts = []

    def failing(*a, **k):
        attempts.append(1)
        raise RuntimeError("the probe met something")

    monkeypatch.setattr(board, "measure_ratio", failing)
    free[0] = board.READ_BYTES  # less than the read and its margin: never tried
    with pytest.warns(UserWarning, match="no 1024 MiB free.*FLASHTILE_DECODE_BOARD"):
        assert not board.full_grid_board(torch.device("cuda", 0))
    assert not board.full_grid_board(torch.device("cuda", 0))
    assert attempts == []
    free[0] = 80 << 30
    with pytest.warns(UserWarning, match="RuntimeError: the probe met something"):
        assert not board.full_grid_board(torch.device("cuda", 1))
    assert not board.full_grid_board(torch.device("cuda", 1))
    assert attempts == [1]


def _fake_cuda(monkeypatch, capturing=False):
    """torch.cuda's calls that full_grid_board makes, answered on a CPU-only machine; returns the free-memory cell."""
    import contextlib

    monkeypatch.delenv("FLASHTILE_DECODE_BOARD", raising=False)
    free = [80 << 30]
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free[0], 141 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    board.forget()
    monkeypatch.setattr(board, "_KNOWN", {})
    monkeypatch.setattr(board, "_RATIOS", {})
    monkeypatch.setattr(board, "_RATES", {})
    return free


def test_measured_once_a_device_by_the_threshold(monkeypatch, caplog):
    _fake_cuda(monkeypatch)
    ratios = {0: 1.0199, 1: 1.0033}  # C29 and a normal board at 1 GiB
    measured = []

    def measure(device):  # as measure_ratio does: the ratio returned, the 132-program read's rate recorded
        measured.append(device.index)
        board._RATES[device.index] = (4.6, 4.7)[device.index]
        return ratios[device.index]

    monkeypatch.setattr(board, "measure_ratio", measure)
    assert board.known(torch.device("cuda", 0)) == {"setting": "", "class": None, "ratio": None, "read_tb_s": None}
    with caplog.at_level("INFO", logger="flashtile"):
        assert board.full_grid_board(torch.device("cuda", 0))
        assert not board.full_grid_board(torch.device("cuda", 1))
        assert board.full_grid_board(torch.device("cuda", 0))
    assert measured == [0, 1] and board._RATIOS == ratios
    assert "full-grid board" in caplog.text and "a normal board" in caplog.text and "4.60 TB/s" in caplog.text
    assert board.known(torch.device("cuda", 0)) == {"setting": "", "class": "full-grid", "ratio": 1.0199,
                                                    "read_tb_s": 4.6}
    assert board.known(torch.device("cuda", 1)) == {"setting": "", "class": "normal", "ratio": 1.0033,
                                                    "read_tb_s": 4.7}


def test_a_capture_measures_nothing_and_remembers_nothing(monkeypatch):
    _fake_cuda(monkeypatch, capturing=True)
    monkeypatch.setattr(board, "measure_ratio", lambda device: pytest.fail("measured inside a capture"))
    assert not board.full_grid_board(torch.device("cuda", 0))
    assert board._KNOWN == {}


@pytest.mark.parametrize("programs, tiles", [(132, 300), (128, 300), (7, 5)])
def test_the_grid_read_reads_every_tile_once(monkeypatch, programs, tiles):
    """kernels/grid_read.py through the interpreter: the programs' XORs together are every tile's of both buffers
    (a tile read twice or skipped would change them)."""
    from flashtile.kernels.grid_read import _grid_read_kernel

    block = 16
    a = torch.randint(-(2 ** 15), 2 ** 15, (tiles * block,), dtype=torch.int16)
    b = torch.randint(-(2 ** 15), 2 ** 15, (tiles * block,), dtype=torch.int16)
    out = torch.zeros(programs * block, dtype=torch.int16)
    _grid_read_kernel[(programs,)](a, b, out, tiles, BLOCK=block, STAGES=1)
    want = torch.zeros(block, dtype=torch.int16)
    for t in torch.cat([a, b]).view(-1, block):
        want ^= t
    got = torch.zeros(block, dtype=torch.int16)
    for t in out.view(programs, block):
        got ^= t
    assert torch.equal(got, want)
