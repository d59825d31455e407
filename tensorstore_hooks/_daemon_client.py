"""DaemonStore: the client of the storage daemon (``tsh://HOST:PORT``, ``tsh+unix:///path``).

The daemon itself lives in ``tensorstore_hooks.server`` and is never imported here;
both sides share only :mod:`tensorstore_hooks.protocol`.

NOTE [ Reconnect and resume ]
A connection that fails (reset, EOF, the daemon restarting) is dropped with every
idle pooled connection (they are most likely dead too), and the request is retried
on a fresh connection with jittered exponential backoff until ``reconnect_deadline_s``
has passed, after which :class:`StoreUnavailableError` names the URL. A fresh
connection resumes the session (HELLO with the session id; the token is checked
again), so keys written before are reachable if the daemon still has them: a
restarted daemon with a disk tier keeps every tensor that had reached disk, but
tensors held only in its RAM are gone (reads raise KeyNotFoundError). If the session
itself is gone (its lease expired), a new one is opened and a warning logged.

A PUT retried after a lost answer may leave the first copy behind in the session;
it is freed with the session (``close()`` or the lease).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import socket
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from . import _urls
from ._codec import TensorMeta
from ._store import BlobStore
from ._units import format_bytes
from ._urls import DaemonAddress
from .errors import (
    ConfigError,
    IntegrityError,
    KeyNotFoundError,
    QuotaExceededError,
    StoreUnavailableError,
    TensorStoreError,
)
from .protocol import (
    MAX_KEYS_PER_REQUEST,
    PREFIX_BYTES,
    PROTOCOL_VERSION,
    ErrorCode,
    ProtocolError,
    body_size,
    frame_chunks,
    is_valid_key,
    is_valid_session_id,
    message_head,
    pack_prefix,
    parse_prefix,
    raise_for_error,
    unpack_body,
    unpack_header,
)

__all__ = ["DaemonStore", "fetch_stats", "parse_daemon_url"]

log = logging.getLogger("tensorstore_hooks.daemon_client")


def parse_daemon_url(url: str) -> DaemonAddress:
    """The daemon's address (``_urls.parse_daemon_url``: NOTE [ Store URL rules ] Rule 5).

    ``tsh+tls://`` is refused until this client speaks TLS: never plaintext in its place.
    """
    addr = _urls.parse_daemon_url(url)
    if addr.tls:
        raise ConfigError(
            f"DaemonStore: {url!r}: this client cannot speak TLS yet; use tsh://HOST:PORT "
            "on a trusted network or tsh+unix:///path on the same machine"
        )
    return addr


class _Lost(Exception):
    """The connection died or could not be made; the request may be retried."""


class _Conn:
    """One blocking socket speaking the protocol. Used by one thread at a time."""

    def __init__(self, addr: DaemonAddress, connect_timeout_s: float, io_timeout_s: float) -> None:
        try:
            if addr.path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(connect_timeout_s)
                    sock.connect(addr.path)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((addr.host, addr.port), timeout=connect_timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            raise _Lost(f"cannot connect: {e}") from e
        sock.settimeout(io_timeout_s)
        self.sock = sock
        self.broken = False
        self.session: str | None = None
        self._ids = itertools.count(1)
        self._prefix = bytearray(PREFIX_BYTES)

    def close(self) -> None:
        self.broken = True
        with contextlib.suppress(OSError):
            self.sock.close()

    def call(self, header: dict[str, Any], payload: Any = None) -> tuple[dict[str, Any], Any]:
        """Send a request, return ``(answer header, payload or None)``.

        Raises :class:`_Lost` (retryable: transport failure or a connection-level
        error frame) or :class:`ProtocolError` (the daemon refused this request).
        """
        rid = next(self._ids)
        header["id"] = rid
        try:
            self._send(header, payload)
            answer, body = self._recv()
        except (OSError, EOFError) as e:
            self.close()
            raise _Lost(str(e) or type(e).__name__) from e
        except ProtocolError as e:
            self.close()  # the daemon's bytes made no sense: never reuse this stream
            raise _Lost(f"protocol error from the daemon: {e}") from e
        got = answer.get("id")
        if got is None and answer.get("ok") is not True:
            # A connection-level error (idle timeout, session kicked, busy): retryable,
            # except a refused token which no retry can fix.
            self.close()
            try:
                raise_for_error(answer)
            except ProtocolError as e:
                if e.code is ErrorCode.UNAUTHORIZED:
                    raise
                raise _Lost(str(e)) from e
        if got != rid:
            self.close()
            raise _Lost(f"answer for request {got!r} while waiting for {rid}")
        try:
            raise_for_error(answer)
        except ProtocolError as e:
            if e.fatal:
                self.close()
            raise
        return answer, body

    def _send(self, header: dict[str, Any], payload: Any) -> None:
        view = memoryview(payload).cast("B") if payload is not None else memoryview(b"")
        size = len(view)
        if size:
            header["size"] = size
        bufs: list[Any] = []
        for i, (start, stop) in enumerate(frame_chunks(size)):
            bufs.append(
                message_head(header, stop - start) if i == 0 else pack_prefix(0, stop - start)
            )
            if stop > start:
                bufs.append(view[start:stop])
        sock = self.sock
        while bufs:
            n = sock.sendmsg(bufs)
            while n:
                if n >= len(bufs[0]):
                    n -= len(bufs[0])
                    bufs.pop(0)
                else:
                    bufs[0] = memoryview(bufs[0])[n:]
                    n = 0
            while bufs and not len(bufs[0]):
                bufs.pop(0)

    def _recv_exact(self, view: memoryview) -> None:
        sock = self.sock
        while view:
            n = sock.recv_into(view)
            if n == 0:
                raise EOFError("the daemon closed the connection")
            view = view[n:]

    def _recv(self) -> tuple[dict[str, Any], Any]:
        prefix = memoryview(self._prefix)
        self._recv_exact(prefix)
        header_len, payload_len = parse_prefix(self._prefix)
        if header_len == 0:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "answer without a header", fatal=True)
        raw = bytearray(header_len)
        self._recv_exact(memoryview(raw))
        header = unpack_header(raw)
        size = body_size(header)
        if payload_len > size:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "frame larger than its message", fatal=True)
        if not size:
            return header, None
        body = np.empty(size, dtype=np.uint8)
        view = body.data
        self._recv_exact(view[:payload_len])
        pos = payload_len
        while pos < size:
            self._recv_exact(prefix)
            hl, pl = parse_prefix(self._prefix)
            if hl != 0 or pl == 0 or pos + pl > size:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "bad continuation frame", fatal=True)
            self._recv_exact(view[pos : pos + pl])
            pos += pl
        return header, body


class _Pool:
    """Connections and the keepalive stop flag: what the finalizer may touch (never the store)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.idle: list[_Conn] = []
        self.open = 0
        self.closed = False
        self.stop = threading.Event()

    def close_all(self) -> None:
        self.stop.set()
        with self.cond:
            self.closed = True
            conns, self.idle = self.idle, []
            self.cond.notify_all()
        for c in conns:
            c.close()


