"""Hardware ceilings read in the same process as the benchmarks, so ratios to them are honest."""

from __future__ import annotations

import torch

from flashtile.bench.timing import bench


def matmul_tflops(device: str = "cuda", n: int = 8192, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """TFLOP/s of a dense bf16 ``n x n @ n x n`` matmul."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    ms = bench(lambda: torch.matmul(a, b, out=c), device, warmup_ms, rep_ms)
    return 2.0 * n**3 / (ms * 1e-3) / 1e12


def copy_tb_s(device: str = "cuda", nbytes: int = 1 << 30, warmup_ms: float = 25,
              rep_ms: float = 100) -> float:
    """TB/s of a device-to-device copy of ``nbytes``, counting the read and the write."""
    src = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device, warmup_ms, rep_ms)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e12


def measure_ceilings(device: str = "cuda", n: int = 8192, copy_bytes: int = 1 << 30,
                     warmup_ms: float = 25, rep_ms: float = 100) -> dict:
    """Both ceilings: ``{"matmul_tflops", "matmul_n", "copy_tb_s", "copy_bytes"}``."""
    return {
        "matmul_tflops": matmul_tflops(device, n, warmup_ms, rep_ms),
        "matmul_n": n,
        "copy_tb_s": copy_tb_s(device, copy_bytes, warmup_ms, rep_ms),
        "copy_bytes": copy_bytes // 4 * 4,
    }
