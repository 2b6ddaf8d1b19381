"""Compile a Gluon kernel for sm_90 without a GPU and keep what the compile tests read: TTGIR, SASS
and ptxas's -v log. Shared by tests/test_gluon_compile.py and tests/aot_gluon_bwd.py (both run it in
a subprocess with TRITON_INTERPRET unset)."""

import pathlib
import subprocess


def compile_for_sm90(kernel, constexprs: dict, types: dict, num_warps: int, out: pathlib.Path, tag: str,
                     aligned_ints: tuple[str, ...] = (), **options) -> dict:
    """Constexprs not given take their defaults; other arguments not in constexprs take their type
    from types, else i32; pointers, and integers whose names start with one of ``aligned_ints``, are marked
    16-divisible, as the JIT specialises aligned tensors and strides. Writes <tag>.ttgir / .sass / .ptx /
    .ptxas.log under out; returns dict(tag, shared, ptxas_log, sass)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        param = kernel.params[i]
        if name not in constexprs and param.is_constexpr and param.default is not inspect.Parameter.empty:
            constexprs = dict(constexprs, **{name: param.default})  # e.g. LAUNCH_DEPENDENTS = False
        if name in constexprs:
            sig[name] = "constexpr"
            consts[(i,)] = constexprs[name]
        else:
            sig[name] = types.get(name, "i32")
        if isinstance(sig[name], tuple):  # a tuple of pointers (flex's captured tensors): no alignment claimed
            continue
        if sig[name].startswith("*") or (sig[name] != "constexpr" and name.startswith(aligned_ints)):
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(GluonASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, **options))
    (out / f"{tag}.ttgir").write_text(compiled.asm["ttgir"])
    (out / f"{tag}.sass").write_text(compiled.asm["sass"])
    log = ptxas_log(compiled.asm["ptx"], out, tag)
    return dict(tag=tag, shared=compiled.metadata.shared, ptxas_log=log, sass=compiled.asm["sass"])


def ptxas_log(ptx_text: str, out: pathlib.Path, tag: str, gpu_name: str = "sm_90a") -> str:
    """ptxas -v's log (registers, spills) of a PTX text for ``gpu_name``: Triton drops it on success, so run ptxas
    again on the same PTX. Writes <tag>.ptx / .cubin / .ptxas.log under out."""
    from triton import knobs

    ptx = out / f"{tag}.ptx"
    ptx.write_text(ptx_text)
    cmd = [knobs.nvidia.ptxas.path, "-v", f"--gpu-name={gpu_name}", str(ptx), "-o", str(out / f"{tag}.cubin")]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    log = res.stdout + res.stderr
    (out / f"{tag}.ptxas.log").write_text(log)
    return log


def decode_build_summary(got: dict) -> str:
    """The decode build figures the compile tests read, from compile_for_sm90's result: shared memory, registers,
    spill stores, 16-byte cp.async copies and mma.sync instructions in the SASS, and the CTA barriers between the
    key loop's first copy wait (the last DEPBAR before the first mma: a prologue may wait on copies too) and its
    back edge, and those after the back edge (the epilogue's)."""
    import re

    log, sass = got["ptxas_log"], got["sass"]
    regs, spill = (re.search(pat, log) for pat in (r"Used (\d+) registers", r"(\d+) bytes spill stores"))
    first_mma = sass.find("HMMA")
    loop = sass[sass.rfind("DEPBAR", 0, first_mma if first_mma >= 0 else len(sass)):]
    tail = loop[loop.find("BRA", loop.find("HMMA")):] if "HMMA" in loop else ""
    loop = loop[:loop.find("BRA", loop.find("HMMA"))] if "HMMA" in loop else loop
    return (f"SHARED {got['shared']} REGISTERS {regs.group(1) if regs else -1} "
            f"SPILL_STORES {spill.group(1) if spill else 0} LDGSTS {sass.count('LDGSTS')} HMMA {sass.count('HMMA')} "
            f"LOOP_BARRIERS {loop.count('BAR.SYNC')} TAIL_BARRIERS {tail.count('BAR.SYNC')}")


def max_ex2_under_wgmma(sass: str) -> int:
    """The most MUFU.EX2 executed between an HGMMA / QGMMA and the WARPGROUP.DEPBAR after it (straight-line
    order of the listing; the loops keep their body contiguous)."""
    best, in_flight, count = 0, False, 0
    for line in sass.splitlines():
        if "HGMMA" in line or "QGMMA" in line:  # 16-bit / fp8 wgmma
            in_flight = True
        elif "WARPGROUP.DEPBAR" in line:
            best, in_flight, count = max(best, count), False, 0
        elif "MUFU.EX2" in line and in_flight:
            count += 1
    return best
