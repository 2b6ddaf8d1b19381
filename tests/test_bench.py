"""CPU smoke tests of ``python -m flashtile.bench``: CLI, JSON schema, FLOPs, plots."""

from __future__ import annotations

import json

import pytest
import torch

from flashtile.bench import attention_flops, main, make_shapes, measure_ceilings
from flashtile.bench.peers import PEERS, Impl

# Short timing windows: these tests check plumbing, not speed.
FAST = ["--device", "cpu", "--quick", "--dtype", "fp16", "--warmup", "1", "--rep", "3"]
ROW_KEYS = {"mode", "d", "s", "b", "h", "causal", "dtype", "flops", "ms", "tflops", "ratios", "errors",
            "max_err", "mismatch"}
META_KEYS = {"device", "gpu", "torch", "triton", "cuda", "cudnn", "date", "command", "hostname", "mode",
             "dtype", "timing", "impls", "check", "ceilings"}


def _load(path):
    with open(path) as f:
        return json.load(f)


def _check_rows(data, mode, impls):
    assert META_KEYS <= set(data["meta"])
    assert data["meta"]["device"] == "cpu" and data["meta"]["mode"] == mode
    rows = data["rows"]
    # --quick: d 64, s 64 and 128, causal no and yes, hidden 128, tokens 256.
    assert [(r["d"], r["s"], r["causal"]) for r in rows] == [
        (64, 64, False), (64, 128, False), (64, 64, True), (64, 128, True)]
    for r in rows:
        assert ROW_KEYS <= set(r)
        assert r["mode"] == mode and r["dtype"] == "fp16"
        assert (r["b"], r["h"]) == (256 // r["s"], 128 // r["d"])
        assert r["flops"] == attention_flops(r["b"], r["h"], r["s"], r["d"], r["causal"], mode)
        assert list(r["ms"]) == impls and list(r["tflops"]) == impls
        for name in impls:
            # Every implementation is either measured or says why not; never silently absent.
            assert (r["ms"][name] is None) == (name in r["errors"]), (name, r)
            if r["ms"][name] is not None:
                assert r["ms"][name] > 0
                assert r["tflops"][name] == pytest.approx(r["flops"] / (r["ms"][name] * 1e-3) / 1e12)
        # CPU timings of tiny shapes are noisy: a bwd row may be refused as "timing noise" (fwd+bwd
        # measured below fwd). That refusal is the tool working; any other missing time is a failure.
        if r["ms"]["flashtile"] is None:
            assert mode != "fwd" and "timing noise" in r["errors"]["flashtile"], r["errors"]
        assert not r["mismatch"] and 0 <= r["max_err"] < 0.01
    return rows


def test_flops_formula():
    b, h, s, d = 2, 4, 128, 64
    fwd = 4 * b * h * s * s * d
    assert attention_flops(b, h, s, d, False) == fwd
    assert attention_flops(b, h, s, d, True) == fwd / 2
    assert attention_flops(b, h, s, d, False, "bwd") == 2.5 * fwd
    assert attention_flops(b, h, s, d, True, "fwdbwd") == 3.5 * fwd / 2
    assert attention_flops(b, h, s, d, False, s_k=2 * s) == 2 * fwd
    with pytest.raises(ValueError, match="mode"):
        attention_flops(b, h, s, d, False, "decode")


def test_default_shapes_follow_baselines():
    shapes = make_shapes([64, 128, 256], [512, 16384])
    assert len(shapes) == 3 * 2 * 2
    assert all(s.h * s.d == 2048 and s.b * s.s == 16384 for s in shapes)
    assert [s.causal for s in shapes[:4]] == [False, False, True, True]


def test_help_needs_no_run(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "fwd" in capsys.readouterr().out


def test_fwd_quick_cpu(tmp_path, capsys):
    out = tmp_path / "fwd.json"
    assert main(["fwd", *FAST, "--peers", "flash", "cudnn", "--out", str(out)]) == 0
    rows = _check_rows(_load(out), "fwd", ["flashtile", "flash", "cudnn"])
    # cuDNN cannot run on CPU: recorded per row with its reason.
    assert all("CUDA" in r["errors"]["cudnn"] for r in rows)
    captured = capsys.readouterr()
    assert "[4/4] fwd" in captured.err  # progress per row
    assert "ft/flash" in captured.out and "cudnn: SDPA's CUDNN_ATTENTION" in captured.out


def test_bwd_quick_cpu_default_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["bwd", *FAST, "--peers", "flash"]) == 0
    (path,) = (tmp_path / "flashtile" / "bench").glob("bwd_cpu_*.json")
    rows = _check_rows(_load(path), "bwd", ["flashtile", "flash"])
    for r in rows:
        assert r["max_err_grad"] < 0.03
        for name, parts in r["ms_parts"].items():
            if r["ms"][name] is not None:
                assert r["ms"][name] == pytest.approx(parts["fwdbwd"] - parts["fwd"])


def test_bwd_cuda_graph_option_quick_cpu(tmp_path):
    # off CUDA the graph timer falls back to plain timing; the bwd step (forward + autograd.grad)
    # must still run for every implementation and be recorded as graph-timed
    out = tmp_path / "bwd.json"
    assert main(["bwd", *FAST, "--peers", "flash", "--cuda-graph", "--out", str(out)]) == 0
    data = _load(out)
    assert data["meta"]["timing"]["cuda_graph"] is True
    measured = 0
    for r in _check_rows(data, "bwd", ["flashtile", "flash"]):
        for name, ms in r["ms"].items():
            # CPU timings of sub-millisecond steps on a loaded 2-core machine can put fwd + bwd at or
            # under fwd alone; the bench then records that refusal instead of a negative time
            assert (ms is not None and ms > 0) or "timing noise" in r["errors"].get(name, ""), r
            measured += ms is not None
    assert measured >= len(data["rows"])  # most timings made it


def test_failing_peer_is_recorded_not_raised(tmp_path, monkeypatch):
    def boom(shape, device):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setitem(PEERS, "flex", Impl("flex", "bhsd", "always fails", lambda device: None, boom))
    out = tmp_path / "r.json"
    assert main(["fwdbwd", *FAST, "--causal", "yes", "--seqlens", "64", "--peers", "flex",
                 "--out", str(out)]) == 0
    (row,) = _load(out)["rows"]
    assert row["ms"]["flex"] is None and "no kernel for this shape" in row["errors"]["flex"]
    assert row["ms"]["flashtile"] > 0


def test_wrong_output_is_flagged(tmp_path, monkeypatch, capsys):
    import flashtile

    real = flashtile.flash_attn_func
    monkeypatch.setattr(flashtile, "flash_attn_func", lambda q, k, v, **kw: real(q, k, v, **kw) * 1.5)
    out = tmp_path / "bad.json"
    argv = ["fwd", *FAST, "--seqlens", "64", "--causal", "no", "--peers", "--out", str(out)]
    assert main([*argv, "--fail-on-mismatch"]) == 1
    (row,) = _load(out)["rows"]
    assert row["mismatch"] and row["max_err"] > 0.01
    assert "MISMATCH" in capsys.readouterr().out


def test_plot_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    rows = []
    for d in (64, 128):
        for s, causal in ((1024, False), (4096, True)):
            rows.append({"mode": "fwd", "d": d, "s": s, "b": 16384 // s, "h": 2048 // d, "causal": causal,
                         "dtype": "bf16", "ms": {"flashtile": 1.0, "flash": 1.2, "cudnn": None},
                         "tflops": {"flashtile": 300.0, "flash": 250.0, "cudnn": None},
                         "errors": {"cudnn": "unavailable"}, "max_err": 1e-3, "mismatch": s == 4096})
    src = tmp_path / "r.json"
    src.write_text(json.dumps({"meta": {"gpu": "NVIDIA H200", "date": "2026-11-29"}, "rows": rows}))
    png = tmp_path / "r.png"
    assert main(["plot", str(src), str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ceilings_on_cpu_small():
    c = measure_ceilings("cpu", n=64, copy_bytes=1 << 16, warmup_ms=1, rep_ms=2)
    assert c["matmul_tflops"] > 0 and c["copy_tb_s"] > 0 and c["matmul_n"] == 64


def test_cuda_requested_without_cuda_fails_cleanly(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(["fwd", "--device", "cuda", "--quick"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_fwd_fp8_quick_cpu(tmp_path):
    """--dtype fp8: flashtile on e4m3 inputs, its own bf16 forward as the reference column."""
    out = tmp_path / "fp8.json"
    fast = [a if a != "fp16" else "fp8" for a in FAST]
    assert main(["fwd", *fast, "--peers", "flash", "--out", str(out)]) == 0
    rows = _load(out)["rows"]
    assert len(rows) == 4 and all(r["dtype"] == "fp8" for r in rows)
    for r in rows:
        assert list(r["ms"]) == ["flashtile", "flashtile-bf16", "flash"]
        assert r["ms"]["flashtile"] and r["ms"]["flashtile-bf16"]
        assert r["ratios"]["flashtile-bf16"] == pytest.approx(r["ms"]["flashtile-bf16"] / r["ms"]["flashtile"])
        assert r["max_err"] is not None and r["max_err"] < 0.25  # e4m3 on randn: checked, and bounded
    assert main(["bwd", *fast, "--out", str(tmp_path / "x.json")]) == 2  # fp8 is forward only


def test_meta_records_the_public_settings():
    # a result file must say which path it measured (FLASHTILE_GLUON, FLASHTILE_FAST_LAUNCH, ...)
    from flashtile import config
    from flashtile.bench.report import collect_meta

    with config.override(gluon=False):
        settings = collect_meta([], "cpu")["settings"]
    assert settings["FLASHTILE_GLUON"] is False
    assert set(settings) == set(config.ENV_FIELDS)


def test_gpu_limits_parses_nvidia_smi_and_says_nothing_on_failure(monkeypatch):
    import subprocess

    from flashtile.bench import report

    class Done:
        def __init__(self, rc, out):
            self.returncode, self.stdout = rc, out

    asked = []

    def smi(cmd, **kw):
        asked.append(cmd)
        return Done(0, "1653724024579, 1980, 3201, 700.00, 700.00\n")

    monkeypatch.setattr(subprocess, "run", smi)
    assert report.gpu_limits("c3e50557-0417-fe08-06df-582c433a835c") == {
        "serial": "1653724024579", "clocks.max.sm": "1980", "clocks.max.mem": "3201", "power.limit": "700.00",
        "power.max_limit": "700.00"}
    # by UUID, not by index: nvidia-smi's indices ignore CUDA_VISIBLE_DEVICES
    assert asked[-1][-2:] == ["-i", "GPU-c3e50557-0417-fe08-06df-582c433a835c"]
    assert report.gpu_limits(None) is None and len(asked) == 1
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Done(9, "No devices were found"))
    assert report.gpu_limits("c3e5") is None

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    assert report.gpu_limits("c3e5") is None


def test_results_go_to_the_cache_dir_unless_out_is_given(tmp_path, monkeypatch):
    """Without --out the results land under $XDG_CACHE_HOME/flashtile/bench, never in the working directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["fwd", *FAST, "--seqlens", "64", "--causal", "no", "--peers"]) == 0
    assert list(work.iterdir()) == []
    (written,) = (tmp_path / "cache" / "flashtile" / "bench").glob("fwd_*.json")
    assert _load(written)["meta"]["mode"] == "fwd"
