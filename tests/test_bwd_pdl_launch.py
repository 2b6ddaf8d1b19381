"""The backward's programmatic-dependent-launch wiring (backends/triton/attn_bwd.py use_bwd_pdl), on CPU.

With it on, the dK/dV kernel (Triton or Gluon) is built to signal its dependents and the dQ kernel
is launched behind it with ``launch_pdl`` and waits at its end; with it off, every launch is plain.
The kernels are stubbed here: their builds are checked by tests/test_sm90_compile.py and
tests/test_gluon_bwd_compile.py, their results against ordinary launches by tests/test_gpu_bwd_pdl.py.
"""

import pytest
import torch

from flashtile import autograd as ag
from flashtile import config
from flashtile.backends.triton import attn_bwd, gluon_bwd


def _backward(monkeypatch, pdl=True, gluon_dkdv=False, causal=True, window=(-1, -1), seqlen_k=64):
    """Run the launcher with recording stubs for every launch: [(kernel name, keywords)]; the rule's
    arguments are recorded as ("use_bwd_pdl", {"causal": ..., "seqlen": ...})."""
    calls = []

    def record(kernel, grid, *args, **meta):
        calls.append((getattr(kernel, "__name__", str(kernel)), meta))

    monkeypatch.setattr(attn_bwd, "launch", record)
    monkeypatch.setattr(attn_bwd, "run_kernel", record)

    def rule(q, causal, seqlen):
        calls.append(("use_bwd_pdl", {"causal": causal, "seqlen": seqlen}))
        return pdl

    monkeypatch.setattr(attn_bwd, "use_bwd_pdl", rule)
    monkeypatch.setattr(gluon_bwd, "use_gluon_bwd", lambda *a: gluon_dkdv)
    monkeypatch.setattr(gluon_bwd, "gluon_attn_bwd_dkdv",
                        lambda *a, **kw: calls.append(("gluon_dkdv", kw)))
    q, dout = (torch.randn(1, 64, 2, 64, dtype=torch.float16) for _ in range(2))
    k, v = (torch.randn(1, seqlen_k, 2, 64, dtype=torch.float16) for _ in range(2))
    _, _, _, p = ag.padded_params(q, k, v, 0.0, None, causal, window, 0.0, None, False, False)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 64)
    attn_bwd._attn_bwd(dout, q, k, v, out, lse, p, *(torch.empty_like(q) for _ in range(3)))
    return dict(calls)


def test_split_backward_with_pdl(monkeypatch):
    calls = _backward(monkeypatch)
    assert calls["_attn_bwd_dkdv_kernel"]["LAUNCH_DEPENDENTS"] is True
    assert calls["_attn_bwd_dq_kernel"]["WAIT_AT_END"] is True and calls["_attn_bwd_dq_kernel"]["launch_pdl"] is True
    assert "launch_pdl" not in calls["_attn_bwd_preprocess_kernel"]


@pytest.mark.parametrize("causal,window,seqlen_k,expected", [
    (True, (-1, -1), 64, (True, 64)),
    (False, (-1, -1), 96, (False, 96)),  # the longer of the two lengths
    (False, (-1, 0), 64, (True, 64)),  # an explicit (-1, 0) window is the causal mask
    (True, (8, -1), 64, (False, 64)),  # a band (window_left >= 0) is not
])
def test_rule_gets_the_mask_and_length(monkeypatch, causal, window, seqlen_k, expected):
    calls = _backward(monkeypatch, causal=causal, window=window, seqlen_k=seqlen_k)
    assert (calls["use_bwd_pdl"]["causal"], calls["use_bwd_pdl"]["seqlen"]) == expected


def test_gluon_dkdv_signals_too(monkeypatch):
    calls = _backward(monkeypatch, gluon_dkdv=True)
    assert calls["gluon_dkdv"]["launch_dependents"] is True
    assert "_attn_bwd_dkdv_kernel" not in calls
    assert calls["_attn_bwd_dq_kernel"]["launch_pdl"] is True


def test_off_leaves_every_launch_as_before(monkeypatch):
    calls = _backward(monkeypatch, pdl=False, gluon_dkdv=True)
    assert calls["gluon_dkdv"]["launch_dependents"] is False
    assert not {"WAIT_AT_END", "launch_pdl"} & set(calls["_attn_bwd_dq_kernel"])


def test_rule_needs_a_cuda_hopper(monkeypatch):
    q = torch.empty(1, 4, 1, 8)
    with config.override(bwd_pdl=True):
        assert not attn_bwd.use_bwd_pdl(q, True, 2048)  # CPU tensors (the interpreter)
        monkeypatch.setattr(type(q), "device", property(lambda t: torch.device("cuda", 0)), raising=False)
        monkeypatch.setattr(attn_bwd, "capability", lambda device: (9, 0))
        assert attn_bwd.use_bwd_pdl(q, True, 2048)
        monkeypatch.setattr(attn_bwd, "capability", lambda device: (8, 0))
        assert not attn_bwd.use_bwd_pdl(q, True, 2048)  # Ampere has no programmatic dependent launch
    monkeypatch.setattr(attn_bwd, "capability", lambda device: (9, 0))
    q64, q128 = torch.empty(1, 4, 1, 64), torch.empty(1, 4, 1, 128)
    for t in (q64, q128):
        monkeypatch.setattr(type(t), "device", property(lambda t: torch.device("cuda", 0)), raising=False)
    # the table (PDL_TABLE): d = 64 everywhere, d = 128 causal 2048..4096, non-causal up to 1024
    assert attn_bwd.use_bwd_pdl(q64, False, 1024) and attn_bwd.use_bwd_pdl(q64, True, 16384)
    assert attn_bwd.use_bwd_pdl(q128, True, 2048) and attn_bwd.use_bwd_pdl(q128, True, 4096)
    assert not attn_bwd.use_bwd_pdl(q128, False, 4096) and not attn_bwd.use_bwd_pdl(q128, True, 16384)
    assert not attn_bwd.use_bwd_pdl(q128, True, 1024)
    with config.override(bwd_pdl=False):
        assert not attn_bwd.use_bwd_pdl(q64, False, 1024)  # forced off
    with config.override(bwd_pdl=True):
        assert attn_bwd.use_bwd_pdl(q128, False, 4096)  # forced on
    # the table was measured on sm_90 only: other sm_90+ GPUs take PDL only when forced
    monkeypatch.setattr(attn_bwd, "capability", lambda device: (10, 0))
    with config.override(bwd_pdl=True):
        assert attn_bwd.use_bwd_pdl(q64, False, 1024)
    assert not attn_bwd.use_bwd_pdl(q64, False, 1024)


def test_pdl_table():
    """The table's rows, as measured (docs/backward.md, "The dQ launch behind dK/dV")."""
    pref = attn_bwd.pdl_preferred
    assert all(pref(64, c, s) for c in (False, True) for s in (512, 1024, 16384))
    assert all(pref(32, c, s) for c in (False, True) for s in (512, 16384))  # its bucket's row
    assert [pref(128, False, s) for s in (1024, 2048, 4096, 16384)] == [True, False, False, False]
    assert [pref(128, True, s) for s in (1024, 2048, 4096, 8192, 16384)] == [False, True, True, False, False]
    assert [pref(96, True, s) for s in (1024, 2048, 4096, 8192)] == [False, True, True, False]
    assert [pref(256, True, s) for s in (1024, 2048, 16384)] == [False, True, True]
    assert [pref(256, False, s) for s in (1024, 2048, 16384)] == [True, True, True]
