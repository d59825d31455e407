"""The state and the movers of a :class:`~tensorstore_hooks.TierChain` (``_chain.py``).

:class:`Core` owns the chain's map (chain key -> tier, key there), each tier's
byte count and age order, and the mover threads; the public class only forwards.

NOTE [ Tier chain ]
The rules, each kept by the code that names it:

1. Budgets count bytes actually held: a tensor counts in a tier from the moment room is
   reserved for it there until its copy there is deleted. During a move it counts in
   both tiers; the last tier has no budget.
2. A put lands in the first tier (or where Rule 8 plans it). When that tier has no
   room, the put waits (at most ``put_wait_s``) while the movers make room; it goes to
   the next tier at once if the tensor is larger than the budget, when a move out of
   the tier fails while it waits, or when the wait runs out. A tier that refuses or fails the write
   (``QuotaExceededError``, an unreachable service) passes it on to the next tier too;
   only the last tier's failure reaches the caller, so a tensor is always somewhere or
   still with the caller.
3. Movers (``move_threads`` threads of the chain's own, started when first needed)
   move while a tier's held bytes, plus the bytes puts are waiting to place there,
   exceed its budget: the oldest tensor (in put order) that is not already moving is
   read from tier ``i`` and written to tier ``i + 1``; room there is reserved first,
   and when tier ``i + 1`` is full the mover first moves *its* oldest tensor down
   (at most a few times; then it writes further down). Only after the new copy is
   written does the chain's map point at it, and only then is the old copy deleted.
4. A move that fails leaves the tensor where it was (the map never changed), counts a
   failure and is tried again after a backoff (0.1 s doubling to 5 s); the waiting
   puts are told (Rule 2).
5. A get reads the copy the map points at. If that copy is gone when the read gets
   there (a move just finished and deleted it), the get looks again and reads the new
   copy; a key no longer in the map is a ``KeyNotFoundError``.
6. A delete takes the key out of the map at once and deletes the copy the map pointed
   at; a move of that key still in flight finds the key gone when it finishes and
   deletes the copy it made (or, if its read lost the race, nothing).
7. ``close()`` lets no new move start, waits for the moves in flight (at most
   ``close_timeout_s``), then closes the tiers the chain opened. In a forked child it
   only marks the chain closed: the tiers are the parent's.
8. Planned puts (``plan``, on by default): a training loop fills the chain in forward
   and empties it in backward, step after step. A *cycle* runs from the chain being
   empty to it being empty again; the most bytes it held at once is that cycle's
   size. From the second cycle on, a put whose tensor would end up below a tier by
   the last cycle's size — more bytes are still to come after it than the tiers
   above can hold — is written straight to the tier the moves would have taken it
   to. The placement is what Rules 2-3 produce, without writing those tensors to the
   fast tier and reading them back: with the first tier at half a step, half of a
   step goes to each tier and no tensor moves. A cycle larger than the last still
   fills the first tier and moves its oldest, as above.

The chain's map (chain key -> tier, key there) lives in this process; each tier keeps
its own index, so ``tensorstore-hooks inspect URL URL ...`` lists what each tier holds
(the Zarr tiers of one chain share one namespace name).
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ._codec import encode
from ._store import BlobStore, TensorStore
from ._units import format_bytes
from .errors import (
    IntegrityError,
    KeyNotFoundError,
    StoreClosedError,
    TensorStoreError,
    UnsupportedTensorError,
)

__all__ = ["ChainStats", "Core", "Tier", "TierStats"]

log = logging.getLogger("tensorstore_hooks")

_FIRST_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 5.0
_CASCADE_TRIES = 3  # Rule 3: room-making moves into a full tier before writing further down
_GET_TRIES = 8  # Rule 5: a key moving faster than this many reads is not a real workload


# --------------------------------------------------------------------------- stats
@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier of a chain, at the moment :attr:`TierChain.stats` was read."""

    url: str
    budget: int | None
    """Bytes the tier may hold; ``None`` for the last tier."""
    tensors: int
    """Chain keys whose copy is in this tier now."""
    bytes: int
    """Payload bytes held now, copies being moved in or out included (Rule 1)."""
    peak_bytes: int
    """The most :attr:`bytes` this tier held at once."""
    puts: int
    """Puts that landed here."""
    bytes_put: int
    moved_in: int
    """Tensors moved here from the tier above."""
    bytes_moved_in: int
    moved_out: int
    """Tensors moved from here to a tier below."""
    bytes_moved_out: int


