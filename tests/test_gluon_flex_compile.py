"""The Gluon flex forward (kernels/gluon_flex_fwd.py) compiles for sm_90 through ptxas with generated mods, at each
head dim's table config: no spills, no serialised wgmma, shared memory within sm_90's limit, and the overlap it was
written for in the SASS (a key tile's exp2 executing under in-flight wgmmas). Mods: a learned bias table under a
causal mask (the heaviest: a gather per score), a softcap (tanh on every score), a causal mask alone, document ids
read from a captured tensor; the ragged-length build (index bounds, end masks) for the heaviest. No GPU needed."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from flashtile.kernels.gluon_flex_fwd import GLUON_FLEX_FWD_CONFIGS

SCRIPT = pathlib.Path(__file__).with_name("aot_gluon_flex.py")
SM90_MAX_SHARED = 232448


def _specs():
    specs = []
    for d, (bm, bn, nb, warps) in GLUON_FLEX_FWD_CONFIGS.items():
        cfg = f"{d},{bm},{bn},{nb},{warps}"
        specs += [f"rel_bias,{cfg},1", f"rel_bias,{cfg},0"]
        if d == 128:
            specs += [f"{mods},{cfg},1" for mods in ("softcap", "causal", "document")]
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
        assert b["spill"] == 0, f"{b['tag']}: {b['spill']} bytes of spills"
        assert 0 < b["shared"] <= SM90_MAX_SHARED, b


def test_the_softmax_runs_under_the_tensor_cores(builds):
    # a key tile is BLOCK_M x BLOCK_N scores over the CTA's threads; every one of their exp2 should issue while a
    # wgmma is in flight (the d = 128 builds measured a whole tile, 32 or 34 with the row's alpha)
    for b in builds:
        d = int(b["tag"].split("_d")[1].split("_")[0])
        bm, bn, _, warps = GLUON_FLEX_FWD_CONFIGS[d]
        assert b["ex2"] >= bm * bn // (32 * warps), f"{b['tag']}: {b['ex2']} exp2 under a wgmma"
