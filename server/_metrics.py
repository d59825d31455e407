"""Prometheus text endpoint (``--metrics HOST:PORT``), text made by prometheus-client.

The endpoint is served on the daemon's event loop (no thread at all, so idle
connections cost a few hundred bytes each, never a thread): one request per
connection (``GET /metrics``), which must arrive within :data:`REQUEST_TIMEOUT_S`;
at most :data:`MAX_CLIENTS` connections at once: a new one beyond that closes the
oldest (so silent connections cannot lock the scraper out).
It never touches the daemon's live state: it renders the latest snapshot, which the
housekeeping task replaces a few times a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from tensorstore_hooks.errors import ConfigError
from tensorstore_hooks.protocol import OPS, Msgpack

from ._config import is_loopback, parse_address
from ._wire import with_timeout

if TYPE_CHECKING:  # prometheus-client is optional: imported when the endpoint starts
    from prometheus_client.metrics_core import Metric

__all__ = ["MAX_CLIENTS", "REQUEST_TIMEOUT_S", "MetricsServer", "start_metrics_server"]

log = logging.getLogger("tensorstore_hooks.server")

REQUEST_TIMEOUT_S = 5.0
"""A metrics connection must send its whole request within this."""
MAX_CLIENTS = 16
"""Metrics connections served at once; more are closed at once."""
_MAX_REQUEST_BYTES = 8 << 10

Snapshot = Callable[[], Mapping[str, Msgpack]]


def _at(snap: Mapping[str, Msgpack], *path: str) -> Msgpack:
    """The value at ``path`` in a ``stats`` snapshot (``KeyError`` if it is not there)."""
    value: Msgpack = snap
    for name in path:
        if not isinstance(value, Mapping):
            raise TypeError(f"stats snapshot: {'.'.join(path)}: {name!r} is not in a map")
        value = value[name]
    return value


def _number(snap: Mapping[str, Msgpack], *path: str) -> float:
    """The number at ``path`` in a ``stats`` snapshot."""
    value = _at(snap, *path)
    if not isinstance(value, int | float):
        raise TypeError(f"stats snapshot: {'.'.join(path)} is {value!r}, not a number")
    return float(value)


def _budget_families(snap: Mapping[str, Msgpack]) -> Iterator[Metric]:
    """The named budgets (``buffers``), RAM held by answers, preemptions."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    buffers = GaugeMetricFamily(
        "tsh_buffer_bytes",
        "Memory held in the daemon's named budgets: PUTs bound for disk, GET answers read "
        "from disk, disk-tier bookkeeping, the discard buffer, the disk tier's buffer pool.",
        labels=["kind"],
    )
    for kind in ("put", "get", "bookkeeping", "discard", "store_pool"):
        section = _at(snap, "buffers")
        if isinstance(section, Mapping) and kind in section:
            buffers.add_metric([kind], _number(snap, "buffers", kind, "used"))
    yield buffers
    yield GaugeMetricFamily(
        "tsh_ram_answer_bytes",
        "RAM held only by GET answers still sending tensors deleted or spilled meanwhile.",
        value=_number(snap, "tiers", "ram", "answers"),
    )
    preempted = CounterMetricFamily(
        "tsh_preemptions",
        "Budget holders preempted for others (GET pieces read again, PUTs dropped).",
        labels=["budget"],
    )
    for budget in ("put", "get"):
        preempted.add_metric([budget], _number(snap, "counters", f"{budget}_preemptions"))
    yield preempted


