"""Sizes (``"8MiB"``) and durations (``"30s"``): parsing, and the shared field types.

The library's config (``_config``) and the daemon's (``tensorstore_hooks.server``)
use the same :data:`Size` and :data:`Duration` pydantic field types from here, so a
value one accepts the other accepts.

NOTE [ Whole bytes ]
A size is a whole number of bytes: a non-negative int, or a string of a number and
a unit. A decimal fraction is accepted only where it makes whole bytes, computed
exactly (``"1.5MiB"`` is 1572864; ``"0.5KB"`` is 500); ``"1.5"`` (1.5 bytes) and
``"0.3KiB"`` (307.2 bytes) are refused rather than rounded, and so are Python floats
(``1.5`` or ``1024.0``: YAML ``min_bytes: 1.5`` is a float).

NOTE [ Memory shares ]
A budget (``device_budget``, ``host_budget``) is a size, or a share of the memory there
is: ``"auto"`` (all of it) or a percentage from ``"0%"`` to ``"100%"`` (``"60%"``,
``"12.5%"``). ``memory_headroom`` is a size or a percentage (of the memory limit).
What "the memory there is" means: NOTE [ Auto budgets ] in ``pipeline/_budgets.py``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated

from pydantic import BeforeValidator, PlainValidator

__all__ = [
    "AUTO",
    "BUDGET_HELP",
    "DEFAULT_HEADROOM",
    "DURATION_HELP",
    "HEADROOM_HELP",
    "Budget",
    "Headroom",
    "MemoryShare",
    "OptBudget",
    "SIZE_HELP",
    "Duration",
    "OptSize",
    "Size",
    "check_budget",
    "check_duration",
    "check_headroom",
    "check_size",
    "format_bytes",
    "parse_bytes",
    "parse_duration",
]

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

SIZE_HELP = (
    'a whole number of bytes: a non-negative int or a string like "512KiB", "8MiB", "1.5GiB"'
)
BUDGET_HELP = (
    'a size (a non-negative int of bytes or a string like "512MiB", "1.5GiB"), "auto" '
    '(the memory there is) or a share of it from "0%" to "100%" like "60%"'
)
HEADROOM_HELP = (
    'a size (a non-negative int of bytes or a string like "512MiB") or a share of the '
    'memory limit from "0%" to "100%" like "10%"'
)
DURATION_HELP = 'a non-negative number of seconds or a string like "500ms", "30s", "5m"'


def _bytes(value: object) -> int | str:
    """The byte count of ``value``, or the reason it is not one (without the value)."""
    if isinstance(value, bool):
        return f"expected {SIZE_HELP}"
    if isinstance(value, int):
        return value if value >= 0 else f"expected {SIZE_HELP}, not a negative number"
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is not None and m.group(2).lower() in _SIZE_UNITS:
            # Decimal: a decimal string times an integer unit is exact (NOTE [ Whole bytes ]).
            exact = Decimal(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
            if exact == exact.to_integral_value():
                return int(exact)
            return (
                f"expected {SIZE_HELP}; this is {exact.normalize():f} bytes, not a whole "
                "number (use a smaller unit)"
            )
    if isinstance(value, float):
        return f"expected {SIZE_HELP}, not a float"
    return f"expected {SIZE_HELP}"


def parse_bytes(value: object, *, what: str = "size") -> int:
    """Return ``value`` as a byte count (see NOTE [ Whole bytes ]).

    Accepts non-negative ints and strings with binary (KiB, MiB, GiB, TiB, K, M, G, T)
    or decimal (KB, MB, GB, TB) units, case-insensitive, fractions only where the
    result is whole bytes. Raises ``ValueError`` naming ``what`` and the value otherwise.
    """
    n = _bytes(value)
    if isinstance(n, str):
        raise ValueError(f"{what}: {n}; got {value!r}")
    return n


def parse_duration(value: object, *, what: str = "duration") -> float:
    """Return ``value`` as seconds (float). Accepts finite non-negative numbers and
    ``"30s"``-style strings; raises ``ValueError`` naming ``what`` and the value."""
    seconds = _seconds(value)
    if isinstance(seconds, str):
        raise ValueError(f"{what}: {seconds}; got {value!r}")
    return seconds


def _seconds(value: object) -> float | str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 0:
            return f"expected {DURATION_HELP}"
        return float(value)
    if isinstance(value, str):
        m = _TIME_RE.match(value)
        if m is not None and m.group(2).lower() in _TIME_UNITS:
            return float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]
    return f"expected {DURATION_HELP}"


def check_size(value: object) -> int:
    """:func:`parse_bytes` for validators whose error report shows the value itself:
    the ``ValueError`` carries only what is wrong and what is allowed."""
    n = _bytes(value)
    if isinstance(n, str):
        raise ValueError(n)
    return n


def _optional_size_field(value: object) -> int | None:
    return None if value is None else check_size(value)


def check_duration(value: object) -> float:
    """:func:`parse_duration` with the value left out of the message (see :func:`check_size`)."""
    seconds = _seconds(value)
    if isinstance(seconds, str):
        raise ValueError(seconds)
    return seconds


@dataclass(frozen=True, slots=True)
class MemoryShare:
    """A share of the memory there is (NOTE [ Memory shares ]): ``"auto"`` or ``"60%"``."""

    percent: float
    """0 to 100; ``AUTO`` is 100."""

    def __post_init__(self) -> None:
        p = self.percent
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p <= 100:
            raise ValueError(f"MemoryShare: percent must be from 0 to 100, got {p!r}")

    def of(self, nbytes: int) -> int:
        """This share of ``nbytes``, whole bytes rounded down (0 for ``nbytes <= 0``)."""
        return max(0, int(nbytes * self.percent) // 100) if self.percent < 100 else max(0, nbytes)

    def __str__(self) -> str:
        return "auto" if self.percent == 100 else f"{self.percent:g}%"


AUTO = MemoryShare(100)
"""``"auto"``: all of the memory there is."""
DEFAULT_HEADROOM = MemoryShare(10)
"""``memory_headroom``'s default: 10% of the memory limit."""

