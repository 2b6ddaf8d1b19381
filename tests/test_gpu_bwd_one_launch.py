"""GPU tests of the one-launch backward (dK/dV and dQ programs in one grid, FLASHTILE_BWD_ONE_LAUNCH).

Every config of the tuning list (kernels/attn_bwd.py ONE_LAUNCH_CANDIDATES) is checked, so a config the sweep picks
is known to give the right gradients, with the 3x rule of attn_cases."""

import pytest
import torch

from attn_cases import check_padded, check_varlen, repeated_grads
from flashtile.backends.triton import attn_bwd as launcher
from flashtile.kernels.attn_bwd import ONE_LAUNCH_CANDIDATES

pytestmark = pytest.mark.gpu
DEV = "cuda"
CONFIGS = ONE_LAUNCH_CANDIDATES
CASES = [(d, c) for d, cfgs in CONFIGS.items() for c in cfgs]


@pytest.fixture
def one_launch(monkeypatch):
    monkeypatch.setattr(launcher, "ONE_LAUNCH_OVERRIDE", True)

    def pin(cfg):
        m1, n1, m2, n2, w, s = cfg
        monkeypatch.setattr(launcher, "CONFIG_OVERRIDE", ((m1, n1, w, s), (m2, n2, w, s)))
    return pin


@pytest.mark.parametrize("d,cfg", CASES, ids=[f"d{d}-{'_'.join(map(str, c))}" for d, c in CASES])
@pytest.mark.parametrize("causal", [False, True])
def test_one_launch_grads(one_launch, d, cfg, causal):
    one_launch(cfg)
    for sq, sk in [(1, 239), (113, 203), (1023, 1024)]:
        check_padded(2, sq, sk, 4, 2, d, torch.bfloat16, device=DEV, causal=causal)


@pytest.mark.parametrize("kw", [dict(window_size=(50, 30)), dict(softcap=30.0, causal=True), dict(alibi="bh"),
                                dict(dropout_p=0.1, causal=True)])
def test_one_launch_features(one_launch, kw):
    one_launch(CONFIGS[128][0])
    check_padded(2, 300, 500, 4, 1, 128, torch.bfloat16, device=DEV, **kw)


def test_one_launch_varlen(one_launch):
    one_launch(CONFIGS[128][0])
    check_varlen([1, 300, 0, 700, 77], [5, 300, 17, 900, 0], 8, 2, 128, torch.bfloat16, device=DEV, causal=True)


def test_one_launch_deterministic_20_runs(one_launch):
    one_launch(CONFIGS[128][0])
    runs = repeated_grads(20, device=DEV, causal=True, deterministic=True)
    for grads in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], grads))