def _families(snap: Mapping[str, Msgpack]) -> Iterator[Metric]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if not snap:
        return
    for name, field, doc in (
        (
            "tsh_tier_used_bytes",
            "used",
            "Bytes counted against the tier's quota (payload + per-tensor overhead; "
            "disk: chunk files + metadata).",
        ),
        ("tsh_tier_reserved_bytes", "reserved", "Bytes reserved by PUTs and spills in flight."),
        ("tsh_tier_quota_bytes", "quota", "The tier's quota."),
        ("tsh_tier_tensors", "tensors", "Tensors stored in the tier."),
    ):
        g = GaugeMetricFamily(name, doc, labels=["tier"])
        for tier in ("ram", "disk"):
            g.add_metric([tier], _number(snap, "tiers", tier, field))
        yield g
    yield from _budget_families(snap)
    disk = _at(snap, "tiers", "disk")
    yield GaugeMetricFamily(
        "tsh_disk_writable",
        "1 if the disk tier takes writes now, 0 while it backs off a failure (or is off).",
        value=1.0 if isinstance(disk, Mapping) and disk.get("writable") else 0.0,
    )
    yield GaugeMetricFamily(
        "tsh_sessions", "Open sessions.", value=_number(snap, "sessions_total")
    )
    yield GaugeMetricFamily(
        "tsh_connections", "Open connections.", value=_number(snap, "connections")
    )
    yield GaugeMetricFamily(
        "tsh_uptime_seconds", "Seconds since start.", value=_number(snap, "uptime_s")
    )
    req = CounterMetricFamily("tsh_requests", "Requests served, by op.", labels=["op"])
    for op in OPS:
        req.add_metric([op], _number(snap, "counters", op))
    yield req
    for name, key, doc in (
        ("tsh_received_bytes", "bytes_in", "Bytes received from clients."),
        ("tsh_sent_bytes", "bytes_out", "Bytes sent to clients."),
        ("tsh_spills", "spills", "Tensors spilled from RAM to disk."),
        ("tsh_spilled_bytes", "spill_bytes", "Bytes spilled from RAM to disk."),
        ("tsh_quota_rejections", "quota_rejected", "PUTs refused with QUOTA_EXCEEDED."),
        ("tsh_disk_write_failures", "disk_write_failures", "Disk-tier writes that failed."),
        ("tsh_delete_failures", "delete_failures", "DELETEs refused: not journaled."),
        ("tsh_disk_direct_bytes", "disk_direct_bytes", "Disk-tier bytes moved with O_DIRECT."),
        (
            "tsh_disk_buffered_bytes",
            "disk_buffered_bytes",
            "Disk-tier bytes moved through the page cache.",
        ),
        ("tsh_sessions_expired", "sessions_expired", "Sessions ended by their lease."),
        ("tsh_expired_bytes", "expired_bytes", "Bytes freed by expired leases."),
        ("tsh_errors", "errors", "Error answers and dropped connections."),
        ("tsh_connections_accepted", "connections", "Connections accepted."),
        ("tsh_connections_refused", "refused", "Connections refused at the cap."),
    ):
        yield CounterMetricFamily(name, doc, value=_number(snap, "counters", key))


class _Collector:
    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        return _families(self._snapshot())

    def describe(self) -> list[Metric]:
        return []  # values come from a snapshot; nothing to describe up front


class MetricsServer:
    """The ``/metrics`` endpoint on the event loop; :meth:`close` stops it."""

    def __init__(self, render: Callable[[], bytes], content_type: str) -> None:
        self._render = render
        self._content_type = content_type
        self._server: asyncio.Server | None = None
        self._clients: dict[asyncio.StreamWriter, None] = {}  # oldest first
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(
            self._serve, host, port, limit=_MAX_REQUEST_BYTES
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._clients) >= MAX_CLIENTS:
            next(iter(self._clients)).close()  # its task ends with a closed stream
        self._clients[writer] = None
        try:
            request = await with_timeout(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            status, body, kind = self._answer(request)
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode("ascii") + body)
            await with_timeout(writer.drain(), REQUEST_TIMEOUT_S)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a silent, slow or oversized client: just close
        finally:
            self._clients.pop(writer, None)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _answer(self, request: bytes) -> tuple[str, bytes, str]:
        parts = request.split(b"\r\n", 1)[0].split()
        if len(parts) < 2 or parts[0] not in (b"GET", b"HEAD"):
            return "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
        if parts[1].split(b"?", 1)[0] not in (b"/metrics", b"/"):
            return "404 Not Found", b"GET /metrics\n", "text/plain"
        body = self._render()
        return "200 OK", (b"" if parts[0] == b"HEAD" else body), self._content_type

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()


async def start_metrics_server(address: str, snapshot: Snapshot) -> MetricsServer:
    """Serve ``/metrics`` on ``address`` from the running event loop. Raises ConfigError
    without prometheus-client, OSError if the address cannot be bound."""
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    except ImportError as e:
        raise ConfigError(
            "daemon config: --metrics needs prometheus-client: "
            "pip install 'tensorstore-hooks[metrics]'"
        ) from e
    host, port = parse_address(address)
    if not is_loopback(host):
        log.warning(
            "metrics endpoint %s is reachable from the network and has no authentication", address
        )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshot))
    server = MetricsServer(lambda: bytes(generate_latest(registry)), CONTENT_TYPE_LATEST)
    await server.start(host, port)
    log.info("metrics on http://%s:%d/metrics", host, server.port)
    return server
