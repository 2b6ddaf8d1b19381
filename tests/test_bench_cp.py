"""``python -m flashtile.bench cp`` as a CPU smoke run: one gloo rank, every scheme, JSON rows."""

from __future__ import annotations

import json

import torch.distributed as dist

from flashtile.bench import main


def test_quick_cpu_rows_and_schema(tmp_path):
    out = tmp_path / "cp.json"
    assert main(["cp", "--device", "cpu", "--quick", "--out", str(out)]) == 0
    assert not dist.is_initialized()  # the group it made is gone
    data = json.loads(out.read_text())
    assert data["meta"]["world_size"] == 1
    rows = data["rows"]
    assert {(r["scheme"], r["mode"]) for r in rows} == {(s, m) for s in ("ring", "zigzag", "ulysses", "hybrid",
                                                                          "allgather") for m in ("fwd", "fwdbwd")}
    for r in rows:
        assert "error" not in r, r
        assert r["ms"] > 0 and r["tflops_per_gpu"] > 0 and r["efficiency"] > 0
    ring = next(r for r in rows if r["scheme"] == "ring" and r["mode"] == "fwd")
    assert ring["kernels_ms"] > 0 and ring["comm_ms"] >= 0
