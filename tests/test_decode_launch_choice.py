"""Which tile and split count a decode launch takes (backends/triton/decode.py decode_attn), on CPU
with an sm_90 of 132 SMs standing in and the kernel launch captured instead of run: the table's
tiles, and num_splits_heuristic's count (16 for one row of 8 kv heads, 2 for eight rows).

Session 9 measured 64-key tiles for short splits (b = 1, 8k / 16k): faster as single-call graphs
(tune_decode_tiles_b1_h200_2026-11-30_session9.json) but slower inside 8-layer graphs (17.6 / 27.3
against 16.3 / 24.1 us, decode_graph_layers8_b1_tiles64_h200_2026-11-30_session9.json), so the
table's tiles stay; the first test pins that."""

import pytest
import torch

from flashtile.backends.triton import decode
from flashtile.kernels.decode import DECODE_CONFIGS


@pytest.fixture
def captured(monkeypatch):
    calls = []
    monkeypatch.setattr(decode, "_arch", lambda device: "sm90")
    monkeypatch.setattr(decode, "num_sms", lambda device: 132)
    monkeypatch.setattr(decode, "launch", lambda kernel, grid, *args, **meta: calls.append((grid, meta)))
    monkeypatch.setattr(decode, "combine", lambda *a, **k: None)
    monkeypatch.setattr(decode, "CONFIG_OVERRIDE", None)
    return calls


def _decode(b, capacity, num_splits=0, paged=False):
    h, h_k, d = 32, 8, 128
    q = torch.zeros(b, 1, h, d, dtype=torch.float16)
    if paged:
        page = 16
        kc = torch.zeros(b * capacity // page, page, h_k, d, dtype=torch.float16)
        table = torch.arange(b * capacity // page, dtype=torch.int32).reshape(b, -1)
    else:
        kc = torch.zeros(b, capacity, h_k, d, dtype=torch.float16)
        table = None
    decode.decode_attn(q, kc, kc, s_new=0, cache_seqlens=None, cache_len_const=capacity, cache_batch_idx=None,
                       cache_leftpad=None, block_table=table, rotary_cos=None, rotary_sin=None,
                       rotary_interleaved=False, rotary_per_token=False, softmax_scale=1.0, window_left=-1,
                       window_right=-1, softcap=0.0, alibi_slopes=None, num_splits=num_splits)


def test_split_launches_keep_the_tables_tiles(captured):
    table_bn = DECODE_CONFIGS[("sm90", 128)][0]
    _decode(1, 8192)  # b = 1: 16 splits, one wave of 128 programs
    grid, meta = captured[-1]
    assert meta["BLOCK_N"] == table_bn and meta["NUM_SPLITS"] == 16 and grid == (16 * 8,)
    _decode(1, 131072)
    assert captured[-1][1]["BLOCK_N"] == table_bn and captured[-1][1]["NUM_SPLITS"] == 16
    _decode(8, 8192)  # b = 8: 2 splits
    assert captured[-1][1]["BLOCK_N"] == table_bn and captured[-1][1]["NUM_SPLITS"] == 2
    _decode(1, 8192, num_splits=1)  # forced: unsplit
    assert captured[-1][1]["NUM_SPLITS"] == 1 and captured[-1][0] == (8,)
    _decode(1, 8192, num_splits=4)
    assert captured[-1][1]["NUM_SPLITS"] == 4


def test_paged_caches_keep_their_tiles(captured):
    _decode(1, 8192, paged=True)
    assert captured[-1][1]["BLOCK_N"] == DECODE_CONFIGS[("sm90", 128)][0]


def test_edge_pipelining_is_an_ab_knob(captured, monkeypatch):
    """The masked edge loops are unpipelined by default (the kernel's PIPELINE_EDGES is left at False);
    FLASHTILE_DECODE_PIPELINE_EDGES=1 pipelines them again, for A/B runs (decode_tuning_log.md, session 15)."""
    monkeypatch.delenv("FLASHTILE_DECODE_PIPELINE_EDGES", raising=False)
    _decode(1, 8192)
    assert "PIPELINE_EDGES" not in captured[-1][1]
    monkeypatch.setenv("FLASHTILE_DECODE_PIPELINE_EDGES", "1")
    _decode(1, 8192, paged=True)
    assert captured[-1][1]["PIPELINE_EDGES"] is True
    monkeypatch.setenv("FLASHTILE_DECODE_PIPELINE_EDGES", "0")
    _decode(1, 8192)
    assert "PIPELINE_EDGES" not in captured[-1][1]
    monkeypatch.setenv("FLASHTILE_DECODE_PIPELINE_EDGES", "yes")  # a typo must not silently mean off
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_PIPELINE_EDGES"):
        _decode(1, 8192)
