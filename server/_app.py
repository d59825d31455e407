"""The daemon: lifecycle (start, drain, stop), leases, recovery after a restart.

It builds the parts and wires them together; each part owns its state: ``_conns``
(the connection registry), ``_sessions`` (sessions and their tensors), ``_tiers`` and
``_disk`` (where bytes live), ``_payload`` (memory for payloads in flight),
``_stats`` (request counters, the ``stats`` snapshot). Connections get the parts as
one :class:`~._services.Services` (``_connection``, ``_handlers``), never the daemon.

Threads: everything here runs on the event-loop thread except disk-tier I/O, which
runs on a small thread pool (see ``_disk``), and the optional Prometheus endpoint,
which reads an immutable snapshot refreshed by the housekeeping task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tensorstore_hooks.errors import ConfigError
from tensorstore_hooks.protocol import Msgpack

from ._checks import check_config
from ._config import ServerConfig, read_token
from ._connection import serve_connection
from ._conns import Conn, ConnRegistry
from ._disk import DiskTier
from ._handlers import Handlers
from ._journal import StateJournal
from ._listen import Listener, accept_loop, bind, server_tls_context
from ._payload import AnswerBudget, PayloadBudget
from ._recovery import open_disk, recover
from ._services import Services
from ._sessions import SessionTable
from ._stats import DaemonStats, Report
from ._tiers import Tiers
from ._wire import DISCARD_BYTES, FrameConn, discard_bytes

if TYPE_CHECKING:  # prometheus-client is optional: _metrics is imported with --metrics
    from ._metrics import MetricsServer

__all__ = ["Daemon", "serve"]

log = logging.getLogger("tensorstore_hooks.server")

_HOUSEKEEPING_S = 0.25


class Daemon:
    """One daemon instance. ``await start()``, then ``await run()`` until stopped."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.limits = config.limits
        self.token = read_token(config.token_file) if config.token_file else None
        self.tls = server_tls_context(config)
        self.url = ""
        self.stats = DaemonStats()
        self.conns = ConnRegistry(self.limits.max_connections, self.limits.max_unauthenticated)
        self.puts = PayloadBudget(self.limits.put_buffer_bytes)
        self.answers = AnswerBudget(
            self.limits.get_buffer_bytes, self.limits.session_get_buffer_bytes
        )
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tsh-disk")
        self.disk: DiskTier | None = None
        self.journal: StateJournal | None = None
        self.tiers: Tiers
        self.sessions: SessionTable
        self._handlers: Handlers
        self._services: Services
        self._listener: Listener | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self._metrics: MetricsServer | None = None
        self._root_unlock: Callable[[], None] | None = None
        """Releases the root's lock (NOTE [ One daemon per root ]): the last thing done."""

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> str:
        """Open the tiers (recovering a previous run's state), bind, start accepting.

        Returns the URL clients use (``tsh://HOST:PORT`` or ``tsh+unix:///path``).
        """
        cfg = self.config
        if cfg.disk_enabled:
            assert cfg.root is not None
            store, self.journal, self._root_unlock = open_disk(
                cfg.root, self.limits.max_tensor_bytes
            )
            self.disk = DiskTier(
                store, self.pool, cfg.disk_quota_bytes, self.limits.disk_bookkeeping_bytes
            )
        self.tiers = Tiers(memory_quota=cfg.memory_quota_bytes, disk=self.disk)
        self.sessions = SessionTable(
            self.tiers, self.journal, cfg.lease_s, session_quota=cfg.session_quota_bytes
        )
        if self.disk is not None:
            assert self.journal is not None
            recover(self.sessions, self.disk, self.journal)
        self._services = Services(
            config=cfg,
            token=self.token,
            tls=self.tls,
            stats=self.stats,
            conns=self.conns,
            sessions=self.sessions,
            tiers=self.tiers,
            puts=self.puts,
            answers=self.answers,
            snapshot=self.snapshot,
        )
        self._handlers = Handlers(self._services)
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
        self.refresh_stats()
        if cfg.metrics:
            from ._metrics import start_metrics_server

            try:
                self._metrics = await start_metrics_server(cfg.metrics, lambda: self.stats.latest)
            except OSError as e:
                raise ConfigError(
                    f"daemon config: metrics {cfg.metrics}: cannot listen: {e}"
                ) from e
        log.info(
            "serving %s: RAM quota %d bytes, disk %s, lease %gs, token %s, TLS %s",
            self.url,
            cfg.memory_quota_bytes,
            f"{cfg.root} quota {cfg.disk_quota_bytes} bytes" if self.disk is not None else "none",
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
        self.conns.draining = True
        # Stop the accept loops before closing their sockets (they are registered
        # with the selector until cancelled).
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for task in self.conns.idle_tasks():
            task.cancel()
        busy = self.conns.tasks()
        if busy:
            _, pending = await asyncio.wait(busy, timeout=self.limits.drain_timeout_s)
            for t in pending:
                t.cancel()
            if pending:
                log.warning("%d connections did not finish within the drain timeout", len(pending))
                await asyncio.wait(pending, timeout=1.0)
        await self.sessions.drain()
        await self.tiers.drain()
        self.pool.shutdown(wait=True)
        if self.journal is not None:
            self.sessions.compact_journal()
            self.journal.close()
        if self.disk is not None:
            self.disk.store.close()
        if self._metrics is not None:
            await self._metrics.close()
        self.release_root()
        log.info("stopped")

    def release_root(self) -> None:
        """Release the root's lock (after the disk tier is closed, or a failed start)."""
        if self._root_unlock is not None:
            self._root_unlock()
            self._root_unlock = None

    def _spawn(self, coro: Coroutine[object, None, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----------------------------------------------------------- connections
    def _accepted(self, sock: socket.socket, addr: object) -> None:
        wire = FrameConn(sock, self.limits.read_timeout_s)
        if self.conns.refuse_while_draining(wire):
            return
        c = Conn(wire, peer=str(addr) if addr else "unix")
        evicted = self.conns.add(c)
        if evicted is not None and evicted.task is not None:
            evicted.task.cancel()  # NOTE [ Fairness ] in _conns, rule 3
        c.task = asyncio.get_running_loop().create_task(
            serve_connection(self._services, self._handlers, c)
        )

    # ---------------------------------------------------------- housekeeping
    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(_HOUSEKEEPING_S)
            try:
                now = time.monotonic()
                for s in self.conns.busy_sessions():
                    s.last_seen = now  # NOTE [ Fairness ], rule 2
                for s in self.sessions.expire(now):
                    self.conns.kick(
                        s, f"session expired after {self.config.lease_s:g}s without traffic"
                    )
                if self.disk is not None:
                    self.disk.check()
                    self.sessions.retry_unrecorded()
                if self.journal is not None and self.journal.needs_compaction():
                    self.sessions.compact_journal()
                self.refresh_stats()
            except Exception:  # pragma: no cover - keep the daemon alive
                log.exception("housekeeping failed")

    def _reports(self) -> tuple[Report, ...]:
        buffers: dict[str, Msgpack] = {
            "put": self.puts.snapshot(),
            "get": self.answers.snapshot(),
            "discard": {"used": discard_bytes(), "limit": DISCARD_BYTES},
            "bookkeeping": (
                self.disk.bookkeeping_snapshot()
                if self.disk is not None
                else {"used": 0, "limit": self.limits.disk_bookkeeping_bytes, "per_tensor": 0}
            ),
        }
        if self.disk is not None:
            pool = self.disk.store.buffers
            buffers["store_pool"] = {
                "used": pool.held_bytes,
                "idle": pool.idle_bytes,
                "in_use": pool.in_use_bytes,
                "idle_limit": pool.idle_limit_bytes,
            }
        budgets: Report = {
            "buffers": buffers,
            "counters": {
                "get_buffer_waits": self.answers.waits,
                "get_preemptions": self.answers.snapshot()["preempted"],
                "put_preemptions": self.puts.snapshot()["preempted"],
            },
        }
        return (
            self.tiers.snapshot(),
            self.sessions.snapshot(self.conns.per_session(), time.monotonic()),
            self.conns.snapshot(),
            budgets,
        )

    def _header(self) -> dict[str, Msgpack]:
        return {"url": self.url, "lease_s": self.config.lease_s, "root": self.config.root}

    def refresh_stats(self) -> None:
        """Take a rate sample and a snapshot for the metrics endpoint."""
        self.stats.refresh(self._header(), *self._reports())

    def snapshot(self) -> dict[str, Msgpack]:
        """Everything ``stats`` and the metrics endpoint show (msgpack-safe)."""
        return self.stats.snapshot(self._header(), *self._reports())


async def _main(config: ServerConfig, on_ready: Callable[[str], None] | None) -> int:
    daemon = Daemon(config)
    try:
        url = await daemon.start()
    except BaseException:
        daemon.pool.shutdown(wait=False)
        daemon.release_root()
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
