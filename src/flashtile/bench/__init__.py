"""Benchmarks of flashtile beside its peers: ``python -m flashtile.bench --help``.

flashtile itself is imported only when a benchmark runs, so ``--help`` and ``plot`` work even
while the kernels are broken.
"""

from flashtile.bench.cli import COMMANDS, main
from flashtile.bench.shapes import attention_flops, make_shapes


def measure_ceilings(*args, **kwargs):
    """bf16 matmul TFLOP/s and copy TB/s; see :func:`flashtile.bench.ceilings.measure_ceilings`."""
    from flashtile.bench.ceilings import measure_ceilings as _measure

    return _measure(*args, **kwargs)


__all__ = ["COMMANDS", "attention_flops", "main", "make_shapes", "measure_ceilings"]
