"""Memory the daemon holds for payloads in flight: PUT payloads bound for disk, GET
answers read from disk. Both are bounded, counted in pieces as bytes move.

NOTE [ Payload bytes as they arrive ]
A PUT placed on the disk tier is received into a transient buffer and written to
disk before it is acknowledged; :class:`PayloadBudget` (``limits.put_buffer``) bounds
those buffers in total. Reserving a PUT's whole size before its payload arrives would
let a peer that sent half of a 256 MiB PUT and stopped hold the whole budget, and
every other client's disk-bound PUT would wait for the read deadline. So:

1. A PUT takes budget in pieces of at most :data:`PIECE_BYTES`, just before it
   receives each piece: what a slow peer holds is what it actually sent, plus one
   piece.
2. A piece is granted if it fits, in order of asking. The *oldest* PUT in
   progress is always granted, even past the limit: partial holders waiting for
   each other can never deadlock, and the overshoot is at most the rest of one
   PUT (at most ``max_tensor``).
3. Waiting for budget is the daemon's doing, not the peer's: it does not count
   against the peer's read deadline (``_wire``).

NOTE [ Answers read from disk ]
A GET of a disk-tier tensor is streamed: the daemon reads one piece (whole chunks,
about :data:`ANSWER_PIECE_BYTES`), sends it as one frame, and only then reads the
next, so a connection holds at most one piece at a time whatever the tensor's size.
:class:`AnswerBudget` bounds the pieces held per session (``limits.session_get_buffer``)
and in total (``limits.get_buffer``):

1. A piece is taken just before it is read from disk and returned once the socket
   took all of it. A client that does not read its answers therefore holds at most
   one piece per connection, and never more than its session's share: it stalls
   its own session's GETs, not other sessions' (their pieces come from the rest of
   the total, and a stalled send is dropped after ``read_timeout``).
2. Pieces are granted in order of asking, except that a request whose *session* is
   at its share waits without holding up requests of other sessions behind it.
3. A piece larger than a limit is granted when nothing else holds that budget (so
   a small limit slows GETs down, never refuses them).
An answer served from the RAM tier is sent from the tensor's own buffer: no copy,
nothing to count.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

__all__ = [
    "ANSWER_PIECE_BYTES",
    "PIECE_BYTES",
    "AnswerBudget",
    "PayloadBudget",
    "PayloadTicket",
]

PIECE_BYTES = 1 << 20
"""A PUT's payload is counted in pieces of this size (NOTE [ Payload bytes as they arrive ])."""
ANSWER_PIECE_BYTES = 4 << 20
"""A GET answer read from disk is read and sent in pieces of about this size (whole
chunks: at least one chunk, NOTE [ Answers read from disk ])."""


class PayloadTicket:
    """One PUT's share of the budget; :meth:`PayloadBudget.close` returns it."""

    __slots__ = ("held", "order")

    def __init__(self, order: int) -> None:
        self.order = order
        self.held = 0


