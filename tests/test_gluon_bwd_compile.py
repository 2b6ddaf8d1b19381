"""The Gluon dK/dV kernel (kernels/gluon_bwd.py) must compile for sm_90 through ptxas for every config of
its table, plain and causal: no spills, no serialised
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


def _table_config(cfg: dict, keys) -> list:
    """A table entry as the compile helper's list: BLOCK_M, BLOCK_N, NUM_BUFFERS, num_warps, then
    WARPS_N and ROTATED (the kernel defaults where the entry leaves them out)."""
    return [cfg[key] for key in keys[:4]] + [cfg.get("WARPS_N", 1), int(cfg.get("ROTATED", 1))]


def _cases():
    """(dtype, d, causal, config, kernel) per compile."""
    from flashtile.kernels.gluon_bwd import BWD_DKDV_CONFIGS, CONFIG_KEYS

    cases = []
    for d, cfg in BWD_DKDV_CONFIGS.items():
        cases += [("bf16", d, causal, _table_config(cfg, CONFIG_KEYS), "dkdv") for causal in (False, True)]
    cases.append(("fp16", 128, True, _table_config(BWD_DKDV_CONFIGS[128], CONFIG_KEYS), "dkdv"))
    return cases


def _rotated(case) -> bool:
    return bool(case[3][5])


# The plain order at d = 128 causal spills 24 bytes (ptxas -v); it measured the fastest config anyway
# (docs/gluon.md, "The backward's dK/dV kernel"). Every other build must not spill.
SPILL_ALLOWANCE = {("dkdv", 128, True, False): 24}


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


def _compile_cases(out, cases) -> list:
    """Compile the cases for sm_90 in a subprocess (TRITON_INTERPRET unset there): one row each."""
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(out / "cache")
    res = subprocess.run([sys.executable, str(SCRIPT), str(out), json.dumps(cases)], capture_output=True,
                         text=True, env=env, timeout=900)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(cases)
    return rows


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("gluon_bwd")
    return out, _compile_cases(out, _cases())


def test_every_config_compiles_without_spills(compiled):
    _, rows = compiled
    assert len(rows) == len(_cases())
    for case, row in zip(_cases(), rows):
        _, d, causal, _, which = case
        assert row["spill_bytes"] <= SPILL_ALLOWANCE.get((which, d, causal, _rotated(case)), 0), row
        assert not row["serialized"], row
        assert row["shared"] <= SM90_MAX_SHARED, row


def test_exponentials_run_under_inflight_wgmma(compiled):
    # the rotated schedule's point (the plain order waits for every product within its step and
    # overlaps through a second CTA or warpgroup instead, so it is not checked here)
    out, rows = compiled
    for case, row in zip(_cases(), rows):
        if not _rotated(case):
            continue
        cfg = case[3]
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


def test_other_schedule_compiles_unserialised(tmp_path):
    # scripts/tune_gluon_bwd.py's candidates in the schedule the table does not take: the rotated one
    # at d = 128, the plain order at d = 64. An in-flight product across steps once made ptxas serialise
    # the wgmmas; neither build may.
    cases = [["bf16", 128, True, [32, 64, 4, 4, 1, 1]], ["bf16", 64, True, [64, 64, 2, 4, 1, 0]]]
    rows = _compile_cases(tmp_path, cases)
    assert len(rows) == 2
    for row in rows:
        assert not row["serialized"] and row["spill_bytes"] == 0 and row["shared"] <= SM90_MAX_SHARED, row


def test_table_builds_carry_no_griddepcontrol(compiled):
    _, rows = compiled
    assert all(row["gdc_launch"] == 0 for row in rows), [row["tag"] for row in rows if row["gdc_launch"]]


def test_launch_dependents_builds(tmp_path):
    # attn_bwd.use_bwd_pdl: the table's d = 128 / 256 dK/dV builds signal the dQ
    # kernel's programmatic dependent launch once, at their start, and stay unserialised
    pytest.importorskip("triton.experimental.gluon")
    from flashtile.kernels.gluon_bwd import BWD_DKDV_CONFIGS, CONFIG_KEYS

    cases = [["bf16", d, causal, _table_config(BWD_DKDV_CONFIGS[d], CONFIG_KEYS) + [1]]
             for d in (128, 256) for causal in (False, True)]
    rows = _compile_cases(tmp_path, cases)
    assert len(rows) == 4
    for row in rows:
        assert row["gdc_launch"] == 1 and not row["serialized"] and row["shared"] <= SM90_MAX_SHARED, row


@pytest.mark.parametrize("d", [128, 192])
def test_sliding_window_builds_compile_without_spills(tmp_path, d):
    # LOCAL: the causal mask gains the window's left edge and the query range stops window_left past the block
    from flashtile.kernels.gluon_bwd import BWD_DKDV_CONFIGS, CONFIG_KEYS

    cfg = _table_config(BWD_DKDV_CONFIGS[d], CONFIG_KEYS) + [0, 1]
    row, = _compile_cases(tmp_path, [["bf16", d, True, cfg]])
    assert row["shared"] <= SM90_MAX_SHARED and not row["serialized"], row
    assert row["spill_bytes"] <= SPILL_ALLOWANCE.get(("dkdv", d, True, False), 0), row


@pytest.mark.parametrize("d", [128, 192])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_builds_compile_without_spills(tmp_path, d, causal):
    # VARLEN: an early exit for key blocks past the sequence, a row-by-row store for a block ending past it
    from flashtile.kernels.gluon_bwd import BWD_DKDV_CONFIGS, CONFIG_KEYS

    cfg = _table_config(BWD_DKDV_CONFIGS[d], CONFIG_KEYS) + [0, 0, 1]
    row, = _compile_cases(tmp_path, [["bf16", d, causal, cfg]])
    assert row["shared"] <= SM90_MAX_SHARED and not row["serialized"], row
    assert row["spill_bytes"] <= SPILL_ALLOWANCE.get(("dkdv", d, causal, False), 0), row


# softcap keeps tanh's value live beside P^T for dS^T: the d = 128 causal build spills 84 bytes (the plain causal
# build 24); whether it still beats the Triton dK/dV is for scripts/ab_routes.py --softcaps to say
SOFTCAP_SPILL_ALLOWANCE = {(128, True): 84}


@pytest.mark.parametrize("d", [128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_builds_compile(tmp_path, d, causal):
    from flashtile.kernels.gluon_bwd import BWD_DKDV_CONFIGS, CONFIG_KEYS

    cfg = _table_config(BWD_DKDV_CONFIGS[d], CONFIG_KEYS) + [0, 0, 0, 1]
    row, = _compile_cases(tmp_path, [["bf16", d, causal, cfg]])
    assert row["shared"] <= SM90_MAX_SHARED and not row["serialized"], row
    assert row["spill_bytes"] <= SOFTCAP_SPILL_ALLOWANCE.get((d, causal), 0), row


# ALIBI (causal): the key's part of slope * (key - row) is one add per score, the row's part joins the row's lse
# term. ptxas -v at the table configs: d = 128 spills 16 bytes alone (below the plain causal build's 24), 12 with a
# window in packed sequences (0 without ALiBi) and 124 with a softcap (softcap alone: 84), all at the 255 registers
# the plain causal d = 128 build already uses; whether they still beat the Triton dK/dV is for
# scripts/ab_routes.py --alibi to say. d = 192 / 256 do not spill.
ALIBI_SPILL_ALLOWANCE = {(128, "alibi"): 16, (128, "softcap"): 124, (128, "window_varlen"): 12}
# the flags after ROTATED: LAUNCH_DEPENDENTS, LOCAL, VARLEN, SOFTCAP, ALIBI
ALIBI_VARIANTS = {"alibi": [0, 0, 0, 0, 1], "softcap": [0, 0, 0, 1, 1], "window_varlen": [0, 1, 1, 0, 1]}


@pytest.mark.parametrize("d", [128, 192, 256])
def test_alibi_builds_compile(tmp_path, d):
    from flashtile.kernels.gluon_bwd import BWD_DKDV_CONFIGS, CONFIG_KEYS

    cfg = _table_config(BWD_DKDV_CONFIGS[d], CONFIG_KEYS)
    rows = _compile_cases(tmp_path, [["bf16", d, True, cfg + flags] for flags in ALIBI_VARIANTS.values()])
    for name, row in zip(ALIBI_VARIANTS, rows):
        assert row["shared"] <= SM90_MAX_SHARED and not row["serialized"], (name, row)
        assert row["spill_bytes"] <= ALIBI_SPILL_ALLOWANCE.get((d, name), 0), (name, row)
        sass = (tmp_path / f"{row['tag']}.sass").read_text()
        assert not re.search(r"HGMMA\S* R\d+, R\d+, gdesc", sass), (name, row["tag"])


# d = 128's causal build sits at 255 registers and spills 24 bytes; the shift's scalar costs it 8 more
UNEQUAL_EXTRA_SPILL = {128: 8}


@pytest.mark.parametrize("d", [128, 192, 256])
def test_unequal_lengths_build_compiles(tmp_path, d):
    # UNEQUAL: the key block's first key in query-row coordinates, one subtraction before the loop; the build
    # must cost nothing the causal one does not (spills included), causal and with a window
    from flashtile.kernels.gluon_bwd import BWD_DKDV_CONFIGS, CONFIG_KEYS

    cfg = _table_config(BWD_DKDV_CONFIGS[d], CONFIG_KEYS)
    flags = ([], [0, 0, 0, 0, 0, 1], [0, 1, 0, 0, 0, 1])  # plain causal, UNEQUAL, UNEQUAL with LOCAL
    plain, unequal, window = _compile_cases(tmp_path, [["bf16", d, True, cfg + f] for f in flags])
    for row in (unequal, window):
        assert row["shared"] <= SM90_MAX_SHARED and not row["serialized"], row
        assert row["spill_bytes"] <= plain["spill_bytes"] + UNEQUAL_EXTRA_SPILL.get(d, 0), (row, plain)


VARLEN_K_EXTRA_SPILL = {128: 12}


@pytest.mark.parametrize("d", [128, 192, 256])
def test_varlen_k_builds_compile(tmp_path, d):
    # VARLEN_K: packed k with sequences of its own (its start and length read before the loop and again after it).
    # ptxas -v at d = 128 (255 registers): 16 / 12 bytes of spill non-causal / causal (the plain causal build 24),
    # 4 / 96 with a softcap (packed sequences with a softcap, causal: 84); d = 192 / 256 do not spill
    from flashtile.kernels.gluon_bwd import BWD_DKDV_CONFIGS, CONFIG_KEYS

    cfg = _table_config(BWD_DKDV_CONFIGS[d], CONFIG_KEYS)
    # flags after ROTATED: LAUNCH_DEPENDENTS, LOCAL, VARLEN, SOFTCAP, ALIBI, UNEQUAL, VARLEN_K
    cases = [["bf16", d, causal, cfg + [0, 0, 1, cap, 0, 0, 1]] for causal in (False, True) for cap in (0, 1)]
    plain_causal, = _compile_cases(tmp_path, [["bf16", d, True, cfg]])
    for (*_, c), row in zip(cases, _compile_cases(tmp_path, cases)):
        assert row["shared"] <= SM90_MAX_SHARED and not row["serialized"], row
        allowed = SOFTCAP_SPILL_ALLOWANCE.get((d, True), 0) if c[-4] else plain_causal["spill_bytes"]
        assert row["spill_bytes"] <= allowed + VARLEN_K_EXTRA_SPILL.get(d, 0), (row, plain_causal)


# FUSED_DQ (config.gluon_fused_dq): the dK/dV kernel adds each step's dQ^T = K^T dS^T by TMA reduce-add, no dQ
# kernel. Flags after ROTATED: LAUNCH_DEPENDENTS, LOCAL, VARLEN, SOFTCAP, ALIBI, UNEQUAL, VARLEN_K, FUSED_DQ.
FUSED_VARIANTS = {
    "plain": (False, [0, 0, 0, 0, 0, 0, 0, 1]),
    "causal": (True, [0, 0, 0, 0, 0, 0, 0, 1]),
    "causal_window_varlen": (True, [0, 1, 1, 0, 0, 0, 0, 1]),
    "causal_softcap_alibi": (True, [0, 0, 0, 1, 1, 0, 0, 1]),
    "varlen": (False, [0, 0, 1, 0, 0, 0, 0, 1]),  # non-causal builds mask the keys past the sequence
    "varlen_own_k": (False, [0, 0, 1, 0, 0, 0, 1, 1]),
    "unequal": (True, [0, 0, 0, 0, 0, 1, 0, 1]),
}


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_fused_dq_builds_compile(tmp_path, d):
    # every feature without spills or serialised wgmma, one reduce-add a step; d = 64 / 128 keep two CTAs an SM (the
    # overlap the plain order counts on)
    from flashtile.kernels.gluon_bwd import BWD_FUSED_CONFIGS, CONFIG_KEYS

    cfg = _table_config(BWD_FUSED_CONFIGS[d], CONFIG_KEYS)
    # every feature where the fused build carries it past the split kernel's coverage (d = 64: the split's config is
    # rotated) or sits near the register limit (d = 128; d = 64 with a softcap and ALiBi reaches 255)
    names = {64: list(FUSED_VARIANTS), 128: list(FUSED_VARIANTS),
             192: ["plain", "causal_softcap_alibi", "varlen_own_k"], 256: ["plain", "causal"]}[d]
    rows = _compile_cases(tmp_path, [["bf16", d, FUSED_VARIANTS[n][0], cfg + FUSED_VARIANTS[n][1]] for n in names])
    for name, row in zip(names, rows):
        assert row["spill_bytes"] == 0 and not row["serialized"], (name, row)
        # one reduce-add a step, two where the head dim is split (192 = 128 + 64)
        assert row["tma_reduce"] == (2 if d == 192 else 1) and row["gdc_launch"] == 0, (name, row)
        assert row["shared"] <= (SM90_MAX_SHARED // 2 if d <= 128 else SM90_MAX_SHARED), (name, row)


def test_unfused_builds_carry_no_reduce(compiled):
    _, rows = compiled
    assert all(row["tma_reduce"] == 0 for row in rows), [row["tag"] for row in rows if row["tma_reduce"]]
