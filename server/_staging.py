"""The staging budget: memory held by disk-bound PUT payloads, counted as bytes arrive.

NOTE [ Staging as bytes arrive ]
A PUT placed on the disk tier is received into a transient buffer and written to
disk before it is acknowledged; the staging budget (``limits.staging``) bounds
those buffers in total. Reserving a PUT's whole size before its payload arrives
let a peer that sent half of a 256 MiB PUT and stopped hold the whole budget, so
every other client's disk-bound PUT, however small, waited for the read deadline
(issue 15 item 4). Here:

1. A PUT takes budget in pieces of at most :data:`PIECE_BYTES`, just before it
   receives each piece: what a slow peer holds is what it actually sent, plus one
   piece.
2. A piece is granted if it fits, in order of asking. The *oldest* PUT in
   progress is always granted, even past the limit: partial holders waiting for
   each other can never deadlock, and the overshoot is at most the rest of one
   PUT (at most ``max_tensor``).
3. Waiting for budget is the daemon's doing, not the peer's: it does not count
   against the peer's read deadline (``_wire``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools

__all__ = ["PIECE_BYTES", "StagingBudget", "StagingTicket"]

PIECE_BYTES = 1 << 20


class StagingTicket:
    """One PUT's share of the budget; :meth:`StagingBudget.close` returns it."""

    __slots__ = ("held", "order")

    def __init__(self, order: int) -> None:
        self.order = order
        self.held = 0


class StagingBudget:
    """Event-loop thread only. See NOTE [ Staging as bytes arrive ]."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._open: dict[int, StagingTicket] = {}  # insertion order = oldest first
        self._waiters: collections.deque[tuple[StagingTicket, int, asyncio.Future[None]]] = (
            collections.deque()
        )
        self._orders = itertools.count()

    def open(self) -> StagingTicket:
        t = StagingTicket(next(self._orders))
        self._open[t.order] = t
        return t

    def _oldest(self) -> StagingTicket | None:
        return next(iter(self._open.values()), None)

    def _grant(self, t: StagingTicket, n: int) -> None:
        self.used += n
        t.held += n

    async def take(self, t: StagingTicket, n: int) -> None:
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

    def close(self, t: StagingTicket) -> None:
        """Return everything ``t`` holds. Idempotent."""
        if self._open.pop(t.order, None) is None:
            return
        self.used -= t.held
        t.held = 0
        self._wake()

    def _wake(self) -> None:
        # Drop waiters that gave up, then Rule 2: the oldest PUT first, then in
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
