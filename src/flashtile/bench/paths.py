"""Where ``python -m flashtile.bench`` writes its results when ``--out`` is not given.

The default directory is ``$XDG_CACHE_HOME/flashtile/bench`` (``~/.cache/flashtile/bench`` when
``XDG_CACHE_HOME`` is unset), never the working directory: a benchmark run from a checkout must not
leave files in it unasked. Every run prints the path it wrote. README, "Benchmarks" documents this.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path

from flashtile.bench.report import device_slug


def results_dir() -> Path:
    """The directory results go to when no ``--out`` is given."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashtile" / "bench"


def default_out_path(mode: str, meta: dict) -> str:
    """``<results_dir>/<mode>_<gpu>_<date-time>.json``; the time is in the name so reruns never collide."""
    stamp = _dt.datetime.fromisoformat(meta["date"]).strftime("%Y%m%d-%H%M%S")
    return str(results_dir() / f"{mode}_{device_slug(meta)}_{stamp}.json")
