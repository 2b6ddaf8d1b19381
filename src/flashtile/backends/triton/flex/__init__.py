"""Triton backend of flashtile.flex: trace the mods, generate their jit helpers, launch the flex kernels."""
