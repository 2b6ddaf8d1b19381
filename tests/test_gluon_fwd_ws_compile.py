"""The warp-specialised Gluon forward (kernels/gluon_fwd_ws.py, an experiment) built for sm_90 on the CPU: the
loader and consumer partitions get the registers the launcher plans (24 and 232 at a 128-register launch, two
CTAs of 8 warps an SM), nothing spills, ptxas keeps the wgmmas asynchronous (no C7512 / C7514), and the softmax
runs under an in-flight wgmma; the default ring fits two CTAs in an SM's shared memory at d = 128."""

import os
import pathlib
import subprocess
import sys

import pytest

from flashtile.backends.triton import gluon_fwd

TESTS = pathlib.Path(__file__).resolve().parent
SM90_SMEM_PER_SM = 233472


def _compile(*args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["PYTHONPATH"] = str(TESTS.parent / "src")
    res = subprocess.run([sys.executable, str(TESTS / "aot_gluon_fwd_ws.py"), *map(str, args)], capture_output=True,
                         text=True, env=env, cwd=TESTS, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    f = res.stdout.split()
    return {key: int(val) for key, val in zip(f[::2], f[1::2])}


@pytest.mark.parametrize("d, causal", [(128, False), (128, True), (64, True)])
def test_default_ring_builds_for_two_ctas_an_sm(d, causal):
    got = _compile(d, gluon_fwd.WS_BLOCK_N, gluon_fwd.WS_BUFFERS, int(causal), gluon_fwd.WS_BLOCK_M)
    assert got["REGISTERS"] == gluon_fwd.WS_MAXNREG[64] and 2 * 256 * got["REGISTERS"] <= 65536, got
    assert got["CONSUMER_REGS"] == 232 and got["LOADER_REGS"] == 24, got
    assert got["SPILL_STORES"] == 0 and got["C7512"] == 0 and got["C7514"] == 0, got
    assert got["EX2_UNDER_WGMMA"] >= 16, got  # half of a 64-key block's exponentials a thread, at least
    assert 2 * (got["SHARED"] + 1024) <= SM90_SMEM_PER_SM, got


@pytest.mark.parametrize("value", ["64,64,2", "64,48,4", "96,64,3", "64,4", "x"])
def test_ring_setting_refuses_what_cannot_run(monkeypatch, value):
    monkeypatch.setenv("FLASHTILE_GLUON_WS_CONFIG", value)
    with pytest.raises(ValueError, match="FLASHTILE_GLUON_WS_CONFIG"):
        gluon_fwd.ws_config()


def test_ring_setting(monkeypatch):
    monkeypatch.delenv("FLASHTILE_GLUON_WS_CONFIG", raising=False)
    assert gluon_fwd.ws_config() == (gluon_fwd.WS_BLOCK_M, gluon_fwd.WS_BLOCK_N, gluon_fwd.WS_BUFFERS)
    monkeypatch.setenv("FLASHTILE_GLUON_WS_CONFIG", "128,128,3")
    assert gluon_fwd.ws_config() == (128, 128, 3)
