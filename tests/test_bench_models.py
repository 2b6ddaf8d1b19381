"""CPU tests of ``python -m flashtile.bench models``: CLI, JSON schema, the bars' arithmetic on fake timings,
the checks catching a wrong kernel, and the chunk rows' equal work."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from flashtile.bench import attention_flops, main, models
from flashtile.bench.models import BARS, NOISE, Case, chunked_flops, judge
from flashtile.bench.peers import PEERS, Impl, _sdpa_build

FAST = ["models", "--device", "cpu", "--quick", "--warmup", "1", "--rep", "3"]
ROW_KEYS = {"group", "mode", "d", "dv", "s", "b", "h", "causal", "chunk", "dtype", "flops", "subject", "baseline",
            "baseline_shape", "bar", "ms", "tflops", "ratios", "rounds_ms", "ratio", "passes", "verdict", "errors",
            "max_err", "mismatch"}
META_KEYS = {"device", "gpu", "torch", "date", "command", "mode", "dtype", "groups", "modes", "timing", "bars",
             "impls", "check"}


def _load(path):
    with open(path) as f:
        return json.load(f)


def test_quick_cpu_forward_rows_and_schema(tmp_path, capsys):
    out = tmp_path / "models.json"
    assert main([*FAST, "--modes", "fwd", "--out", str(out)]) == 0
    data = _load(out)
    meta = data["meta"]
    assert META_KEYS <= set(meta)
    assert meta["mode"] == "models" and meta["device"] == "cpu" and meta["timing"]["rounds"] == 2
    assert meta["bars"]["noise"] == NOISE == 0.01
    assert meta["bars"]["dv"]["min_ratio"] == 0.95 and meta["bars"]["sink"]["min_ratio"] == pytest.approx(1 / 1.05)
    rows = data["rows"]
    # --quick: hidden 256, tokens 128; dv d 192 / dv 128 at s 64, sink d 64 at s 64, chunk d 64 at s 128, c 64
    assert [(r["group"], r["causal"]) for r in rows] == [
        ("dv", False), ("dv", True), ("sink", False), ("sink", True), ("chunk", False), ("chunk", True)]
    for r in rows:
        assert ROW_KEYS <= set(r) and r["mode"] == "fwd" and r["dtype"] == "bf16"
        assert r["bar"]["min_ratio"] == BARS[r["group"]].min_ratio and r["baseline"] == BARS[r["group"]].baseline
        assert list(r["ms"])[0] == r["subject"] and list(r["ms"]) == list(r["tflops"])
        for name, ms in r["ms"].items():
            assert (ms is None) == (name in r["errors"]), (name, r)
            if ms is not None:
                assert ms > 0 and len(r["rounds_ms"][name]) == 2
                assert ms == pytest.approx(statistics.median(r["rounds_ms"][name]))
                assert r["tflops"][name] == pytest.approx(r["flops"] / (ms * 1e-3) / 1e12)
        assert r["ratio"] == r["ratios"].get(r["baseline"])
        assert (r["passes"], r["verdict"]) == judge(r["ratio"], r["bar"]["min_ratio"])
        assert not r["mismatch"] and 0 <= r["max_err"] < 0.05, r
    dv = [r for r in rows if r["group"] == "dv"]
    for r in dv:
        assert (r["d"], r["dv"], r["s"], r["b"], r["h"]) == (192, 128, 64, 2, 2)
        assert r["flops"] == attention_flops(2, 2, 64, 192, r["causal"], "fwd", dv=128)
        assert list(r["ms"]) == ["flashtile", "cudnn", "sdpa"]
        # cuDNN cannot run on CPU: no ratio to hold to the bar, and the reason is recorded
        assert "CUDA" in r["errors"]["cudnn"] and r["ratio"] is None and r["verdict"] == "not measured"
        assert r["ratios"]["sdpa"] > 0
    for r in rows:
        if r["group"] == "sink":
            assert (r["d"], r["s"], r["b"], r["h"]) == (64, 64, 2, 4)
            assert list(r["ms"]) == ["flashtile-sink", "flashtile"] and r["ratio"] > 0
        if r["group"] == "chunk":
            assert (r["s"], r["chunk"], r["b"], r["h"], r["baseline_shape"]) == (128, 64, 1, 4, {"b": 2, "s": 64})
            assert list(r["ms"]) == ["flashtile-chunk", "flashtile-split"] and r["ratio"] > 0
            # the chunk row's work is its baseline's: the plain causal (or full) attention over the chunks
            assert r["flops"] == attention_flops(2, 4, 64, 64, r["causal"], "fwd")
    text = capsys.readouterr()
    assert "[6/6] models chunk fwd" in text.err
    assert "[dv] subject flashtile" in text.out and "[chunk] subject flashtile-chunk" in text.out
    assert "cudnn: SDPA's CUDNN_ATTENTION backend needs a CUDA device" in text.out and "bars: " in text.out


def test_quick_cpu_backward_rows_check_gradients(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main([*FAST, "--groups", "sink", "chunk", "--modes", "bwd", "--causal", "yes"]) == 0
    (path,) = (tmp_path / "flashtile" / "bench").glob("models_cpu_*.json")
    rows = _load(path)["rows"]
    assert [(r["group"], r["mode"]) for r in rows] == [("sink", "bwd"), ("chunk", "bwd")]
    for r in rows:
        assert r["flops"] == pytest.approx(2.5 * attention_flops(r["b"], r["h"], r["s"], r["d"], True, "fwd",
                                                                 s_k=r["chunk"] or r["s"]))
        assert not r["mismatch"] and r["max_err"] < 0.05 and r["max_err_grad"] < 0.15
        for name, ms in r["ms"].items():
            # CPU times of tiny steps are noisy: a backward under its forward's noise is refused as such
            if ms is None:
                assert "timing noise" in r["errors"][name], r["errors"]
                continue
            parts = r["ms_parts"][name]
            assert set(parts) == {"fwd", "fwdbwd"}
            assert ms == pytest.approx(statistics.median(r["rounds_ms"][name]))


def _fake_timings(monkeypatch):
    """Replace the per-round measurement with a table keyed by (column, mode); round i of a column takes
    the table's i-th value. Returns the log of calls, in order."""
    fwd = {"flashtile-sink": [1.0, 9.0, 1.0],  # an outlier round: the median ignores it
           "flashtile": [1.0, 1.0, 1.0],
           "flashtile-chunk": [1.1] * 3, "flashtile-split": [1.0] * 3,
           "cudnn": [0.945] * 3, "sdpa": [2.0] * 3}
    # bwd: (fwd, fwd+bwd) per round
    bwd = {"flashtile-sink": [(1.0, 3.11)] * 3, "flashtile": [(1.0, 3.0), (1.0, 3.0), (1.0, 3.0)],
           "flashtile-chunk": [(1.0, 2.9)] * 3, "flashtile-split": [(1.0, 3.0)] * 3,
           "cudnn": [(0.5, 1.5)] * 3, "sdpa": [(1.0, 5.0)] * 3}
    log = []

    def fake(name, attn, tensors, context, mode, device, args):
        i = sum(1 for n, m in log if (n, m) == (name, mode)) % 3
        log.append((name, mode))
        if mode == "fwd":
            return {"fwd": fwd[name][i]}
        f, fb = bwd[name][i]
        return {"fwd": f, "fwdbwd": fb}

    monkeypatch.setattr(models, "_measure", fake)
    # a cuDNN stand-in that runs on CPU, so the dv rows have their bar's peer
    monkeypatch.setitem(PEERS, "cudnn", Impl("cudnn", "bhsd", "stand-in", lambda device: None, _sdpa_build))
    return log


