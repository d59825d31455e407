"""Memory the daemon holds for payloads in flight: PUT payloads bound for disk, GET
answers read from disk. Both are bounded, counted in pieces as bytes move, and shared
fairly between sessions.

NOTE [ Payload bytes as they arrive ]
A PUT placed on the disk tier is received into a transient buffer and written to
disk before it is acknowledged; :class:`PayloadBudget` (``limits.put_buffer``) bounds
those buffers in total. Reserving a PUT's whole size before its payload arrives would
let a peer that sent half of a 256 MiB PUT and stopped hold the whole budget, and
every other client's disk-bound PUT would wait for the read deadline. So:

1. A PUT takes budget in pieces of at most :data:`PIECE_BYTES`, just before it
   receives each piece: what a slow peer holds is what it actually sent, plus one
   piece.
2. A piece is granted if it fits, the sessions holding least first (then in order
   of asking), and if its session stays within its share: ``limit // (sessions
   holding or asking + 1)``, so that one session (whatever its number of
   connections) never holds more than its part and a session that arrives finds
   room. A session past its share is still granted when no other waiting session
   holds less, and only from the room that the other sessions with a PUT in
   progress that hold less than their share cannot claim (up to their share): a
   PUT larger than a share completes without waiting to become the oldest, and the
   room one preemption made for a PUT within its share stays that PUT's for its
   next pieces, not taken back by the sessions over theirs between two of them.
   The *oldest* PUT in progress is always granted, even past the limit or its
   share: partial holders waiting for each other can never deadlock, and the
   overshoot is at most the rest of one PUT (at most ``max_tensor``).
3. Waiting for budget is the daemon's doing, not the peer's: it does not count
   against the peer's read deadline (``_wire``).
4. A PUT whose peer has sent nothing for :data:`PUT_STALL_S` while another request
   waits for this budget is dropped (NOTE [ Preemption ]): its connection closes
   with a BUSY error frame, and its buffer is freed at once. So is a PUT that has
   waited :data:`PUT_STALL_S` for more budget while its session holds more than its
   share and another session's request does not fit the total: many sessions whose
   PUTs each hold a little and wait for more would otherwise keep the whole budget.
   When that request's session holds less than its share, PUTs of sessions over
   their share go after :data:`FAIR_STALL_S` instead (NOTE [ Fair preemption ]).

NOTE [ Answers read from disk ]
A GET of a disk-tier tensor is streamed: the daemon reads one piece (whole chunks,
about :data:`ANSWER_PIECE_BYTES`), sends it as one frame, and only then reads the
next, so a connection holds at most one piece at a time whatever the tensor's size.
:class:`AnswerBudget` bounds the pieces held per session (``limits.session_get_buffer``)
and in total (``limits.get_buffer``):

1. A piece is taken just before it is read from disk and returned once the socket
   took all of it; the buffer is dropped with it (nothing keeps a piece alive
   between reads). A client that does not read its answers therefore holds at most
   one piece per connection, and never more than its session's share.
2. Pieces are granted in order of asking, the requests of sessions holding less
   than their fair share of the total (``limit // (sessions holding or asking +
   1)``) first, except that a request whose *session* is at ``session_get_buffer``
   waits without holding up requests of other sessions behind it.
3. A piece larger than a limit is granted when nothing else holds that budget (so
   a small limit slows GETs down, never refuses them).
4. A piece whose send has been waiting for the client to read for
   :data:`GET_STALL_S` while another request waits for this budget is *preempted*
   (NOTE [ Preemption ]): it gives its budget back, its buffer is dropped, and the
   answer goes on later from where it stopped, the piece read from disk again once
   the client has read what the kernel holds for it.
5. Answers built for one request (LIST, STATS) are held in this budget too while
   they are sent; one that stalls for :data:`PUT_STALL_S` while another request
   waits is dropped with its connection (it cannot be built again identically).
An answer served from the RAM tier is sent from the tensor's own buffer: no copy;
its bytes stay counted in the RAM tier until the send ends (``_tiers``).

NOTE [ Preemption ]
A shared budget must never be held by clients that do not move their bytes while
others wait: that is how one client stalls everyone. So every holder of a budget
(:class:`Hold`) says when it is *blocked*, waiting on its own client (the socket
full for a GET piece, empty for a PUT payload), and a budget that cannot grant a
request preempts holders blocked for longer than their stall time, the session
holding the most first, until the request fits. Preempting a GET piece costs a disk
read; preempting a PUT costs the client a retry (it reconnects and sends again). A
holder blocked for less than its stall time is left alone (a wake-up is scheduled
for when it is not), so a client that reads and writes at its own pace is never
preempted for a short pause. Holders waiting for the disk, or for the budget itself,
are not preempted (that wait is the daemon's doing), except a PUT of a session over
its share (rule 4 above).

NOTE [ Fair preemption ]
A stall time long enough to spare a slow client (:data:`PUT_STALL_S`) is far longer
than a piece takes, so a client that holds a budget with stalled requests and comes
back as soon as it is dropped (or moves a few bytes now and then, never stalled that
long) would make every other session wait that long per piece. So, when the request
that cannot be granted is of a session holding less than its fair share, holders of
sessions holding more than theirs are preempted once stalled :data:`FAIR_STALL_S` (on
their client, or a PUT waiting for budget): about one piece's time. Everything else
keeps its own stall time: a session's own PUTs, requests of sessions at or past
their share, the total for a session past its share, LIST and STATS answers (they
cannot be built again, so a drop costs the connection). A client that moves its
bytes at loopback pace is never blocked that long; one that is, while over its share
and another session is under its, costs itself a retry, not the others a wait.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable

__all__ = [
    "ANSWER_PIECE_BYTES",
    "FAIR_STALL_S",
    "GET_STALL_S",
    "PIECE_BYTES",
    "PUT_STALL_S",
    "AnswerBudget",
    "Hold",
    "PayloadBudget",
    "PayloadTicket",
    "Preempted",
]

PIECE_BYTES = 1 << 20
"""A PUT's payload is counted in pieces of this size (NOTE [ Payload bytes as they arrive ])."""
ANSWER_PIECE_BYTES = 4 << 20
"""A GET answer read from disk is read and sent in pieces of about this size (whole
chunks: at least one chunk, NOTE [ Answers read from disk ])."""
GET_STALL_S = 0.02
"""A GET piece blocked on its client this long may be preempted (NOTE [ Preemption ])."""
PUT_STALL_S = 0.5
"""A PUT blocked on its client this long may be dropped (NOTE [ Preemption ])."""
FAIR_STALL_S = 0.02
"""A holder of a session over its fair share, stalled this long (on its client, or
waiting for budget), may be preempted for a session under its share (NOTE [ Fair
preemption ]). About one piece's time on loopback (a 1 MiB PUT piece or a 4 MiB GET
piece moves in a few ms): the longest a request under its share waits per piece for
holders that do not move their bytes. Any longer and a client that keeps
reconnecting and refilling the budget sets the pace of everyone else."""


