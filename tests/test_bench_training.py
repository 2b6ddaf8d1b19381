"""CPU tests of ``python -m flashtile.bench train``: rows and schema on the CPU path, the check catching a wrong
varlen kernel, the bars' arithmetic on fake per-round times, and the rows' work."""

from __future__ import annotations

import json

import pytest

from flashtile.bench import main, training
from flashtile.bench.shapes import attention_flops

FAST = ["train", "--device", "cpu", "--quick", "--warmup", "1", "--rep", "3", "--rounds", "1"]


def _rows(path):
    with open(path) as f:
        return json.load(f)["rows"]


def test_quick_cpu_rows_check_both_groups(tmp_path):
    out = tmp_path / "train.json"
    assert main([*FAST, "--out", str(out)]) == 0
    rows = _rows(out)
    assert [(r["group"], r["mode"]) for r in rows] == [("gqa", "fwd"), ("gqa", "fwdbwd"),
                                                       ("varlen", "fwd"), ("varlen", "fwdbwd")]
    for r in rows:
        assert not r["mismatch"] and r["max_err"] < 0.05, r
        assert r["ms"]["flashtile"] > 0 and r["own"]["ratio"] is not None
        # SDPA's flash backend runs on CPU; the other two need CUDA and say so
        assert "sdpa-flash" in r["ms"] and "needs a CUDA device" in r["errors"]["sdpa-cudnn"]
        assert r["sdpa"]["ratio"] is not None
    assert rows[1]["max_err_grad"] < 0.1 and rows[3]["max_err_grad"] < 0.1


def test_a_varlen_kernel_that_leaks_across_documents_is_flagged(tmp_path, monkeypatch):
    import flashtile

    real = flashtile.flash_attn_varlen_func

    def one_sequence(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        # every token attends over the whole packed batch, as if the boundaries were lost
        whole = q.new_tensor([0, q.shape[0]], dtype=cu_q.dtype)
        return real(q, k, v, whole, whole, q.shape[0], q.shape[0], **kw)

    monkeypatch.setattr(flashtile, "flash_attn_varlen_func", one_sequence)
    out = tmp_path / "bad.json"
    assert main([*FAST, "--groups", "varlen", "--modes", "fwd", "--out", str(out)]) == 1
    (row,) = _rows(out)
    assert row["mismatch"] and row["max_err"] > 0.05


def test_bars_from_fake_round_times():
    row = {"flops": 1e12, "ms": {}, "tflops": {}, "rounds_ms": {}, "errors": {},
           "own": {"baseline": "flashtile-mha", "min_ratio": training.OWN_MIN, "ratio": None},
           "sdpa": {"baseline": "fastest", "min_ratio": training.SDPA_MIN, "ratio": None}}
    # round by round the fastest SDPA backend differs: the bar takes each round's fastest
    training.summarize(row, {"flashtile": [1.0, 1.0, 1.0], "flashtile-mha": [1.0, 0.96, 0.9],
                             "sdpa-cudnn": [0.9, 1.2, 1.1], "sdpa-flash": [1.3, 0.98, 1.05]})
    assert row["own"]["ratio"] == pytest.approx(0.96) and row["own"]["verdict"] == "within noise"
    assert row["sdpa"]["ratio"] == pytest.approx(0.98) and row["sdpa"]["verdict"] == "fail"
    assert row["ms"]["flashtile"] == 1.0 and row["tflops"]["flashtile"] == pytest.approx(1000.0)


def test_varlen_documents_and_work():
    assert sum(n * c for n, c in training.VARLEN_DOCS) == training.TOKENS
    assert {n for n, _ in training.VARLEN_DOCS} == {128, 256, 512, 1024, 2048, 4096}
    case = training.Case("varlen", 16, 16, 128, training.VARLEN_DOCS)
    # each document is its own causal square: the work is the buckets', not one 16k square's
    want = sum(attention_flops(c, 16, n, 128, True, "fwd") for n, c in training.VARLEN_DOCS)
    assert case.flops("fwd") == want < attention_flops(1, 16, training.TOKENS, 128, True, "fwd") / 3
    gqa = training.Case("gqa", 32, 8, 128, ((4096, 4),))
    assert gqa.flops("fwdbwd") == attention_flops(4, 32, 4096, 128, True, "fwdbwd")