def test_bars_from_fake_timings(tmp_path, monkeypatch):
    log = _fake_timings(monkeypatch)
    out = tmp_path / "fake.json"
    assert main([*FAST, "--no-check", "--rounds", "3", "--causal", "no", "--out", str(out)]) == 0
    data = _load(out)
    assert data["meta"]["check"] is None
    rows = {(r["group"], r["mode"]): r for r in data["rows"]}
    assert len(rows) == 6

    r = rows["sink", "fwd"]
    assert r["rounds_ms"]["flashtile-sink"] == [1.0, 9.0, 1.0] and r["ms"]["flashtile-sink"] == 1.0
    assert r["ratio"] == 1.0 and (r["passes"], r["verdict"]) == (True, "pass")
    r = rows["sink", "bwd"]  # 2.0 / 2.11 = 0.948: under 1/1.05 = 0.952, but by less than the noise
    assert r["ms"]["flashtile-sink"] == pytest.approx(2.11) and r["ms"]["flashtile"] == pytest.approx(2.0)
    assert r["ms_parts"]["flashtile-sink"] == {"fwd": 1.0, "fwdbwd": 3.11}
    assert r["ratio"] == pytest.approx(2.0 / 2.11) and (r["passes"], r["verdict"]) == (True, "within noise")
    r = rows["chunk", "fwd"]  # 1.0 / 1.1 = 0.909: more than 5% slower
    assert r["ratio"] == pytest.approx(1 / 1.1) and (r["passes"], r["verdict"]) == (False, "fail")
    r = rows["chunk", "bwd"]  # 2.0 / 1.9: chunked is faster
    assert r["ratio"] == pytest.approx(2.0 / 1.9) and (r["passes"], r["verdict"]) == (True, "pass")
    r = rows["dv", "fwd"]  # 0.945x cuDNN: under 0.95 by less than 1%
    assert r["ratio"] == pytest.approx(0.945) and (r["passes"], r["verdict"]) == (True, "within noise")
    assert r["ratios"]["sdpa"] == pytest.approx(2.0)
    r = rows["dv", "bwd"]  # cuDNN's backward 1.0 against flashtile's 2.0
    assert r["ratio"] == pytest.approx(0.5) and (r["passes"], r["verdict"]) == (False, "fail")

    # rounds rotate which column goes first. Rows run dv fwd (3 columns x 3 rounds), dv bwd, sink fwd (2 x 3), ...
    assert [n for n, _ in log[:9]] == ["flashtile", "cudnn", "sdpa", "cudnn", "sdpa", "flashtile",
                                       "sdpa", "flashtile", "cudnn"]
    assert log[18:24] == [(n, "fwd") for n in ("flashtile-sink", "flashtile", "flashtile", "flashtile-sink",
                                               "flashtile-sink", "flashtile")]