def _keepalive(
    ref: weakref.ReferenceType[DaemonStore], stop: threading.Event, every_s: float
) -> None:
    # Holds only a weak reference, so a store its owner forgot to close can still be
    # garbage collected (its finalizer then stops this thread).
    while not stop.wait(every_s):
        store = ref()
        if store is None:
            return
        try:
            store._ping_if_idle(every_s)
        except Exception as e:  # the next real request reports problems
            log.debug("keepalive ping to %s failed: %s", store.url, e)
        del store


class DaemonStore(BlobStore):
    """A :class:`TensorStore` kept by a ``tensorstore-hooks serve`` daemon.

    ``url``: ``tsh://HOST:PORT`` or ``tsh+unix:///path.sock``. ``token``: the daemon's
    token; else the contents of ``token_file``; else the ``TSH_TOKEN`` environment
    variable. Nothing is sent until the first request.

    * Thread-safe: up to ``connections`` sockets, each used by one thread at a time.
    * ``put`` raises :class:`QuotaExceededError` when the daemon's RAM and disk tiers
      are full (the offload hooks then keep the tensor: a fallback).
    * The daemon drops a session that stays silent for its lease; a background
      thread pings while the store is idle. ``close()`` ends the session and frees
      its tensors on the daemon at once.
    * Transport failures are retried, see NOTE [ Reconnect and resume ]; past
      ``reconnect_deadline_s`` they raise :class:`StoreUnavailableError`.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        connections: int = 4,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 120.0,
        reconnect_deadline_s: float = 30.0,
        keepalive: bool = True,
    ) -> None:
        self._addr = parse_daemon_url(url)
        if token is None and token_file is not None:
            try:
                with open(token_file, encoding="utf-8") as f:
                    token = f.read().strip()
            except OSError as e:
                raise ConfigError(
                    f"DaemonStore({self._addr.url}): cannot read token_file: {e}"
                ) from e
        if token is None:
            token = os.environ.get("TSH_TOKEN") or None
        if connections < 1:
            raise ConfigError(f"DaemonStore: connections must be >= 1, got {connections}")
        self._token = token
        self._max_conns = connections
        self._connect_timeout_s = connect_timeout_s
        self._io_timeout_s = io_timeout_s
        self._reconnect_deadline_s = reconnect_deadline_s
        self._keepalive_enabled = keepalive
        self._pool = _Pool()
        self._session_lock = threading.Lock()
        self._session: str | None = None
        self._lease_s = 60.0
        self._limits: dict[str, Any] = {}
        self._last_activity = time.monotonic()
        self._keepalive_thread: threading.Thread | None = None
        self._pid = os.getpid()
        self.sessions_lost = 0
        """How many times the daemon had forgotten this store's session (keys lost)."""
        self._finalizer = weakref.finalize(self, _Pool.close_all, self._pool)

    # -------------------------------------------------------------- plumbing
    @property
    def url(self) -> str:
        return self._addr.url

    def __enter__(self) -> DaemonStore:
        return self

    @property
    def session_id(self) -> str | None:
        """The daemon session (a secret: with the token it grants access to the keys)."""
        return self._session

    def _fail(self, msg: str) -> str:
        return f"DaemonStore({self.url}): {msg}"

    def _connect(self) -> _Conn:
        conn = _Conn(self._addr, self._connect_timeout_s, self._io_timeout_s)
        try:
            with self._session_lock:
                sid = self._session
                try:
                    answer = self._hello(conn, sid)
                except ProtocolError as e:
                    if e.code is not ErrorCode.NOT_FOUND or sid is None:
                        raise
                    self.sessions_lost += 1
                    log.warning(
                        "%s: the daemon no longer knows this store's session (lease expired); "
                        "opened a new one: tensors stored before are gone",
                        self.url,
                    )
                    answer = self._hello(conn, None)
                new_sid = answer.get("session")
                if not is_valid_session_id(new_sid):
                    raise _Lost("HELLO answer without a valid session id")
                self._session = conn.session = new_sid
                lease = answer.get("lease_s")
                if isinstance(lease, int | float) and lease > 0:
                    self._lease_s = float(lease)
                limits = answer.get("limits")
                if isinstance(limits, dict):
                    self._limits = limits
                self._start_keepalive()
        except ProtocolError as e:
            conn.close()
            if e.code is ErrorCode.UNAUTHORIZED:
                raise StoreUnavailableError(
                    self._fail(f"the daemon refused the connection: {e.message}")
                ) from e
            if e.code is ErrorCode.BUSY:
                raise _Lost(str(e)) from e
            raise StoreUnavailableError(self._fail(f"handshake failed: {e}")) from e
        except BaseException:
            conn.close()
            raise
        return conn

    def _hello(self, conn: _Conn, sid: str | None) -> dict[str, Any]:
        answer, _ = conn.call(
            {
                "op": "hello",
                "version": PROTOCOL_VERSION,
                "token": self._token,
                "session": sid,
                "client": f"tensorstore-hooks pid {os.getpid()}",
            }
        )
        return answer

    def _start_keepalive(self) -> None:
        # Called with the session lock held: one thread per store.
        if not self._keepalive_enabled or self._keepalive_thread is not None:
            return
        every = max(0.05, self._lease_s / 3)
        t = threading.Thread(
            target=_keepalive,
            args=(weakref.ref(self), self._pool.stop, every),
            name="tsh-keepalive",
            daemon=True,
        )
        self._keepalive_thread = t
        t.start()

    def _acquire(self) -> _Conn:
        if self._pid != os.getpid():
            self._after_fork()
        pool = self._pool
        with pool.cond:
            while True:
                if pool.closed:
                    raise StoreUnavailableError(self._fail("the store is closed; open a new one"))
                if pool.idle:
                    return pool.idle.pop()
                if pool.open < self._max_conns:
                    pool.open += 1
                    break
                pool.cond.wait()
        try:
            return self._connect()
        except BaseException:
            with pool.cond:
                pool.open -= 1
                pool.cond.notify()
            raise

    def _after_fork(self) -> None:
        # A forked child (a DataLoader worker, say) must not talk on its parent's
        # sockets: close its copies (the parent's connections stay up) and start over.
        self._pid = os.getpid()
        pool = self._pool
        with pool.cond:
            conns, pool.idle = pool.idle, []
            pool.open = 0
        for c in conns:
            c.close()
        self._keepalive_thread = None

    def _release(self, conn: _Conn) -> None:
        pool = self._pool
        with pool.cond:
            if conn.broken or pool.closed:
                pool.open -= 1
                conn.close()
            else:
                pool.idle.append(conn)
            pool.cond.notify()

    def _drop_idle(self) -> None:
        pool = self._pool
        with pool.cond:
            conns, pool.idle = pool.idle, []
            pool.open -= len(conns)
            pool.cond.notify_all()
        for c in conns:
            c.close()

    def _call(
        self, header: dict[str, Any], payload: Any = None, *, retry: bool = True
    ) -> tuple[dict[str, Any], Any]:
        """One request with reconnect/retry; daemon error codes become library errors."""
        deadline: float | None = None
        attempt = 0
        while True:
            conn: _Conn | None = None
            try:
                conn = self._acquire()
                answer, body = conn.call(dict(header), payload)
            except _Lost as e:
                if conn is not None:
                    self._release(conn)
                self._drop_idle()
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self._reconnect_deadline_s
                if not retry or now >= deadline:
                    raise StoreUnavailableError(
                        self._fail(
                            "the daemon is unreachable (gave up after "
                            f"{self._reconnect_deadline_s:g}s): {e}; "
                            "is `tensorstore-hooks serve` running there?"
                        )
                    ) from e
                # Full jitter: clients of a restarted daemon must not reconnect in lockstep.
                delay = random.uniform(0, min(1.0, 0.02 * 2**attempt))
                time.sleep(min(delay, max(0.0, deadline - now)))
                attempt += 1
                continue
            except ProtocolError as e:
                if conn is not None:
                    self._release(conn)
                raise self._translate(e, header) from e
            self._release(conn)
            self._last_activity = time.monotonic()
            return answer, body

    def _translate(self, e: ProtocolError, header: dict[str, Any]) -> TensorStoreError:
        if e.code is ErrorCode.NOT_FOUND:
            return KeyNotFoundError(self._fail(e.message))
        if e.code in (ErrorCode.QUOTA_EXCEEDED, ErrorCode.TOO_LARGE):
            return QuotaExceededError(self._fail(e.message))
        if e.code is ErrorCode.UNAUTHORIZED:
            return StoreUnavailableError(self._fail(f"refused: {e.message}"))
        if e.code is ErrorCode.INTERNAL:
            return StoreUnavailableError(self._fail(f"the daemon failed: {e.message}"))
        return TensorStoreError(self._fail(f"{header.get('op', '?').upper()} rejected: {e}"))

    def _ping_if_idle(self, idle_s: float) -> None:
        if time.monotonic() - self._last_activity >= idle_s and self._session is not None:
            self._call({"op": "ping"}, retry=False)

    def _ping(self) -> dict[str, Any]:
        answer, _ = self._call({"op": "ping"})
        return answer

    @staticmethod
    def _missing_key(key: object, url: str) -> KeyNotFoundError:
        return KeyNotFoundError(f"DaemonStore({url}): no key {key!r} (not a key this store issues)")

    # ------------------------------------------------------------- the store
    def put_blob(self, meta: TensorMeta, payload: Any) -> str:
        n = meta.nbytes
        limit = self._limits.get("max_tensor_bytes")
        if isinstance(limit, int) and n > limit:
            raise QuotaExceededError(
                self._fail(
                    f"a tensor of {format_bytes(n)} exceeds the daemon's max_tensor "
                    f"({format_bytes(limit)})"
                )
            )
        data = memoryview(payload).cast("B") if n else None
        if data is not None and len(data) != n:
            raise IntegrityError(self._fail(f"payload has {len(data)} bytes, metadata says {n}"))
        answer, _ = self._call({"op": "put", "meta": meta.to_dict(), "size": n}, data)
        key = answer.get("key")
        if not is_valid_key(key):
            raise TensorStoreError(self._fail(f"PUT answer carries an invalid key {key!r}"))
        return str(key)

    def get_blob(self, key: str) -> tuple[TensorMeta, Any]:
        if not is_valid_key(key):
            raise self._missing_key(key, self.url)
        answer, body = self._call({"op": "get", "key": key})
        meta = TensorMeta.from_dict(answer.get("meta"))
        if body is None:
            body = np.empty(0, dtype=np.uint8)
        if len(body) != meta.nbytes:
            raise IntegrityError(
                self._fail(f"key {key!r}: {len(body)} payload bytes, metadata says {meta.nbytes}")
            )
        return meta, body

    def meta(self, key: str) -> TensorMeta:
        if not is_valid_key(key):
            raise self._missing_key(key, self.url)
        answer, _ = self._call({"op": "get", "key": key, "head": True})
        return TensorMeta.from_dict(answer.get("meta"))

    def delete(self, key: str) -> None:
        if not is_valid_key(key):
            raise self._missing_key(key, self.url)
        answer, _ = self._call({"op": "delete", "keys": [key]})
        if answer.get("missing"):
            raise KeyNotFoundError(self._fail(f"no key {key!r} to delete"))

    def delete_many(self, keys: Iterable[str]) -> None:
        valid = [k for k in keys if is_valid_key(k)]
        for i in range(0, len(valid), MAX_KEYS_PER_REQUEST):
            self._call({"op": "delete", "keys": valid[i : i + MAX_KEYS_PER_REQUEST]})

    def keys(self) -> Iterator[str]:
        _, body = self._call({"op": "list"})
        keys = unpack_body(body) if body is not None else []
        if not isinstance(keys, list) or not all(is_valid_key(k) for k in keys):
            raise TensorStoreError(self._fail("LIST answer is not a list of keys"))
        return iter(keys)

    def __contains__(self, key: object) -> bool:
        if not is_valid_key(key):
            return False
        try:
            self.meta(str(key))
        except KeyNotFoundError:
            return False
        return True

    def __len__(self) -> int:
        return int(self._ping().get("keys", 0))

    @property
    def nbytes(self) -> int:
        return int(self._ping().get("nbytes", 0))

    def stats(self) -> dict[str, Any]:
        """The daemon's statistics (what ``tensorstore-hooks stats`` shows)."""
        _, body = self._call({"op": "stats"})
        snap = unpack_body(body) if body is not None else {}
        if not isinstance(snap, dict):
            raise TensorStoreError(self._fail("STATS answer is not a map"))
        return snap

    def close(self) -> None:
        """End the session (the daemon frees its tensors at once) and close the sockets.

        Idempotent; never raises because the daemon is unreachable.
        """
        pool = self._pool
        with pool.cond:
            if pool.closed:
                return
            conn = pool.idle.pop() if pool.idle else None
        pool.stop.set()
        if self._keepalive_thread is not None:
            self._keepalive_thread.join(timeout=5.0)
        if self._session is not None:
            try:
                if conn is None:
                    conn = _Conn(self._addr, min(1.0, self._connect_timeout_s), 5.0)
                    self._hello(conn, self._session)
                conn.sock.settimeout(5.0)
                conn.call({"op": "bye"})
            except (_Lost, ProtocolError, OSError) as e:
                log.debug(
                    "%s: BYE failed (%s); the daemon frees the session after its lease", self.url, e
                )
        if conn is not None:
            conn.close()
        pool.close_all()
        self._finalizer.detach()


def fetch_stats(url: str, *, token: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    """One STATS request on an observer connection (no session is opened)."""
    addr = parse_daemon_url(url)
    if token is None:
        token = os.environ.get("TSH_TOKEN") or None
    try:
        conn = _Conn(addr, timeout_s, timeout_s)
    except _Lost as e:
        raise StoreUnavailableError(f"stats: cannot reach the daemon at {addr.url}: {e}") from e
    try:
        conn.call(
            {
                "op": "hello",
                "version": PROTOCOL_VERSION,
                "token": token,
                "open_session": False,
                "client": "tensorstore-hooks stats",
            }
        )
        _, body = conn.call({"op": "stats"})
        with contextlib.suppress(_Lost, ProtocolError):
            conn.call({"op": "bye"})
    except (_Lost, ProtocolError) as e:
        raise StoreUnavailableError(f"stats: {addr.url}: {e}") from e
    finally:
        conn.close()
    snap = unpack_body(body) if body is not None else None
    if not isinstance(snap, dict):
        raise StoreUnavailableError(f"stats: {addr.url}: the answer is not a statistics map")
    return snap