class PayloadBudget:
    """Disk-bound PUT payloads (NOTE [ Payload bytes as they arrive ]). Event-loop only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._open: dict[int, PayloadTicket] = {}  # insertion order = oldest first
        self._waiters: collections.deque[tuple[PayloadTicket, int, asyncio.Future[None]]] = (
            collections.deque()
        )
        self._orders = itertools.count()

    def open(self) -> PayloadTicket:
        t = PayloadTicket(next(self._orders))
        self._open[t.order] = t
        return t

    def _oldest(self) -> PayloadTicket | None:
        return next(iter(self._open.values()), None)

    def _grant(self, t: PayloadTicket, n: int) -> None:
        self.used += n
        t.held += n

    async def take(self, t: PayloadTicket, n: int) -> None:
        """Count ``n`` more bytes for ``t`` (waits while the budget is full)."""
        if t is self._oldest() or (not self._waiters and self.used + n <= self.limit):
            self._grant(t, n)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        item = (t, n, fut)
        self._waiters.append(item)
        try:
            await fut
        except asyncio.CancelledError:
            if item in self._waiters:
                self._waiters.remove(item)
            raise  # a grant already made stays with t: close() returns it

    def close(self, t: PayloadTicket) -> None:
        """Return everything ``t`` holds. Idempotent."""
        if self._open.pop(t.order, None) is None:
            return
        self.used -= t.held
        t.held = 0
        self._wake()

    def _wake(self) -> None:
        # Drop waiters that gave up, then rule 2: the oldest PUT first, then in
        # order of asking while pieces fit.
        self._waiters = collections.deque(
            w for w in self._waiters if not w[2].done() and w[0].order in self._open
        )
        oldest = self._oldest()
        for item in list(self._waiters):
            if item[0] is oldest:
                self._waiters.remove(item)
                self._grant(item[0], item[1])
                item[2].set_result(None)
        while self._waiters and self.used + self._waiters[0][1] <= self.limit:
            t, n, fut = self._waiters.popleft()
            self._grant(t, n)
            fut.set_result(None)

    def snapshot(self) -> dict[str, int]:
        return {"used": self.used, "limit": self.limit}


@dataclass(eq=False, slots=True)
class _Ask:
    session: str
    n: int
    fut: asyncio.Future[None]


class AnswerBudget:
    """GET answers read from disk, per session and in total. Event-loop thread only.

    See NOTE [ Answers read from disk ].
    """

    def __init__(self, limit: int, session_limit: int) -> None:
        self.limit = limit
        self.session_limit = session_limit
        self.used = 0
        self._by_session: dict[str, int] = {}
        self._waiters: collections.deque[_Ask] = collections.deque()
        self.waits = 0
        """Pieces that had to wait for room (a counter, for ``stats``)."""

    def _session_fits(self, session: str, n: int) -> bool:
        held = self._by_session.get(session, 0)
        return held == 0 or held + n <= self.session_limit

    def _total_fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    def _grant(self, session: str, n: int) -> None:
        self.used += n
        self._by_session[session] = self._by_session.get(session, 0) + n

    @contextlib.asynccontextmanager
    async def hold(self, session: str, n: int) -> AsyncIterator[None]:
        """Hold ``n`` bytes for ``session`` while the body runs (waits for room first)."""
        await self._acquire(session, n)
        try:
            yield
        finally:
            self._release(session, n)

    async def _acquire(self, session: str, n: int) -> None:
        ask = _Ask(session, n, asyncio.get_running_loop().create_future())
        self._waiters.append(ask)
        self._wake()
        if ask.fut.done():
            return  # granted at once
        self.waits += 1
        try:
            await ask.fut
        except asyncio.CancelledError:
            if ask.fut.done() and not ask.fut.cancelled():
                self._release(session, n)  # granted just as we were cancelled: hand it on
            elif ask in self._waiters:
                self._waiters.remove(ask)
            raise

    def _release(self, session: str, n: int) -> None:
        self.used -= n
        left = self._by_session[session] - n
        if left:
            self._by_session[session] = left
        else:
            del self._by_session[session]
        self._wake()

    def _wake(self) -> None:
        # Rule 2: in order of asking; a request whose session is at its share is
        # skipped (it waits for its own session's pieces), one that does not fit the
        # total stops the scan (first come, first served for the shared part).
        waiting_sessions: set[str] = set()
        for ask in list(self._waiters):
            if ask.fut.done():
                self._waiters.remove(ask)
                continue
            if ask.session in waiting_sessions or not self._session_fits(ask.session, ask.n):
                waiting_sessions.add(ask.session)  # keep each session's own order
                continue
            if not self._total_fits(ask.n):
                break
            self._waiters.remove(ask)
            self._grant(ask.session, ask.n)
            ask.fut.set_result(None)

    def snapshot(self) -> dict[str, int]:
        return {
            "used": self.used,
            "limit": self.limit,
            "session_limit": self.session_limit,
            "sessions": len(self._by_session),
            "waits": self.waits,
        }