_SHARE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def _share(value: object) -> MemoryShare | str | None:
    """``value`` as a share, the reason it is a bad one, or ``None`` (not a share at all)."""
    if isinstance(value, MemoryShare):
        return value
    if not isinstance(value, str):
        return None
    m = _SHARE_RE.match(value)
    if m is None:
        return None
    percent = float(m.group(1))
    if percent > 100:
        return "a share of the memory there is cannot be over 100%"
    return MemoryShare(int(percent) if percent.is_integer() else percent)


def check_budget(value: object) -> int | MemoryShare:
    """A budget field's value (NOTE [ Memory shares ]); ``ValueError`` without the value."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO
    share = _share(value)
    if isinstance(share, str):
        raise ValueError(f"expected {BUDGET_HELP}; {share}")
    if share is not None:
        return share
    n = _bytes(value)
    if isinstance(n, str):
        raise ValueError(n.replace(f"expected {SIZE_HELP}", f"expected {BUDGET_HELP}"))
    return n


def _optional_budget(value: object) -> int | MemoryShare | None:
    return None if value is None else check_budget(value)


def check_headroom(value: object) -> int | MemoryShare:
    """``memory_headroom``'s value: a size or a percentage (``"auto"`` means nothing here)."""
    share = _share(value)
    if isinstance(share, str):
        raise ValueError(f"expected {HEADROOM_HELP}; {share}")
    if share is not None:
        return share
    n = _bytes(value)
    if isinstance(n, str):
        raise ValueError(n.replace(f"expected {SIZE_HELP}", f"expected {HEADROOM_HELP}"))
    return n


Size = Annotated[int, BeforeValidator(check_size)]
"""Pydantic field type, bytes: see NOTE [ Whole bytes ]. Import it from here
(``from tensorstore_hooks._units import Size``); the library and daemon share it."""
OptSize = Annotated[int | None, BeforeValidator(_optional_size_field)]
"""A :data:`Size` or ``None`` (null in YAML)."""
Budget = Annotated[int | MemoryShare, PlainValidator(check_budget)]
"""Pydantic field type: a size, ``"auto"`` or ``"60%"`` (NOTE [ Memory shares ])."""
OptBudget = Annotated[int | MemoryShare | None, PlainValidator(_optional_budget)]
"""A :data:`Budget` or ``None`` (null in YAML)."""
Headroom = Annotated[int | MemoryShare, PlainValidator(check_headroom)]
"""Pydantic field type: a size or a percentage (``memory_headroom``)."""
Duration = Annotated[float, BeforeValidator(check_duration)]
"""Pydantic field type, seconds: a finite non-negative number or ``"500ms"``, ``"30s"``,
``"5m"``, ``"1h"``."""


def format_bytes(n: float) -> str:
    """Render a byte count with a binary unit, e.g. ``"1.50 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover
