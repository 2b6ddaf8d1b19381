"""Which flex forwards the Gluon kernel takes (backends/triton/flex/gluon_launch.py), decided without a GPU: the
device is faked as an sm_90 CUDA device."""

import pytest
import torch

from flashtile import config
from flashtile.backends.triton import host
from flashtile.backends.triton.flex import gluon_launch


@pytest.fixture
def on_sm90(monkeypatch):
    def fake(arch="sm90"):
        monkeypatch.setattr(host, "arch_of", lambda device: arch)
        monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda")), raising=False)
    return fake


def _qkv(d=128, dtype=torch.bfloat16, h_k=4, s=256):
    q = torch.empty(1, 4, s, d, dtype=dtype)
    return q, torch.empty(1, h_k, s, d, dtype=dtype), torch.empty(1, h_k, s, d, dtype=dtype)


def test_takes_16bit_calls_at_d128(on_sm90):
    on_sm90()
    for dtype in (torch.bfloat16, torch.float16):
        assert gluon_launch.wanted(*_qkv(128, dtype), (128, 128), (0, 0, 0, 0), 0.1)
    assert gluon_launch.wanted(*_qkv(h_k=1), (128, 256), (0, 0, 0, 0), 0.1), "GQA, 256-key sparse blocks"


@pytest.mark.parametrize("why,args,block,tiles", [
    ("fp32", _qkv(dtype=torch.float32), (128, 128), (0, 0, 0, 0)),
    ("head dim 96", _qkv(d=96), (128, 128), (0, 0, 0, 0)),
    ("head dim 64 (not timed)", _qkv(d=64), (128, 128), (0, 0, 0, 0)),
    ("head dim 256", _qkv(d=256), (128, 128), (0, 0, 0, 0)),
    ("sparse q block of 64 rows under a 128-row tile", _qkv(), (64, 128), (0, 0, 0, 0)),
    ("sparse kv block of 32 keys under a 64-key tile", _qkv(), (128, 32), (0, 0, 0, 0)),
    ("the call's own tiles (kernel_options)", _qkv(), (128, 128), (64, 64, 4, 2)),
])
def test_refuses(on_sm90, why, args, block, tiles):
    on_sm90()
    assert not gluon_launch.wanted(*args, block, tiles, 0.1), why


def test_v_of_its_own_head_dim_and_unaligned_strides_stay_on_triton(on_sm90):
    on_sm90()
    q, k, _ = _qkv()
    assert not gluon_launch.wanted(q, k, torch.empty(1, 4, 256, 64, dtype=torch.bfloat16), (128, 128), (0,) * 4, 0.1)
    odd = torch.empty(1, 4, 256, 136, dtype=torch.bfloat16)[..., :128]  # row stride 272 bytes: fine
    assert gluon_launch.wanted(odd, k, k, (128, 128), (0,) * 4, 0.1)
    odd = torch.empty(1, 4, 256, 132, dtype=torch.bfloat16)[..., :128]  # 264 bytes: not a 16-byte multiple
    assert not gluon_launch.wanted(odd, k, k, (128, 128), (0,) * 4, 0.1)


def test_settings_and_other_gpus(on_sm90):
    on_sm90()
    args = (*_qkv(), (128, 128), (0, 0, 0, 0), 0.1)
    with config.override(gluon=False):
        assert not gluon_launch.wanted(*args)
    with config.override(gluon_flex=False):
        assert not gluon_launch.wanted(*args)
    with config.override(fwd_tiles=(64, 64, 4, 2)):
        assert not gluon_launch.wanted(*args)
    on_sm90("default")
    assert not gluon_launch.wanted(*args)


def test_cpu_tensors_never_take_it():
    assert not gluon_launch.wanted(*_qkv(), (128, 128), (0, 0, 0, 0), 0.1)


def test_scale_and_grid_limits(on_sm90):
    on_sm90()
    q, k, v = _qkv()
    for scale in (0.0, -0.125, float("nan")):  # a masked score is -inf before the scale multiplies it
        assert not gluon_launch.wanted(q, k, v, (128, 128), (0,) * 4, scale)
    many = torch.empty(4096, 16, 1, 128, dtype=torch.bfloat16)  # 65536 (batch, head) pairs: past the grid's y axis
    assert not gluon_launch.wanted(many, many, many, (128, 128), (0,) * 4, 0.1)
    assert gluon_launch.wanted(many[:4095], many[:4095], many[:4095], (128, 128), (0,) * 4, 0.1)


def test_empty_keys_or_batch_stay_on_triton(on_sm90):
    on_sm90()
    q, k, v = _qkv()
    assert not gluon_launch.wanted(q, k[:, :, :0], v[:, :, :0], (128, 128), (0,) * 4, 0.1)
    assert not gluon_launch.wanted(q[:0], k[:0], v[:0], (128, 128), (0,) * 4, 0.1)


