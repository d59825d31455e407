"""Parsing of human sizes (``"8MiB"``) and durations (``"30s"``)."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_bytes", "parse_duration"]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}
_TIME_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

SIZE_HELP = 'a non-negative int of bytes or a string like "512KiB", "8MiB", "1GiB"'
DURATION_HELP = 'a non-negative number of seconds or a string like "500ms", "30s", "5m"'


def parse_bytes(value: int | str, *, what: str = "size") -> int:
    """Return ``value`` as a byte count.

    Accepts non-negative ints and strings with binary (KiB, MiB, GiB, TiB, K, M, G)
    or decimal (KB, MB, GB) units. Raises ``ValueError`` naming ``what`` otherwise.
    """
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected {SIZE_HELP}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what}: expected {SIZE_HELP}, got negative {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is not None:
            unit = m.group(2).lower()
            if unit in _SIZE_UNITS:
                return int(float(m.group(1)) * _SIZE_UNITS[unit])
    raise ValueError(f"{what}: expected {SIZE_HELP}, got {value!r}")


def parse_duration(value: float | int | str, *, what: str = "duration") -> float:
    """Return ``value`` as seconds (float). Accepts numbers and ``"30s"``-style strings."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected {DURATION_HELP}, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"{what}: expected {DURATION_HELP}, got negative {value}")
        return float(value)
    if isinstance(value, str):
        m = _TIME_RE.match(value)
        if m is not None and m.group(2).lower() in _TIME_UNITS:
            return float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]
    raise ValueError(f"{what}: expected {DURATION_HELP}, got {value!r}")


def format_bytes(n: float) -> str:
    """Render a byte count with a binary unit, e.g. ``"1.50 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover
