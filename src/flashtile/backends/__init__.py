"""Backends that execute attention: the Triton kernels, the chunked PyTorch path and the reference."""
