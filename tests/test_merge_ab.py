"""scripts/merge_ab.py: an A/B's run files (gpu_check.sh decode_ab names them NAME<value>_<seconds>.json)
become one results file, runs in the order measured, each tagged with its setting."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import merge_ab  # noqa: E402


def test_names_parse_to_value_and_seconds():
    assert merge_ab.parse_name("x/decode_layers8_p16_gluon1_143.json", "decode_layers8_p16_gluon") == ("1", 143)
    assert merge_ab.parse_name("decode_p16_stages3_5.json", "decode_p16_stages") == ("3", 5)
    with pytest.raises(ValueError, match="not decode_p16_stages"):
        merge_ab.parse_name("other_1_5.json", "decode_p16_stages")


def test_runs_merge_in_measured_order(tmp_path):
    paths = []
    for value, seconds in (("0", 70), ("1", 143), ("0", 12)):
        p = tmp_path / f"ab{value}_{seconds}.json"
        p.write_text(json.dumps({"meta": {"v": value}, "rows": [{"b": 1, "seqlen_k": 8, "us": {"flashtile": 1.0}}]}))
        paths.append(str(p))
    merged = merge_ab.merge(paths, "ab", "VAR", "cmd", "note")
    assert [(r["VAR"], r["file_order_s"]) for r in merged["runs"]] == [("0", 12), ("0", 70), ("1", 143)]
    assert merged["runs"][0]["meta"] == {"v": "0"} and merged["command"] == "cmd"
    assert "VAR=1 (t=143 s)" in merge_ab.summary(merged, "VAR")
