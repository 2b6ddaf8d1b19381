"""The Gluon flex kernels compile for sm_90 through ptxas with generated mods, at each head dim's table config: the
forward (kernels/gluon_flex_fwd.py) with no spills, no serialised wgmma, shared memory within sm_90's limit, and
the overlap it was written for in the SASS (a key tile's exp2 executing under in-flight wgmmas); the dK/dV kernel
(kernels/gluon_flex_bwd.py, the plain order: every product waited for in its step) and its fused dQ build with
their spills bounded.
Mods: a learned bias table under a causal mask (the heaviest: a gather per score), a softcap (tanh on every
score), a causal mask alone, document ids read from a captured tensor; the ragged-length build (index bounds,
end masks) for the heaviest. No GPU needed."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from flashtile.kernels.gluon_flex_bwd import GLUON_FLEX_BWD_CONFIGS
from flashtile.kernels.gluon_flex_fwd import GLUON_FLEX_FWD_CONFIGS

SCRIPT = pathlib.Path(__file__).with_name("aot_gluon_flex.py")
SM90_MAX_SHARED = 232448
# the dK/dV kernel's dK and dV accumulators take half the register file: a softcap or the learned table's gather
# and atomic gradient spill a little there (16 / 64 bytes at 32 x 64); a tile change that spills more fails here
MAX_DKDV_SPILL = 64
# the fused dQ build (dkdvq) holds a step's dQ^T tile beside them: 60-120 bytes with these mods (ptxas -v)
MAX_FUSED_SPILL = 128


def _specs():
    specs = []
    for kind, table in (("fwd", GLUON_FLEX_FWD_CONFIGS), ("dkdv", GLUON_FLEX_BWD_CONFIGS)):
        for d, (bm, bn, nb, warps) in table.items():
            cfg = f"{d},{bm},{bn},{nb},{warps}"
            specs += [f"{kind},rel_bias,{cfg},1", f"{kind},rel_bias,{cfg},0"]
            specs += [f"{kind},{mods},{cfg},1" for mods in ("softcap", "causal", "document")]
    for d, (bm, bn, nb, warps) in GLUON_FLEX_BWD_CONFIGS.items():
        cfg = f"{d},{bm},{bn},{nb},{warps}"
        specs += [f"dkdvq,rel_bias,{cfg},1", f"dkdvq,softcap,{cfg},0", f"dkdvq,document,{cfg},1"]
    return specs


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    pytest.importorskip("triton.backends.nvidia")
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    out = tmp_path_factory.mktemp("gluon_flex")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(out / "cache")
    env["XDG_CACHE_HOME"] = str(out / "xdg")
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).parents[1] / "src"), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, str(SCRIPT), str(out), *_specs()], capture_output=True, text=True, env=env,
                         timeout=1200, cwd=SCRIPT.parent)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def test_every_config_and_mod_compiles(builds):
    assert len(builds) == len(_specs())
    for b in builds:
        assert not b["serialized"], f"{b['tag']}: ptxas serialised the wgmma pipeline"
        kind = b["tag"].split("_")[0]
        most = dict(fwd=0, dkdv=MAX_DKDV_SPILL, dkdvq=MAX_FUSED_SPILL)[kind]
        assert 0 <= b["spill"] <= most, f"{b['tag']}: {b['spill']} bytes of spills"
        assert 0 < b["shared"] <= SM90_MAX_SHARED, b
        # the fused build adds dQ by TMA reduce-add in both list walks (partly, fully visible); no other build does
        assert b["tma_reduce"] == (2 if kind == "dkdvq" else 0), b


def test_the_softmax_runs_under_the_tensor_cores(builds):
    # a key tile is BLOCK_M x BLOCK_N scores over the CTA's threads; every one of their exp2 should issue while a
    # wgmma is in flight (the d = 128 builds measured a whole tile, 32 or 34 with the row's alpha)
    for b in (b for b in builds if b["tag"].startswith("fwd")):
        d = int(re.search(r"_d(\d+)_m", b["tag"]).group(1))
        bm, bn, _, warps = GLUON_FLEX_FWD_CONFIGS[d]
        assert b["ex2"] >= bm * bn // (32 * warps), f"{b['tag']}: {b['ex2']} exp2 under a wgmma"
