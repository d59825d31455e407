"""A tier chain's movers: the threads that take the oldest tensors of a tier over its
budget down to the next tier (NOTE [ Tier chain ] Rules 3 and 4 in ``storage/chain/_core.py``).

:class:`Movers` decides which tensor moves next, copies it (``_chain_io.copy``), and
retries failed moves after a backoff; the :class:`~._chain_ledger.Ledger` records
each step. The threads hold the ledger and this object, never the ``TierChain``, so a
chain dropped without ``close()`` is collected and its finalizer stops them.
"""

from __future__ import annotations

import logging
import threading
import time

from tensorstore_hooks.storage.chain._io import copy
from tensorstore_hooks.storage.chain._ledger import Ledger, Move

__all__ = ["Movers"]

log = logging.getLogger("tensorstore_hooks")

_FIRST_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 5.0
_CASCADE_TRIES = 3  # Rule 3: room-making moves into a full tier before writing further down


class Movers:
    """Up to ``threads`` mover threads of one chain, started when a tier is first over
    its budget (:meth:`wake`), and what they did (read under the ledger's lock).

    They stop once the ledger is closed, after the move each has in flight;
    :meth:`stop` waits for that.
    """

    def __init__(self, ledger: Ledger, threads: int) -> None:
        self.ledger = ledger
        self.threads = threads
        self._started: list[threading.Thread] = []
        self.moving = 0
        """Moves in flight."""
        self.failures = 0
        """Moves that failed; puts waiting for room watch it (Rule 2)."""
        self.retry_at = 0.0  # time.monotonic() before which no move starts (Rule 4)
        self.backoff_s = 0.0
        self.moves = 0
        self.bytes_moved = 0
        self.move_s = 0.0

    def wake(self) -> None:
        """Under the lock: start the movers if a tier is over its budget, and wake them
        (and every other waiter on the lock)."""
        ledger = self.ledger
        start = len(self._started) < self.threads and not ledger.closed
        if start and any(t.over() for t in ledger.tiers):
            for i in range(len(self._started), self.threads):
                th = threading.Thread(target=self._run, name=f"tsh-chain-mover-{i}", daemon=True)
                self._started.append(th)
                th.start()
        ledger.cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no tier is over budget and no move is in flight (or a move failed
        and waits for its retry). True if that happened within ``timeout_s``; False at
        once when the ledger is closed."""
        ledger = self.ledger
        deadline = time.monotonic() + timeout_s
        with ledger.cond:
            while self.moving or (
                time.monotonic() >= self.retry_at and any(t.over() for t in ledger.tiers[:-1])
            ):
                left = deadline - time.monotonic()
                if left <= 0 or ledger.closed:
                    return False
                ledger.cond.wait(min(left, 0.1))
            return True

    def stop(self, timeout_s: float) -> bool:
        """After the ledger is closed (and its waiters notified): wait up to
        ``timeout_s`` for the mover threads to end. False if one is still running (a
        move stuck in a store); called from a mover itself, it does not wait for that one."""
        with self.ledger.cond:
            started = list(self._started)
        deadline = time.monotonic() + timeout_s
        for th in started:
            if th is not threading.current_thread():
                th.join(max(0.0, deadline - time.monotonic()))
        return not any(th.is_alive() for th in started)

    # ----------------------------------------------------------- the threads
    def _run(self) -> None:
        cond = self.ledger.cond
        while True:
            with cond:
                job = self._next_move()
                while job is None:
                    if self.ledger.closed:
                        return
                    wait = max(0.0, self.retry_at - time.monotonic()) or None
                    cond.wait(wait)
                    job = self._next_move()
            self._move(job)
            del job

    def _next_move(self) -> Move | None:
        """Under the lock: the oldest movable tensor of the deepest tier over budget."""
        tiers = self.ledger.tiers
        if self.ledger.closed or time.monotonic() < self.retry_at:
            return None
        for i in range(len(tiers) - 2, -1, -1):
            if tiers[i].over():
                job = self._take_oldest(i)
                if job is not None:
                    return job
        return None

    def _take_oldest(self, i: int) -> Move | None:
        """Under the lock: start moving tier ``i``'s oldest tensor (Rule 3)."""
        job = self.ledger.take_oldest(i)
        if job is not None:
            self.moving += 1
        return job

    def _reserve(self, start: int, n: int) -> int:
        """Reserve room for a moved tensor in tier ``start`` or below (Rule 3): when a
        tier is full, first move its own oldest down, a few times at most."""
        ledger = self.ledger
        for i in range(start, len(ledger.tiers)):
            tier = ledger.tiers[i]
            for _ in range(_CASCADE_TRIES):
                with ledger.cond:
                    if ledger.reserve(i, n):
                        return i
                    assert tier.budget is not None
                    if n > tier.budget or ledger.closed:
                        break
                    victim = self._take_oldest(i)
                if victim is None:
                    break
                self._move(victim)
        raise AssertionError("unreachable: the last tier has no budget")  # pragma: no cover

    def _move(self, job: Move) -> None:
        """Copy ``job``'s tensor down, point the map at the copy, delete the old one."""
        ledger = self.ledger
        n = job.placement.nbytes
        t0 = time.perf_counter()
        dst = -1
        try:
            dst = self._reserve(job.src + 1, n)
            new_key = copy(ledger.tiers[job.src].store, job.src_key, ledger.tiers[dst].store)
        except Exception as e:
            self._failed(job, dst, e)
            return
        with ledger.cond:
            cleanup_tier, cleanup, moved = ledger.moved(job, dst, new_key)
            if moved:
                self.moves += 1
                self.bytes_moved += n
                self.backoff_s = 0.0
            self.move_s += time.perf_counter() - t0
        try:
            ledger.tiers[cleanup_tier].store.delete(cleanup)
        except Exception as e:
            log.warning(
                "TierChain(%s): deleting the old copy %r from tier %d failed: %r",
                ledger.url, cleanup, cleanup_tier, e,
            )  # fmt: skip
        finally:
            with ledger.cond:
                # In flight until the old copy is gone: wait_idle() then sees the
                # tier as it will stay.
                self.moving -= 1
                ledger.release(cleanup_tier, n, moved_out=moved)
                self.wake()

    def _failed(self, job: Move, dst: int, error: Exception) -> None:
        """Rule 4 (or Rule 6, when the read lost the race with a delete)."""
        ledger, src = self.ledger, job.src
        with ledger.cond:
            self.moving -= 1
            if not ledger.move_failed(job, dst):
                ledger.cond.notify_all()
                return  # deleted while moving: nothing to keep
            self.failures += 1
            first = self.backoff_s == 0.0
            self.backoff_s = min(_MAX_BACKOFF_S, max(_FIRST_BACKOFF_S, 2 * self.backoff_s))
            self.retry_at = time.monotonic() + self.backoff_s
            ledger.cond.notify_all()
        if ledger.closed:
            return
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "TierChain(%s): moving a tensor from tier %d to tier %d failed (it stays in "
            "tier %d; retrying in %.1fs): %s",
            ledger.url, src, src + 1, src, self.backoff_s, error,
        )  # fmt: skip
