"""A tier chain's bookkeeping: where each chain key's bytes are, and what each tier
holds (NOTE [ Tier chain ] Rule 1 in ``storage/chain/_core.py``).

:class:`Ledger` is the one owner of the chain's map (chain key -> tier, key there),
each tier's byte and tensor counts and age order, and the moves in flight; the puts
(``Core``) and the movers (``Movers``) change them only through its methods, each
named for what the caller did and returning what the caller must do outside the lock.
It does no I/O and starts no thread.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass, field

from tensorstore_hooks.errors import KeyNotFoundError, StoreClosedError
from tensorstore_hooks.storage._store import TensorStore
from tensorstore_hooks.storage.chain._stats import TierStats

__all__ = ["Ledger", "Move", "Placement", "Tier"]


@dataclass(slots=True, eq=False)
class Placement:
    """Where one chain key's bytes are. Changed only by the :class:`Ledger`, under its
    lock; ``eq=False``: a placement is compared by identity (Rule 6 asks "is the key
    still this placement?")."""

    seq: int
    """Put order (the chain key is its hex)."""
    tier: int
    key: str
    """The key in that tier."""
    nbytes: int
    moving: bool = False


@dataclass(slots=True)
class Tier:
    """One store of a chain and its counts. Read anywhere under the chain's lock;
    written by the :class:`Ledger`, except ``wanted``, which the puts that wait for
    room here (``Core``) raise and lower around their wait."""

    store: TensorStore
    url: str
    budget: int | None
    """Bytes the tier may hold; ``None`` for the last tier (it takes what is left)."""
    owned: bool
    """Whether the chain closes the store."""
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
        """Rule 3: held bytes, plus those puts wait to place here, minus those moving
        out, exceed the budget (never for the last tier)."""
        return self.budget is not None and (self.held + self.wanted - self.outgoing > self.budget)

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


class Move:
    """One move in flight: a chain key's placement and where it was read from."""

    __slots__ = ("chain_key", "placement", "src", "src_key")

    def __init__(self, chain_key: str, placement: Placement) -> None:
        self.chain_key = chain_key
        self.placement = placement
        self.src = placement.tier
        self.src_key = placement.key


class Ledger:
    """The chain's map and per-tier counts, and the one lock (``cond``) that guards
    them; the chain's other units use that lock too.

    Methods marked "under the lock" expect the caller to hold ``cond``; none of them
    blocks, does I/O or notifies (the caller does, when it has made room).
    """

    def __init__(self, tiers: list[Tier]) -> None:
        self.tiers = tiers
        self.url = " -> ".join(t.url for t in tiers)
        self.cond = threading.Condition(threading.Lock())
        self.map: dict[str, Placement] = {}
        self.nbytes = 0
        """Payload bytes of the chain's keys (a moving tensor counts once)."""
        self.next_seq = 0
        self.closed = False

    # ---------------------------------------------------------------- checks
    def check_open(self) -> None:
        """Raise ``StoreClosedError`` once :meth:`close` ran."""
        if self.closed:
            raise self.closed_error()

    def closed_error(self) -> StoreClosedError:
        return StoreClosedError(
            f"TierChain({self.url}) is closed; open a new one with tsh.open_store([...])"
        )

    def missing(self, key: object, why: str = "") -> KeyNotFoundError:
        """The error for a chain key that is not in the map (``why``: a suffix that
        says why, instead of the usual guesses)."""
        return KeyNotFoundError(
            f"TierChain({self.url}): no key {key!r}"
            + (why or " (never written, already deleted, or written by another store object)")
        )

    def budgets(self) -> list[int]:
        """The budgets of all tiers but the last."""
        return [t.budget for t in self.tiers if t.budget is not None]

    def close(self) -> bool:
        """Under the lock (or, in a forked child, without it): let no new put, get,
        delete or move start. False if the ledger was already closed."""
        was_open, self.closed = not self.closed, True
        return was_open

    # ----------------------------------------------------------------- puts
    def new_seq(self) -> int:
        """Under the lock: the next put order (raises once closed)."""
        self.check_open()
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def reserve(self, i: int, n: int) -> bool:
        """Under the lock: hold ``n`` bytes in tier ``i`` if they fit its budget (Rule 1:
        they count from now until :meth:`release`)."""
        tier = self.tiers[i]
        if not tier.fits(n):
            return False
        tier.hold(n)
        return True

    def release(self, i: int, n: int, moved_out: bool = False) -> None:
        """Under the lock: tier ``i`` no longer holds ``n`` bytes (a copy deleted or
        never written; ``moved_out``: the old copy of a tensor that moved down, which
        :meth:`moved` left counted as outgoing). The caller notifies the waiters."""
        tier = self.tiers[i]
        tier.held -= n
        if moved_out:
            tier.outgoing -= n

    def placed(self, seq: int, i: int, inner: str, n: int) -> str:
        """Under the lock: a put of ``n`` bytes (room reserved in tier ``i``) was
        written there as ``inner``; returns its chain key."""
        key = format(seq, "x")
        tier = self.tiers[i]
        self.map[key] = Placement(seq, i, inner, n)
        self.nbytes += n
        tier.tensors += 1
        tier.puts += 1
        tier.bytes_put += n
        if tier.budget is not None:
            heapq.heappush(tier.oldest, (seq, key))
        return key

    # -------------------------------------------------------------- deletes
    def forget(self, keys: list[str], *, strict: bool) -> dict[int, list[tuple[str, int]]]:
        """Under the lock: take ``keys`` out of the map (Rule 6); returns, per tier, the
        (key there, bytes) the caller must delete and then :meth:`release`. ``strict``:
        a key not in the map raises ``KeyNotFoundError`` (keys before it are already
        out), else it is skipped."""
        self.check_open()
        by_tier: dict[int, list[tuple[str, int]]] = {}
        for key in keys:
            p = self.map.pop(key, None) if isinstance(key, str) else None
            if p is None:
                if strict:
                    raise self.missing(key)
                continue
            self.nbytes -= p.nbytes
            self.tiers[p.tier].tensors -= 1
            by_tier.setdefault(p.tier, []).append((p.key, p.nbytes))
        return by_tier

    # ---------------------------------------------------------------- moves
    def take_oldest(self, i: int) -> Move | None:
        """Under the lock: mark tier ``i``'s oldest tensor not already moving as moving
        (Rule 3); None if it holds none. The caller must end the move with
        :meth:`moved` or :meth:`move_failed`."""
        tier = self.tiers[i]
        while tier.oldest:
            _, key = heapq.heappop(tier.oldest)
            p = self.map.get(key)
            if p is None or p.tier != i or p.moving:
                continue  # stale: deleted, already moved, or taken by another mover
            p.moving = True
            tier.outgoing += p.nbytes
            return Move(key, p)
        return None

    def moved(self, job: Move, dst: int, new_key: str) -> tuple[int, str, bool]:
        """Under the lock: ``job``'s tensor was copied to tier ``dst`` (room reserved
        there) as ``new_key``. The map points at the new copy unless the key was
        deleted meanwhile (Rule 6). Returns (tier, key there, moved): the copy the
        caller must delete and then :meth:`release` (the old one, or the new one when
        the key is gone), and whether the tensor moved (then pass ``moved_out=True``)."""
        p, src, n = job.placement, job.src, job.placement.nbytes
        s, d = self.tiers[src], self.tiers[dst]
        if self.map.get(job.chain_key) is not p:  # Rule 6: deleted while moving
            s.outgoing -= n
            return dst, new_key, False
        # The old copy stays outgoing until it is deleted and released
        # (release(moved_out=True)): until then it still counts as held, and without
        # the outgoing bytes beside it the tier would look over budget and another
        # mover would move one tensor too many.
        p.tier, p.key, p.moving = dst, new_key, False
        s.tensors -= 1
        d.tensors += 1
        s.moved_out += 1
        s.bytes_moved_out += n
        d.moved_in += 1
        d.bytes_moved_in += n
        if d.budget is not None:
            heapq.heappush(d.oldest, (p.seq, job.chain_key))
        return src, job.src_key, True

    def move_failed(self, job: Move, dst: int) -> bool:
        """Under the lock: ``job`` failed (``dst``: the tier room was reserved in, or -1);
        that room is released. True if the tensor stays where it was and will be moved
        again (Rule 4); False if its key was deleted meanwhile (Rule 6)."""
        p, n = job.placement, job.placement.nbytes
        if dst >= 0:
            self.tiers[dst].held -= n
        self.tiers[job.src].outgoing -= n
        if self.map.get(job.chain_key) is not p:
            return False
        p.moving = False
        heapq.heappush(self.tiers[job.src].oldest, (p.seq, job.chain_key))
        return True