def test_judge_thresholds():
    assert judge(None, 0.95) == (None, "not measured")
    assert judge(0.96, 0.95) == (True, "pass")  # 0.96 >= 0.95 * 1.01 = 0.9595
    assert judge(0.959, 0.95) == (True, "within noise")
    assert judge(0.95, 0.95) == (True, "within noise")
    assert judge(0.941, 0.95) == (True, "within noise")  # >= 0.95 * 0.99 = 0.9405
    assert judge(0.940, 0.95) == (False, "fail")
    assert judge(1.0, 1 / 1.05, noise=0.0) == (True, "pass")
    assert judge(1 / 1.06, 1 / 1.05, noise=0.0) == (False, "fail")


@pytest.mark.parametrize("feature", ["learnable_sink", "attention_chunk"])
def test_a_kernel_that_ignores_the_feature_is_flagged(tmp_path, monkeypatch, feature):
    import flashtile

    real = flashtile.flash_attn_func

    def ignoring(q, k, v, **kw):
        kw.pop(feature, None)
        return real(q, k, v, **kw)

    monkeypatch.setattr(flashtile, "flash_attn_func", ignoring)
    group = "sink" if feature == "learnable_sink" else "chunk"
    out = tmp_path / "bad.json"
    argv = [*FAST, "--groups", group, "--modes", "fwd", "--causal", "yes", "--rounds", "1", "--out", str(out)]
    assert main([*argv, "--fail-on-mismatch"]) == 1
    (row,) = _load(out)["rows"]
    assert row["mismatch"] and row["max_err"] > 0.05


def test_chunk_rows_do_the_visible_work_of_their_split():
    """A chunk row and its baseline (the chunks as sequences of their own) see the same (query, key) pairs,
    so one FLOP count serves both: counted from the mask, and from the formulas."""
    from flashtile.backends.masking import visible

    def pairs(s, chunk, causal):
        rows, cols = torch.arange(s).view(s, 1), torch.arange(s).view(1, s)
        return int(visible(rows, cols, s, s, -1, 0 if causal else -1, chunk).sum())

    for s, c in ((64, 16), (96, 32), (128, 128)):
        for causal in (False, True):
            assert pairs(s, c, causal) == (s // c) * pairs(c, 0, causal)
            case = Case("chunk", b=3, h=2, s=s, d=32, causal=causal, chunk=c)
            base = case.baseline_shape()
            assert (base.b, base.s, base.causal) == (3 * s // c, c, causal)
            for mode in ("fwd", "bwd", "fwdbwd"):
                flops = chunked_flops(3, 2, s, 32, c, causal, mode)
                assert flops == attention_flops(base.b, 2, base.s, 32, causal, mode)
                assert flops == models.case_flops(case, mode)
            # the forward count is 4 * d per visible pair, with causal's diagonal counted as half (c^2 / 2)
            full = 3 * 2 * 4 * 32 * pairs(s, c, False)
            assert chunked_flops(3, 2, s, 32, c, causal, "fwd") == (full / 2 if causal else full)


def test_flops_with_v_head_dim():
    b, h, s = 2, 4, 128
    for mode in ("fwd", "bwd", "fwdbwd"):
        for causal in (False, True):
            assert attention_flops(b, h, s, 64, causal, mode, dv=64) == attention_flops(b, h, s, 64, causal, mode)
    assert attention_flops(b, h, s, 192, False, dv=128) == 2 * b * h * s * s * (192 + 128)
    assert attention_flops(b, h, s, 192, True, "bwd", dv=128) == b * h * s * s * (3 * 192 + 2 * 128)
    assert attention_flops(b, h, s, 192, False, "fwdbwd", dv=128) == 2 * b * h * s * s * (4 * 192 + 3 * 128)


def test_chunk_must_divide_the_length(capsys):
    assert main([*FAST, "--groups", "chunk", "--chunks", "48"]) == 2
    assert "must divide" in capsys.readouterr().err


def test_plot_models_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    rows = []
    for group, verdict, ratio in (("dv", "pass", 1.1), ("sink", "within noise", 0.95), ("chunk", "fail", None)):
        for mode in ("fwd", "bwd"):
            bar = BARS[group]
            rows.append({"group": group, "mode": mode, "d": 128, "dv": 128, "s": 4096, "b": 4, "h": 16,
                         "causal": True, "chunk": 2048 if group == "chunk" else 0, "dtype": "bf16",
                         "bar": {"baseline": bar.baseline, "min_ratio": bar.min_ratio, "text": bar.text},
                         "ratio": ratio, "verdict": verdict if ratio else "not measured", "mismatch": False,
                         "ms": {}, "tflops": {}})
    src = tmp_path / "m.json"
    src.write_text(json.dumps({"meta": {"gpu": "NVIDIA H100", "bars": {"noise": NOISE}}, "rows": rows}))
    png = tmp_path / "m.png"
    assert main(["plot", str(src), str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
