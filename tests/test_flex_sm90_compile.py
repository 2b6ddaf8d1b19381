"""The flex kernels, with generated mods (a learnable relative-position table under a causal mask), compile
for Hopper (sm_90) through ptxas at the launcher's sm_90 tiles for d = 128: dots on warp-group MMA, shared
memory within sm_90's limit, and register spills bounded: the tuned tiles (measured fastest on an H100 with their
spills) spill at most a few hundred bytes with this, the heaviest mod; a tile change that spills more fails here."""

import os
import pathlib
import subprocess
import sys

import pytest

from flashtile.kernels.flex_bwd import FLEX_BWD_CONFIGS
from flashtile.kernels.flex_fwd import FLEX_FWD_CONFIGS

SCRIPT = pathlib.Path(__file__).with_name("aot_flex_sm90.py")
SM90_MAX_SHARED = 232448
(KV_CFG, Q_CFG) = FLEX_BWD_CONFIGS[("sm90", 128)]
CASES = {"fwd": FLEX_FWD_CONFIGS[("sm90", 128)], "fwd-tma": FLEX_FWD_CONFIGS[("sm90", 128)], "dkdv": KV_CFG,
         "dq": Q_CFG}
# warp-group dots per kernel: two per loop (QK^T, PV), dK/dV four, dQ three; two loops (partial, full blocks)
DOTS = {"fwd": 4, "fwd-tma": 4, "dkdv": 8, "dq": 6}
MAX_SPILL_BYTES = {"fwd": 0, "fwd-tma": 0, "dkdv": 256, "dq": 64}


@pytest.mark.parametrize("which", sorted(CASES))
def test_flex_kernel_compiles_for_sm90(tmp_path, which):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).parents[1] / "src"), env.get("PYTHONPATH", "")])
    bm, bn, warps, stages = CASES[which]
    res = subprocess.run([sys.executable, str(SCRIPT), which.removesuffix("-tma"), str(bm), str(bn), str(warps),
                          str(stages), str(int(which.endswith("-tma")))],
                         capture_output=True, text=True, env=env, timeout=600, cwd=SCRIPT.parent)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    f = res.stdout.split()
    fields = {k: int(v) for k, v in zip(f[::2], f[1::2])}
    assert fields["WGMMA"] == DOTS[which]
    assert fields["SHARED"] <= SM90_MAX_SHARED
    assert fields["SPILL_STORES"] <= MAX_SPILL_BYTES[which], f"{which}: {fields['SPILL_STORES']} bytes of spills"
