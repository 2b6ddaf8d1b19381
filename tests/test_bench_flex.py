"""``python -m flashtile.bench flex`` as a CPU smoke test: every variant runs (the CPU path), the JSON has its
rows, and the bars' arithmetic holds on made-up ratios."""

import json

import pytest

from flashtile.bench import main
from flashtile.bench.flex import MODES, VARIANTS, summarize


def test_quick_cpu_run_writes_every_variant(tmp_path):
    out = tmp_path / "flex.json"
    assert main(["flex", "--device", "cpu", "--quick", "--warmup", "1", "--rep", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["variant"], r["mode"]) for r in rows] == [(v, m) for v in VARIANTS for m in MODES]
    for r in rows:
        assert r["ms"]["flashtile"] > 0 and r["compile_s"]["flashtile"] > 0 and not r["errors"].get("flashtile")
    assert data["meta"]["mode"] == "flex" and data["meta"]["bars"] == {"geomean": 1.1, "row": 1.0}


@pytest.mark.parametrize("ratios, passes", [([1.2, 1.15, 1.05], True), ([1.5, 1.5, 0.99], False),
                                            ([1.05, 1.08, 1.1], False)])
def test_bars(ratios, passes):
    rows = [dict(mode="fwd", ratio=x) for x in ratios]
    assert summarize(rows)["fwd"]["passes"] is passes


def test_cuda_graph_flag_reaches_the_rows(tmp_path):
    # off CUDA a graph replay falls back to plain timing: the flag's plumbing is what runs here
    out = tmp_path / "flex.json"
    args = ["flex", "--device", "cpu", "--quick", "--variants", "causal", "--cuda-graph", "--warmup", "1", "--rep",
            "2", "--out", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["cuda_graph"] is True
    assert all(r["ms"]["flashtile"] > 0 for r in data["rows"])