@dataclass(frozen=True, slots=True)
class ChainStats:
    """What a :class:`TierChain` holds and has done (a snapshot)."""

    tiers: tuple[TierStats, ...]
    moves: int
    """Tensors moved down a tier."""
    bytes_moved: int
    move_failures: int
    """Moves that failed (the tensor stayed; it is moved again later)."""
    move_s: float
    """Time movers spent moving (summed over movers)."""
    put_waits: int
    """Puts that waited for the movers to make room."""
    put_wait_s: float
    spills: int
    """Puts that went past a tier: too large for its budget, no room in time, or the
    tier refused or failed the write."""
    planned_puts: int
    """Puts written straight to a lower tier by the last cycle's size (Rule 8)."""
    cycle_bytes: int
    """The last finished cycle's size (Rule 8): the most bytes held at once between two
    moments the chain was empty; 0 before the first cycle ends."""

    def summary(self) -> str:
        """One line for logs."""
        tiers = "; ".join(
            f"tier {i} {t.url}: {t.tensors} tensors, {format_bytes(t.bytes)}"
            + (f" of {format_bytes(t.budget)}" if t.budget is not None else "")
            + f" (peak {format_bytes(t.peak_bytes)})"
            for i, t in enumerate(self.tiers)
        )
        return (
            f"{tiers}; moves {self.moves} ({format_bytes(self.bytes_moved)} in "
            f"{self.move_s:.3f}s, {self.move_failures} failed); puts waited {self.put_waits} "
            f"({self.put_wait_s:.3f}s), spilled past a tier {self.spills}, planned below "
            f"{self.planned_puts} (last cycle {format_bytes(self.cycle_bytes)})"
        )


# --------------------------------------------------------------------------- state
@dataclass(slots=True, eq=False)
class _Placement:
    """Where one chain key's bytes are. Changed only under the chain's lock."""

    seq: int
    tier: int
    key: str
    nbytes: int
    moving: bool = False


