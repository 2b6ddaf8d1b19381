"""The Gluon Hopper forward kernel must compile for sm_90 through ptxas, fit shared memory, and keep
the intra-warpgroup overlap it was written for all the way down to SASS. No GPU needed.

The compile runs in a subprocess (TRITON_INTERPRET must be unset there): this file run as a script
compiles the configs named on its command line and writes TTGIR, ptxas's log and SASS to a folder.
The checks, in order of how close they are to the hardware:
  * TTGIR: inside the key loop the QK^T wgmma of block j+1 is issued (async) before the softmax
    exp2 of block j with no wgmma wait in between, and the PV wgmma is still in flight at the back
    edge (its result goes into scf.yield unwaited);
  * ptxas: no "wgmma ... serialized" performance warning (C7514 and friends: ptxas then waits
    after every wgmma, whatever the source says), no spills;
  * SASS: tens of MUFU.EX2 (the softmax) execute between an HGMMA and the next
    WARPGROUP.DEPBAR that waits for it.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

SM90_MAX_SHARED = 232448  # 227 KiB, the most one block may allocate on sm_90
CONFIGS = [(64, False), (128, True)]
# a 128 x 128 score tile over 256 threads is 64 exponentials per thread and block; ask for half
MIN_OVERLAPPED_EX2 = 32


def _compile(d: int, causal: bool, out: pathlib.Path) -> dict:
    import triton
    import triton.experimental.gluon.language as gl
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from flashtile.kernels.gluon_fwd import _gluon_attn_fwd_kernel as kernel
    from flashtile.kernels.gluon_fwd import fwd_config

    cfg = fwd_config(d, causal)

    def desc(rows):  # what the JIT derives from a host-side gluon TensorDescriptor
        layout = gl.NVMMASharedLayout.get_default_for([1, rows, 1, d], gl.bfloat16)
        return f"tensordesc<bf16[1,{rows},1,{d}],{layout!r}>"

    constexprs = dict(HEAD_DIM=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], NUM_BUFFERS=cfg["NUM_BUFFERS"],
                      CAUSAL=causal)
    types = dict(desc_q=desc(cfg["BLOCK_M"]), desc_k=desc(cfg["BLOCK_N"]), desc_v=desc(cfg["BLOCK_N"]),
                 desc_o=desc(cfg["BLOCK_M"]), LSE="*fp32", qk_scale="fp32")
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            consts[(i,)] = constexprs[name]
        else:
            sig[name] = types.get(name, "i32")
        if sig[name].startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(GluonASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=cfg["num_warps"]))
    tag = f"d{d}_{'causal' if causal else 'full'}"
    (out / f"{tag}.ttgir").write_text(compiled.asm["ttgir"])
    (out / f"{tag}.sass").write_text(compiled.asm["sass"])
    # Triton drops ptxas's log on success: run ptxas again on the same PTX for it
    ptx = out / f"{tag}.ptx"
    ptx.write_text(compiled.asm["ptx"])
    cmd = [knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(out / f"{tag}.cubin")]
    log = subprocess.run(cmd, capture_output=True, text=True, check=True)
    (out / f"{tag}.ptxas.log").write_text(log.stdout + log.stderr)
    return dict(tag=tag, shared=compiled.metadata.shared)


def _loop_bodies(ttgir: str) -> list[list[str]]:
    """The lines of every scf.for body (the printer indents a region two spaces past its op)."""
    lines, bodies = ttgir.splitlines(), []
    for i, line in enumerate(lines):
        if "scf.for" in line:
            indent = len(line) - len(line.lstrip())
            end = next(k for k in range(i + 1, len(lines))
                       if lines[k].strip().startswith("}") and len(lines[k]) - len(lines[k].lstrip()) == indent)
            bodies.append(lines[i + 1:end])
    return bodies


def _check_ttgir_overlap(ttgir: str) -> None:
    bodies = _loop_bodies(ttgir)
    assert bodies, "no key loop in the TTGIR"
    for body in bodies:
        ops = [("dot" if "ttng.warp_group_dot " in ln else "wait" if "ttng.warp_group_dot_wait" in ln
                else "exp2" if "math.exp2" in ln else "yield" if "scf.yield" in ln else None, ln) for ln in body]
        ops = [(kind, ln) for kind, ln in ops if kind]
        kinds = [kind for kind, _ in ops]
        assert kinds.count("dot") == 2, f"expected QK^T and PV wgmmas in the loop, got {kinds}"
        first_dot, first_exp = kinds.index("dot"), kinds.index("exp2")
        # QK^T of the next block is issued before this block's softmax, and nothing waits for it first
        assert first_dot < first_exp and "wait" not in kinds[first_dot:first_exp], kinds
        assert "isAsync = true" in ops[first_dot][1]
        # PV is the last wgmma and nothing waits for it before the back edge
        last_dot = len(kinds) - 1 - kinds[::-1].index("dot")
        assert "wait" not in kinds[last_dot:], kinds
        pv = re.match(r"\s*(%[\w#]+) = ttng.warp_group_dot ", ops[last_dot][1]).group(1)
        assert pv in ops[-1][1] and kinds[-1] == "yield", "PV's in-flight result must be loop-carried"


def _max_ex2_under_wgmma(sass: str) -> int:
    """The most MUFU.EX2 executed between an HGMMA and the WARPGROUP.DEPBAR after it (straight-line
    order of the listing; the loops keep their body contiguous)."""
    best, in_flight, count = 0, False, 0
    for line in sass.splitlines():
        if "HGMMA" in line:
            in_flight = True
        elif "WARPGROUP.DEPBAR" in line:
            best, in_flight, count = max(best, count), False, 0
        elif "MUFU.EX2" in line and in_flight:
            count += 1
    return best


def _ptxas_ok(log: str) -> None:
    assert "serialized" not in log, f"ptxas serialised the wgmma pipeline:\n{log}"
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log), f"register spills:\n{log}"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    pytest.importorskip("triton.backends.nvidia")
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    out = tmp_path_factory.mktemp("gluon_sm90")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(out / "cache")
    args = [f"{d}:{int(causal)}" for d, causal in CONFIGS]
    res = subprocess.run([sys.executable, __file__, str(out), *args], capture_output=True, text=True, env=env,
                         timeout=600)
    if res.returncode != 0 and ("ptxas" in res.stderr or "cuobjdump" in res.stderr) and "not found" in res.stderr:
        pytest.skip("no ptxas / cuobjdump in this triton install")
    assert res.returncode == 0, res.stderr[-4000:]
    summary = {r["tag"]: r for r in json.loads(res.stdout.strip().splitlines()[-1])}
    return out, summary


@pytest.mark.parametrize("d,causal", CONFIGS, ids=[f"d{d}-{'causal' if c else 'full'}" for d, c in CONFIGS])
def test_gluon_fwd_compiles_for_sm90_with_overlap(compiled, d, causal):
    out, summary = compiled
    tag = f"d{d}_{'causal' if causal else 'full'}"
    shared = summary[tag]["shared"]
    assert shared <= SM90_MAX_SHARED, f"{tag} needs {shared} bytes of shared memory"
    _check_ttgir_overlap((out / f"{tag}.ttgir").read_text())
    _ptxas_ok((out / f"{tag}.ptxas.log").read_text())
    ex2 = _max_ex2_under_wgmma((out / f"{tag}.sass").read_text())
    assert ex2 >= MIN_OVERLAPPED_EX2, f"only {ex2} exp2 run while a wgmma is in flight: the softmax is not overlapped"


def test_overlap_checks_catch_a_serialised_kernel():
    # the SASS check must fail on the shape of a non-overlapped loop: wait right after the MMA
    sass = "\n".join(["HGMMA.64x128x16.F32.BF16 R88", "WARPGROUP.DEPBAR.LE gsb0, 0x0"] + ["MUFU.EX2 R1, R1"] * 64)
    assert _max_ex2_under_wgmma(sass) == 0
    with pytest.raises(AssertionError):
        _ptxas_ok("ptxas info : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized")


def _qkv(b=1, s=16, h=2, d=64, dtype=None, sk=None):
    import torch

    dtype = dtype or torch.bfloat16
    sk = s if sk is None else sk
    return (torch.randn(b, s, h, d).to(dtype), torch.randn(b, sk, h, d).to(dtype), torch.randn(b, sk, h, d).to(dtype))


@pytest.mark.parametrize("case,match", [
    (dict(dtype="float16"), "bf16 only"),
    (dict(d=96), "head_dim"),
    (dict(sk=24), "seqlen_q == seqlen_k"),
    (dict(), "CUDA tensors only"),
])
def test_launcher_refuses_unsupported_inputs(case, match):
    import torch

    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd

    if "dtype" in case:
        case = dict(case, dtype=getattr(torch, case["dtype"]))
    q, k, v = _qkv(**case)
    with pytest.raises(ValueError, match=match):
        gluon_attn_fwd(q, k, v, 0.125, causal=False)


if __name__ == "__main__":
    folder = pathlib.Path(sys.argv[1])
    results = []
    for spec in sys.argv[2:]:
        d, causal = spec.split(":")
        results.append(_compile(int(d), causal == "1", folder))
    print(json.dumps(results))
