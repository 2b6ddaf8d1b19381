"""Tile-config tables from JSON files (``FLASHTILE_FWD_CONFIGS`` / ``FLASHTILE_BWD_CONFIGS``), read once per file."""

from __future__ import annotations

import json
from collections.abc import Callable

_LOADED: dict = {}


def load(path: str | None, parse: Callable[[str, object], tuple]) -> dict:
    """{parsed key: config} of the JSON file at ``path`` ({} when unset); ``parse(key, value)`` turns one entry
    into ``(table key, config)`` and raises ValueError on a bad one. Cached by (path, parse)."""
    if not path:
        return {}
    table = _LOADED.get((path, parse))
    if table is None:
        with open(path) as f:
            entries = json.load(f)
        try:
            table = dict(parse(key, value) for key, value in entries.items())
        except ValueError as exc:  # name the file the bad entry came from
            raise ValueError(f"{path}: {exc}") from exc
        _LOADED[(path, parse)] = table
    return table
