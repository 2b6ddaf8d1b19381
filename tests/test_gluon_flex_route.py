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
