"""The fused dQ build of the Gluon dK/dV kernel (config.gluon_fused_dq) on CPU: when the backward takes it, what
the launcher hands the kernel, and that the fp32 sums come back cast into dq with no dQ kernel after them. The
kernel's builds are checked by tests/test_gluon_bwd_compile.py, its gradients by tests/test_gpu_gluon_bwd.py."""

import pytest
import torch

from flashtile import autograd as ag
from flashtile import config
from flashtile.backends.triton import attn_bwd, gluon_bwd
from flashtile.params import AttnParams


def _t(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("d,dv,deterministic,setting,want", [
    (128, 128, False, None, False),   # not yet a default route
    (128, 128, False, True, True),
    (256, 256, False, True, True),
    (128, 128, True, True, False),    # reduce-adds land in a varying order: deterministic keeps the dQ kernel
    (192, 128, False, True, True),    # the split head dim: both column ranges of dQ
    (192, 192, False, True, False),   # v's head dim the kernel does not take
    (64, 64, False, True, True),      # d = 64 (its split dK/dV stays on Triton): the plain order, fused
    (96, 96, False, True, False),     # no Gluon build
    (128, 128, False, False, False),
])
def test_rule(d, dv, deterministic, setting, want):
    q, v = _t(1, 256, 4, d), _t(1, 256, 2, dv)
    with config.override(gluon_fused_dq=setting):
        assert gluon_bwd.use_fused_dq(q, v, AttnParams(softmax_scale=0.1, deterministic=deterministic)) is want


@pytest.mark.parametrize("s,causal,window,deterministic,want", [
    (2048, True, -1, False, True),
    (1024, True, -1, False, False),   # shorter than the row's start
    (4096, False, -1, False, True),
    (2048, True, 256, False, False),  # a causal window is neither row
    (2048, True, -1, True, False),    # deterministic keeps the split
])
def test_route_table(monkeypatch, s, causal, window, deterministic, want):
    # FUSED_ROUTE_TABLE decides where config.gluon_fused_dq leaves it (None); stand-in rows here
    monkeypatch.setattr(gluon_bwd, "FUSED_ROUTE_TABLE", {(128, True): 2048, (128, False): 1024})
    q, v = _t(1, s, 4, 128), _t(1, s, 2, 128)
    p = AttnParams(softmax_scale=0.1, window_left=window if causal else -1, window_right=0 if causal else -1,
                   deterministic=deterministic)
    assert gluon_bwd.use_fused_dq(q, v, p) is want
    with config.override(gluon_fused_dq=False):
        assert not gluon_bwd.use_fused_dq(q, v, p)


def _backward(monkeypatch, fused):
    """attn_bwd._attn_bwd with the Gluon dK/dV route taken and every launch recorded; the Gluon stub writes a known
    fp32 pattern into dq_accum. Returns (calls, dq, pattern, softmax_scale)."""
    calls = []

    def record(kernel, grid, *args, **meta):
        calls.append((getattr(kernel, "__name__", str(kernel)), meta))

    def gluon_dkdv(*args, dq_accum=None, **kw):
        calls.append(("gluon_dkdv", dict(kw, dq_accum=dq_accum)))
        if dq_accum is not None:
            assert dq_accum.dtype == torch.float32 and not dq_accum.any()  # zeros: the kernel only adds
            dq_accum.copy_(pattern)

    monkeypatch.setattr(attn_bwd, "launch", record)
    monkeypatch.setattr(attn_bwd, "run_kernel", record)
    monkeypatch.setattr(attn_bwd, "use_bwd_pdl", lambda *a: True)
    monkeypatch.setattr(gluon_bwd, "use_gluon_bwd", lambda *a: True)
    monkeypatch.setattr(gluon_bwd, "gluon_attn_bwd_dkdv", gluon_dkdv)
    q, dout = (torch.randn(1, 64, 2, 128, dtype=torch.float16) for _ in range(2))
    k, v = (torch.randn(1, 64, 2, 128, dtype=torch.float16) for _ in range(2))
    pattern = torch.randn(q.shape)
    _, _, _, p = ag.padded_params(q, k, v, 0.0, 0.25, True, (-1, -1), 0.0, None, False, False)
    dq = torch.full_like(q, float("nan"))
    with config.override(gluon_fused_dq=fused):
        attn_bwd._attn_bwd(dout, q, k, v, torch.empty_like(q), torch.empty(1, 2, 64), p, dq, torch.empty_like(k),
                           torch.empty_like(v))
    return dict(calls), dq, pattern, p.softmax_scale


def test_fused_backward_casts_the_sums_into_dq(monkeypatch):
    calls, dq, pattern, _ = _backward(monkeypatch, fused=True)
    assert calls["gluon_dkdv"]["launch_dependents"] is False  # no dQ kernel to start early
    assert "_attn_bwd_dq_kernel" not in calls
    torch.testing.assert_close(dq, pattern.to(dq.dtype), rtol=0, atol=0)  # the kernel scaled them already


def test_split_backward_keeps_the_dq_kernel(monkeypatch):
    calls, _, _, _ = _backward(monkeypatch, fused=None)
    assert calls["gluon_dkdv"]["dq_accum"] is None and calls["gluon_dkdv"]["launch_dependents"] is True
    assert "_attn_bwd_dq_kernel" in calls


def _launcher_args(d=128, dv=None, h_k=2):
    q = dout = torch.empty(1, 256, 4, d, dtype=torch.bfloat16)
    k = dk = torch.empty(1, 256, h_k, d, dtype=torch.bfloat16)
    v = dv_ = torch.empty(1, 256, h_k, dv or d, dtype=torch.bfloat16)
    return q, k, v, dout, torch.empty(1, 4, 256), torch.empty(1, 4, 256), dk, dv_


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
def test_launcher_builds_the_fused_kernel(monkeypatch, d, dv):
    from flashtile.kernels.gluon_bwd import BWD_FUSED_CONFIGS

    seen = []
    monkeypatch.setattr(gluon_bwd, "_descriptor", lambda x, block: (x, block))
    monkeypatch.setattr(gluon_bwd, "run_kernel", lambda kernel, grid, *args, **meta: seen.append((args, meta)))
    args = _launcher_args(d, dv)
    accum = torch.zeros(args[0].shape)
    gluon_bwd.gluon_attn_bwd_dkdv(*args, 0.1, causal=True, dq_accum=accum)
    (pos, meta), = seen
    bm = BWD_FUSED_CONFIGS[d]["BLOCK_M"]
    assert meta["FUSED_DQ"] is True and meta["BLOCK_M"] == bm
    # the fused table's config, the plain order (d = 64's split config is the rotated schedule)
    assert meta["ROTATED"] == 0 and meta["NUM_BUFFERS"] == BWD_FUSED_CONFIGS[d]["NUM_BUFFERS"]
    assert meta["num_warps"] == BWD_FUSED_CONFIGS[d]["num_warps"]
    (lead, lead_box), (tail, tail_box) = pos[-2:]
    if d == 192:  # two column ranges of one buffer: 128 + 64
        assert lead_box == [1, bm, 1, 128] and tail_box == [1, bm, 1, 64]
        assert lead.data_ptr() == accum.data_ptr() and tail.data_ptr() == accum[..., 128:].data_ptr()
        assert lead.shape[-1] == 128 and tail.shape[-1] == 64
    else:  # one range: the second descriptor repeats the first
        assert lead is accum and tail is accum and lead_box == tail_box == [1, bm, 1, d]


@pytest.mark.parametrize("change,message", [
    (dict(dtype=torch.bfloat16), "fp32"),
    (dict(shape=(1, 256, 2, 128)), "q's shape"),
    (dict(dv=64), r"\(d, dv\)"),
    (dict(pdl=True), "dependent"),
])
def test_launcher_refuses_a_bad_dq_accum(change, message):
    args = _launcher_args(dv=change.get("dv"))
    accum = torch.zeros(change.get("shape", args[0].shape), dtype=change.get("dtype", torch.float32))
    with pytest.raises(ValueError, match=message):
        gluon_bwd.gluon_attn_bwd_dkdv(*args, 0.1, causal=True, dq_accum=accum,
                                      launch_dependents=change.get("pdl", False))


def test_the_fp32_buffer_gets_a_descriptor():
    # the launchers build dq_accum's descriptor with the same helper as the 16-bit tensors' (stubbed above)
    from flashtile.backends.triton.gluon_fwd import _descriptor

    accum = torch.zeros(2, 256, 4, 128)
    desc = _descriptor(accum, [1, 32, 1, 128])
    assert desc.base is accum and desc.block_shape == [1, 32, 1, 128]
    assert desc.layout.element_bitwidth == 32 and desc.layout.rank == 4
