"""Benchmark shapes and the FLOP counts that turn times into TFLOP/s."""

from __future__ import annotations

from dataclasses import dataclass

# The FlashAttention papers' convention, which BASELINES.md follows: a fixed hidden size and a fixed
# number of tokens per batch, so every row does comparable work and only the shape changes.
HIDDEN = 2048
TOKENS = 16384
DEFAULT_DIMS = (64, 128, 256)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)

# --quick: small enough for the CPU path to run forward and backward in well under a second.
QUICK_HIDDEN = 128
QUICK_TOKENS = 256
QUICK_DIMS = (64,)
QUICK_SEQLENS = (64, 128)

# Backward does 2.5x the forward's matmul work (5 matmuls against 2); a training step does both.
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
# The same matmuls split by the head dim they run over, for v's own head dim dv: the forward's QK^T runs
# over d and PV over dv; the backward recomputes QK^T and forms dQ, dK over d, dP = dO V^T and dV over dv.
MODE_MATMULS = {"fwd": (1, 1), "bwd": (3, 2), "fwdbwd": (4, 3)}


@dataclass(frozen=True)
class Shape:
    """One benchmark row's problem: q, k, v are (b, s, h, d) in flashtile's layout."""

    b: int
    h: int
    s: int
    d: int
    causal: bool
    dv: int | None = None  # v's head dim when it differs from q/k's (v and out are (b, s, h, dv))

    def label(self) -> str:
        dims = f"d={self.d}" + (f" dv={self.dv}" if self.dv not in (None, self.d) else "")
        return f"{dims} s={self.s} b={self.b} h={self.h} causal={'yes' if self.causal else 'no'}"


def attention_flops(b: int, h: int, s_q: int, d: int, causal: bool, mode: str = "fwd",
                    s_k: int | None = None, dv: int | None = None) -> float:
    """FLOPs of one attention call: ``4*b*h*s_q*s_k*d`` forward, halved when causal.

    ``mode`` scales it: ``fwd`` 1x, ``bwd`` 2.5x, ``fwdbwd`` 3.5x. With v's own head dim ``dv``
    each matmul counts its own dim: forward ``2*b*h*s_q*s_k*(d + dv)``, backward ``(3d + 2dv)``.
    """
    if mode not in MODE_FLOP_FACTOR:
        raise ValueError(f"mode must be one of {sorted(MODE_FLOP_FACTOR)}, got {mode!r}")
    s_k = s_q if s_k is None else s_k
    if dv is not None and dv != d:
        n_d, n_dv = MODE_MATMULS[mode]
        flops = 2.0 * b * h * s_q * s_k * (n_d * d + n_dv * dv)
        return flops / 2 if causal else flops
    flops = 4.0 * b * h * s_q * s_k * d
    if causal:
        flops /= 2
    return flops * MODE_FLOP_FACTOR[mode]


def tflops(flops: float, ms: float | None) -> float | None:
    """TFLOP/s for ``flops`` done in ``ms`` milliseconds (None when there is no time)."""
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def make_shapes(dims, seqlens, causal: str = "both", hidden: int = HIDDEN,
                tokens: int = TOKENS) -> list[Shape]:
    """Rows ordered by head dim, then causal (no before yes), then seqlen, as in BASELINES.md."""
    causal_opts = {"both": (False, True), "yes": (True,), "no": (False,)}[causal]
    shapes = []
    for d in dims:
        for c in causal_opts:
            for s in seqlens:
                shapes.append(Shape(b=max(1, tokens // s), h=max(1, hidden // d), s=s, d=d, causal=c))
    return shapes
