"""Prometheus text endpoint (``--metrics HOST:PORT``), via prometheus-client.

The HTTP server runs on prometheus-client's own thread. It never touches the
daemon's live state: it reads the latest immutable snapshot, which the event loop
replaces a few times a second.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from tensorstore_hooks.errors import ConfigError
from tensorstore_hooks.protocol import OPS, Msgpack

from ._config import is_loopback, parse_address

if TYPE_CHECKING:  # prometheus-client is optional: imported when the endpoint starts
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric

__all__ = ["start_metrics_server"]

log = logging.getLogger("tensorstore_hooks.server")

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
    buffers = GaugeMetricFamily(
        "tsh_buffer_bytes",
        "Memory held for payloads in flight: PUTs bound for disk, GET answers read from disk.",
        labels=["kind"],
    )
    for kind in ("put", "get"):
        buffers.add_metric([kind], _number(snap, "buffers", kind, "used"))
    yield buffers
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


def start_metrics_server(address: str, snapshot: Snapshot) -> Callable[[], None]:
    """Serve ``/metrics`` on ``address``; returns a function that stops the server."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
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
    # prometheus-client returns (server, thread) since 0.17, None before.
    started: object = start_http_server(port, addr=host, registry=registry)
    httpd: WSGIServer | None = started[0] if isinstance(started, tuple) else None
    bound = httpd.server_port if httpd is not None else port
    log.info("metrics on http://%s:%d/metrics", host, bound)

    def stop() -> None:
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()

    return stop
