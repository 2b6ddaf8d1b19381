"""flashtile's settings: one typed object, read from the environment once, changed in tests by a context manager.

Public environment variables (each in the README's table; at most eight):

==========================  =======  ==========================================================================
variable                    default  meaning
==========================  =======  ==========================================================================
``FLASHTILE_INTERPRET``     0        1: CPU tensors run the Triton kernels in Triton's interpreter (set
                                     ``TRITON_INTERPRET=1`` too, before triton is imported); 0: the CPU path
``FLASHTILE_GLUON``         1        0: never take a Gluon (Hopper) kernel; the Triton kernels run instead
``FLASHTILE_FAST_LAUNCH``   1        0: launch every kernel through Triton's own ``kernel[grid](...)`` path
``FLASHTILE_FWD_CONFIGS``   unset    a JSON file of forward tile configs that replace the built-in table's rows
``FLASHTILE_BWD_CONFIGS``   unset    the same for the backward kernels
``FLASHTILE_DECODE_ROUTE``  unset    force one decode route by name (benchmarks compare routes with it)
==========================  =======  ==========================================================================

Code reads ``config.get().<field>``: a plain attribute of a frozen dataclass, cheap on the launch path.
Tests and tuning scripts change settings for a block with ``with config.override(field=value): ...``;
fields without an environment variable exist for them (tile pins that keep interpreter runs fast).
A ``FLASHTILE_*`` variable that is not in the table above is reported once with a warning, so a typo
or a removed switch never passes silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every setting flashtile reads. Environment-backed fields name their variable in ``metadata["env"]``."""

    interpret: bool = dataclasses.field(default=False, metadata={"env": "FLASHTILE_INTERPRET"})
    gluon: bool = dataclasses.field(default=True, metadata={"env": "FLASHTILE_GLUON"})
    fast_launch: bool = dataclasses.field(default=True, metadata={"env": "FLASHTILE_FAST_LAUNCH"})
    fwd_configs: str | None = dataclasses.field(default=None, metadata={"env": "FLASHTILE_FWD_CONFIGS"})
    bwd_configs: str | None = dataclasses.field(default=None, metadata={"env": "FLASHTILE_BWD_CONFIGS"})
    decode_route: str | None = dataclasses.field(default=None, metadata={"env": "FLASHTILE_DECODE_ROUTE"})

    # --- not from the environment: tests and tuners set these through override() ---
    # (BLOCK_M, BLOCK_N, num_warps, num_stages) for every Triton forward launch
    fwd_tiles: tuple | None = None
    # ((dK/dV BLOCK_M, BLOCK_N, warps, stages), (dQ BLOCK_M, BLOCK_N, warps, stages)) for every backward
    bwd_tiles: tuple | None = None
    # True / False: take / refuse the Gluon forward wherever it can run; None: the route table decides
    gluon_fwd: bool | None = None
    # the same for the Gluon dK/dV kernel of the backward
    gluon_bwd: bool | None = None
    # True / False: the Gluon dK/dV kernel's fused dQ build (TMA reduce-add into fp32, no dQ kernel) wherever it can
    # run with deterministic=False (taking the Gluon kernel at any length) / never; None: its route table
    # (gluon_bwd.FUSED_ROUTE_TABLE, empty until timed: docs/backward.md). flex's fused build: only when True
    gluon_fused_dq: bool | None = None
    # the same for the Gluon flex forward (flashtile.flex; None: its route, backends/triton/flex/gluon_launch.py)
    gluon_flex: bool | None = None
    # True: the flex backward's dK/dV half on its Gluon kernel where it can run; None / False: the Triton kernel
    # (the Gluon one awaits its first GPU run and timing, docs/programmable.md)
    gluon_flex_bwd: bool | None = None
    # True / False: tensor-descriptor (TMA) loads on / off in the Triton kernels; None: the launcher's rule
    tma: bool | None = None
    # causal programs start with their longest row blocks (bitwise the same result either way)
    heavy_first: bool = True
    # a launch whose config needs more shared memory than the GPU has retries with fewer stages
    reduce_stages_on_oor: bool = True

    # --- training ---
    # (BLOCK_M, BLOCK_N, num_warps, num_stages) for every launch of the Triton fp8 forward
    fp8_tiles: tuple | None = None
    # True / False: the backward's dQ kernel with / without programmatic dependent launch behind the dK/dV
    # kernel (sm_90+ NVIDIA only); None: the launcher's table decides
    bwd_pdl: bool | None = None
    # True / False: the masked edge ranges of the Triton forward and backward kernels through the software
    # pipeline / loaded directly, in every launch; None: the launchers' tables decide
    pipeline_edges: bool | None = None

    # --- decode ---
    # (largest BLOCK_M, BLOCK_N, num_warps, num_stages) of every Triton split-KV decode launch; None: the route's
    decode_tiles: tuple | None = None
    # True / False: every decode-side launch (append, decode, merge) a programmatic dependent / none; None: the route's
    decode_pdl: bool | None = None
    # rows a program of the rotary kernel; None: its table's
    rotary_block_m: int | None = None


ENV_FIELDS = {f.metadata["env"]: f for f in dataclasses.fields(Settings) if "env" in f.metadata}
_FALSE = ("0", "false", "False", "no", "off")
_TRUE = ("1", "true", "True", "yes", "on")


def _parse(field: dataclasses.Field, name: str, raw: str):
    if field.type in ("bool", bool):
        if raw in _TRUE:
            return True
        if raw in _FALSE:
            return False
        raise ValueError(f"{name} must be 0 or 1 (unset: {int(field.default)}), got {raw!r}")
    return raw or None


def from_environment(environ=None) -> Settings:
    """The settings the environment asks for (defaults for unset variables). Raises ValueError naming a
    variable whose value cannot be read; warns about ``FLASHTILE_*`` variables flashtile does not know."""
    environ = os.environ if environ is None else environ
    values = {}
    for name, field in ENV_FIELDS.items():
        raw = environ.get(name, "")
        if raw != "":
            values[field.name] = _parse(field, name, raw)
    unknown = sorted(n for n in environ if n.startswith("FLASHTILE_") and n not in ENV_FIELDS)
    if unknown:
        warnings.warn(f"flashtile: ignoring unknown environment variable(s) {', '.join(unknown)}; the settings are "
                      f"{', '.join(ENV_FIELDS)} (README, 'Settings')", RuntimeWarning, stacklevel=3)
    return Settings(**values)


_current: Settings | None = None


def get() -> Settings:
    """The settings in force (read from the environment on first use)."""
    global _current
    if _current is None:
        _current = from_environment()
    return _current


def reload() -> Settings:
    """Read the environment again (for scripts that set ``FLASHTILE_*`` variables after import)."""
    global _current
    _current = from_environment()
    return _current


@contextlib.contextmanager
def override(**changes):
    """Change settings for the block, then restore them: ``with config.override(interpret=True): ...``.
    Unknown names raise TypeError, as a dataclass constructor does."""
    global _current
    before = get()
    _current = dataclasses.replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before
