"""GPU tests of the launch cache (backends/triton/fast_launch.py; config.fast_launch, FLASHTILE_FAST_LAUNCH=0 off).

With it on, every Triton or Gluon launch after the first with its argument key calls the compiled
kernel's launcher directly. Results must be bit-identical to the normal path, later launches must
hit (per-call seeds and lengths included), and a launch whose arguments Triton would specialise
differently (a misaligned pointer) must not reuse the wrong kernel.
"""

import pytest
import torch

import flashtile
from flashtile import config
from flashtile.backends.triton import fast_launch

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture
def fast(monkeypatch):
    """The cache on and empty; returns the list its hits are recorded in."""
    assert fast_launch.AVAILABLE, "Triton's private launch API is not as fast_launch.py expects"
    monkeypatch.setattr(fast_launch, "_COMPILED", {})
    hits = []
    launch_cached = fast_launch._launch_cached

    def counted(hit, grid, args):
        hits.append(hit[0])
        launch_cached(hit, grid, args)

    monkeypatch.setattr(fast_launch, "_launch_cached", counted)
    # Triton kernels here; the Gluon test forces the Gluon ones
    with config.override(fast_launch=True, gluon_fwd=False, gluon_bwd=False):
        yield hits


def _step(q, k, v, g, **kw):
    out = flashtile.flash_attn_func(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), g))


def _qkv(s=300, d=64, dtype=torch.bfloat16):
    q, k, v = (torch.randn(2, s, 4, d, device=DEV, dtype=dtype, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(2, s, 4, d, device=DEV, dtype=dtype)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(64, 8), softcap=20.0),
                                dict(dropout_p=0.2, deterministic=True)])
def test_fast_path_is_bit_identical(fast, kw):
    q, k, v, g = _qkv()

    def seeded_step():  # the same dropout mask in every run (seeds are drawn per call)
        torch.manual_seed(5)
        return _step(q, k, v, g, **kw)

    first = seeded_step()  # compile + cache
    assert fast_launch._COMPILED, "nothing was cached"
    assert not fast
    second = seeded_step()  # every launch from the cache
    assert len(fast) >= 4, f"only {len(fast)} launches hit the cache"
    with config.override(fast_launch=False):
        normal = seeded_step()
    for a, b, c in zip(first, second, normal):
        assert torch.equal(a, c) and torch.equal(b, c)


def test_misaligned_inputs_do_not_reuse_an_aligned_kernel(fast):
    q, k, v, g = _qkv(d=64)
    _step(q, k, v, g)
    # the same shapes and strides one element into a wider buffer: base pointers 2 bytes off
    # 16-byte alignment, so only the alignment part of the key tells the two apart
    n = q.numel()
    bufs = [torch.randn(n + 1, device=DEV, dtype=torch.bfloat16) for _ in range(4)]
    qm, km, vm = (b_[1:].view(q.shape).detach().requires_grad_(True) for b_ in bufs[:3])
    gm = bufs[3][1:].view(q.shape)
    assert qm.data_ptr() % 16 == 2
    fast_out = _step(qm, km, vm, gm)
    with config.override(fast_launch=False):
        normal = _step(qm, km, vm, gm)
    for a, b in zip(fast_out, normal):
        assert torch.equal(a, b)


def test_decode_through_the_fast_path(fast):
    b, h, h_k, d, cap = 2, 8, 2, 128, 4096
    kc, vc = (torch.randn(b, cap, h_k, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(b, 1, h, d, device=DEV, dtype=torch.bfloat16)
    lens = torch.tensor([4000, 1234], device=DEV, dtype=torch.int32)
    outs = [flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens) for _ in range(2)]
    assert fast, "the second decode call did not hit the cache"
    # an int length changes every step: one kernel class for all of them, so later steps hit too
    hits = len(fast)
    for length in (3001, 3002):
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=length)
    flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3003)
    assert len(fast) > hits
    with config.override(fast_launch=False):
        normal = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    assert all(torch.equal(o, normal) for o in outs)


@pytest.mark.parametrize("causal", [False, True])
def test_gluon_kernels_through_the_cache(fast, causal):
    # the Gluon forward and dK/dV kernels take Gluon tensor descriptors, keyed by Triton's own
    # specialisation (block shape, dtype, layout)
    q, k, v, g = _qkv(s=512, d=128)
    with config.override(gluon_fwd=True, gluon_bwd=True):
        first, second = _step(q, k, v, g, causal=causal), _step(q, k, v, g, causal=causal)
        names = {getattr(hit, "name", "") for hit in fast}
        assert any("gluon" in name for name in names), names
        with config.override(fast_launch=False):
            normal = _step(q, k, v, g, causal=causal)
    for a, b, c in zip(first, second, normal):
        assert torch.equal(a, c) and torch.equal(b, c)