class Preempted(Exception):
    """A budget took back what a blocked holder held (NOTE [ Preemption ]).

    ``sent``: bytes of the interrupted send that the socket had taken (0 for a recv).
    """

    def __init__(self, sent: int = 0) -> None:
        super().__init__("preempted")
        self.sent = sent


class Hold:
    """One holder of a budget: a PUT in flight, or one GET piece. Event-loop thread only.

    The connection's I/O (``_wire``) calls :meth:`block` while it waits on the client
    and :meth:`unblock` when the client moved bytes; a budget calls :meth:`preempt`.
    """

    __slots__ = (
        "_wake",
        "blocked_since",
        "fair_stall_s",
        "held",
        "on_block",
        "order",
        "preempted",
        "session",
        "stall_s",
        "waiting_since",
    )

    def __init__(
        self, session: str, order: int, stall_s: float, fair_stall_s: float | None = None
    ) -> None:
        self.session = session
        self.order = order
        self.stall_s = stall_s
        self.fair_stall_s = stall_s if fair_stall_s is None else min(stall_s, fair_stall_s)
        """Its stall time when its session is over its share and a session under its
        share needs room (NOTE [ Fair preemption ])."""
        self.held = 0
        self.blocked_since: float | None = None
        """When it began to wait on its client (None: it is not)."""
        self.waiting_since: float | None = None
        """When it began to wait for more of the budget, holding some (None: it is not)."""
        self.preempted = False
        self.on_block: Callable[[Hold], None] | None = None
        """Set by the budget: told when the holder starts waiting on its client."""
        self._wake: asyncio.Future[None] | None = None

    def block(self, wake: asyncio.Future[None]) -> None:
        """The holder waits on its client until ``wake`` is done (or it is preempted)."""
        self.blocked_since = time.monotonic()
        self._wake = wake
        if self.on_block is not None and self.held:
            self.on_block(self)

    def unblock(self) -> None:
        """The wait is over (whatever ended it)."""
        self.blocked_since = None
        self._wake = None

    def check(self, sent: int = 0) -> None:
        """Raise :class:`Preempted` (with ``sent``) if the budget took this hold back."""
        if self.preempted:
            raise Preempted(sent)

    def wait_budget(self, fut: asyncio.Future[None]) -> None:
        """The holder waits for more of the budget until ``fut`` is done (a PUT)."""
        self.waiting_since = time.monotonic()
        self._wake = fut

    def got_budget(self) -> None:
        """That wait is over; raises :class:`Preempted` if it ended by preemption."""
        self.waiting_since = None
        self._wake = None
        self.check()

    @property
    def stalled(self) -> bool:
        return self.blocked_since is not None or self.waiting_since is not None

    def stalled_for(self, now: float) -> float:
        """Seconds it has been waiting, on its client or for budget (0 when it is not)."""
        since = self.blocked_since if self.blocked_since is not None else self.waiting_since
        return 0.0 if since is None else now - since

    def preempt(self) -> None:
        self.preempted = True
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)


