"""The daemon: lifecycle (start, drain, stop), leases, recovery after a restart.

The rest lives in small modules: ``_listen`` (binding, accepting), ``_connection``
(one connection's handshake and request loop), ``_handlers`` (the handler table),
``_stats`` (counters, rates, the ``stats`` snapshot), ``_tiers`` and ``_sessions``.

Threads: everything here runs on the event-loop thread except disk-tier I/O, which
runs on a small thread pool (see ``_tiers``), and the optional Prometheus endpoint,
which reads an immutable snapshot refreshed by the housekeeping task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tensorstore_hooks.errors import ConfigError
from tensorstore_hooks.protocol import ErrorCode, error_header

from ._checks import check_config
from ._config import ServerConfig, read_token
from ._connection import Client, serve_connection
from ._handlers import Handlers
from ._journal import StateJournal
from ._listen import Listener, accept_loop, bind, server_tls_context
from ._recovery import open_disk, recover
from ._sessions import Session, SessionTable
from ._staging import StagingBudget
from ._stats import DaemonStats, server_version
from ._tiers import Tiers
from ._wire import FrameConn

__all__ = ["Daemon", "serve", "server_version"]

log = logging.getLogger("tensorstore_hooks.server")

_HOUSEKEEPING_S = 0.25

# NOTE [ Fairness ]
# One event loop serves every connection, so a connection must give the loop back
# (issue 15 item 3):
# 1. Each connection's requests queue in its own socket and are served in order,
#    one per turn: after each request the task yields (``sleep(0)``), and the loop
#    polls every socket before it runs that task again. A client pipelining pings
#    therefore gets one request per round, like every other connection.
# 2. A lease is renewed when a request is received, not when it is served: the
#    request handler renews it as soon as the header is read, and housekeeping,
#    before it expires anything, renews every session with a request in progress
#    or bytes waiting on one of its sockets. A session with a request waiting
#    never expires.
# 3. Connections that have not said HELLO do not count against ``max_connections``:
#    they have their own, smaller cap (``max_unauthenticated``) and a short
#    handshake deadline, and when that cap is full the oldest of them is dropped
#    to make room, so idle connections cannot lock out real clients.


class Daemon:
    """One daemon instance. ``await start()``, then ``await run()`` until stopped."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.limits = config.limits
        self.token = read_token(config.token_file) if config.token_file else None
        self.tls = server_tls_context(config)
        self.url = ""
        self.stats = DaemonStats()
        self.staging = StagingBudget(self.limits.staging_bytes)
        self.handlers = Handlers(self)
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tsh-disk")
        self._disk: Any = None
        self.journal: StateJournal | None = None
        self.tiers: Tiers
        self.sessions: SessionTable
        self._listener: Listener | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.clients: set[Client] = set()
        self.pending: dict[Client, None] = {}
        """Connections still in their handshake, oldest first."""
        self._stop = asyncio.Event()
        self.draining = False
        self._metrics_stop: Callable[[], None] | None = None

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> str:
        """Open the tiers (recovering a previous run's state), bind, start accepting.

        Returns the URL clients use (``tsh://HOST:PORT`` or ``tsh+unix:///path``).
        """
        cfg = self.config
        if cfg.disk_enabled:
            assert cfg.root is not None
            self._disk, self.journal = open_disk(cfg.root)
        self.tiers = Tiers(
            memory_quota=cfg.memory_quota_bytes,
            disk_quota=cfg.disk_quota_bytes,
            disk=self._disk,
            pool=self.pool,
            staging_bytes=None,  # counted as bytes arrive: self.staging
        )
        self.sessions = SessionTable(
            self.tiers, self.journal, cfg.lease_s, session_quota=cfg.session_quota_bytes
        )
        if self._disk is not None:
            assert self.journal is not None
            recover(self.sessions, self._disk, self.journal)
        loop = asyncio.get_running_loop()
        for warning in check_config(cfg):
            log.warning("%s", warning)
        self._listener = bind(cfg)
        self.url = self._listener.url
        for lsock in self._listener.sockets:
            self._spawn(accept_loop(lsock, self._accepted))
        self._spawn(self._housekeeping())
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        self.stats.refresh(self)
        if cfg.metrics:
            from ._metrics import start_metrics_server

            try:
                self._metrics_stop = start_metrics_server(cfg.metrics, lambda: self.stats.latest)
            except OSError as e:
                raise ConfigError(
                    f"daemon config: metrics {cfg.metrics}: cannot listen: {e}"
                ) from e
        log.info(
            "serving %s: RAM quota %d bytes, disk %s, lease %gs, token %s, TLS %s",
            self.url,
            cfg.memory_quota_bytes,
            f"{cfg.root} quota {cfg.disk_quota_bytes} bytes" if self._disk is not None else "none",
            cfg.lease_s,
            "required" if self.token else "not required",
            ("with client certificates" if cfg.tls_client_ca else "on") if self.tls else "off",
        )
        return self.url

    def request_stop(self) -> None:
        """Begin a graceful shutdown (signal handlers call this)."""
        if not self._stop.is_set():
            log.info("stop requested: draining connections")
            self._stop.set()

    async def run(self) -> None:
        """Serve until :meth:`request_stop`, then drain and release everything."""
        await self._stop.wait()
        await self._shutdown()

    async def _shutdown(self) -> None:
        self.draining = True
        # Stop the accept loops before closing their sockets (they are registered
        # with the selector until cancelled).
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for c in list(self.clients):
            if c.idle and c.task is not None:
                c.task.cancel()
        busy = [c.task for c in self.clients if c.task is not None]
        if busy:
            _, pending = await asyncio.wait(busy, timeout=self.limits.drain_timeout_s)
            for t in pending:
                t.cancel()
            if pending:
                log.warning("%d connections did not finish within the drain timeout", len(pending))
                await asyncio.wait(pending, timeout=1.0)
        if self._disk is not None:
            await self.tiers.drain()
        self.pool.shutdown(wait=True)
        if self.journal is not None:
            self.sessions.compact_journal()
            self.journal.close()
        if self._disk is not None:
            self._disk.close()
        if self._metrics_stop is not None:
            self._metrics_stop()
        log.info("stopped")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----------------------------------------------------------- connections
    def authenticated_count(self) -> int:
        # Not len(clients) - len(pending): an evicted connection leaves ``pending`` at
        # once but ``clients`` only when its task has run its cleanup.
        return sum(1 for c in self.clients if c.authenticated)

    def _accepted(self, sock: socket.socket, addr: Any) -> None:
        conn = FrameConn(sock, self.limits.read_timeout_s)
        if self.draining:
            self.stats.count("refused")
            conn.send_nowait(error_header(ErrorCode.BUSY, "the daemon is stopping", fatal=True))
            conn.close()
            return
        if len(self.pending) >= self.limits.max_unauthenticated:
            # See NOTE [ Fairness ], rule 3: the oldest silent connection makes room.
            oldest = next(iter(self.pending))
            del self.pending[oldest]
            self.stats.count("evicted_unauthenticated")
            oldest.conn.send_nowait(
                error_header(
                    ErrorCode.BUSY,
                    f"dropped: {self.limits.max_unauthenticated} newer connections are waiting "
                    "for their HELLO; send HELLO at once after connecting",
                    fatal=True,
                )
            )
            if oldest.task is not None:
                oldest.task.cancel()
        self.stats.count("connections")
        client = Client(conn, peer=str(addr) if addr else "unix")
        self.clients.add(client)
        self.pending[client] = None
        client.task = asyncio.get_running_loop().create_task(serve_connection(self, client))

    def kick(self, s: Session, reason: str, keep: Client | None = None) -> None:
        """Close the session's other connections: idle ones now, busy ones after their request."""
        for other in list(s.conns):
            if other is keep:
                continue
            other.kick_reason = reason
            if other.idle and other.task is not None:
                other.task.cancel()

    # ---------------------------------------------------------- housekeeping
    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(_HOUSEKEEPING_S)
            try:
                now = time.monotonic()
                for c in self.clients:
                    # NOTE [ Fairness ], rule 2: a request in progress or waiting renews.
                    if c.session is not None and (not c.idle or c.conn.has_input()):
                        c.session.last_seen = now
                for s in self.sessions.expire(now):
                    self.kick(s, f"session expired after {self.config.lease_s:g}s without traffic")
                if self.journal is not None and self.journal.needs_compaction():
                    self.sessions.compact_journal()
                self.stats.refresh(self)
            except Exception:  # pragma: no cover - keep the daemon alive
                log.exception("housekeeping failed")

    def snapshot(self) -> dict[str, Any]:
        """Everything ``stats`` and the metrics endpoint show (msgpack-safe)."""
        return self.stats.snapshot(self)


async def _main(config: ServerConfig, on_ready: Callable[[str], None] | None) -> int:
    daemon = Daemon(config)
    try:
        url = await daemon.start()
    except BaseException:
        daemon.pool.shutdown(wait=False)
        raise
    if on_ready is not None:
        on_ready(url)
    await daemon.run()
    return 0


def serve(config: ServerConfig, *, on_ready: Callable[[str], None] | None = None) -> int:
    """Run a daemon until SIGTERM/SIGINT; returns the exit code (0 after a clean drain).

    ``on_ready(url)`` is called once the daemon accepts connections.
    """
    return asyncio.run(_main(config, on_ready))