def test_the_dkdv_kernel_runs_only_when_asked(on_sm90):
    # the Gluon dK/dV kernel has not run on a GPU yet: config.gluon_flex_bwd=True alone sends calls to it
    on_sm90()
    q, k, v = _qkv()
    args = (q, k, v, q, (128, 128), (0, 0, 0, 0))
    assert not gluon_launch.bwd_wanted(*args)
    with config.override(gluon_flex_bwd=True):
        assert gluon_launch.bwd_wanted(*args)
        assert not gluon_launch.bwd_wanted(q, k, v, q, (128, 128), (32, 64, 4, 3)), "the call's own dK/dV tiles"
        assert not gluon_launch.bwd_wanted(q, k, v, q, (16, 128), (0,) * 4), "a sparse q block under a 32-row step"
        assert not gluon_launch.bwd_wanted(*_qkv(d=64), q[..., :64], (128, 128), (0,) * 4)
        assert not gluon_launch.bwd_wanted(q, k, v, q.half(), (128, 128), (0,) * 4), "dout of another dtype"
        with config.override(gluon=False):
            assert not gluon_launch.bwd_wanted(*args)


def test_the_fused_dq_build_runs_only_when_asked():
    assert not gluon_launch.fused_dq_wanted()
    with config.override(gluon_fused_dq=True):
        assert gluon_launch.fused_dq_wanted()


def _flex_backward(monkeypatch, fused):
    """launch.flex_bwd with the Gluon dK/dV route taken and every launch recorded; the Gluon stub writes a known
    fp32 pattern into dq_accum. Returns (kernel names launched, the stub's dq_accum, dq, pattern)."""
    from flashtile.backends.triton.flex import launch
    from flashtile.flex import registry

    names, seen = [], {}
    monkeypatch.setattr(host, "launch", lambda kernel, grid, *a, **kw: names.append(kernel.__name__))
    monkeypatch.setattr(gluon_launch, "bwd_wanted", lambda *a: True)

    def dkdv(*args, dq_accum=None):
        seen["dq_accum"] = dq_accum
        if dq_accum is not None:
            assert dq_accum.dtype == torch.float32 and not dq_accum.any()  # zeros: the kernel only adds
            dq_accum.copy_(pattern)

    monkeypatch.setattr(gluon_launch, "gluon_flex_dkdv", dkdv)
    q, k, v = (torch.randn(1, 2, 256, 128, dtype=torch.bfloat16) for _ in range(3))
    pattern = torch.randn(q.shape)
    kernels = registry.entry_for(None, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx).kernels()
    block = tuple(torch.zeros(1, 1, 2, *([2] if i % 2 else []), dtype=torch.int32) for i in range(8))
    with config.override(gluon_fused_dq=fused):
        dq, dk, dv, _ = launch.flex_bwd(torch.randn_like(q), None, q, k, v, torch.randn_like(q),
                                        torch.zeros(1, 2, 256), block, kernels, 0.1, (128, 128), False)
    return names, seen["dq_accum"], dq, pattern


def test_the_fused_build_replaces_the_dq_kernel(monkeypatch):
    names, accum, dq, pattern = _flex_backward(monkeypatch, True)
    assert accum is not None and "_flex_bwd_dq_kernel" not in names
    torch.testing.assert_close(dq, pattern.to(dq.dtype), rtol=0, atol=0)  # the kernel scaled them already
    names, accum, _, _ = _flex_backward(monkeypatch, None)
    assert accum is None and "_flex_bwd_dq_kernel" in names


@pytest.mark.parametrize("fused", [False, True])
def test_dkdv_launcher_binds(monkeypatch, fused):
    # the launcher's arguments bound to the kernel's signature as Triton would (the kernel only runs on sm_90)
    import inspect

    from flashtile.flex import registry
    from flashtile.kernels.gluon_flex_bwd import _gluon_flex_bwd_dkdv_kernel

    bound = []

    def record(kernel, grid, *args, **meta):
        assert kernel is _gluon_flex_bwd_dkdv_kernel
        params = {key: val for key, val in meta.items() if key != "num_warps"}
        bound.append(inspect.signature(kernel.fn).bind(*args, **params).arguments)

    monkeypatch.setattr(host, "run_kernel", record)
    monkeypatch.setattr(gluon_launch, "_descriptor", lambda x, rows: x)
    q, k, v = _qkv()
    kernels = registry.entry_for(None, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx).kernels()
    lists = tuple(torch.zeros(1, 4, 2, *([2] if i % 2 else []), dtype=torch.int32) for i in range(4))
    accum = torch.zeros(q.shape) if fused else None
    gluon_launch.gluon_flex_dkdv(q, k, v, q, torch.zeros(1, 4, 256), torch.zeros(1, 4, 256), torch.empty_like(k),
                                 torch.empty_like(v), lists, (torch.empty(1),), (), kernels, 0.1, (128, 128), accum)
    args, = bound
    assert args["FUSED_DQ"] is fused and (args["desc_dq"] is accum if fused else args["desc_dq"].shape == k.shape)
    with pytest.raises(ValueError, match="dq_accum"):
        gluon_launch.gluon_flex_dkdv(q, k, v, q, torch.zeros(1, 4, 256), torch.zeros(1, 4, 256), torch.empty_like(k),
                                     torch.empty_like(v), lists, (torch.empty(1),), (), kernels, 0.1, (128, 128),
                                     torch.zeros(q.shape, dtype=torch.bfloat16))