class _Shares:
    """What each session holds of one budget, its holders, and their preemption
    (NOTE [ Preemption ])."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.by_session: dict[str, int] = {}
        self.holders: dict[Hold, None] = {}  # insertion order = oldest first
        self.preemptions = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def grant(self, h: Hold, n: int) -> None:
        self.used += n
        h.held += n
        self.by_session[h.session] = self.by_session.get(h.session, 0) + n

    def give_back(self, h: Hold) -> None:
        if not h.held:
            return
        self.used -= h.held
        left = self.by_session[h.session] - h.held
        if left:
            self.by_session[h.session] = left
        else:
            del self.by_session[h.session]
        h.held = 0

    def preempt(
        self, need: int, among: list[Hold], again: Callable[[], None], fair_share: int = 0
    ) -> None:
        """Preempt blocked holders of ``among``, the session holding most first, until
        ``need`` bytes are on their way back. Holders blocked for less than their stall
        time are left alone; ``again`` is called when the soonest of them reaches it
        (if that much was not found). ``fair_share``: when not 0, the request is of a
        session under this share, and holders of sessions over it have their short
        stall time (NOTE [ Fair preemption ])."""
        now = time.monotonic()
        ready: list[Hold] = []
        soonest: float | None = None
        for h in among:
            if h.preempted or not h.stalled or not h.held:
                continue
            over = fair_share and self.by_session.get(h.session, 0) > fair_share
            left = (h.fair_stall_s if over else h.stall_s) - h.stalled_for(now)
            if left <= 0:
                ready.append(h)
            elif soonest is None or left < soonest:
                soonest = left
        ready.sort(key=lambda h: (-self.by_session.get(h.session, 0), -h.held, -h.stalled_for(now)))
        freed = sum(h.held for h in among if h.preempted)  # already on their way back
        for h in ready:
            if freed >= need:
                return
            h.preempt()
            self.preemptions += 1
            freed += h.held
        if freed < need and soonest is not None:
            self.arm(now + soonest, again)

    def arm(self, at: float, again: Callable[[], None]) -> None:
        """Call ``again`` at monotonic time ``at`` (one wake-up, the earliest asked for:
        it rescans everything)."""
        if self._timer is not None:
            if self._timer_at <= at:
                return
            self._timer.cancel()

        def fire() -> None:
            self._timer = None
            again()

        self._timer_at = at
        delay_s = max(0.0, at - time.monotonic()) + 0.001
        self._timer = asyncio.get_running_loop().call_later(delay_s, fire)


class PayloadTicket(Hold):
    """One PUT's share of the budget; :meth:`PayloadBudget.close` returns it."""

    __slots__ = ()