@dataclass(slots=True)
class Tier:
    store: TensorStore
    url: str
    budget: int | None
    owned: bool
    held: int = 0  # Rule 1
    wanted: int = 0  # bytes of puts waiting for room here (Rule 3)
    outgoing: int = 0  # bytes of moves out of here in flight
    tensors: int = 0
    peak: int = 0
    puts: int = 0
    bytes_put: int = 0
    moved_in: int = 0
    bytes_moved_in: int = 0
    moved_out: int = 0
    bytes_moved_out: int = 0
    oldest: list[tuple[int, str]] = field(default_factory=list)
    """Heap of (put order, chain key) of what the tier holds; stale entries are skipped."""

    def hold(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def fits(self, n: int) -> bool:
        return self.budget is None or self.held + n <= self.budget

    def over(self) -> bool:
        return self.budget is not None and (
            self.held + self.wanted - self.outgoing > self.budget
        )

    def snapshot(self) -> TierStats:
        return TierStats(
            url=self.url,
            budget=self.budget,
            tensors=self.tensors,
            bytes=self.held,
            peak_bytes=self.peak,
            puts=self.puts,
            bytes_put=self.bytes_put,
            moved_in=self.moved_in,
            bytes_moved_in=self.bytes_moved_in,
            moved_out=self.moved_out,
            bytes_moved_out=self.bytes_moved_out,
        )


class _Move:
    """One move in flight: a chain key's placement and where it was read from."""

    __slots__ = ("chain_key", "placement", "src", "src_key")

    def __init__(self, chain_key: str, placement: _Placement) -> None:
        self.chain_key = chain_key
        self.placement = placement
        self.src = placement.tier
        self.src_key = placement.key


class Core:
    """The chain's state and its movers; :class:`TierChain` is the public face.

    Movers hold this object, never the :class:`TierChain`, so a chain dropped without
    ``close()`` is collected and its finalizer closes this.
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
        self.tiers = tiers
        self.url = " -> ".join(t.url for t in tiers)
        self.move_threads = move_threads
        self.put_wait_s = put_wait_s
        self.close_timeout_s = close_timeout_s
        self.cond = threading.Condition(threading.Lock())
        self.map: dict[str, _Placement] = {}
        self.nbytes = 0
        self.next_seq = 0
        self.closed = False
        self.pid = os.getpid()
        self.movers: list[threading.Thread] = []
        self.moving = 0  # moves in flight
        self.failures = 0
        self.retry_at = 0.0
        self.backoff_s = 0.0
        self.moves = 0
        self.bytes_moved = 0
        self.move_s = 0.0
        self.put_waits = 0
        self.put_wait_s_total = 0.0
        self.spills = 0
        self.plan = plan
        self.planned_puts = 0
        self.cycle_bytes = 0  # Rule 8: the last finished cycle's size
        self.cycle_peak = 0  # the current cycle's size so far

    # ----------------------------------------------------------------- helpers
    def check_open(self) -> None:
        if self.closed:
            raise StoreClosedError(
                f"TierChain({self.url}) is closed; open a new one with tsh.open_store([...])"
            )

    def missing(self, key: object, why: str = "") -> KeyNotFoundError:
        return KeyNotFoundError(
            f"TierChain({self.url}): no key {key!r}"
            + (why or " (never written, already deleted, or written by another store object)")
        )

    def _wake_movers(self) -> None:
        """Under the lock: start the movers if a tier is over its budget, and wake them."""
        start = len(self.movers) < self.move_threads and not self.closed
        if start and any(t.over() for t in self.tiers):
            for i in range(len(self.movers), self.move_threads):
                th = threading.Thread(target=self._mover, name=f"tsh-chain-mover-{i}", daemon=True)
                self.movers.append(th)
                th.start()
        self.cond.notify_all()

    # ------------------------------------------------------------------- puts
    def put(self, tensor: torch.Tensor) -> str:
        meta, payload = encode(tensor)  # UnsupportedTensorError before anything is reserved
        n = meta.nbytes
        with self.cond:
            self.check_open()
            seq = self.next_seq
            self.next_seq += 1
            first = self._planned_tier(n)
        i = self._reserve_for_put(first, n)
        while True:
            tier = self.tiers[i]
            try:
                if isinstance(tier.store, BlobStore):
                    inner = tier.store.put_blob(meta, payload)
                else:
                    inner = tier.store.put(tensor)
            except TensorStoreError as e:
                self._release(i, n)
                if isinstance(e, UnsupportedTensorError) or i == len(self.tiers) - 1:
                    raise
                if self.closed:
                    raise
                log.debug("TierChain(%s): tier %d refused a put (%s); next tier", self.url, i, e)
                with self.cond:
                    self.spills += 1
                i = self._reserve_for_put(i + 1, n)  # Rule 2
                continue
            except BaseException:  # a user store's bug, or an interrupt: give the room back
                self._release(i, n)
                raise
            break
        key = format(seq, "x")
        with self.cond:
            if self.closed:  # closed while writing: the chain is gone, the copy is not wanted
                tier.held -= n
                discard = True
            else:
                discard = False
                self.map[key] = _Placement(seq, i, inner, n)
                self.nbytes += n
                self.cycle_peak = max(self.cycle_peak, self.nbytes)
                tier.tensors += 1
                tier.puts += 1
                tier.bytes_put += n
                if tier.budget is not None:
                    heapq.heappush(tier.oldest, (seq, key))
                self._wake_movers()
        if discard:
            with contextlib.suppress(Exception):
                tier.store.delete(inner)
            self.check_open()
        return key

    def _planned_tier(self, n: int) -> int:
        """Under the lock: Rule 8's tier for a put of ``n`` bytes (0 without a plan)."""
        if not self.plan or not self.cycle_bytes:
            return 0
        after = self.cycle_bytes - self.nbytes - n  # bytes the last cycle saved after it
        above = 0
        where = len(self.tiers) - 1
        for i, tier in enumerate(self.tiers[:-1]):
            assert tier.budget is not None
            above += tier.budget
            if after + n <= above:  # it and all that follows fit in the tiers so far
                where = i
                break
        if where:
            self.planned_puts += 1
        return where

    def _reserve_for_put(self, start: int, n: int) -> int:
        """Rule 2: reserve ``n`` bytes in the first tier from ``start`` that takes them."""
        with self.cond:
            for i in range(start, len(self.tiers)):
                self.check_open()
                tier = self.tiers[i]
                if tier.fits(n):
                    tier.hold(n)
                    return i
                assert tier.budget is not None  # the last tier always fits
                if n > tier.budget or self.put_wait_s <= 0:
                    self.spills += 1
                    continue
                if self._wait_for_room(tier, n):
                    tier.hold(n)
                    return i
                self.spills += 1
        raise AssertionError("unreachable: the last tier has no budget")  # pragma: no cover

    def _wait_for_room(self, tier: Tier, n: int) -> bool:
        """Under the lock: wait while the movers make room for ``n`` bytes in ``tier``.

        False when a move fails meanwhile or ``put_wait_s`` runs out (Rule 2)."""
        t0 = time.monotonic()
        deadline = t0 + self.put_wait_s
        failures = self.failures
        tier.wanted += n
        self.put_waits += 1
        try:
            self._wake_movers()
            while not tier.fits(n):
                self.check_open()
                left = deadline - time.monotonic()
                if self.failures != failures or left <= 0:
                    return False
                self.cond.wait(left)
            return True
        finally:
            tier.wanted -= n
            self.put_wait_s_total += time.monotonic() - t0

    def _release(self, i: int, n: int) -> None:
        with self.cond:
            self.tiers[i].held -= n
            self.cond.notify_all()

    # ------------------------------------------------------------------- gets
    def get(self, key: str, device: torch.device | str | None) -> torch.Tensor:
        for _ in range(_GET_TRIES):
            with self.cond:
                self.check_open()
                p = self.map.get(key) if isinstance(key, str) else None
                if p is None:
                    raise self.missing(key)
                i, inner = p.tier, p.key
            try:
                return self.tiers[i].store.get(inner, device=device)
            except KeyError as e:  # Rule 5: moved (or deleted) while we read
                with self.cond:
                    q = self.map.get(key)
                    if q is None:
                        raise self.missing(key, " (deleted while being read)") from e
                    if (q.tier, q.key) == (i, inner):
                        raise IntegrityError(
                            f"TierChain({self.url}): key {key!r} is missing from tier {i} "
                            f"({self.tiers[i].url}) that should hold it as {inner!r}: {e}"
                        ) from e
        raise TensorStoreError(
            f"TierChain({self.url}): key {key!r} kept moving while being read "
            f"({_GET_TRIES} tries)"
        )

    # ---------------------------------------------------------------- deletes
    def delete_many(self, keys: Iterable[str], *, strict: bool) -> None:
        """Rule 6. ``strict``: a missing key is a ``KeyNotFoundError`` (one key)."""
        by_tier: dict[int, list[tuple[str, int]]] = {}
        with self.cond:
            self.check_open()
            for key in keys:
                p = self.map.pop(key, None) if isinstance(key, str) else None
                if p is None:
                    if strict:
                        raise self.missing(key)
                    continue
                self.nbytes -= p.nbytes
                self.tiers[p.tier].tensors -= 1
                by_tier.setdefault(p.tier, []).append((p.key, p.nbytes))
            if not self.map and self.cycle_peak:  # Rule 8: a cycle ends
                self.cycle_bytes, self.cycle_peak = self.cycle_peak, 0
        for i, items in by_tier.items():
            store = self.tiers[i].store
            try:
                if len(items) == 1:
                    with contextlib.suppress(KeyError):
                        store.delete(items[0][0])
                else:
                    store.delete_many([k for k, _ in items])
            except Exception as e:  # the key is gone from the chain either way
                log.warning(
                    "TierChain(%s): deleting %d key(s) from tier %d failed: %r",
                    self.url, len(items), i, e,
                )  # fmt: skip
            finally:
                with self.cond:
                    self.tiers[i].held -= sum(n for _, n in items)
                    self.cond.notify_all()

    # ------------------------------------------------------------------ moves
    def _mover(self) -> None:
        while True:
            with self.cond:
                job = self._next_move()
                while job is None:
                    if self.closed:
                        return
                    wait = max(0.0, self.retry_at - time.monotonic()) or None
                    self.cond.wait(wait)
                    job = self._next_move()
            self._move(job)
            del job

    def _next_move(self) -> _Move | None:
        """Under the lock: the oldest movable tensor of the deepest tier over budget."""
        if self.closed or time.monotonic() < self.retry_at:
            return None
        for i in range(len(self.tiers) - 2, -1, -1):
            if self.tiers[i].over():
                job = self._take_oldest(i)
                if job is not None:
                    return job
        return None

    def _take_oldest(self, i: int) -> _Move | None:
        """Under the lock: mark tier ``i``'s oldest tensor as moving (Rule 3)."""
        tier = self.tiers[i]
        while tier.oldest:
            _, key = heapq.heappop(tier.oldest)
            p = self.map.get(key)
            if p is None or p.tier != i or p.moving:
                continue  # stale: deleted, already moved, or taken by another mover
            p.moving = True
            tier.outgoing += p.nbytes
            self.moving += 1
            return _Move(key, p)
        return None

    def _reserve_for_move(self, start: int, n: int) -> int:
        """Reserve room for a moved tensor in tier ``start`` or below (Rule 3)."""
        for i in range(start, len(self.tiers)):
            tier = self.tiers[i]
            for _ in range(_CASCADE_TRIES):
                with self.cond:
                    if tier.fits(n):
                        tier.hold(n)
                        return i
                    assert tier.budget is not None
                    if n > tier.budget or self.closed:
                        break
                    victim = self._take_oldest(i)
                if victim is None:
                    break
                self._move(victim)
        raise AssertionError("unreachable: the last tier has no budget")  # pragma: no cover

    def _move(self, job: _Move) -> None:
        p, src, n = job.placement, job.src, job.placement.nbytes
        t0 = time.perf_counter()
        dst = -1
        try:
            dst = self._reserve_for_move(src + 1, n)
            new_key = _copy(self.tiers[src].store, job.src_key, self.tiers[dst].store)
        except Exception as e:
            self._move_failed(job, dst, e)
            return
        with self.cond:
            self.tiers[src].outgoing -= n
            self.moving -= 1
            if self.map.get(job.chain_key) is not p:  # Rule 6: deleted while moving
                cleanup, cleanup_tier = new_key, dst
            else:
                p.tier, p.key, p.moving = dst, new_key, False
                s, d = self.tiers[src], self.tiers[dst]
                s.tensors -= 1
                d.tensors += 1
                s.moved_out += 1
                s.bytes_moved_out += n
                d.moved_in += 1
                d.bytes_moved_in += n
                if d.budget is not None:
                    heapq.heappush(d.oldest, (p.seq, job.chain_key))
                self.moves += 1
                self.bytes_moved += n
                self.backoff_s = 0.0
                cleanup, cleanup_tier = job.src_key, src
            self.move_s += time.perf_counter() - t0
        try:
            self.tiers[cleanup_tier].store.delete(cleanup)
        except Exception as e:
            log.warning(
                "TierChain(%s): deleting the old copy %r from tier %d failed: %r",
                self.url, cleanup, cleanup_tier, e,
            )  # fmt: skip
        finally:
            with self.cond:
                self.tiers[cleanup_tier].held -= n
                self._wake_movers()

    def _move_failed(self, job: _Move, dst: int, error: Exception) -> None:
        """Rule 4 (or Rule 6, when the read lost the race with a delete)."""
        p, src, n = job.placement, job.src, job.placement.nbytes
        with self.cond:
            if dst >= 0:
                self.tiers[dst].held -= n
            self.tiers[src].outgoing -= n
            self.moving -= 1
            if self.map.get(job.chain_key) is not p:
                self.cond.notify_all()
                return  # deleted while moving: nothing to keep
            p.moving = False
            heapq.heappush(self.tiers[src].oldest, (p.seq, job.chain_key))
            self.failures += 1
            first = self.backoff_s == 0.0
            self.backoff_s = min(_MAX_BACKOFF_S, max(_FIRST_BACKOFF_S, 2 * self.backoff_s))
            self.retry_at = time.monotonic() + self.backoff_s
            self.cond.notify_all()
        if self.closed:
            return
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "TierChain(%s): moving a tensor from tier %d to tier %d failed (it stays in "
            "tier %d; retrying in %.1fs): %s",
            self.url, src, src + 1, src, self.backoff_s, error,
        )  # fmt: skip

    # ------------------------------------------------------------------ close
    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no tier is over budget and no move is in flight (or a move failed
        and waits for its retry). True if that happened within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.moving or (
                time.monotonic() >= self.retry_at and any(t.over() for t in self.tiers[:-1])
            ):
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return False
                self.cond.wait(min(left, 0.1))
            return True

    def close(self) -> None:
        if os.getpid() != self.pid:
            # Rule 7: a forked child touches nothing of its parent's (not even the lock,
            # which a mover of the parent may have held at the fork).
            self.closed = True
            return
        with self.cond:
            if self.closed:
                return
            self.closed = True
            movers = list(self.movers)
            self.cond.notify_all()
        deadline = time.monotonic() + self.close_timeout_s
        for th in movers:
            if th is not threading.current_thread():
                th.join(max(0.0, deadline - time.monotonic()))
        if any(th.is_alive() for th in movers):
            log.warning(
                "TierChain(%s): a move was still running after %.0fs; closing the tiers anyway",
                self.url, self.close_timeout_s,
            )  # fmt: skip
        for tier in self.tiers:
            if tier.owned:
                try:
                    tier.store.close()
                except Exception as e:  # close every tier, whatever one of them does
                    log.warning("TierChain(%s): closing %s failed: %r", self.url, tier.url, e)

    def stats(self) -> ChainStats:
        with self.cond:
            return ChainStats(
                tiers=tuple(t.snapshot() for t in self.tiers),
                moves=self.moves,
                bytes_moved=self.bytes_moved,
                move_failures=self.failures,
                move_s=self.move_s,
                put_waits=self.put_waits,
                put_wait_s=self.put_wait_s_total,
                spills=self.spills,
                planned_puts=self.planned_puts,
                cycle_bytes=self.cycle_bytes,
            )


def _copy(src: TensorStore, key: str, dst: TensorStore) -> str:
    """Write ``src``'s ``key`` into ``dst``; returns the key there. Bytes and metadata
    go across unchanged between two byte-level stores (no decode, no device)."""
    if isinstance(src, BlobStore) and isinstance(dst, BlobStore):
        meta, payload = src.get_blob(key)
        return dst.put_blob(meta, payload)
    return dst.put(src.get(key))
