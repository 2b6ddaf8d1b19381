"""GPU tests of the fused backward (FLASHTILE_BWD_FUSED_DQ): dQ added inside the dK/dV kernel, by one
bulk tensor reduce-add per tile (TMA, the sm_90 default) or by per-element fp32 atomics.

The interpreter cannot run descriptor reduces, so the TMA mode is only tested here; the 3x rule of
attn_cases is the bar. Atomic sums vary in order run to run, so repeat runs are compared with a
tolerance, not bitwise (deterministic=True never takes this path)."""

import pytest
import torch

from attn_cases import check_padded, check_varlen, repeated_grads
from flashtile.backends.triton import attn_bwd as launcher

pytestmark = pytest.mark.gpu
DEV = "cuda"
CONFIGS = {64: (64, 128, 8, 2), 128: (32, 128, 8, 2), 256: (64, 64, 8, 2)}


@pytest.fixture(params=[True, False], ids=["tma", "atomic"])
def fused(request, monkeypatch):
    monkeypatch.setattr(launcher, "FUSED_OVERRIDE", True)
    monkeypatch.setattr(launcher, "FUSED_DQ_TMA_OVERRIDE", request.param)

    def pin(d):
        cfg = CONFIGS[64 if d <= 64 else 128 if d <= 128 else 256]
        monkeypatch.setattr(launcher, "CONFIG_OVERRIDE", (cfg, cfg))
    return pin


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_dq_grads(fused, d, causal):
    fused(d)
    for sq, sk in [(1, 239), (113, 203), (1023, 1024)]:
        check_padded(2, sq, sk, 4, 2, d, torch.bfloat16, device=DEV, causal=causal)


@pytest.mark.parametrize("kw", [dict(window_size=(50, 30)), dict(softcap=30.0, causal=True), dict(alibi="bh"),
                                dict(dropout_p=0.1, causal=True)])
def test_fused_dq_features(fused, kw):
    fused(128)
    check_padded(2, 300, 500, 4, 1, 128, torch.bfloat16, device=DEV, **kw)


def test_fused_dq_varlen(fused):
    fused(128)
    check_varlen([1, 300, 0, 700, 77], [5, 300, 17, 900, 0], 8, 2, 128, torch.bfloat16, device=DEV, causal=True)


def test_fused_dq_repeat_runs_agree(fused):
    fused(128)
    runs = repeated_grads(10, device=DEV, causal=True)
    for grads in runs[1:]:
        for a, b in zip(runs[0], grads):
            # fp32 sums in a varying order, then one bf16 rounding: at most a bf16 ulp or so apart
            assert (a.float() - b.float()).abs().max().item() <= 2e-2 * a.float().abs().max().item()
