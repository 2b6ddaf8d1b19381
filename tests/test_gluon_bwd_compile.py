"""The Gluon backward kernels (dK/dV: kernels/gluon_bwd.py, dQ: kernels/gluon_bwd_dq.py) must compile
for sm_90 through ptxas for every config of their tables, plain and causal: no spills, no serialised
wgmma, shared memory within 227 KiB, the exponentials of a step running while wgmmas are in flight
(in the SASS, at least half of a step's MUFU.EX2 sit between an HGMMA and the WARPGROUP.DEPBAR that
waits for it), and no wgmma reading an operand from registers. No GPU needed."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("aot_gluon_bwd.py")
SM90_MAX_SHARED = 232448


def _cases():
    """(dtype, d, causal, config, kernel) per compile."""
    from flashtile.kernels.gluon_bwd import BWD_DKDV_CONFIGS, CONFIG_KEYS
    from flashtile.kernels.gluon_bwd_dq import BWD_DQ_CONFIGS

    cases = []
    for which, table in (("dkdv", BWD_DKDV_CONFIGS), ("dq", BWD_DQ_CONFIGS)):
        for d, cfg in table.items():
            cfg = [cfg[key] for key in CONFIG_KEYS[:4]] + ([cfg["WARPS_N"]] if "WARPS_N" in cfg else [])
            cases += [("bf16", d, causal, cfg, which) for causal in (False, True)]
        cases.append(("fp16", 128, True, [table[128][key] for key in CONFIG_KEYS[:4]], which))
    return cases


def _exp2_under_mma(sass: str) -> int:
    """The most MUFU.EX2 found between an HGMMA and the next WARPGROUP.DEPBAR."""
    best = run = 0
    in_flight = False
    for line in sass.splitlines():
        if "HGMMA" in line:
            in_flight, run = True, 0
        elif "WARPGROUP.DEPBAR" in line:
            best, in_flight = max(best, run), False
        elif in_flight and "MUFU.EX2" in line:
            run += 1
    return best


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    pytest.importorskip("triton.experimental.gluon")
    out = tmp_path_factory.mktemp("gluon_bwd")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(out / "cache")
    res = subprocess.run([sys.executable, str(SCRIPT), str(out), json.dumps(_cases())], capture_output=True,
                         text=True, env=env, timeout=900)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    return out, [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def test_every_config_compiles_without_spills(compiled):
    _, rows = compiled
    assert len(rows) == len(_cases())
    for row in rows:
        assert row["spill_bytes"] == 0, row
        assert not row["serialized"], row
        assert row["shared"] <= SM90_MAX_SHARED, row


def test_exponentials_run_under_inflight_wgmma(compiled):
    out, rows = compiled
    for (_, _, _, cfg, _), row in zip(_cases(), rows):
        bm, bn, _, nw = cfg[:4]
        per_thread = bm * bn // (32 * nw)  # one step's exponentials per thread
        sass = (out / f"{row['tag']}.sass").read_text()
        assert _exp2_under_mma(sass) >= per_thread // 2, (row["tag"], _exp2_under_mma(sass), per_thread)


def test_no_wgmma_reads_registers(compiled):
    # The first version fed P^T / dS^T to the dV / dK wgmmas from registers, and ptxas rewrote those
    # registers with the next step's values while the wgmmas were still in flight (causal build,
    # wrong gradients on the H200). Every operand now comes from shared memory: an HGMMA whose A
    # operand is a register ("HGMMA... Rd, Ra, gdesc") would bring the hazard back.
    out, rows = compiled
    for row in rows:
        sass = (out / f"{row['tag']}.sass").read_text()
        register_a = [line.strip() for line in sass.splitlines() if re.search(r"HGMMA\S* R\d+, R\d+, gdesc", line)]
        assert not register_a, (row["tag"], register_a[:3])



def test_plain_order_candidates_compile_unserialised(tmp_path):
    # scripts/tune_gluon_bwd.py's ROTATED = 0 candidates (64-row steps, every product waited for in
    # its step): an in-flight product across steps made ptxas serialise the wgmmas, this order must not
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    cases = [["bf16", 128, False, [64, 64, 2, 4, 1, 0]], ["bf16", 64, True, [64, 64, 2, 4, 1, 0]]]
    res = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), json.dumps(cases)], capture_output=True,
                         text=True, env=env, timeout=900)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    for row in rows:
        assert not row["serialized"] and row["spill_bytes"] == 0 and row["shared"] <= SM90_MAX_SHARED, row
