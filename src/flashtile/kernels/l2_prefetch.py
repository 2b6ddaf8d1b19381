"""An L2 prefetch-size hint on the decode kernel's asynchronous copies (an experiment, off by default).

Triton emits ``cp.async.cg.shared.global`` without PTX's ``.L2::{64,128,256}B`` prefetch-size
qualifier, which CUTLASS-style kernels (cuDNN's decode among them) put on every tile copy: with it,
the first 16-byte request that misses in L2 fetches the whole aligned 64 / 128 / 256-byte block from
DRAM at once instead of sector by sector. ``FLASHTILE_DECODE_L2_PREFETCH=64|128|256`` adds the
qualifier to the PTX of ``_decode_kernel`` builds, through Triton's compiler-stage hook; unset or 0
leaves the PTX alone.

The hook is not part of Triton's cache key, so a process with the hint on compiles into its own
cache directory (``<Triton's cache dir>/flashtile_l2_<size>``): a build made under one setting is
never reused under another.
"""

import os
import re

from .. import env

SIZES = (64, 128, 256)
_COPY = re.compile(r"cp\.async\.cg\.shared\.global(?=\s)")
_installed: int | None = None


def setting() -> int:
    """The prefetch size in bytes from FLASHTILE_DECODE_L2_PREFETCH (0: none)."""
    value = env.get("FLASHTILE_DECODE_L2_PREFETCH", "")
    if value in ("", "0"):
        return 0
    if not value.isdigit() or int(value) not in SIZES:
        raise ValueError(f"FLASHTILE_DECODE_L2_PREFETCH must be 0, 64, 128 or 256, got {value!r}")
    return int(value)


def add_hint(ptx: str, size: int) -> str:
    """``ptx`` with every 16-byte-class global-to-shared copy (``cp.async.cg``) carrying ``.L2::<size>B``."""
    return _COPY.sub(f"cp.async.cg.shared.global.L2::{size}B", ptx)


def install() -> None:
    """Hook the hint into later compilations of the decode kernel when the variable asks for it (once)."""
    global _installed
    size = setting()
    if size == 0 or _installed == size:
        return
    from triton import knobs

    outer = knobs.runtime.add_stages_inspection_hook

    def hook(backend, stages, options, language, capability):
        if outer is not None:
            outer(backend, stages, options, language, capability)
        make_ptx = stages.get("ptx")
        if make_ptx is None:
            return

        def ptx_with_hint(src, metadata):
            ptx = make_ptx(src, metadata)
            return add_hint(ptx, size) if metadata.get("name", "").startswith("_decode_kernel") else ptx

        stages["ptx"] = ptx_with_hint

    knobs.runtime.add_stages_inspection_hook = hook
    knobs.cache.dir = os.path.join(knobs.cache.dir, f"flashtile_l2_{size}")
    _installed = size
