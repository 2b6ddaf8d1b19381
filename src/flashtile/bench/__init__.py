"""Benchmarks of flashtile beside its peers, in one process.

    python -m flashtile.bench fwd --d 128 --seqlens 1024 4096 --causal yes --plot fwd.png
    python -m flashtile.bench bwd --peers flash cudnn --ceilings --out bwd.json
    python -m flashtile.bench plot bwd.json bwd.png

flashtile itself is imported only when a benchmark runs, so ``--help`` and ``plot`` do not depend
on the kernels. Subcommands live in the table ``COMMANDS`` (``flashtile.bench.cli``).
"""

from flashtile.bench.cli import COMMANDS, main
from flashtile.bench.shapes import attention_flops, make_shapes


def measure_ceilings(*args, **kwargs):
    """bf16 matmul TFLOP/s and copy TB/s; see :func:`flashtile.bench.ceilings.measure_ceilings`."""
    from flashtile.bench.ceilings import measure_ceilings as _measure

    return _measure(*args, **kwargs)


__all__ = ["COMMANDS", "attention_flops", "main", "make_shapes", "measure_ceilings"]
