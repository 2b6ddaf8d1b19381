"""Tuning-table lookups: the backward's (arch, bucket[, causal[, "short"]]) rows and the file override."""

import json

import pytest

from flashtile import config
from flashtile.backends.triton import attn_bwd as launcher
from flashtile.backends.triton import attn_fwd as fwd_launcher
from flashtile.kernels.attn_bwd import BWD_CONFIGS, SHORT_SEQLEN, bwd_configs

A = ((16, 32, 4, 1), (32, 16, 4, 1))
B = ((32, 32, 4, 2), (64, 16, 4, 2))


def test_bwd_lookup_prefers_the_most_specific_row():
    base = BWD_CONFIGS[("sm90", 128)]
    assert bwd_configs("sm90", 128) == base
    table = {("sm90", 128, True, "short"): A, ("sm90", 128, False): B}
    assert bwd_configs("sm90", 128, table, True, SHORT_SEQLEN) == A
    assert bwd_configs("sm90", 128, table, True, SHORT_SEQLEN + 1) == base  # not short: falls back
    assert bwd_configs("sm90", 128, table, False, 512) == B  # no short row for non-causal: causal row
    assert bwd_configs("sm90", 100, table, False, 512) == B  # d = 100 is in the 128 bucket
    assert bwd_configs("interpret", 128, table, True, 512) == BWD_CONFIGS[("interpret", 0)]


def test_bwd_override_file_keys(tmp_path):
    path = tmp_path / "bwd_table.json"
    path.write_text(json.dumps({"sm90,64": [list(A[0]), list(A[1])],
                                "sm90,128,True,short": [list(B[0]), list(B[1])]}))
    assert launcher.config_overrides() == {}  # no file named
    with config.override(bwd_configs=str(path)):
        table = launcher.config_overrides()
    assert table == {("sm90", 64): A, ("sm90", 128, True, "short"): B}
    assert bwd_configs("sm90", 128, table, True, 256) == B


def test_bwd_override_file_rejects_bad_keys(tmp_path):
    path = tmp_path / "bwd_table.json"
    path.write_text(json.dumps({"sm90,128,short": [list(A[0]), list(A[1])]}))
    with config.override(bwd_configs=str(path)), pytest.raises(ValueError, match="bad key 'sm90,128,short'"):
        launcher.config_overrides()


def test_fwd_override_file_keys(tmp_path):
    from flashtile.kernels.attn_fwd import fwd_config

    path = tmp_path / "fwd_table.json"
    path.write_text(json.dumps({"sm90,128,True,short": [32, 32, 4, 2], "sm90,64,False": [16, 16, 4, 1]}))
    assert fwd_launcher.config_overrides() == {}
    with config.override(fwd_configs=str(path)):
        table = fwd_launcher.config_overrides()
    assert table == {("sm90", 128, True, "short"): (32, 32, 4, 2), ("sm90", 64, False): (16, 16, 4, 1)}
    assert fwd_config("sm90", 128, True, 512, table) == (32, 32, 4, 2)
    assert fwd_config("sm90", 64, False, 4096, table) == (16, 16, 4, 1)


def test_decode_launch_config_rules():
    from flashtile.backends.triton.decode import launch_config
    from flashtile.kernels.decode import DECODE_CONFIGS

    bn, w, st = DECODE_CONFIGS[("sm90", 128)]
    assert launch_config("sm90", 128, False, 2) == (bn, w, st)
    # paged: two more stages (the block-table load takes one of its own)
    assert launch_config("sm90", 128, True, 2, page_size=256) == (bn, w, st + 2)
    # small pages on a grid that is full without splitting: 64-key tiles; split launches keep the table's
    assert launch_config("sm90", 128, True, 2, page_size=16, grid_full=True) == (64, w, st + 2)
    assert launch_config("sm90", 128, True, 2, page_size=16, grid_full=False) == (bn, w, st + 2)
    assert launch_config("sm90", 128, True, 2, page_size=64, grid_full=True) == (bn, w, st + 2)
    # fp32 caches: half the keys per tile, so a stage holds as many bytes
    assert launch_config("sm90", 128, False, 4) == (bn // 2, w, st)
    # the interpreter's tiny row is left alone (no paging extras beyond the stage rule)
    assert launch_config("interpret", 128, False, 2) == DECODE_CONFIGS[("interpret", 0)]
