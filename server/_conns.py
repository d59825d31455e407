"""The connection registry: every open connection, which are still in their
handshake, and which belong to each session. The one owner of that state.

NOTE [ Fairness ]
One event loop serves every connection, so a connection must give the loop back:

1. Each connection's requests queue in its own socket and are served in order,
   one per turn: after each request the task yields (``sleep(0)``), and the loop
   polls every socket before it runs that task again. A client pipelining pings
   therefore gets one request per round, like every other connection.
2. A lease is renewed when a request is received, not when it is served: the
   request handler renews it as soon as the header is read, and housekeeping,
   before it expires anything, renews every session with a request in progress
   or bytes waiting on one of its sockets (:meth:`ConnRegistry.busy_sessions`).
   A session with a request waiting never expires.
3. Connections that have not said HELLO do not count against ``max_connections``:
   they have their own, smaller cap (``max_unauthenticated``) and a short
   handshake deadline, and when that cap is full the oldest of them is dropped
   to make room, so idle connections cannot lock out real clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

from tensorstore_hooks.protocol import ErrorCode, Msgpack, error_header

from ._model import Session
from ._wire import FrameConn

__all__ = ["Conn", "ConnRegistry"]


@dataclass(eq=False)
class Conn:
    """One connection's state, owned by its handler task (the registry files it)."""

    wire: FrameConn
    peer: str
    task: asyncio.Task[None] | None = None
    session: Session | None = None
    observer: bool = False
    idle: bool = True
    """True while waiting for the next message: the only time the task may be cancelled."""
    kick_reason: str | None = None
    authenticated: bool = False
    """True once HELLO succeeded; until then the connection counts as unauthenticated."""


class ConnRegistry:
    """Every open connection. Event-loop thread only; see NOTE [ Fairness ], rule 3."""

    def __init__(self, max_connections: int, max_unauthenticated: int) -> None:
        self.max_connections = max_connections
        self.max_unauthenticated = max_unauthenticated
        self.draining = False
        """True once the daemon stops: no new connections, no new requests."""
        self._all: set[Conn] = set()
        self._pending: dict[Conn, None] = {}  # in their handshake, oldest first
        self._by_session: dict[str, set[Conn]] = {}
        self._closed_bytes_in = 0
        self._closed_bytes_out = 0
        self.accepted = 0
        self.refused = 0
        self.evicted_unauthenticated = 0

    def __iter__(self) -> Iterator[Conn]:
        return iter(list(self._all))

    # ----------------------------------------------------------------- joins
    def add(self, c: Conn) -> Conn | None:
        """File a new connection (in its handshake). Returns the oldest connection
        still in its handshake if the cap made it give way: the caller tells it why
        and cancels its task (rule 3)."""
        evicted = None
        if len(self._pending) >= self.max_unauthenticated:
            evicted = next(iter(self._pending))
            del self._pending[evicted]
            self.evicted_unauthenticated += 1
            evicted.wire.send_nowait(
                error_header(
                    ErrorCode.BUSY,
                    f"dropped: {self.max_unauthenticated} newer connections are waiting "
                    "for their HELLO; send HELLO at once after connecting",
                    fatal=True,
                )
            )
        self.accepted += 1
        self._all.add(c)
        self._pending[c] = None
        return evicted

    def authenticated_count(self) -> int:
        # Not len(_all) - len(_pending): an evicted connection leaves _pending at once
        # but _all only when its task has run its cleanup.
        return sum(1 for c in self._all if c.authenticated)

    def authenticate(self, c: Conn) -> bool:
        """HELLO succeeded on ``c``; False (and counted) when the cap is full."""
        if self.authenticated_count() >= self.max_connections:
            self.refused += 1
            return False
        c.authenticated = True
        self._pending.pop(c, None)
        return True

    def attach(self, c: Conn, s: Session) -> None:
        """``c`` serves session ``s`` from now on."""
        c.session = s
        self._by_session.setdefault(s.id, set()).add(c)

    def detach(self, c: Conn) -> None:
        """``c`` no longer serves a session (BYE)."""
        s, c.session = c.session, None
        if s is not None:
            conns = self._by_session.get(s.id)
            if conns is not None:
                conns.discard(c)
                if not conns:
                    del self._by_session[s.id]

    def remove(self, c: Conn) -> None:
        """``c`` closed (its task's last step). Idempotent."""
        if c not in self._all:
            return
        self.detach(c)
        self._all.discard(c)
        self._pending.pop(c, None)
        self._closed_bytes_in += c.wire.bytes_in
        self._closed_bytes_out += c.wire.bytes_out

    # --------------------------------------------------------------- actions
    def kick(self, s: Session, reason: str, keep: Conn | None = None) -> None:
        """Close ``s``'s connections but ``keep``: idle ones now, busy ones after their
        request (a task is only cancelled while it waits for a message)."""
        for other in list(self._by_session.get(s.id, ())):
            if other is keep:
                continue
            other.kick_reason = reason
            if other.idle and other.task is not None:
                other.task.cancel()

    def busy_sessions(self) -> list[Session]:
        """Sessions with a request in progress or bytes waiting on a socket (rule 2)."""
        return [
            c.session
            for c in self._all
            if c.session is not None and (not c.idle or c.wire.has_input())
        ]

    def refuse_while_draining(self, wire: FrameConn) -> bool:
        """True (and the peer told so) if the daemon is stopping."""
        if not self.draining:
            return False
        self.refused += 1
        wire.send_nowait(error_header(ErrorCode.BUSY, "the daemon is stopping", fatal=True))
        wire.close()
        return True

    def idle_tasks(self) -> list[asyncio.Task[None]]:
        return [c.task for c in self._all if c.idle and c.task is not None]

    def tasks(self) -> list[asyncio.Task[None]]:
        return [c.task for c in self._all if c.task is not None]

    # ----------------------------------------------------------------- report
    def per_session(self) -> dict[str, int]:
        """Session id -> its open connections."""
        return {sid: len(conns) for sid, conns in self._by_session.items()}

    def snapshot(self) -> dict[str, Msgpack]:
        """This part of ``stats``: connection counts and the connection counters."""
        return {
            "connections": len(self._all),
            "unauthenticated": len(self._pending),
            "max_connections": self.max_connections,
            "counters": {
                "connections": self.accepted,
                "refused": self.refused,
                "evicted_unauthenticated": self.evicted_unauthenticated,
                "bytes_in": self._closed_bytes_in + sum(c.wire.bytes_in for c in self._all),
                "bytes_out": self._closed_bytes_out + sum(c.wire.bytes_out for c in self._all),
            },
        }
