"""The daemon's counters, request rates and the ``stats`` snapshot.

Event-loop thread only. The Prometheus endpoint never reads these directly: it
reads :attr:`DaemonStats.latest`, an immutable snapshot the housekeeping task
replaces a few times a second.
"""

from __future__ import annotations

import collections
import os
import time
from typing import TYPE_CHECKING, Any

from tensorstore_hooks.protocol import OPS

if TYPE_CHECKING:
    from ._app import Daemon

__all__ = ["COUNTERS", "DaemonStats", "server_version"]

_RATE_WINDOW_S = 10.0
COUNTERS: tuple[str, ...] = (
    *OPS,
    "errors",
    "connections",
    "refused",
    "evicted_unauthenticated",
    "bytes_in",
    "bytes_out",
)
"""Every counter ``stats`` shows besides the tiers' and sessions' own."""


def server_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tensorstore-hooks")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"


class DaemonStats:
    """Counters by name, rates over the last ~10 s, and the latest snapshot."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._rate_samples: collections.deque[tuple[float, dict[str, int]]] = collections.deque()
        self.latest: dict[str, Any] = {}
        """The last snapshot taken by :meth:`refresh` (read by the metrics thread)."""

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def _live_counts(self, d: Daemon) -> dict[str, int]:
        counts = dict(self.counters)
        counts["bytes_in"] += sum(c.conn.bytes_in for c in d.clients)
        counts["bytes_out"] += sum(c.conn.bytes_out for c in d.clients)
        return counts

    def refresh(self, d: Daemon) -> None:
        """Take a rate sample and replace :attr:`latest` (housekeeping calls this)."""
        now = time.monotonic()
        self._rate_samples.append((now, self._live_counts(d)))
        while len(self._rate_samples) > 2 and now - self._rate_samples[1][0] >= _RATE_WINDOW_S:
            self._rate_samples.popleft()
        self.latest = self.snapshot(d)

    def snapshot(self, d: Daemon) -> dict[str, Any]:
        """Everything ``stats`` and the metrics endpoint show (msgpack-safe)."""
        now = time.monotonic()
        counts = self._live_counts(d)
        rates: dict[str, float] = {}
        if self._rate_samples:
            t0, c0 = self._rate_samples[0]
            dt = now - t0
            if dt > 0.05:
                rates = {
                    k: (counts[k] - c0.get(k, 0)) / dt for k in (*OPS, "bytes_in", "bytes_out")
                }
        cfg = d.config
        sessions = sorted(d.sessions.sessions.values(), key=lambda s: -s.nbytes)
        return {
            "server": server_version(),
            "url": d.url,
            "pid": os.getpid(),
            "uptime_s": now - self.started,
            "lease_s": cfg.lease_s,
            "root": cfg.root,
            "tiers": {**d.tiers.snapshot(), "staging_bytes": d.staging.used},
            "counters": {
                **counts,
                "spills": d.tiers.spills,
                "spill_bytes": d.tiers.spill_bytes,
                "spill_failures": d.tiers.spill_failures,
                "quota_rejected": d.tiers.quota_rejected,
                "sessions_opened": d.sessions.opened,
                "sessions_expired": d.sessions.expired,
                "expired_bytes": d.sessions.expired_bytes,
            },
            "rates": rates,
            "connections": len(d.clients),
            "unauthenticated": len(d.pending),
            "max_connections": cfg.limits.max_connections,
            "sessions_total": len(sessions),
            "sessions": [
                {
                    "id": s.label,
                    "tensors": len(s.entries),
                    "ram_bytes": s.ram_bytes,
                    "disk_bytes": s.disk_bytes,
                    "connections": len(s.conns),
                    "idle_s": now - s.last_seen,
                    "lease_left_s": max(0.0, cfg.lease_s - (now - s.last_seen)),
                    "requests": s.requests,
                }
                for s in sessions[:200]
            ],
        }
