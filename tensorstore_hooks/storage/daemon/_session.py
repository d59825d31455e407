"""The daemon client's session: connecting, TLS, and the HELLO that opens or resumes it.

:class:`DaemonSession` makes ready connections for :class:`~tensorstore_hooks.
_daemon_client.DaemonStore`'s pool: socket (TCP, TLS or Unix, with the peer check),
then HELLO with the session id so that a fresh connection resumes the session (see
NOTE [ Reconnect and resume ] in ``_daemon_client``).
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable

from tensorstore_hooks.errors import StoreUnavailableError
from tensorstore_hooks.protocol import ErrorCode, Header, ProtocolError, is_valid_session_id
from tensorstore_hooks.storage.daemon._conn import Connection, DaemonAddress, Lost, hello_request

__all__ = ["DaemonSession"]

log = logging.getLogger("tensorstore_hooks.daemon_client")


class DaemonSession:
    """One daemon session: its id, lease and limits, and how to reach it. Thread-safe."""

    def __init__(
        self,
        addr: DaemonAddress,
        token: str | None,
        *,
        tls: ssl.SSLContext | None,
        client_cert: bool = False,
        peer_uid: int | None,
        connect_timeout_s: float,
        io_timeout_s: float,
        on_open: Callable[[], None],
    ) -> None:
        self.addr = addr
        self.tls = tls
        self.client_cert = client_cert
        """``tls`` presents a client certificate (for messages)."""
        self.peer_uid = peer_uid
        self.connect_timeout_s = connect_timeout_s
        self.io_timeout_s = io_timeout_s
        self._token = token
        self._on_open = on_open
        self._lock = threading.Lock()
        self.id: str | None = None
        """The session id (a secret: with the token it grants access to the keys)."""
        self.lease_s = 60.0
        self.limits: Header = {}
        """What the daemon's HELLO answer advertised (``max_tensor_bytes``, ...)."""
        self.lost = 0
        """How many times the daemon had forgotten this session (keys lost)."""

    def _fail(self, msg: str) -> str:
        return f"DaemonStore({self.addr.url}): {msg}"

    def new_conn(self, connect_timeout_s: float, io_timeout_s: float) -> Connection:
        return Connection(
            self.addr,
            connect_timeout_s,
            io_timeout_s,
            tls=self.tls,
            client_cert=self.client_cert,
            peer_uid=self.peer_uid,
        )

    def hello(self, conn: Connection, sid: str | None) -> Header:
        answer, _ = conn.call(hello_request(self._token, sid))
        return answer

    def connect(self) -> Connection:
        """A new connection that has joined (or opened) the session.

        Raises :class:`Lost` (retryable, ``BUSY`` included) or
        :class:`StoreUnavailableError` (refused token, TLS, handshake failure).
        """
        conn = self.new_conn(self.connect_timeout_s, self.io_timeout_s)
        try:
            with self._lock:
                self._join(conn)
                self._on_open()
        except ProtocolError as e:
            conn.close()
            if e.code is ErrorCode.UNAUTHORIZED:
                raise StoreUnavailableError(
                    self._fail(f"the daemon refused the connection: {e.message}")
                ) from e
            if e.code is ErrorCode.BUSY:
                raise Lost(str(e)) from e
            raise StoreUnavailableError(self._fail(f"handshake failed: {e}")) from e
        except BaseException:
            conn.close()
            raise
        return conn

    def _join(self, conn: Connection) -> None:
        sid = self.id
        try:
            answer = self.hello(conn, sid)
        except ProtocolError as e:
            if e.code is not ErrorCode.NOT_FOUND or sid is None:
                raise
            self.lost += 1
            log.warning(
                "%s: the daemon no longer knows this store's session (lease expired); "
                "opened a new one: tensors stored before are gone",
                self.addr.url,
            )
            answer = self.hello(conn, None)
        new_sid = answer.get("session")
        if not is_valid_session_id(new_sid):
            raise Lost("HELLO answer without a valid session id")
        self.id = conn.session = new_sid
        lease = answer.get("lease_s")
        if isinstance(lease, int | float) and lease > 0:
            self.lease_s = float(lease)
        limits = answer.get("limits")
        if isinstance(limits, dict):
            self.limits = limits
