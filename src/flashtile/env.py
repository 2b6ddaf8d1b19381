"""Reading FLASHTILE_* switches from the environment, cheaply enough for every call.

The launch path reads several switches per call (route overrides, experimental kernels), and tests
flip them with ``monkeypatch.setenv`` between calls, so they cannot be read once at import.
``os.environ.get`` encodes the name and decodes the value on every read, about 2 us each on the
H200 machine's CPU; :func:`get` looks the pre-encoded name up in the same mapping ``os.environ``
writes through (CPython's ``os.environ._data`` on POSIX), so it sees every change made through
``os.environ``, and decodes only a value that is set. Elsewhere, or when ``os.environ`` itself was
replaced (``mock.patch("os.environ", ...)``), it is ``os.environ.get``.
"""

from __future__ import annotations

import contextlib
import os

_ENVIRON = os.environ
_DATA = getattr(_ENVIRON, "_data", None)
_FAST = os.name == "posix" and isinstance(_DATA, dict)
_NAMES: dict[str, bytes] = {}


def get(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``."""
    if not _FAST or os.environ is not _ENVIRON:  # a replaced os.environ (mock.patch): ask it
        return os.environ.get(name, default)
    key = _NAMES.get(name)
    if key is None:
        key = _NAMES[name] = os.fsencode(name)
    value = _DATA.get(key)
    return default if value is None else os.fsdecode(value)


def switch(name: str) -> bool | None:
    """A 0 / 1 switch: False, True, or None when unset (or set empty: the caller's measured rule).
    Any other value raises a ValueError naming the variable, so a typo never silently means "off"."""
    value = get(name, "")
    if value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 (off), 1 (on) or unset (the default rule), got {value!r}")
    return value == "1"


def count(name: str, low: int = 1, high: int | None = None) -> int | None:
    """A whole number in [low, high] (high None: no bound), or None when unset or empty (the caller's rule).
    Anything else raises a ValueError naming the variable and the range."""
    value = get(name, "")
    if value == "":
        return None
    if not value.isdigit() or int(value) < low or (high is not None and int(value) > high):
        span = f"{low}-{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be a whole number {span} (unset: the default rule), got {value!r}")
    return int(value)


@contextlib.contextmanager
def overrides(pairs: dict[str, str]):
    """Set the environment variables ``pairs`` for the block, then restore each (unset again if it was unset):
    for scripts that time or profile one setting after another in one process."""
    before = {name: os.environ.get(name) for name in pairs}
    os.environ.update(pairs)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
