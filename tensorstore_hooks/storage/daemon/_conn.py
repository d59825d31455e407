"""The daemon client's transport: URLs, one blocking connection, and the pool of them.

:class:`DaemonStore` (``_daemon_client``) sits on top: it owns the session and the
retry loop; this module owns sockets. Errors: :class:`Lost` means the connection
died or could not be made and the request may be retried; a
:class:`~tensorstore_hooks.errors.StoreUnavailableError` raised here is final (a
TLS certificate that does not verify, a Unix socket owned by another user): no
retry can fix it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import select
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tensorstore_hooks._codec import Buffer, as_memoryview
from tensorstore_hooks.errors import ConfigError, StoreClosedError, StoreUnavailableError
from tensorstore_hooks.protocol import (
    MAGIC,
    PREFIX_BYTES,
    PROTOCOL_VERSION,
    Bye,
    ErrorCode,
    Header,
    Hello,
    ProtocolError,
    Request,
    body_size,
    frame_chunks,
    message_head,
    pack_prefix,
    parse_prefix,
    raise_for_error,
    unpack_header,
)

# Addresses are parsed with every other store URL: NOTE [ Store URL rules ] in _urls.
from tensorstore_hooks.storage._urls import DEFAULT_PORT, DaemonAddress, parse_daemon_url

__all__ = [
    "DEFAULT_PORT",
    "Connection",
    "ConnectionPool",
    "DaemonAddress",
    "Lost",
    "TlsOptions",
    "hello_request",
    "parse_daemon_url",
]

log = logging.getLogger("tensorstore_hooks.daemon_client")


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """Client TLS settings for ``tsh+tls://`` (PEM file paths)."""

    ca: str | None = None
    """CA bundle that signed the daemon's certificate; None: the system's CAs."""
    cert: str | None = None
    """Client certificate, for a daemon started with ``--tls-client-ca``."""
    key: str | None = None
    """Private key of ``cert`` (None: ``cert`` holds both)."""

    def context(self, url: str) -> ssl.SSLContext:
        """A verifying context (certificate and host name checked). Raises ConfigError."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            if self.cert is not None:
                ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                f"DaemonStore({url}): cannot load TLS files (tls_ca={self.ca!r}, "
                f"tls_cert={self.cert!r}, tls_key={self.key!r}; PEM expected): {e}"
            ) from e
        return ctx


def hello_request(
    token: str | None,
    session: str | None,
    *,
    client: str | None = None,
    open_session: bool = True,
) -> Hello:
    """The one place a HELLO is built (stores, resumes, ``close()``'s BYE, ``stats``)."""
    return Hello(
        id=0,
        version=PROTOCOL_VERSION,
        token=token,
        session=session,
        client=client if client is not None else f"tensorstore-hooks pid {os.getpid()}",
        open_session=open_session,
    )


class Lost(Exception):
    """The connection died or could not be made; the request may be retried."""


def _peer_uid(sock: socket.socket) -> int | None:
    if not hasattr(socket, "SO_PEERCRED"):
        return None  # pragma: no cover - not Linux; the socket file's mode still applies
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def _check_peer(sock: socket.socket, addr: DaemonAddress, peer_uid: int | None) -> None:
    # Before the token is sent: a socket path in a shared directory may have been
    # replaced by another user's listener, which must not learn the token.
    uid = _peer_uid(sock)
    allowed = {os.getuid(), 0} if peer_uid is None else {peer_uid}
    if uid is not None and uid not in allowed:
        raise StoreUnavailableError(
            f"DaemonStore({addr.url}): the process listening on {addr.path} runs as uid "
            f"{uid}, not as you (uid {os.getuid()}) or root: refusing to send it the token. "
            f"If that daemon is yours, pass peer_uid={uid}; else move the socket to a "
            "private directory"
        )


_CERT_REFUSED = ("CERTIFICATE_REQUIRED", "UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_UNKNOWN")
"""TLS alerts a daemon sends when it refuses the client's certificate."""


def _cert_refused(client_cert: bool) -> str:
    """Why a daemon with ``--tls-client-ca`` refused this client, and what to do."""
    if client_cert:
        return (
            "the daemon refused this client's certificate: it is not signed by a CA the "
            "daemon trusts (its --tls-client-ca); use a certificate that CA signed"
        )
    return (
        "the daemon refused the connection for want of a client certificate (it was "
        "started with --tls-client-ca): pass tls_cert= and tls_key="
    )


def _tls_failure(
    addr: DaemonAddress, e: ssl.SSLError, client_cert: bool
) -> StoreUnavailableError:
    text = str(e).upper()
    if isinstance(e, ssl.SSLCertVerificationError):
        why = (
            f"the daemon's certificate did not verify ({e.verify_message}); pass "
            "tls_ca= the CA that signed it, and connect by the host name it names"
        )
    elif "WRONG_VERSION_NUMBER" in text or "RECORD LAYER" in text or "PACKET LENGTH" in text:
        why = "the daemon did not answer in TLS: it serves plaintext, use tsh:// instead"
    elif any(alert in text for alert in _CERT_REFUSED):
        why = _cert_refused(client_cert)
    else:
        why = "TLS failed"
    return StoreUnavailableError(f"DaemonStore({addr.url}): {why}: {e}")


class Connection:
    """One blocking socket speaking the protocol. Used by one thread at a time."""

    def __init__(
        self,
        addr: DaemonAddress,
        connect_timeout_s: float,
        io_timeout_s: float,
        *,
        tls: ssl.SSLContext | None = None,
        client_cert: bool = False,
        peer_uid: int | None = None,
    ) -> None:
        """``client_cert``: ``tls`` presents a client certificate (for messages)."""
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
            raise Lost(f"cannot connect: {e}") from e
        try:
            if addr.path is not None:
                _check_peer(sock, addr, peer_uid)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=addr.host)
        except StoreUnavailableError:  # final (another user's socket): never retried
            sock.close()
            raise
        except ssl.SSLError as e:
            sock.close()
            raise _tls_failure(addr, e, client_cert) from e
        except OSError as e:
            sock.close()
            raise Lost(f"TLS handshake: {e}") from e
        except BaseException:
            sock.close()
            raise
        sock.settimeout(io_timeout_s)
        self.addr = addr
        self.sock = sock
        self.tls = tls is not None
        self.client_cert = client_cert
        self.broken = False
        self.session: str | None = None
        self._ids = itertools.count(1)
        self._prefix = bytearray(PREFIX_BYTES)

    def close(self) -> None:
        self.broken = True
        with contextlib.suppress(OSError):
            self.sock.close()

    def alive(self) -> bool:
        """False if the daemon closed this idle connection (EOF or an error frame waits)."""
        if self.broken:
            return False
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return False
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def call(self, req: Request, payload: Buffer | None = None) -> tuple[Header, np.ndarray | None]:
        """Send ``req`` (under a fresh id), return ``(answer header, payload or None)``.

        Raises :class:`Lost` (retryable: transport failure or a connection-level
        error frame) or :class:`ProtocolError` (the daemon refused this request).
        """
        rid = next(self._ids)
        try:
            self._send(dataclasses.replace(req, id=rid).to_header(), payload)
            answer, body = self._recv()
        except ssl.SSLError as e:
            self.close()
            if isinstance(e, ssl.SSLEOFError | ssl.SSLZeroReturnError):
                raise Lost(str(e) + self._first_call_hint(rid)) from e
            raise _tls_failure(self.addr, e, self.client_cert) from e
        except (OSError, EOFError) as e:
            self.close()
            raise Lost((str(e) or type(e).__name__) + self._first_call_hint(rid)) from e
        except ProtocolError as e:
            self.close()  # the daemon's bytes made no sense: never reuse this stream
            raise Lost(f"protocol error from the daemon: {e}") from e
        got = answer.get("id")
        if got is None and answer.get("ok") is not True:
            # A connection-level error (idle timeout, session kicked, busy): retryable,
            # except a refused token (or TLS required) which no retry can fix.
            self.close()
            try:
                raise_for_error(answer)
            except ProtocolError as e:
                if e.code is ErrorCode.UNAUTHORIZED:
                    raise
                raise Lost(str(e)) from e
        if got != rid:
            self.close()
            raise Lost(f"answer for request {got!r} while waiting for {rid}")
        try:
            raise_for_error(answer)
        except ProtocolError as e:
            if e.fatal:
                self.close()
            raise
        return answer, body

    def _first_call_hint(self, rid: int) -> str:
        # TLS 1.3 verifies a client certificate after the client's handshake has
        # finished: a daemon with --tls-client-ca refuses us on the first request,
        # with an alert (the daemon lingers so that it arrives) or, if the alert was
        # lost, a bare EOF. Say what that most likely means.
        if not self.tls or rid != 1:
            return ""
        return (
            " (the daemon closed the TLS connection on the first request; if it was "
            f"started with --tls-client-ca, {_cert_refused(self.client_cert)})"
        )

    def _send(self, header: Header, payload: Buffer | None) -> None:
        view = as_memoryview(payload).cast("B") if payload is not None else memoryview(b"")
        size = len(view)
        if size:
            header["size"] = size
        bufs: list[bytes | memoryview] = []
        for i, (start, stop) in enumerate(frame_chunks(size)):
            bufs.append(
                message_head(header, stop - start) if i == 0 else pack_prefix(0, stop - start)
            )
            if stop > start:
                bufs.append(view[start:stop])
        sock = self.sock
        if self.tls:  # an SSLSocket has no sendmsg; TLS copies into records anyway
            for b in bufs:
                sock.sendall(b)
            return
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

    def _recv(self) -> tuple[Header, np.ndarray | None]:
        prefix = memoryview(self._prefix)
        self._recv_exact(prefix)
        if self._prefix[:4] != MAGIC and self._prefix[0] == 0x15 and not self.tls:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                "the daemon answered with a TLS alert: it serves TLS, use tsh+tls://",
                fatal=True,
            )
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
            if hl != 0 and pl == 0:
                # The daemon cut its answer off (a disk read failed mid-way) and says
                # why in an error frame where the next continuation was due.
                raw = bytearray(hl)
                self._recv_exact(memoryview(raw))
                cut = unpack_header(raw)
                if cut.get("ok") is False:
                    return cut, None
            if hl != 0 or pl == 0 or pos + pl > size:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "bad continuation frame", fatal=True)
            self._recv_exact(view[pos : pos + pl])
            pos += pl
        return header, body


