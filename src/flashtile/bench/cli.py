"""Command line of ``python -m flashtile.bench``: one table of subcommands."""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """A subcommand: the module that defines ``add_arguments(parser)`` and ``run(args) -> int``."""

    module: str
    help: str


# Adding a benchmark (e.g. ``decode``) is one module with add_arguments/run and one line here.
COMMANDS: dict[str, Command] = {
    "fwd": Command("flashtile.bench.attention", "forward of dense attention"),
    "bwd": Command("flashtile.bench.attention", "backward of dense attention, timed as (fwd+bwd) - fwd"),
    "fwdbwd": Command("flashtile.bench.attention", "forward + backward of dense attention (a training step)"),
    "models": Command("flashtile.bench.models", "newer models' variants (v head dim 128 under q/k's 192, "
                                                "learnable sink, attention chunk) against their bars"),
    "train": Command("flashtile.bench.training", "a training step's attention on GQA 32/8 and packed documents, "
                                                 "against flashtile's own MHA / length buckets and SDPA's backends"),
    "flex": Command("flashtile.bench.flex", "programmable attention (flashtile.flex) beside FlexAttention: "
                                            "causal, window, prefix-LM, documents, ALiBi, softcap, bias table"),
    "decode": Command("flashtile.bench.decode", "one-token decode over a KV cache (GQA 32/8, d 128, paged too; "
                                                "--mla: h 128 on one latent head, d 64 / dv 512)"),
    "cp": Command("flashtile.bench.cp", "context-parallel attention over torchrun's ranks (ring, zigzag, "
                                        "Ulysses, hybrid, K/V all-gather): per-GPU throughput, scaling, overlap"),
    "plot": Command("flashtile.bench.plot", "re-plot a saved results JSON: plot RESULTS.json OUT.png"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashtile.bench",
        description="Benchmark flashtile beside torch SDPA (flash, cuDNN) and FlexAttention, "
                    "in the same process. Shapes: h = 2048 // d, b = 16384 // s.",
        epilog="example: python -m flashtile.bench fwd --d 128 --seqlens 1024 4096 --causal yes "
               "--plot fwd.png",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        sp = sub.add_parser(name, help=cmd.help, description=cmd.help)
        importlib.import_module(cmd.module).add_arguments(sp)
        sp.set_defaults(_module=cmd.module)
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return importlib.import_module(args._module).run(args)
