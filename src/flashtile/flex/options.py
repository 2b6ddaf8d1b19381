"""FlexAttention's ``kernel_options`` on flashtile's kernels: the keys that choose tiles are honoured, the
others FlexAttention names are accepted and ignored, anything else is an error that names the key.

Keys follow FlexAttention's rules: a plain key applies to both passes, ``fwd_<key>`` to the forward only
and ``bwd_<key>`` to the backward only (overriding the plain key there). Honoured:

- forward: ``BLOCK_M`` (query tile), ``BLOCK_N`` (key tile), ``num_warps``, ``num_stages``;
- backward: ``BLOCK_M1`` / ``BLOCK_N1`` (the dK/dV kernel's query tile, which it walks, and key tile,
  which it owns), ``BLOCK_M2`` / ``BLOCK_N2`` (the dQ kernel's query tile, owned, and key tile,
  walked), ``num_warps`` and ``num_stages`` (both backward kernels).

Tiles are powers of two >= 16 that divide the block mask's block (``BLOCK_SIZE``; 128 without a
mask), since a program walks each listed block in whole tiles; FlexAttention refuses the same. What
is not given comes from the kernels' tables.
"""

from __future__ import annotations

from collections.abc import Mapping

FWD_TILES = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
DKDV_TILES = ("BLOCK_M1", "BLOCK_N1", "num_warps", "num_stages")
DQ_TILES = ("BLOCK_M2", "BLOCK_N2", "num_warps", "num_stages")
BWD_KEYS = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps", "num_stages")
_FWD, _BWD = frozenset(FWD_TILES), frozenset(BWD_KEYS)
# FlexAttention's other options, with the type of their value. flashtile has one Triton kernel per pass
# and no TMA or warp-specialised flex variant, takes the unscaled path (PRESCALE_QK off), checks every
# row (ROWS_GUARANTEED_SAFE changes nothing it computes) and adds captured tensors' gradients in its
# dK/dV kernel (WRITE_DQ's other choice): these change no result of flashtile's, so they are ignored.
IGNORED = {
    "PRESCALE_QK": bool, "ROWS_GUARANTEED_SAFE": bool, "BLOCKS_ARE_CONTIGUOUS": bool, "WRITE_DQ": bool,
    "FORCE_USE_FLEX_ATTENTION": bool, "USE_TMA": bool, "kpack": int, "matrix_instr_nonkdim": int,
    "waves_per_eu": int, "num_consumer_groups": int, "num_buffers_warp_spec": int, "BACKEND": str,
}
BACKENDS = ("AUTO", "TRITON", "TRITON_DECODE", "FLASH")
_SET_BY_FLEX = ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX")
NO_TILES = (0,) * 12


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"flex_attention: kernel_options[{name!r}] must be an int, got {value!r}")
    return value


def _tile_value(name: str, key: str, value, block: tuple[int, int]) -> int:
    v = _int(name, value)
    if key.startswith("BLOCK"):
        which, size = ("Q", block[0]) if key.startswith("BLOCK_M") else ("KV", block[1])
        if v < 16 or v & (v - 1):
            raise ValueError(f"flex_attention: kernel_options[{name!r}] must be a power of two >= 16, got {v}")
        if size % v:
            raise ValueError(f"flex_attention: kernel_options[{name!r}] = {v} must divide the block mask's "
                             f"{which} block size {size} (BLOCK_SIZE)")
    elif key == "num_warps" and v not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"flex_attention: kernel_options[{name!r}] must be a power of two from 1 to 32, got {v}")
    elif key == "num_stages" and v < 1:
        raise ValueError(f"flex_attention: kernel_options[{name!r}] must be >= 1, got {v}")
    return v


def _check_ignored(name: str, key: str, value) -> None:
    want = IGNORED[key]
    if want is int:
        _int(name, value)
    elif not isinstance(value, want):
        raise ValueError(f"flex_attention: kernel_options[{name!r}] must be a {want.__name__}, got {value!r}")
    if key == "BACKEND" and value not in BACKENDS:
        raise ValueError(f"flex_attention: kernel_options['BACKEND'] = {value!r} is not one of {BACKENDS}")


def tiles(kernel_options, block_size: tuple[int, int]) -> tuple[int, ...]:
    """The honoured options as 12 ints, 0 where not given: the forward's (BLOCK_M, BLOCK_N, num_warps,
    num_stages), then the dK/dV kernel's (BLOCK_M1, BLOCK_N1, ...), then the dQ kernel's (BLOCK_M2, ...).
    Raises ValueError naming a key that is unknown, misplaced or has an invalid value."""
    if kernel_options is None:
        return NO_TILES
    if not isinstance(kernel_options, Mapping):
        raise TypeError(f"flex_attention: kernel_options must be a dict, got {type(kernel_options).__name__}")
    plain, fwd, bwd = {}, {}, {}
    for name, value in kernel_options.items():
        if not isinstance(name, str):
            raise ValueError(f"flex_attention: kernel_options has a key {name!r} that is not a string")
        prefix, key = (name[:4], name[4:]) if name.startswith(("fwd_", "bwd_")) else ("", name)
        if key in _SET_BY_FLEX:
            raise ValueError(f"flex_attention: kernel_options[{name!r}] is set by flex_attention itself "
                             "(pass return_lse instead)")
        if key in IGNORED:
            _check_ignored(name, key, value)
            continue
        if key not in _FWD | _BWD:
            raise ValueError(f"flex_attention: unknown kernel_options key {name!r}; honoured: "
                             f"{', '.join(FWD_TILES)} (forward), {', '.join(BWD_KEYS[:4])} (backward), "
                             f"each also as fwd_<key> / bwd_<key>; accepted and ignored: {', '.join(IGNORED)}")
        if (prefix == "fwd_" and key not in _FWD) or (prefix == "bwd_" and key not in _BWD):
            pass_name = "forward" if prefix == "fwd_" else "backward"
            raise ValueError(f"flex_attention: kernel_options[{name!r}]: the {pass_name} has no {key} (the forward "
                             f"takes {', '.join(FWD_TILES)}, the backward {', '.join(BWD_KEYS)})")
        {"": plain, "fwd_": fwd, "bwd_": bwd}[prefix][key] = _tile_value(name, key, value, block_size)
    fwd_opts, bwd_opts = {**plain, **fwd}, {**plain, **bwd}
    return (tuple(fwd_opts.get(k, 0) for k in FWD_TILES) + tuple(bwd_opts.get(k, 0) for k in DKDV_TILES)
            + tuple(bwd_opts.get(k, 0) for k in DQ_TILES))
