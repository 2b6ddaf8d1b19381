"""The Gluon paged-decode kernel (kernels/gluon_decode_paged.py, FLASHTILE_DECODE_GLUON_PAGED=1) must compile
for sm_90 through ptxas with each page size, head dim and dtype the launcher sends it (each at least once,
with and without programmatic dependent launch), fit shared memory, not spill, and issue one TMA copy per
page of K and of V where the Triton kernel gathers per key. No GPU needed: the compile runs in a subprocess
(TRITON_INTERPRET must be unset there); this file run as a script compiles the case named on its command
line."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

SM90_MAX_SHARED = 232448  # 227 KiB


def _compile(page: int, d: int, dtype: str, splits: int, pdl: bool, out: pathlib.Path) -> dict:
    import triton.experimental.gluon.language as gl

    from flashtile.backends.triton import gluon_decode as launcher
    from flashtile.kernels.gluon_decode_paged import _gluon_paged_decode_kernel
    from gluon_aot import compile_for_sm90

    gl_dtype = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for([page, d], gl_dtype)
    desc = f"tensordesc<{dtype}[{page},{d}],{layout!r}>"
    types = dict(Q=f"*{dtype}", O=f"*{dtype}", LSE="*fp32", O_PART="*fp32", LSE_PART="*fp32", SEQLENS="*i32",
                 BLOCK_TABLE="*i32", qk_scale="fp32", desc_k=desc, desc_v=desc)
    constexprs = dict(HEAD_DIM=d, BLOCK_M=launcher.BLOCK_M, BLOCK_N=launcher.BLOCK_N, PAGE=page,
                      NUM_BUFFERS=launcher.NUM_BUFFERS, NUM_SPLITS=splits, USE_PDL=pdl)
    tag = f"p{page}_d{d}_{dtype}_s{splits}_pdl{int(pdl)}"
    row = compile_for_sm90(_gluon_paged_decode_kernel, constexprs, types, 4, out, tag)
    sass = (out / f"{tag}.sass").read_text()
    ptx = (out / f"{tag}.ptx").read_text()
    return dict(shared=row["shared"], log=row["ptxas_log"], tma=sass.count("UTMALDG"), hgmma=sass.count("HGMMA"),
                gdc=[ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")])


@pytest.mark.parametrize("page,d,dtype,splits,pdl", [(16, 128, "bf16", 16, True), (32, 128, "bf16", 1, True),
                                                    (64, 64, "fp16", 4, False), (16, 64, "bf16", 1, False)])
def test_gluon_paged_decode_compiles_for_sm90(tmp_path, page, d, dtype, splits, pdl):
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).parent), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, __file__, str(tmp_path), json.dumps([page, d, dtype, splits, pdl])],
                         capture_output=True, text=True, env=env, timeout=900)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    row = json.loads(res.stdout.strip().splitlines()[-1])
    assert row["shared"] <= SM90_MAX_SHARED, row["shared"]
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", row["log"]), row["log"]
    assert "serializ" not in row["log"].lower(), row["log"]
    # every page box of K and V is a TMA copy: (NUM_BUFFERS prologue tiles + the refill) x pages x 2
    from flashtile.backends.triton import gluon_decode as launcher

    pages = launcher.BLOCK_N // page
    assert row["tma"] == (launcher.NUM_BUFFERS + 1) * pages * 2, row
    # one warp-group MMA per 16 of d for QK^T, per 16 keys for PV
    assert row["hgmma"] == d // 16 + launcher.BLOCK_N // 16, row
    # programmatic dependent launch: one wait, one signal; none otherwise
    assert row["gdc"] == ([1, 1] if pdl else [0, 0]), row


if __name__ == "__main__":
    folder, spec = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps(_compile(*spec, pathlib.Path(folder))))
