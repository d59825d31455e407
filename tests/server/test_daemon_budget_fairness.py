"""The daemon's PUT and GET budgets on their own (NOTE [ Fair preemption ] in
server/_payload.py): a PUT of a session under its share, beside sessions over theirs
whose PUTs trickle (never blocked on their client for PUT_STALL_S) or come back as soon
as they are dropped, gets each piece within about one FAIR_STALL_S, and the room up to
its share stays its own while its PUT is in flight; a GET piece of a session under its
share goes before the waiting pieces of sessions over theirs. No daemon process: the
event loop only."""

from __future__ import annotations

import asyncio
import time

from tensorstore_hooks.server._payload import (
    ANSWER_PIECE_BYTES,
    FAIR_STALL_S,
    PIECE_BYTES,
    PUT_STALL_S,
    AnswerBudget,
    PayloadBudget,
    PayloadTicket,
    Preempted,
)

TRICKLE_S = 0.1
"""The stalled writers move a few bytes this often: never blocked for PUT_STALL_S."""


async def _trickling_writer(budget: PayloadBudget, session: str, pieces: int) -> int:
    """A PUT that takes ``pieces`` pieces, then waits on its client, a few bytes every
    TRICKLE_S; dropped, it comes back at once with a new PUT. Returns its drops
    (runs until cancelled)."""
    drops = 0
    while True:
        t = budget.open(session)
        try:
            for _ in range(pieces):
                await budget.take(t, PIECE_BYTES)
            while True:  # what _wire does while the peer sends nothing
                wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                t.block(wake)
                try:
                    await asyncio.wait_for(asyncio.shield(wake), TRICKLE_S)
                except TimeoutError:
                    pass  # a few bytes arrived
                finally:
                    t.unblock()
                t.check()
        except Preempted:
            drops += 1
        finally:
            budget.close(t)


async def _victim_put(budget: PayloadBudget, pieces: int) -> float:
    """One PUT of ``pieces`` pieces that sends as fast as it is let; its seconds."""
    t: PayloadTicket = budget.open("victim")
    start = time.monotonic()
    try:
        for _ in range(pieces):
            await budget.take(t, PIECE_BYTES)
        return time.monotonic() - start
    finally:
        budget.close(t)


def test_a_put_under_its_share_is_not_held_up_by_trickling_over_share_puts() -> None:
    async def scenario() -> None:
        # Two sessions, two PUTs of 4 pieces each, fill a 16-piece budget: 8 pieces a
        # session, over its share once a third session asks (16 // 4 = 4 pieces).
        budget = PayloadBudget(16 * PIECE_BYTES)
        writers = [
            asyncio.create_task(_trickling_writer(budget, s, 4)) for s in ("a", "a", "b", "b")
        ]
        while budget.used < budget.limit:
            await asyncio.sleep(0.01)
        await asyncio.sleep(2 * TRICKLE_S)  # every writer is trickling
        # The victim's PUTs, each its whole share (4 pieces). The old budget never
        # dropped a writer that moves bytes within PUT_STALL_S: the victim waited for
        # their read deadline (here, the 5 s of wait_for ran out). Now each piece waits
        # about a FAIR_STALL_S at most; the bound, generous for a loaded machine, is a
        # PUT_STALL_S a PUT.
        before = budget.snapshot()["preempted"]
        puts = 5
        took = [await asyncio.wait_for(_victim_put(budget, 4), 5.0) for _ in range(puts)]
        drops = budget.snapshot()["preempted"] - before
        for w in writers:
            w.cancel()
        await asyncio.gather(*writers, return_exceptions=True)
        assert budget.used == 0
        assert sum(took) <= PUT_STALL_S * puts, took
        assert max(took) <= PUT_STALL_S, took
        # One writer dropped makes room for the victim's whole share: the room past
        # the writers' shares stays the victim's while its PUT is in flight (not one
        # drop a piece, the writers taking back the rest each time).
        assert 1 <= drops <= 2 * puts, drops
        assert FAIR_STALL_S < TRICKLE_S < PUT_STALL_S  # what this test is about

    asyncio.run(scenario())


def test_a_get_piece_under_its_share_goes_before_over_share_waiters() -> None:
    async def scenario() -> None:
        piece = ANSWER_PIECE_BYTES
        budget = AnswerBudget(limit=4 * piece, session_limit=4 * piece)
        held: dict[int, asyncio.Event] = {}
        granted: list[int] = []

        async def ask(i: int, session: str) -> None:
            async with budget.hold(session, piece):
                granted.append(i)
                held[i] = asyncio.Event()
                await held[i].wait()

        # Sessions a and b hold two pieces each (the total) and ask for one more each
        # (over their share: 4 pieces // 3 sessions, counting the one to come).
        tasks = [asyncio.create_task(ask(i, s)) for i, s in enumerate("aabbab")]
        await asyncio.sleep(0.01)
        assert granted == [0, 1, 2, 3]
        tasks.append(asyncio.create_task(ask(6, "c")))  # asks last, holds nothing
        await asyncio.sleep(0.01)
        held[0].set()  # one of a's pieces is sent: the room goes to c, not to a or b
        await asyncio.sleep(0.01)
        assert granted == [0, 1, 2, 3, 6]
        for i in (1, 2, 3, 6):
            held[i].set()
            await asyncio.sleep(0.01)
        assert sorted(granted) == list(range(7))
        for e in held.values():
            e.set()
        await asyncio.gather(*tasks)
        assert budget.used == 0

    asyncio.run(scenario())
