"""The daemon's request counters, rates, and the ``stats`` snapshot put together from
each part's own report.

Each part reports itself (``snapshot()`` of the tiers, the session table, the
connection registry, the payload budgets): a dict of the sections it owns, plus
its ``counters``. :meth:`DaemonStats.snapshot` merges them with the request
counters kept here; it knows no part's fields.

Event-loop thread only. The Prometheus endpoint never reads these directly: it
reads :attr:`DaemonStats.latest`, an immutable snapshot the housekeeping task
replaces a few times a second.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Mapping

from tensorstore_hooks.protocol import OPS, Msgpack

__all__ = ["COUNTERS", "DaemonStats", "server_version"]

_RATE_WINDOW_S = 10.0
COUNTERS: tuple[str, ...] = (*OPS, "errors")
"""The counters kept here; the parts add their own."""
_RATED: tuple[str, ...] = (*OPS, "bytes_in", "bytes_out")

Report = Mapping[str, Msgpack]
"""A part's ``snapshot()``: its sections, and ``counters`` (a map of name -> int)."""


def server_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tensorstore-hooks")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"


def merge(reports: tuple[Report, ...]) -> tuple[dict[str, Msgpack], dict[str, int]]:
    """Sections from every report, and their ``counters`` merged (summed by name)."""
    sections: dict[str, Msgpack] = {}
    counters: dict[str, int] = {}
    for report in reports:
        for name, value in report.items():
            if name != "counters":
                sections[name] = value
                continue
            if not isinstance(value, Mapping):
                raise TypeError(f"stats: a report's counters are a {type(value).__name__}")
            for k, n in value.items():
                if not isinstance(n, int):
                    raise TypeError(f"stats: counter {k!r} is {n!r}, not an int")
                counters[k] = counters.get(k, 0) + n
    return sections, counters


class DaemonStats:
    """Request counters by name, rates over the last ~10 s, and the latest snapshot."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._rate_samples: collections.deque[tuple[float, dict[str, int]]] = collections.deque()
        self.latest: dict[str, Msgpack] = {}
        """The last snapshot taken by :meth:`refresh` (read by the metrics thread)."""

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def refresh(self, header: Report, *reports: Report) -> None:
        """Take a rate sample and replace :attr:`latest` (housekeeping calls this)."""
        self.latest = self.snapshot(header, *reports, sample=True)

    def snapshot(
        self, header: Report, *reports: Report, sample: bool = False
    ) -> dict[str, Msgpack]:
        """Everything ``stats`` and the metrics endpoint show (msgpack-safe): ``header``
        (who and where), then each part's report, with this object's counters and rates.
        """
        now = time.monotonic()
        sections, counters = merge(reports)
        for k, n in self.counters.items():
            counters[k] = counters.get(k, 0) + n
        if sample:
            self._rate_samples.append((now, {k: counters.get(k, 0) for k in _RATED}))
            while len(self._rate_samples) > 2 and now - self._rate_samples[1][0] >= _RATE_WINDOW_S:
                self._rate_samples.popleft()
        rates: dict[str, float] = {}
        if self._rate_samples:
            t0, c0 = self._rate_samples[0]
            dt = now - t0
            if dt > 0.05:
                rates = {k: (counters.get(k, 0) - c0.get(k, 0)) / dt for k in _RATED}
        return {
            "server": server_version(),
            "pid": os.getpid(),
            "uptime_s": now - self.started,
            **header,
            **sections,
            "counters": counters,
            "rates": rates,
        }
