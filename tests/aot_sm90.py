"""Compile a flashtile kernel for Hopper (sm_90) on a machine without a GPU, through ptxas.

Run as a script in a subprocess (TRITON_INTERPRET must be unset there):
    python tests/aot_sm90.py MODULE KERNEL '{"CONSTEXPR": value, ...}' '{"arg": "type", ...}' WARPS STAGES [ARCH]
(ARCH: the compute capability to build for, 90 unless given; tests/test_ampere_compile.py builds for 80 / 89)
Arguments not named get a type from their name: ``desc_*`` tensor descriptors need explicit types,
``stride_*``/sizes are i32, ``qk_scale``-like floats fp32, everything else a bf16 pointer; pointers and
strides are marked 16-divisible, as the JIT specialises aligned tensors.
Constexprs with a default (``USE_PDL=False``) take it unless given.
Prints ``WGMMA <warp-group dots> SHARED <bytes> GDC_WAIT <n> GDC_LAUNCH <n> BULK <n> LOADS_AFTER_SHFL <n>
CP_ASYNC_16 <n> LD_GLOBAL <n> PIPELINE_BUFFERS <n> LOOPS <n,n,...>`` (griddepcontrol and TMA bulk-tensor
copy instructions in the PTX, global loads that come after its first warp shuffle, i.e. after the first
reduction began, the PTX's 16-byte cp.async copies (pipelined tile loads), its synchronous global loads,
the multi-buffered shared-memory allocations the software pipeliner made in the TTGIR (one per pipelined
load, and barriers), and the instruction count of each loop body, in PTX order: a loop is a backward
branch to a label).
"""

import importlib
import inspect
import json
import pathlib
import re
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gluon_aot import ptxas_log  # this script runs from tests/ (its folder is on sys.path)

FLOATS = {"qk_scale", "softcap", "dropout_p", "grad_scale"}
INT_POINTERS = {"CU_SEQLENS_Q", "CU_SEQLENS_K", "SEQUSED_Q", "SEQUSED_K"}
FP32_POINTERS = {"LSE", "DELTA", "ALIBI", "PROBS", "SINK"}
TILE_COPY = re.compile(r"cp\.async\.c[ag]\.shared\.global[^;]*, 0x10")  # a 16-byte async copy
PIPELINE_BUFFER = re.compile(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<[^>]*mutable>")  # allocated, not stored
LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
BRANCH = re.compile(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);")


def loop_bodies(ptx: str) -> list[list[str]]:
    """The instructions of each loop body of the PTX (label to the branch back to it; labels, comments
    and braces left out)."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := LABEL.match(ln))}
    bodies = []
    for i, ln in enumerate(lines):
        m = BRANCH.search(ln)
        if m and labels.get(m.group(1), i + 1) < i:
            body = lines[labels[m.group(1)]:i + 1]
            bodies.append([x for x in body if x and not x.startswith(("$", "//", "{", "}"))])
    return bodies


def loop_sizes(ptx: str) -> list[int]:
    """Instructions in each loop body of the PTX."""
    return [len(body) for body in loop_bodies(ptx)]


def main(module, kernel, constexprs, types, warps, stages, arch=90):
    kern = getattr(importlib.import_module(module), kernel)
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(kern.arg_names):
        param = kern.params[i]
        if name not in constexprs and param.is_constexpr and param.default is not inspect.Parameter.empty:
            constexprs = dict(constexprs, **{name: param.default})  # e.g. USE_PDL = False
        if name in constexprs:
            sig[name] = "constexpr"
            consts[(i,)] = constexprs[name]
        elif name in types:
            sig[name] = types[name]
        elif name in FLOATS:
            sig[name] = "fp32"
        elif name in INT_POINTERS:
            sig[name] = "*i32"
        elif name in FP32_POINTERS:
            sig[name] = "*fp32"
        elif name.isupper() or name.startswith("desc"):
            sig[name] = "*bf16"
        else:
            sig[name] = "i32"
        # as the JIT specialises aligned tensors and strides: vector widths, and so the shared
        # memory of pipelined loads, depend on it
        if sig[name].startswith("*") or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kern, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    dots = [ln for ln in compiled.asm["ttgir"].splitlines() if "ttng.warp_group_dot " in ln]
    ptx = compiled.asm["ptx"]  # programmatic dependent launch's two instructions
    with tempfile.TemporaryDirectory() as tmp:
        log = ptxas_log(ptx, pathlib.Path(tmp), "kernel", f"sm_{arch}a" if arch == 90 else f"sm_{arch}")
    regs, spill = (re.search(pat, log) for pat in (r"Used (\d+) registers", r"(\d+) bytes spill stores"))
    print("WGMMA", len(dots), "SHARED", compiled.metadata.shared, "GDC_WAIT", ptx.count("griddepcontrol.wait"),
          "GDC_LAUNCH", ptx.count("griddepcontrol.launch_dependents"), "BULK", ptx.count("cp.async.bulk.tensor"),
          "LOADS_AFTER_SHFL", ptx.partition("shfl.sync")[2].count("ld.global"),
          "CP_ASYNC_16", len(TILE_COPY.findall(ptx)), "LD_GLOBAL", ptx.count("ld.global"),
          "EVICT_LAST", ptx.count("evict_last"),
          "PIPELINE_BUFFERS", len(PIPELINE_BUFFER.findall(compiled.asm["ttgir"])),
          "REGISTERS", regs.group(1) if regs else -1, "SPILL_STORES", spill.group(1) if spill else -1,
          "LOOPS", ",".join(map(str, loop_sizes(ptx))) or "-",
          # CTA barriers a trip of each loop (cross-warp reductions, shared-memory hand-offs)
          "LOOP_BARRIERS", ",".join(str(sum(x.startswith(("bar.sync", "barrier.sync")) for x in body))
                                    for body in loop_bodies(ptx)) or "-")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5]),
         int(sys.argv[6]), *(int(a) for a in sys.argv[7:8]))
