"""The daemon: listening, one task per connection, request dispatch, leases, shutdown.

Threads: everything here runs on the event-loop thread except disk-tier I/O, which
runs on a small thread pool (see ``_tiers``), and the optional Prometheus endpoint,
which reads an immutable snapshot refreshed by the housekeeping task.

A connection task is only ever cancelled while it waits for the next message (or at
the end of the drain period on shutdown), never in the middle of a request: a
session that ends under a busy connection is noticed when that request completes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import hmac
import logging
import os
import secrets
import signal
import socket
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from tensorstore_hooks.errors import ConfigError
from tensorstore_hooks.protocol import (
    MAX_FRAME_PAYLOAD,
    MAX_KEYS_PER_REQUEST,
    PROTOCOL_VERSION,
    Bye,
    Delete,
    ErrorCode,
    Get,
    Hello,
    ListKeys,
    Ping,
    ProtocolError,
    Put,
    Request,
    Stats,
    error_header,
    parse_request,
)

from ._config import ServerConfig, parse_address, read_token
from ._journal import DISK_NAMESPACE, StateJournal
from ._sessions import Session, SessionTable
from ._tiers import Reservation, TierError, Tiers
from ._wire import ConnectionClosed, FrameConn, Head

__all__ = ["Daemon", "serve", "server_version"]

log = logging.getLogger("tensorstore_hooks.server")

_HOUSEKEEPING_S = 0.25
_RATE_WINDOW_S = 10.0
_OPS = ("hello", "put", "get", "delete", "list", "ping", "stats", "bye")


def server_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tensorstore-hooks")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"


@dataclass(eq=False)
class _Client:
    """Per-connection state, owned by its handler task."""

    conn: FrameConn
    peer: str
    task: asyncio.Task[None] | None = None
    session: Session | None = None
    observer: bool = False
    idle: bool = True
    """True while waiting for the next message: the only time the task may be cancelled."""
    kick_reason: str | None = None


class Daemon:
    """One daemon instance. ``await start()``, then ``await run()`` until stopped."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.limits = config.limits
        self.token = read_token(config.token_file) if config.token_file else None
        self.url = ""
        self.started = time.monotonic()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tsh-disk")
        self._disk: Any = None
        self.journal: StateJournal | None = None
        self.tiers: Tiers
        self.sessions: SessionTable
        self._listeners: list[socket.socket] = []
        self._unix_path: str | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._clients: set[_Client] = set()
        self._stop = asyncio.Event()
        self._draining = False
        self.counters: dict[str, int] = dict.fromkeys(
            (*_OPS, "errors", "connections", "refused", "bytes_in", "bytes_out"), 0
        )
        self._rate_samples: collections.deque[tuple[float, dict[str, int]]] = collections.deque()
        self.latest_snapshot: dict[str, Any] = {}
        self._metrics_stop: Callable[[], None] | None = None

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> str:
        """Open the tiers (recovering a previous run's state), bind, start accepting.

        Returns the URL clients use (``tsh://HOST:PORT`` or ``tsh+unix:///path``).
        """
        cfg = self.config
        if cfg.disk_enabled:
            assert cfg.root is not None
            from tensorstore_hooks._zarr_store import ZarrStore

            # No spare chunk files: the disk quota counts live bytes, and the
            # directory must hold no more than that.
            self._disk = ZarrStore(cfg.root, namespace=DISK_NAMESPACE, spare_bytes=0)
            self.journal = StateJournal(cfg.root)
        self.tiers = Tiers(
            memory_quota=cfg.memory_quota_bytes,
            disk_quota=cfg.disk_quota_bytes,
            disk=self._disk,
            pool=self._pool,
            staging_bytes=self.limits.staging_bytes,
        )
        self.sessions = SessionTable(self.tiers, self.journal, cfg.lease_s)
        if self._disk is not None:
            self._recover()
        loop = asyncio.get_running_loop()
        self._bind()
        for lsock in self._listeners:
            self._spawn(self._accept_loop(lsock))
        self._spawn(self._housekeeping())
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        self._refresh_snapshot()
        if cfg.metrics:
            from ._metrics import start_metrics_server

            try:
                self._metrics_stop = start_metrics_server(cfg.metrics, lambda: self.latest_snapshot)
            except OSError as e:
                raise ConfigError(
                    f"daemon config: metrics {cfg.metrics}: cannot listen: {e}"
                ) from e
        log.info(
            "serving %s: RAM quota %d bytes, disk %s, lease %gs, token %s",
            self.url,
            cfg.memory_quota_bytes,
            f"{cfg.root} quota {cfg.disk_quota_bytes} bytes" if self._disk is not None else "none",
            cfg.lease_s,
            "required" if self.token else "not required",
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
        self._draining = True
        # Stop the accept loops before closing their sockets (they are registered
        # with the selector until cancelled).
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for lsock in self._listeners:
            lsock.close()
        if self._unix_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._unix_path)
        for c in list(self._clients):
            if c.idle and c.task is not None:
                c.task.cancel()
        busy = [c.task for c in self._clients if c.task is not None]
        if busy:
            _, pending = await asyncio.wait(busy, timeout=self.limits.drain_timeout_s)
            for t in pending:
                t.cancel()
            if pending:
                log.warning("%d connections did not finish within the drain timeout", len(pending))
                await asyncio.wait(pending, timeout=1.0)
        if self._disk is not None:
            await self.tiers.drain()
        self._pool.shutdown(wait=True)
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

    # --------------------------------------------------------------- binding
    def _bind(self) -> None:
        cfg = self.config
        if cfg.unix is not None:
            path = os.path.abspath(cfg.unix)
            _remove_stale_socket(path)
            lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                old = os.umask(0o177)  # the socket file is created 0600: owner only
                try:
                    lsock.bind(path)
                finally:
                    os.umask(old)
                lsock.listen(128)
            except BaseException:
                lsock.close()
                raise
            self._unix_path = path
            self.url = f"tsh+unix://{path}"
        else:
            assert cfg.listen is not None
            host, port = parse_address(cfg.listen)
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family = infos[0][0]
            lsock = socket.create_server((host, port), family=family, backlog=128)
            bound = lsock.getsockname()
            shown = f"[{bound[0]}]" if family == socket.AF_INET6 else bound[0]
            self.url = f"tsh://{shown}:{bound[1]}"
        lsock.setblocking(False)
        self._listeners.append(lsock)

    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(lsock)
            except OSError as e:
                # EMFILE and friends: back off instead of spinning.
                log.warning("accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = FrameConn(sock, self.limits.read_timeout_s)
            if len(self._clients) >= self.limits.max_connections or self._draining:
                self.counters["refused"] += 1
                conn.send_nowait(
                    error_header(
                        ErrorCode.BUSY,
                        f"the daemon is at its connection cap ({self.limits.max_connections})",
                        fatal=True,
                    )
                )
                conn.close()
                continue
            self.counters["connections"] += 1
            client = _Client(conn, peer=str(addr) if addr else "unix")
            self._clients.add(client)
            client.task = loop.create_task(self._handle(client))

    # ------------------------------------------------------------ connection
    async def _handle(self, c: _Client) -> None:
        conn = c.conn
        linger = False
        try:
            await self._handshake(c)
            while not self._draining and c.kick_reason is None:
                c.idle = True
                head = await conn.read_head(self.limits.idle_timeout_s)
                c.idle = False
                if not await self._dispatch(c, head):
                    break
            if c.kick_reason is not None:
                conn.send_nowait(error_header(ErrorCode.NOT_FOUND, c.kick_reason, fatal=True))
        except asyncio.CancelledError:
            if c.kick_reason is not None:
                conn.send_nowait(error_header(ErrorCode.NOT_FOUND, c.kick_reason, fatal=True))
        except ConnectionClosed:
            log.debug("connection %s closed by the peer", c.peer)
        except TimeoutError:
            log.info("closing connection %s: timed out", c.peer)
            conn.send_nowait(
                error_header(ErrorCode.BAD_REQUEST, "timed out waiting for the client", fatal=True)
            )
        except ProtocolError as e:
            self.counters["errors"] += 1
            log.warning("closing connection %s: %s", c.peer, e)
            conn.send_nowait(error_header(e.code, e.message, fatal=True))
            linger = True
        except Exception as e:
            self.counters["errors"] += 1
            log.exception("closing connection %s after an internal error", c.peer)
            conn.send_nowait(error_header(ErrorCode.INTERNAL, f"internal error: {e}", fatal=True))
            linger = True
        finally:
            if c.session is not None:
                c.session.conns.discard(c)
            self._clients.discard(c)
        try:
            if linger and not self._draining:
                await conn.linger_close()
        finally:
            self.counters["bytes_in"] += conn.bytes_in
            self.counters["bytes_out"] += conn.bytes_out
            conn.close()

    async def _handshake(self, c: _Client) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.handshake_timeout_s
        for _ in range(3):
            head = await c.conn.read_head(max(0.001, deadline - loop.time()))
            if head.size:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "HELLO carries no payload", fatal=True)
            try:
                req = parse_request(head.header)
            except ProtocolError as e:
                raise ProtocolError(e.code, e.message, fatal=True) from e
            if not isinstance(req, Hello):
                raise ProtocolError(
                    ErrorCode.UNAUTHORIZED, "the first message must be HELLO", fatal=True
                )
            self.counters["hello"] += 1
            if req.version != PROTOCOL_VERSION:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    f"protocol version {req.version} is not supported (this daemon speaks "
                    f"{PROTOCOL_VERSION}); upgrade tensorstore-hooks on both sides",
                    fatal=True,
                )
            if self.token is not None and not (
                req.token is not None
                and hmac.compare_digest(req.token.encode("utf-8"), self.token.encode("utf-8"))
            ):
                raise ProtocolError(
                    ErrorCode.UNAUTHORIZED,
                    "missing or wrong token: pass token= to the store or set TSH_TOKEN",
                    fatal=True,
                )
            resumed = False
            if not req.open_session:
                c.observer = True
            elif req.session is not None:
                s = self.sessions.get(req.session)
                if s is None:
                    await c.conn.send(
                        error_header(
                            ErrorCode.NOT_FOUND,
                            "session unknown or expired (its tensors were freed); "
                            "send HELLO without a session to open a new one",
                            req_id=req.id,
                        )
                    )
                    continue
                c.session = s
                resumed = True
            else:
                c.session = self.sessions.open()
            if c.session is not None:
                c.session.conns.add(c)
                c.session.last_seen = time.monotonic()
                if resumed:
                    log.info("session %s joined from %s (%r)", c.session.label, c.peer, req.client)
            await c.conn.send(
                {
                    "id": req.id,
                    "ok": True,
                    "session": c.session.id if c.session is not None else None,
                    "resumed": resumed,
                    "lease_s": self.config.lease_s,
                    "server": server_version(),
                    "version": PROTOCOL_VERSION,
                    "limits": {
                        "max_tensor_bytes": self.limits.max_tensor_bytes,
                        "max_frame_payload": MAX_FRAME_PAYLOAD,
                        "max_keys_per_request": MAX_KEYS_PER_REQUEST,
                        "memory_quota": self.config.memory_quota_bytes,
                        "disk_quota": self.tiers.disk_quota,
                    },
                }
            )
            return
        raise ProtocolError(ErrorCode.BAD_REQUEST, "too many HELLO attempts", fatal=True)

    async def _error(self, c: _Client, code: ErrorCode, message: str, req_id: int | None) -> bool:
        self.counters["errors"] += 1
        await c.conn.send(error_header(code, message, req_id=req_id))
        return True

    async def _dispatch(self, c: _Client, head: Head) -> bool:
        """Serve one request; returns False when the connection should close."""
        h = head.header
        raw_id = h.get("id")
        req_id = raw_id if isinstance(raw_id, int) and not isinstance(raw_id, bool) else None
        if head.size > self.limits.max_tensor_bytes:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"message of {head.size} bytes > max_tensor ({self.limits.max_tensor_bytes})",
                fatal=True,
            )
        try:
            req: Request = parse_request(h)
        except ProtocolError as e:
            await c.conn.read_body(head, None)  # keep the stream in step, then answer
            return await self._error(c, e.code, e.message, req_id)
        if head.size and not isinstance(req, Put):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "only PUT carries a payload", fatal=True)
        op = _op_name(req)
        self.counters[op] += 1
        s = c.session
        if s is not None:
            if s.ended:
                raise ProtocolError(ErrorCode.NOT_FOUND, "the session has ended", fatal=True)
            s.last_seen = time.monotonic()
            s.requests += 1
        if isinstance(req, Ping):
            reply: dict[str, Any] = {"id": req.id, "ok": True, "lease_s": self.config.lease_s}
            if s is not None:
                reply.update(keys=len(s.entries), nbytes=s.nbytes)
            await c.conn.send(reply)
            return True
        if isinstance(req, Stats):
            body = msgpack.packb(self.snapshot(), use_bin_type=True)
            await c.conn.send({"id": req.id, "ok": True}, body)
            return True
        if isinstance(req, Bye):
            if s is not None:
                self.sessions.end(s, "closed by the client")
                self._kick(s, "the session was closed by another connection", keep=c)
                c.session = None
            await c.conn.send({"id": req.id, "ok": True})
            return False
        if isinstance(req, Hello):
            return await self._error(c, ErrorCode.BAD_REQUEST, "HELLO was already done", req.id)
        if s is None:
            await c.conn.read_body(head, None)
            return await self._error(
                c,
                ErrorCode.BAD_REQUEST,
                f"{op.upper()} needs a session (observer connection)",
                req.id,
            )
        if isinstance(req, Put):
            return await self._put(c, s, req, head)
        if isinstance(req, Get):
            found = s.entries.get(req.key)
            if found is None:
                return await self._error(c, ErrorCode.NOT_FOUND, _missing(req.key), req.id)
            reply = {"id": req.id, "ok": True, "meta": found.meta.to_dict(), "tier": found.tier}
            if req.head:
                await c.conn.send(reply)
                return True
            try:
                buf = await self.tiers.read(found)
            except TierError as err:
                return await self._error(c, err.code, err.message, req.id)
            await c.conn.send(reply, buf)
            return True
        if isinstance(req, Delete):
            missing = []
            for key in req.keys:
                entry = s.entries.get(key)
                if entry is None:
                    missing.append(key)
                else:
                    self.sessions.free(entry)
            await c.conn.send(
                {
                    "id": req.id,
                    "ok": True,
                    "deleted": len(req.keys) - len(missing),
                    "missing": missing,
                }
            )
            return True
        if isinstance(req, ListKeys):
            body = msgpack.packb(list(s.entries), use_bin_type=True)
            await c.conn.send({"id": req.id, "ok": True}, body)
            return True
        raise AssertionError(f"unhandled request {req!r}")  # pragma: no cover

    async def _put(self, c: _Client, s: Session, req: Put, head: Head) -> bool:
        try:
            res: Reservation = await self.tiers.admit(req.size)
        except TierError as err:
            await c.conn.read_body(head, None)
            return await self._error(c, err.code, err.message, req.id)
        try:
            # Receive straight into the buffer the tensor will live in.
            buf = np.empty(req.size, dtype=np.uint8)
            await c.conn.read_body(head, buf.data)
            if s.ended:
                return await self._error(c, ErrorCode.NOT_FOUND, "the session has ended", req.id)
            key = secrets.token_urlsafe(16)
            if res.tier == "ram":
                self.sessions.store_ram(s, res, key, req.meta, buf)
            else:
                await self.sessions.store_disk(s, res, key, req.meta, buf)
        except TierError as err:
            return await self._error(c, err.code, err.message, req.id)
        finally:
            self.tiers.release(res)
        s.last_seen = time.monotonic()
        await c.conn.send({"id": req.id, "ok": True, "key": key, "tier": res.tier})
        return True

    def _kick(self, s: Session, reason: str, keep: _Client | None = None) -> None:
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
                for s in self.sessions.expire(time.monotonic()):
                    self._kick(s, f"session expired after {self.config.lease_s:g}s without traffic")
                if self.journal is not None and self.journal.needs_compaction():
                    self.sessions.compact_journal()
                self._refresh_snapshot()
            except Exception:  # pragma: no cover - keep the daemon alive
                log.exception("housekeeping failed")

    def _recover(self) -> None:
        """Re-adopt the previous run's sessions and disk-tier tensors; collect orphans."""
        assert self.journal is not None and self._disk is not None
        sessions, keys = self.journal.load()
        for sid, created in sessions.items():
            self.sessions.restore(sid, created)
        on_disk = set(self._disk.keys())
        adopted: set[str] = set()
        for key, rec in keys.items():
            owner = self.sessions.get(rec.session)
            if owner is None or rec.disk_key not in on_disk or rec.disk_key in adopted:
                continue
            self.sessions.restore_key(key, owner, self._disk.meta(rec.disk_key), rec)
            adopted.add(rec.disk_key)
        orphans = sorted(on_disk - adopted)
        if orphans:
            self._disk.delete_many(orphans)
        self.sessions.compact_journal()
        if sessions or on_disk:
            log.info(
                "recovered %d sessions and %d disk-tier tensors (%d bytes); collected %d orphans",
                len(sessions),
                len(adopted),
                self.tiers.disk_used,
                len(orphans),
            )

    # ----------------------------------------------------------------- stats
    def _live_bytes(self) -> tuple[int, int]:
        bi = self.counters["bytes_in"] + sum(c.conn.bytes_in for c in self._clients)
        bo = self.counters["bytes_out"] + sum(c.conn.bytes_out for c in self._clients)
        return bi, bo

    def _refresh_snapshot(self) -> None:
        now = time.monotonic()
        counts = dict(self.counters)
        counts["bytes_in"], counts["bytes_out"] = self._live_bytes()
        self._rate_samples.append((now, counts))
        while len(self._rate_samples) > 2 and now - self._rate_samples[1][0] >= _RATE_WINDOW_S:
            self._rate_samples.popleft()
        self.latest_snapshot = self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        """Everything ``stats`` and the metrics endpoint show (msgpack-safe)."""
        now = time.monotonic()
        counts = dict(self.counters)
        counts["bytes_in"], counts["bytes_out"] = self._live_bytes()
        rates: dict[str, float] = {}
        if self._rate_samples:
            t0, c0 = self._rate_samples[0]
            dt = now - t0
            if dt > 0.05:
                rates = {
                    k: (counts[k] - c0.get(k, 0)) / dt for k in (*_OPS, "bytes_in", "bytes_out")
                }
        sessions = sorted(self.sessions.sessions.values(), key=lambda s: -s.nbytes)
        return {
            "server": server_version(),
            "url": self.url,
            "pid": os.getpid(),
            "uptime_s": now - self.started,
            "lease_s": self.config.lease_s,
            "root": self.config.root,
            "tiers": self.tiers.snapshot(),
            "counters": {
                **counts,
                "spills": self.tiers.spills,
                "spill_bytes": self.tiers.spill_bytes,
                "spill_failures": self.tiers.spill_failures,
                "quota_rejected": self.tiers.quota_rejected,
                "sessions_opened": self.sessions.opened,
                "sessions_expired": self.sessions.expired,
                "expired_bytes": self.sessions.expired_bytes,
            },
            "rates": rates,
            "connections": len(self._clients),
            "max_connections": self.limits.max_connections,
            "sessions_total": len(sessions),
            "sessions": [
                {
                    "id": s.label,
                    "tensors": len(s.entries),
                    "ram_bytes": s.ram_bytes,
                    "disk_bytes": s.disk_bytes,
                    "connections": len(s.conns),
                    "idle_s": now - s.last_seen,
                    "lease_left_s": max(0.0, self.config.lease_s - (now - s.last_seen)),
                    "requests": s.requests,
                }
                for s in sessions[:200]
            ],
        }


def _remove_stale_socket(path: str) -> None:
    """Remove a Unix socket left by a daemon that died; refuse to steal a live one."""
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return  # not a socket: bind() reports the conflict
    except FileNotFoundError:
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    except OSError:
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another daemon is listening on {path}")


def _op_name(req: Request) -> str:
    return {
        Hello: "hello",
        Put: "put",
        Get: "get",
        Delete: "delete",
        ListKeys: "list",
        Ping: "ping",
        Stats: "stats",
        Bye: "bye",
    }[type(req)]


def _missing(key: str) -> str:
    return (
        f"no key {key!r} in this session (never stored, already deleted, another session's, "
        "or held in RAM by a daemon that restarted)"
    )


async def _main(config: ServerConfig, on_ready: Callable[[str], None] | None) -> int:
    daemon = Daemon(config)
    try:
        url = await daemon.start()
    except BaseException:
        daemon._pool.shutdown(wait=False)
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
