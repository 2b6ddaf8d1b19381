"""The Gluon MLA decode kernel compiles for Hopper (sm_90) through ptxas at its launch config: shared memory
within sm_90's limit, no spills, its wgmmas issued unserialised (a score block: 4 + 2 x 16 k-steps of q . k and
qv . v; the output: 2 halves x BLOCK_N / 16), contiguous and paged, split and causal builds."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from flashtile.kernels.gluon_decode_mla import GLUON_MLA_CONFIGS

SCRIPT = pathlib.Path(__file__).with_name("aot_gluon_mla.py")
SM90_MAX_SHARED = 232448
CONFIGS = [(c["BLOCK_N"], c["NUM_BUFFERS"]) for c in GLUON_MLA_CONFIGS]


@pytest.mark.parametrize("splits,paged,causal", [(1, 0, 0), (4, 1, 0), (1, 0, 1)],
                         ids=["contiguous", "paged-split", "causal"])
@pytest.mark.parametrize("BN,NB", CONFIGS, ids=[f"{bn}x{nb}" for bn, nb in CONFIGS])
def test_gluon_mla_compiles_for_sm90(tmp_path, splits, paged, causal, BN, NB):
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parents[1] / "src"), str(SCRIPT.parent), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), str(BN), str(NB), str(splits), str(paged),
                          str(causal)], capture_output=True, text=True, env=env, timeout=600)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["shared"] <= SM90_MAX_SHARED, got
    assert got["spill_bytes"] == 0, got
    assert not got["serialized"], got
    assert got["hgmma"] == 4 + 2 * 16 + 2 * BN // 16, got