class ConnectionPool:
    """Up to ``limit`` connections, each lent to one thread at a time.

    The pool never talks to the daemon: ``connect`` (given by the store) makes a
    ready connection (handshake done). It holds only sockets and the keepalive's
    stop flag, so a finalizer may close it without touching the store.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.cond = threading.Condition()
        self.idle: list[Connection] = []
        self.open = 0
        """Connections lent out plus idle ones."""
        self.closed = False
        self.stop = threading.Event()
        self._pid = os.getpid()

    def _validate(self) -> None:
        """Check the pool's invariants (called with ``cond`` held); raise if broken."""
        if not 0 <= len(self.idle) <= self.open <= self.limit:
            raise RuntimeError(
                f"connection pool out of step: {len(self.idle)} idle, {self.open} open, "
                f"limit {self.limit} (a bug in tensorstore-hooks; please report it)"
            )
        if self.closed and self.idle:
            raise RuntimeError("connection pool closed with idle connections left")

    def acquire(self, connect: Callable[[], Connection], closed_message: str) -> Connection:
        """An idle live connection, else a new one from ``connect()`` (blocks at the limit)."""
        if self._pid != os.getpid():
            self._after_fork()
        stale: list[Connection] = []
        try:
            with self.cond:
                while True:
                    self._validate()
                    if self.closed:
                        raise StoreClosedError(closed_message)
                    while self.idle:
                        conn = self.idle.pop()
                        if conn.alive():
                            return conn
                        self.open -= 1  # the daemon closed it while idle (idle timeout)
                        stale.append(conn)
                    if self.open < self.limit:
                        self.open += 1
                        break
                    self.cond.wait()
        finally:
            for c in stale:
                c.close()
        try:
            conn = connect()
        except BaseException:
            with self.cond:
                self.open -= 1
                self.cond.notify()
            raise
        return conn

    def release(self, conn: Connection) -> None:
        with self.cond:
            if conn.broken or self.closed:
                self.open -= 1
                conn.close()
            else:
                self.idle.append(conn)
            self._validate()
            self.cond.notify()

    def take_idle(self) -> Connection | None:
        """One idle connection, lent to the caller (``close()`` says BYE on it)."""
        with self.cond:
            return self.idle.pop() if self.idle else None

    def drop_idle(self) -> None:
        """Close every idle connection (after one failed, the others likely did too)."""
        with self.cond:
            conns, self.idle = self.idle, []
            self.open -= len(conns)
            self.cond.notify_all()
        for c in conns:
            c.close()

    def _after_fork(self) -> None:
        # A forked child (a DataLoader worker, say) must not talk on its parent's
        # sockets: close its copies (the parent's connections stay up) and start over.
        self._pid = os.getpid()
        with self.cond:
            conns, self.idle = self.idle, []
            self.open = 0
        for c in conns:
            c.close()

    @property
    def forked(self) -> bool:
        return self._pid != os.getpid()

    def finish(self) -> None:
        """The store was dropped without ``close()`` (garbage, or the interpreter exits):
        end its session with a best-effort BYE on an idle connection, so the daemon frees
        it at once rather than after its lease, then close everything. Never from a
        forked child (the session is its parent's); waits at most 0.5 s."""
        with self.cond:  # the store is gone: nothing else can be using the pool now
            live = not self.closed and not self.forked
            conn = next((c for c in self.idle if c.session is not None), None) if live else None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.sock.settimeout(0.5)
                conn.call(Bye(id=0))
        self.close_all()

    def close_all(self) -> None:
        self.stop.set()
        with self.cond:
            self.closed = True
            conns, self.idle = self.idle, []
            self.cond.notify_all()
        for c in conns:
            c.close()
