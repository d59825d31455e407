"""The front of a :class:`~tensorstore_hooks.TierChain` (``storage/chain/_chain.py``): puts, gets,
deletes, close and stats, over the chain's other units.

A chain is these units around one lock (``Ledger.cond``); ``TierChain`` only forwards
to :class:`Core`:

- ``_chain_ledger.Ledger``: the one owner of the chain's state: the map (chain key ->
  tier, key there), each tier's bytes, tensors and age order, the moves in flight.
- ``_chain_movers.Movers``: the mover threads: what moves next, the copy, retries.
- ``_chain_plan.CyclePlan``: each cycle's size, and the tier a planned put goes to.
- ``_chain_io``: writing a put into a tier, copying a tensor between tiers.
- :class:`Core` (here): puts, gets, deletes, close; the stats of all of them.

NOTE [ Tier chain ]
The rules, each kept by the code that names it (its unit in brackets):

1. Budgets count bytes actually held: a tensor counts in a tier from the moment room is
   reserved for it there until its copy there is deleted. During a move it counts in
   both tiers; the last tier has no budget. [``Ledger.reserve``/``release``]
2. A put lands in the first tier (or where Rule 8 plans it). When that tier has no
   room, the put waits (at most ``put_wait_s``) while the movers make room; it goes to
   the next tier at once if the tensor is larger than the budget, when a move out of
   the tier fails while it waits, or when the wait runs out. A tier that refuses or fails the write
   (``QuotaExceededError``, an unreachable service) passes it on to the next tier too;
   only the last tier's failure reaches the caller (for a planned put, Rule 8, only
   once the tiers above found no room either), so a tensor is always somewhere or
   still with the caller. [``Core.put``, ``Core._after_refusal``]
3. Movers (``move_threads`` threads of the chain's own, started when first needed)
   move while a tier's held bytes, plus the bytes puts are waiting to place there,
   exceed its budget: the oldest tensor (in put order) that is not already moving is
   read from tier ``i`` and written to tier ``i + 1``; room there is reserved first,
   and when tier ``i + 1`` is full the mover first moves *its* oldest tensor down
   (at most a few times; then it writes further down). Only after the new copy is
   written does the chain's map point at it, and only then is the old copy deleted.
   [``Movers``; the order and the map: ``Ledger.take_oldest``/``moved``]
4. A move that fails leaves the tensor where it was (the map never changed), counts a
   failure and is tried again after a backoff (0.1 s doubling to 5 s); the waiting
   puts are told (Rule 2). [``Movers._failed``, ``Ledger.move_failed``]
5. A get reads the copy the map points at. If that copy is gone when the read gets
   there (a move just finished and deleted it), the get looks again and reads the new
   copy; a key no longer in the map is a ``KeyNotFoundError``. [``Core.get``]
6. A delete takes the key out of the map at once and deletes the copy the map pointed
   at; a move of that key still in flight finds the key gone when it finishes and
   deletes the copy it made (or, if its read lost the race, nothing).
   [``Core.delete_many``, ``Ledger.forget``/``moved``/``move_failed``]
7. ``close()`` lets no new move start, waits for the moves in flight (at most
   ``close_timeout_s``), then closes the tiers the chain opened. In a forked child it
   only marks the chain closed: the tiers are the parent's. [``Core.close``,
   ``Movers.stop``]
8. Planned puts (``plan``, on by default): a training loop fills the chain in forward
   and empties it in backward, step after step. A *cycle* runs from the chain being
   empty to it being empty again; the most bytes it held at once is that cycle's
   size. From the second cycle on, a put whose tensor would end up below a tier by
   the last cycle's size — more bytes are still to come after it than the tiers
   above can hold — is written straight to the tier the moves would have taken it
   to. The placement is what Rules 2-3 produce, without writing those tensors to the
   fast tier and reading them back: with the first tier at half a step, half of a
   step goes to each tier and no tensor moves. A cycle larger than the last still
   fills the first tier and moves its oldest, as above. A planned put that its tier
   and every tier below refuse (the object store is down) falls back to the tiers
   above, first tier first, each where there is room within its budget (Rule 2's
   path: a tier with room takes it, not the caller), and counts where it landed
   (``planned_puts`` only below the first tier). The plan is then set aside until
   the cycle ends: its other puts take Rule 2's path rather than each trying the
   failing tier first; the next cycle plans again, by what the chain held in this
   one. [``CyclePlan``, ``Core._after_refusal``]

The chain's map (chain key -> tier, key there) lives in this process; each tier keeps
its own index, so ``tensorstore-hooks inspect URL URL ...`` lists what each tier holds
(the Zarr tiers of one chain share one namespace name).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

from tensorstore_hooks._codec import encode
from tensorstore_hooks.errors import IntegrityError, TensorStoreError, UnsupportedTensorError
from tensorstore_hooks.storage.chain._io import write
from tensorstore_hooks.storage.chain._ledger import Ledger, Tier
from tensorstore_hooks.storage.chain._movers import Movers
from tensorstore_hooks.storage.chain._plan import CyclePlan
from tensorstore_hooks.storage.chain._stats import ChainStats

__all__ = ["Core"]

log = logging.getLogger("tensorstore_hooks")

_GET_TRIES = 8  # Rule 5: a key moving faster than this many reads is not a real workload


class Core:
    """A chain's puts, gets, deletes and close; :class:`TierChain` is the public face
    and checks the arguments. Thread-safe.

    ``ledger`` (the state: read it under ``ledger.cond``), ``movers`` and ``plan`` are
    the other units. Nothing here holds the :class:`TierChain`, so a chain dropped
    without ``close()`` is collected and its finalizer calls :meth:`close`.
    """

    def __init__(
        self,
        tiers: list[Tier],
        *,
        move_threads: int,
        put_wait_s: float,
        close_timeout_s: float,
        plan: bool,
    ) -> None:
        self.ledger = Ledger(tiers)
        self.movers = Movers(self.ledger, move_threads)
        self.plan = CyclePlan(plan)
        self._budgets = self.ledger.budgets()  # fixed for the chain's life
        self.put_wait_s = put_wait_s
        self.close_timeout_s = close_timeout_s
        self.pid = os.getpid()
        self.put_waits = 0
        self.put_wait_s_total = 0.0
        self.spills = 0

    # ------------------------------------------------------------------- puts
    def put(self, tensor: torch.Tensor) -> str:
        """Rules 2 and 8: write ``tensor`` into a tier; returns the chain key. Raises
        ``UnsupportedTensorError`` before anything is reserved, the error of the last
        tier tried when no tier took it, ``StoreClosedError`` once closed."""
        ledger = self.ledger
        meta, payload = encode(tensor)  # UnsupportedTensorError before anything is reserved
        n = meta.nbytes
        with ledger.cond:
            seq = ledger.new_seq()
            planned = self.plan.tier_for(n, ledger.nbytes, self._budgets)
        i = self._reserve(planned, n)
        while True:
            try:
                inner = write(ledger.tiers[i].store, tensor, meta, payload)
            except TensorStoreError as e:
                self._release(i, n)
                if isinstance(e, UnsupportedTensorError) or ledger.closed:
                    raise
                log.debug("TierChain(%s): tier %d refused a put (%s)", ledger.url, i, e)
                after = self._after_refusal(i, planned, n)
                if after is None:  # no tier left to try: the caller keeps the tensor
                    raise
                i = after
                continue
            except BaseException:  # a user store's bug, or an interrupt: give the room back
                self._release(i, n)
                raise
            break
        with ledger.cond:
            if not ledger.closed:
                key = ledger.placed(seq, i, inner, n)
                self.plan.landed(planned, i)  # Rule 8: counted where it landed
                self.plan.held(ledger.nbytes)
                self.movers.wake()
                return key
            ledger.release(i, n)  # closed while writing: the chain is gone, the copy is not wanted
        with contextlib.suppress(Exception):
            ledger.tiers[i].store.delete(inner)
        raise ledger.closed_error()

    def _after_refusal(self, i: int, planned: int, n: int) -> int | None:
        """Rules 2 and 8: tier ``i`` refused or failed the write of a put planned to tier
        ``planned``; reserve ``n`` bytes in the next tier to try and return it, or None
        when no tier is left (the caller raises the refusal: the tensor stays with it).

        Below the planned tier, the next tier down (the last one always has room). When
        the last tier refused a planned put, the tiers above the planned one, first
        tier first, each by the first tier's path (room within its budget, waiting for
        the movers as Rule 2 says): a tier failing below must not send a tensor back to
        the caller while a faster tier has room for it. The plan is then set aside for
        the rest of the cycle (``CyclePlan.set_aside``)."""
        ledger = self.ledger
        last = len(ledger.tiers) - 1
        if i == last and planned == 0:
            return None  # Rule 2: the last tier's failure reaches the caller
        with ledger.cond:
            self.spills += 1
            if planned <= i < last:
                return self._reserve_in(range(i + 1, last + 1), n)  # the last always fits
            if i == last:  # every tier from the planned one down refused: fall back above
                self.plan.set_aside()
            return self._reserve_in(range(0 if i == last else i + 1, planned), n)

    def _reserve(self, start: int, n: int) -> int:
        """Rule 2: reserve ``n`` bytes in the first tier from ``start`` down that takes them."""
        with self.ledger.cond:
            i = self._reserve_in(range(start, len(self.ledger.tiers)), n)
        assert i is not None, "unreachable: the last tier has no budget"
        return i

    def _reserve_in(self, tiers: range, n: int) -> int | None:
        """Under the lock: reserve ``n`` bytes in the first of ``tiers`` that takes them
        (Rule 2: waiting for room where the tensor fits the budget); None if none does."""
        ledger = self.ledger
        for i in tiers:
            ledger.check_open()
            tier = ledger.tiers[i]
            if ledger.reserve(i, n):
                return i
            assert tier.budget is not None  # the last tier always fits
            waits = n <= tier.budget and self.put_wait_s > 0  # room can be made for it
            if waits and self._wait_for_room(i, n) and ledger.reserve(i, n):  # it fits now
                return i
            self.spills += 1
        return None

    def _wait_for_room(self, i: int, n: int) -> bool:
        """Under the lock: wait while the movers make room for ``n`` bytes in tier ``i``.

        False when a move fails meanwhile or ``put_wait_s`` runs out (Rule 2)."""
        ledger, tier = self.ledger, self.ledger.tiers[i]
        t0 = time.monotonic()
        deadline = t0 + self.put_wait_s
        failures = self.movers.failures
        tier.wanted += n
        self.put_waits += 1
        try:
            self.movers.wake()
            while not tier.fits(n):
                ledger.check_open()
                left = deadline - time.monotonic()
                if self.movers.failures != failures or left <= 0:
                    return False
                ledger.cond.wait(left)
            return True
        finally:
            tier.wanted -= n
            self.put_wait_s_total += time.monotonic() - t0

    def _release(self, i: int, n: int) -> None:
        with self.ledger.cond:
            self.ledger.release(i, n)
            self.ledger.cond.notify_all()

    # ------------------------------------------------------------------- gets
    def get(self, key: str, device: torch.device | str | None) -> torch.Tensor:
        """Rule 5: read ``key`` from the tier that holds it (again, if it moved while
        being read). ``KeyNotFoundError`` for a key not in the chain."""
        ledger = self.ledger
        for _ in range(_GET_TRIES):
            with ledger.cond:
                ledger.check_open()
                p = ledger.map.get(key) if isinstance(key, str) else None
                if p is None:
                    raise ledger.missing(key)
                i, inner = p.tier, p.key
            try:
                return ledger.tiers[i].store.get(inner, device=device)
            except KeyError as e:  # Rule 5: moved (or deleted) while we read
                with ledger.cond:
                    q = ledger.map.get(key)
                    if q is None:
                        raise ledger.missing(key, " (deleted while being read)") from e
                    if (q.tier, q.key) == (i, inner):
                        raise IntegrityError(
                            f"TierChain({ledger.url}): key {key!r} is missing from tier {i} "
                            f"({ledger.tiers[i].url}) that should hold it as {inner!r}: {e}"
                        ) from e
        raise TensorStoreError(
            f"TierChain({ledger.url}): key {key!r} kept moving while being read "
            f"({_GET_TRIES} tries)"
        )

    # ---------------------------------------------------------------- deletes
    def delete_many(self, keys: list[str], *, strict: bool) -> None:
        """Rule 6. ``strict``: a missing key is a ``KeyNotFoundError`` (one key). A tier
        that fails to delete is logged: the keys are gone from the chain either way."""
        ledger = self.ledger
        with ledger.cond:
            by_tier = ledger.forget(keys, strict=strict)
            if not ledger.map:  # Rule 8: a cycle ends
                self.plan.emptied()
        for i, items in by_tier.items():
            store = ledger.tiers[i].store
            try:
                if len(items) == 1:
                    with contextlib.suppress(KeyError):
                        store.delete(items[0][0])
                else:
                    store.delete_many([k for k, _ in items])
            except Exception as e:  # the key is gone from the chain either way
                log.warning(
                    "TierChain(%s): deleting %d key(s) from tier %d failed: %r",
                    ledger.url, len(items), i, e,
                )  # fmt: skip
            finally:
                self._release(i, sum(n for _, n in items))

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Rule 7: stop the movers (waiting up to ``close_timeout_s``), then close the
        owned tiers. Idempotent; never raises (a tier that fails to close is logged)."""
        ledger = self.ledger
        if os.getpid() != self.pid:
            # Rule 7: a forked child touches nothing of its parent's (not even the lock,
            # which a mover of the parent may have held at the fork).
            ledger.close()
            return
        with ledger.cond:
            if not ledger.close():
                return
            ledger.cond.notify_all()
        if not self.movers.stop(self.close_timeout_s):
            log.warning(
                "TierChain(%s): a move was still running after %.0fs; closing the tiers anyway",
                ledger.url, self.close_timeout_s,
            )  # fmt: skip
        for tier in ledger.tiers:
            if tier.owned:
                try:
                    tier.store.close()
                except Exception as e:  # close every tier, whatever one of them does
                    log.warning("TierChain(%s): closing %s failed: %r", ledger.url, tier.url, e)

    def stats(self) -> ChainStats:
        """A snapshot of every unit's counts (:attr:`TierChain.stats`)."""
        ledger, movers = self.ledger, self.movers
        with ledger.cond:
            return ChainStats(
                tiers=tuple(t.snapshot() for t in ledger.tiers),
                moves=movers.moves,
                bytes_moved=movers.bytes_moved,
                move_failures=movers.failures,
                move_s=movers.move_s,
                put_waits=self.put_waits,
                put_wait_s=self.put_wait_s_total,
                spills=self.spills,
                planned_puts=self.plan.planned_puts,
                plan_fallbacks=self.plan.fallbacks,
                cycle_bytes=self.plan.cycle_bytes,
            )
