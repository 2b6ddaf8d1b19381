"""The Gluon warps-along-keys decode kernel run as thread-block clusters of adjacent kv heads kept in lockstep
(FLASHTILE_DECODE_CLUSTER=C, FLASHTILE_DECODE_LOCKSTEP=P; an experiment, session 22): every cluster shape must
give the plain launch's results (the same programs, only scheduled together), match the reference, survive rows
of different lengths and rows without keys (every program of a cluster has its row's tile count, so the syncs
pair up), append in the kernel, and replay in a CUDA graph."""

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.backends.triton import decode_gluon
from test_gpu_decode_gluon_warp_keys import gluon_calls, graph_steps_match_the_default  # noqa: F401 (fixture)
from test_gpu_kvcache import _check, _inputs

pytestmark = pytest.mark.gpu

SETTINGS = [(2, 1), (4, 1), (8, 1), (8, 0), (8, 4)]  # (cluster, period)


@pytest.fixture(params=SETTINGS, ids=[f"c{c}p{p}" for c, p in SETTINGS])
def clustered(request, monkeypatch, gluon_calls):  # noqa: F811 (the fixture imported above)
    c, p = request.param
    monkeypatch.setenv("FLASHTILE_DECODE_CLUSTER", str(c))
    monkeypatch.setenv("FLASHTILE_DECODE_LOCKSTEP", str(p))
    return gluon_calls


def _plain(monkeypatch, fn):
    """fn() with the clusters off (the plain launch of the same kernel), then the settings restored."""
    saved = {k: decode_gluon.env.get(k) for k in ("FLASHTILE_DECODE_CLUSTER", "FLASHTILE_DECODE_LOCKSTEP")}
    monkeypatch.delenv("FLASHTILE_DECODE_CLUSTER")
    monkeypatch.delenv("FLASHTILE_DECODE_LOCKSTEP")
    try:
        return fn()
    finally:
        for k, v in saved.items():
            monkeypatch.setenv(k, v)


@pytest.mark.parametrize("cap, s_new", [(8192, 0), (4133, 1), (1000, 9)])
def test_matches_reference_and_the_plain_launch(clustered, monkeypatch, cap, s_new):
    q, kc, vc, kw = _inputs(32, 1, s_new, 32, 8, 128, cap, torch.bfloat16, seed=cap)
    _check(q, kc, vc, kw, causal=True)  # ragged rows (one full, the others random), the append in the kernel
    assert clustered
    call = dict(kw, return_softmax_lse=True, causal=True)
    out, lse = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **call)
    ref, ref_lse = _plain(monkeypatch, lambda: flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **call))
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_rows_without_keys_and_an_int_length(clustered):
    q, kc, vc, kw = _inputs(32, 1, 0, 32, 8, 128, 700, torch.bfloat16, seed=3)
    kw["cache_seqlens"][1::2] = 0  # clusters whose programs have no tile at all: out 0, lse +inf
    _check(q, kc, vc, kw)
    kw["cache_seqlens"] = 77
    _check(q, kc, vc, kw)
    assert clustered


def test_cuda_graph_step(clustered, monkeypatch):
    graph_steps_match_the_default(monkeypatch, "FLASHTILE_DECODE_GLUON_WARP_KEYS")
    assert clustered


def test_cluster_must_divide_the_kv_heads(gluon_calls, monkeypatch):  # noqa: F811
    monkeypatch.setenv("FLASHTILE_DECODE_CLUSTER", "8")
    q, kc, vc, kw = _inputs(64, 1, 0, 16, 4, 128, 300, torch.bfloat16)
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_CLUSTER=8"):
        flash_attn_with_kvcache(q, kc, vc, **kw)
