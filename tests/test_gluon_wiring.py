"""Every Gluon launcher's arguments bind to its kernel's parameters (CPU).

The Gluon kernels only run on an sm_90 GPU and Triton's interpreter cannot run them, so a launcher that
passes one argument too few, a stale keyword or a constexpr the kernel no longer has would only fail on
the GPU. Here each launcher runs on CPU tensors with the launch intercepted (``host.run_kernel``), and
its positional and keyword arguments are bound to the kernel function's signature, as Triton would.
"""

import dataclasses
import inspect

import pytest
import torch

from flashtile.backends.triton import gluon_bwd, gluon_fwd
from flashtile.backends.triton.decode import gluon as decode_gluon
from flashtile.backends.triton.decode import route as decode_route

# keywords Triton takes as compile / launch options, not as kernel parameters
LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "launch_cooperative_grid"}


def _bind(kernel, args, kwargs):
    fn = getattr(kernel, "fn", kernel)
    params = {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    bound = inspect.signature(fn).bind(*args, **params)  # TypeError on a missing / extra / unknown argument
    bound.apply_defaults()
    return bound.arguments


@pytest.fixture
def launches(monkeypatch):
    """Launches through run_kernel, recorded instead of run: (kernel, grid, bound arguments)."""
    seen = []

    def record(kernel, grid, *args, **kwargs):
        seen.append((kernel, grid, _bind(kernel, args, kwargs)))

    for module in (gluon_fwd, gluon_bwd, decode_gluon):
        monkeypatch.setattr(module, "run_kernel", record)
    return seen


def test_forward_binds(monkeypatch, launches):
    monkeypatch.setattr(gluon_fwd, "_validate", lambda *a: None)
    monkeypatch.setattr(gluon_fwd, "_descriptor", lambda x, block: x)
    q = torch.empty(2, 256, 8, 128, dtype=torch.bfloat16)
    k = v = torch.empty(2, 256, 2, 128, dtype=torch.bfloat16)
    for causal in (False, True):
        gluon_fwd.gluon_attn_fwd(q, k, v, causal=causal)
    assert len(launches) == 2 and all(a["HEAD_DIM"] == 128 for _, _, a in launches)


def test_fp8_forward_binds(monkeypatch, launches):
    monkeypatch.setattr(gluon_fwd, "_validate_fp8", lambda *a: None)
    monkeypatch.setattr(gluon_fwd, "_descriptor", lambda x, block: x)
    q = torch.empty(1, 256, 4, 128, dtype=torch.float8_e4m3fn)
    k = torch.empty(1, 256, 2, 128, dtype=torch.float8_e4m3fn)
    v_t = torch.empty(1, 2, 128, 256, dtype=torch.float8_e4m3fn)
    gluon_fwd.gluon_attn_fwd_fp8(q, k, v_t, causal=True)
    assert len(launches) == 1


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("pdl,fused", [(False, False), (True, False), (False, True)])
def test_backward_dkdv_binds(monkeypatch, launches, d, pdl, fused):
    monkeypatch.setattr(gluon_bwd, "_descriptor", lambda x, block: x)
    q = dout = torch.empty(1, 256, 4, d, dtype=torch.bfloat16)
    k = v = dk = dv = torch.empty(1, 256, 2, d, dtype=torch.bfloat16)
    lse = delta = torch.empty(1, 4, 256)
    accum = torch.zeros(q.shape) if fused else None
    gluon_bwd.gluon_attn_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, 0.1, causal=True, launch_dependents=pdl,
                                  dq_accum=accum)
    (_, _, bound), = launches
    assert bound["HEAD_DIM"] == d and bound.get("LAUNCH_DEPENDENTS", False) == pdl
    assert bound["FUSED_DQ"] is fused
    assert bound["desc_dq"] is bound["desc_dq2"] is (accum if fused else dk)


# (splits, the kernel appends the call's new keys itself): a split launch reads them from the cache instead
@pytest.mark.parametrize("splits,append", [(1, False), (1, True), (4, False)])
def test_decode_binds(monkeypatch, launches, splits, append):
    monkeypatch.setattr(decode_gluon, "combine", lambda *a, **k: None)
    b, cap, h, h_k, d = 2, 1024, 8, 2, 128
    q = torch.empty(b, 1, h, d, dtype=torch.bfloat16)
    k_cache = v_cache = torch.empty(b, cap, h_k, d, dtype=torch.bfloat16)
    new = torch.empty(b, 1, h_k, d, dtype=torch.bfloat16) if append else None
    route = dataclasses.replace(decode_route.Route(kernel="gluon", block_n=64), splits=splits)
    decode_gluon.decode(q, k_cache, v_cache, route, cache_seqlens=torch.zeros(b, dtype=torch.int32),
                        cache_len_const=0, s_new=1 if append else 0, softmax_scale=0.1, k_new=new, v_new=new)
    (_, grid, bound), = launches
    assert grid == (b * h_k * splits,) and bound["FUSED_NEW"] == append