class PayloadBudget:
    """Disk-bound PUT payloads (NOTE [ Payload bytes as they arrive ]). Event-loop only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._shares = _Shares(limit)
        self._waiters: collections.deque[tuple[PayloadTicket, int, asyncio.Future[None]]] = (
            collections.deque()
        )
        self._orders = itertools.count()

    @property
    def used(self) -> int:
        return self._shares.used

    def open(self, session: str) -> PayloadTicket:
        t = PayloadTicket(session, next(self._orders), PUT_STALL_S, FAIR_STALL_S)
        t.on_block = self._blocked
        self._shares.holders[t] = None
        return t

    def _blocked(self, t: Hold) -> None:
        if self._waiters:  # rule 4: look again once it may have stalled long enough
            self._shares.arm(time.monotonic() + t.fair_stall_s, self._wake)

    def _oldest(self) -> Hold | None:
        return next(iter(self._shares.holders), None)

    def _share(self, asking: str) -> int:
        """Rule 2: ``limit // (sessions holding or asking + 1)``, at least one piece."""
        active = set(self._shares.by_session)
        active.update(t.session for t, _, _ in self._waiters)
        active.add(asking)
        return max(PIECE_BYTES, self.limit // (len(active) + 1))

    def _total_fits(self, n: int) -> bool:
        return self._shares.used + n <= self.limit

    def _share_fits(self, t: PayloadTicket, n: int, share: int) -> bool:
        return self._shares.by_session.get(t.session, 0) + n <= share

    async def take(self, t: PayloadTicket, n: int) -> None:
        """Count ``n`` more bytes for ``t`` (waits while the budget is full)."""
        if t is self._oldest() or (
            not self._waiters
            and self._total_fits(n)
            and self._share_fits(t, n, self._share(t.session))
        ):
            self._shares.grant(t, n)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        item = (t, n, fut)
        self._waiters.append(item)
        if t.held:
            t.wait_budget(fut)  # rule 4: holding some while it waits, it may be dropped
            self._blocked(t)
        self._wake()
        try:
            await fut
        except asyncio.CancelledError:
            if item in self._waiters:
                self._waiters.remove(item)
            raise  # a grant already made stays with t: close() returns it
        finally:
            t.waiting_since = None
        t.got_budget()

    def close(self, t: PayloadTicket) -> None:
        """Return everything ``t`` holds. Idempotent."""
        if t not in self._shares.holders:
            return
        del self._shares.holders[t]
        self._shares.give_back(t)
        self._wake()

    def _wake(self) -> None:
        # Drop waiters that gave up. Rule 2: the oldest PUT is granted whatever it
        # asks; the others session holding least first (then in order of asking), a
        # session at its share skipped (it waits for its own PUTs) unless no waiting
        # session holds less and the room kept for sessions under their share allows,
        # the first that does not fit the total ending the scan. Rule 4: for each
        # session short of its share, its own PUTs stalled on their clients may be
        # dropped; for the first request short of the total, any PUT stalled on its
        # client, and any waiting for budget over its share (after FAIR_STALL_S for a
        # request of a session under its share, NOTE [ Fair preemption ]).
        self._waiters = collections.deque(
            w for w in self._waiters if not w[2].done() and w[0] in self._shares.holders
        )
        oldest = self._oldest()
        share = self._share("")
        held = self._shares.by_session
        skipped: set[str] = set()
        short: list[tuple[PayloadTicket, int, bool]] = []  # who, bytes short, own share
        for item in self._scan_order(oldest):
            t, n, fut = item
            if t is not oldest:
                if t.session in skipped:
                    continue
                if not self._total_fits(n):
                    short.append((t, self._shares.used + n - self.limit, False))
                    break
                if not self._share_fits(t, n, share) and not (
                    self._holds_least(t, skipped) and self._spare_fits(t, n, share)
                ):
                    short.append((t, held.get(t.session, 0) + n - share, True))
                    skipped.add(t.session)
                    continue
            self._waiters.remove(item)
            self._shares.grant(t, n)
            fut.set_result(None)
        for t, need, own in short:
            # NOTE [ Fair preemption ]: a request of a session under its share does not
            # wait PUT_STALL_S for holders of sessions over theirs.
            fair = 0 if own or held.get(t.session, 0) >= share else share
            self._shares.preempt(need, self._droppable(t, own, share), self._wake, fair)

    def _scan_order(
        self, oldest: Hold | None
    ) -> list[tuple[PayloadTicket, int, asyncio.Future[None]]]:
        """Waiters in granting order (rule 2): the oldest PUT, then the sessions
        holding least first, each in order of asking."""
        held = self._shares.by_session
        ranked = sorted(
            enumerate(self._waiters),
            key=lambda iw: (iw[1][0] is not oldest, held.get(iw[1][0].session, 0), iw[0]),
        )
        return [w for _, w in ranked]

    def _holds_least(self, t: PayloadTicket, skipped: set[str]) -> bool:
        """No other session still waiting holds less than ``t``'s (rule 2: a session
        past its share still moves when it is the one that holds least, so a PUT larger
        than a share always completes, and the others wait at most its next piece)."""
        held = self._shares.by_session
        mine = held.get(t.session, 0)
        return all(
            held.get(w.session, 0) >= mine
            for w, _, _ in self._waiters
            if w.session != t.session and w.session not in skipped
        )

    def _spare_fits(self, t: PayloadTicket, n: int, share: int) -> bool:
        """``n`` bytes past ``t``'s share fit beside the room kept for the other
        sessions with a PUT in progress that hold less than their share (rule 2): a
        session past its share takes only what they cannot claim, so a PUT within its
        share is not preempting a piece back at every piece."""
        held = self._shares.by_session
        sessions = {h.session for h in self._shares.holders if h.session != t.session}
        kept = sum(max(0, share - held.get(s, 0)) for s in sessions)
        return self._shares.used + n + kept <= self.limit

    def _droppable(self, t: PayloadTicket, own: bool, share: int) -> list[Hold]:
        """Who may be dropped for ``t`` (rule 4): PUTs stalled on their clients (of its
        own session only, ``own``), and PUTs waiting for budget over their share."""
        by_session = self._shares.by_session
        out: list[Hold] = []
        for h in self._shares.holders:
            if h is t or (own and h.session != t.session):
                continue
            if h.blocked_since is not None or (
                not own and h.waiting_since is not None and by_session.get(h.session, 0) > share
            ):
                out.append(h)
        return out

    def snapshot(self) -> dict[str, int]:
        return {
            "used": self.used,
            "limit": self.limit,
            "sessions": len(self._shares.by_session),
            "preempted": self._shares.preemptions,
        }


class AnswerBudget:
    """GET answers read from disk, per session and in total. Event-loop thread only.

    See NOTE [ Answers read from disk ].
    """

    def __init__(self, limit: int, session_limit: int) -> None:
        self.limit = limit
        self.session_limit = session_limit
        self._shares = _Shares(limit)
        self._orders = itertools.count()
        self._waiters: collections.deque[tuple[Hold, int, asyncio.Future[None]]] = (
            collections.deque()
        )
        self.waits = 0
        """Pieces that had to wait for room (a counter, for ``stats``)."""

    @property
    def used(self) -> int:
        return self._shares.used

    def _session_fits(self, session: str, n: int) -> bool:
        held = self._shares.by_session.get(session, 0)
        return held == 0 or held + n <= self.session_limit

    def _total_fits(self, n: int) -> bool:
        return self._shares.used == 0 or self._shares.used + n <= self.limit

    @contextlib.asynccontextmanager
    async def hold(self, session: str, n: int) -> AsyncIterator[Hold]:
        """Hold ``n`` bytes for ``session`` while the body runs (waits for room first).
        The body reports through the :class:`Hold` when it waits on its client."""
        h = await self.acquire(session, n)
        try:
            yield h
        finally:
            self.release(h)

    async def acquire(
        self,
        session: str,
        n: int,
        stall_s: float = GET_STALL_S,
        fair_stall_s: float = FAIR_STALL_S,
    ) -> Hold:
        """Wait for room, then hold ``n`` bytes for ``session``; :meth:`release` it.
        ``stall_s``: how long the holder may be blocked on its client before it may be
        preempted (rule 4); ``fair_stall_s``: the same while its session is over its
        share and a session under its share waits (NOTE [ Fair preemption ])."""
        h = Hold(session, next(self._orders), stall_s, fair_stall_s)
        h.on_block = self._blocked
        item = (h, n, asyncio.get_running_loop().create_future())
        self._waiters.append(item)
        self._wake()
        if item[2].done():
            return h  # granted at once
        self.waits += 1
        try:
            await item[2]
        except asyncio.CancelledError:
            if item[2].done() and not item[2].cancelled():
                self.release(h)  # granted just as we were cancelled: hand it on
            elif item in self._waiters:
                self._waiters.remove(item)
            raise
        return h

    def _blocked(self, h: Hold) -> None:
        if self._waiters:  # rule 4: look again once it may have stalled long enough
            self._shares.arm(time.monotonic() + h.fair_stall_s, self._wake)

    def release(self, h: Hold) -> None:
        """Give back what ``h`` holds. Idempotent."""
        if h not in self._shares.holders:
            return
        del self._shares.holders[h]
        self._shares.give_back(h)
        self._wake()

    def _fair_share(self) -> int:
        """Rule 2: ``limit // (sessions holding or asking + 1)``."""
        active = set(self._shares.by_session)
        active.update(h.session for h, _, _ in self._waiters)
        return max(1, self.limit // (len(active) + 1))

    def _scan_order(self, share: int) -> list[tuple[Hold, int, asyncio.Future[None]]]:
        """Waiters in granting order (rule 2): those of sessions holding less than
        ``share`` first, then the others, each group in order of asking."""
        held = self._shares.by_session
        return sorted(self._waiters, key=lambda w: held.get(w[0].session, 0) >= share)

    def _wake(self) -> None:
        # Rule 2: sessions under their fair share first, then in order of asking; a
        # request whose session is at its session limit is skipped (it waits for its
        # own session's pieces), one that does not fit the total stops the scan (first
        # come, first served for the shared part). Rule 4: whoever waits first may
        # preempt blocked holders: its own session's when it waits for its session
        # limit, anyone's (the biggest session first) for the total, those of sessions
        # over their share after FAIR_STALL_S if it is under its share.
        self._waiters = collections.deque(w for w in self._waiters if not w[2].done())
        share = self._fair_share()
        fair = 0
        waiting_sessions: set[str] = set()
        short_share: list[tuple[str, int]] = []  # (session, bytes over its share)
        short_total = 0
        for item in self._scan_order(share):
            h, n, fut = item
            if h.session in waiting_sessions or not self._session_fits(h.session, n):
                if h.session not in waiting_sessions:
                    held = self._shares.by_session.get(h.session, 0)
                    short_share.append((h.session, held + n - self.session_limit))
                waiting_sessions.add(h.session)  # keep each session's own order
                continue
            if not self._total_fits(n):
                short_total = self._shares.used + n - self.limit
                fair = share if self._shares.by_session.get(h.session, 0) < share else 0
                break
            self._waiters.remove(item)
            self._shares.grant(h, n)
            self._shares.holders[h] = None
            fut.set_result(None)
        holders = self._shares.holders
        for session, need in short_share:
            self._shares.preempt(need, [x for x in holders if x.session == session], self._wake)
        if short_total > 0:
            self._shares.preempt(short_total, list(holders), self._wake, fair)

    def snapshot(self) -> dict[str, int]:
        return {
            "used": self.used,
            "limit": self.limit,
            "session_limit": self.session_limit,
            "sessions": len(self._shares.by_session),
            "waits": self.waits,
            "preempted": self._shares.preemptions,
        }
