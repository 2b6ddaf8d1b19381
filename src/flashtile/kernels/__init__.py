"""Triton kernels (``@triton.jit`` code and their tuning tables only; launchers live in backends/triton)."""
