"""The daemon's budget for GET answers read from disk, on its own (NOTE [ Answers read
from disk ] in server/_payload.py): the total over every session holds
(``limits.get_buffer``) beside each session's share (``limits.session_get_buffer``),
a session at its share never holds up another, and a piece larger than a limit is
granted once nothing else holds that budget. No daemon process: the event loop only."""

from __future__ import annotations

import asyncio

from tensorstore_hooks.server._payload import AnswerBudget

MiB = 1 << 20
PIECE = 4 * MiB


async def _holders(
    budget: AnswerBudget, asks: list[tuple[str, int]]
) -> tuple[list[asyncio.Task[None]], list[asyncio.Event], list[bool]]:
    """One task per (session, bytes) ask, each holding its piece until its event is set;
    ``granted[i]`` says whether ask ``i`` holds its piece now."""
    releases = [asyncio.Event() for _ in asks]
    granted = [False] * len(asks)

    async def hold(i: int, session: str, n: int) -> None:
        async with budget.hold(session, n):
            granted[i] = True
            await releases[i].wait()
        granted[i] = False

    tasks = [asyncio.create_task(hold(i, s, n)) for i, (s, n) in enumerate(asks)]
    await asyncio.sleep(0)  # every ask made, in order
    return tasks, releases, granted


def test_the_total_holds_over_sessions_and_a_session_at_its_share_blocks_no_other() -> None:
    async def scenario() -> None:
        budget = AnswerBudget(limit=24 * MiB, session_limit=16 * MiB)
        # Session a asks for 5 pieces (its share is 4), then b for 4 (the total leaves 2).
        asks = [("a", PIECE)] * 5 + [("b", PIECE)] * 4
        tasks, releases, granted = await _holders(budget, asks)
        await asyncio.sleep(0)
        assert granted == [True] * 4 + [False] + [True, True, False, False]
        assert budget.used == 24 * MiB  # the total, not 2 x 16 MiB of shares
        assert budget.waits == 3

        releases[5].set()  # one of b's pieces is sent: b's next ask takes its room
        await asyncio.sleep(0.01)
        assert granted[5:] == [False, True, True, False] and budget.used == 24 * MiB

        releases[0].set()  # one of a's: a's waiting ask (asked first) goes next
        await asyncio.sleep(0.01)
        assert granted[4] and budget.used == 24 * MiB and not granted[8]

        for r in releases:
            r.set()
        await asyncio.gather(*tasks)
        assert budget.used == 0 and not any(granted)

    asyncio.run(scenario())


def test_a_piece_larger_than_the_limits_waits_for_an_empty_budget_then_goes() -> None:
    async def scenario() -> None:
        budget = AnswerBudget(limit=8 * MiB, session_limit=8 * MiB)
        asks = [("a", PIECE), ("b", 16 * MiB), ("c", PIECE)]
        tasks, releases, granted = await _holders(budget, asks)
        await asyncio.sleep(0)
        # The large piece waits for the budget to empty, and c, asked after it, waits
        # behind it (first come, first served for the total).
        assert granted == [True, False, False]
        releases[0].set()
        await asyncio.sleep(0.01)
        assert granted == [False, True, False] and budget.used == 16 * MiB  # alone, over
        releases[1].set()  # the limit: slower, never refused
        await asyncio.sleep(0.01)
        assert granted == [False, False, True] and budget.used == PIECE
        releases[2].set()
        await asyncio.gather(*tasks)
        assert budget.used == 0

    asyncio.run(scenario())
