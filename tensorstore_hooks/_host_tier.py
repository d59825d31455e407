"""The host tier: a budgeted pool of (pinned) host buffers with an oldest-first spill order.

Pure logic behind one seam: the allocator is injected (``pin_memory=True`` buffers in
real use, plain CPU tensors, or anything with a size, in tests), so what is held, what
spills and in which order is testable without a device. See NOTE [ Host tier ].

NOTE [ Host tier ]
Rules, numbered so code can cite them:

1. Every byte the tier hands out counts against ``cap_bytes`` (``host_budget``):
   buffers held for a tensor, buffers of tensors being spilled (their bytes are
   still there until the store has them), buffers lent to reads, and idle buffers
   kept for reuse. ``used_bytes <= cap_bytes`` at all times.
2. Buffers are recycled by exact size (rounded up to 4 KiB): a training loop saves
   the same sizes every step, so after the first step the allocator (a
   ``cudaHostAlloc`` for pinned memory, ~ms each) is not called again. When room is
   needed, idle buffers are dropped first (least recently returned first), before
   any tensor spills.
3. Held tensors spill in the order they were held, oldest first: backward reads
   newest first, so the oldest are needed last. :meth:`make_room` only *chooses*
   the victims (they move to ``spilling``); the caller writes each to the store and
   then calls :meth:`release`, which is when its bytes come back.
4. A tensor larger than the cap is never held (:meth:`make_room` returns ``None``):
   the caller sends it to the store directly. ``cap_bytes == 0`` turns the tier off.
5. Reads that bring spilled tensors back (backward's prefetch) borrow buffers
   through :meth:`try_take` only while their copy to the device runs, and never make
   anything spill: a read that finds no room gets ``None`` (the caller then copies
   from pageable memory), so reads cannot evict the tensors backward needs next.
6. ``host`` rules (a tensor moved to pinned memory for backward) draw from the same
   pool through the same calls, so one cap bounds all pinned memory of a pipeline.

Thread-safe: writers, readers and the pack hook call it concurrently; :meth:`take`
blocks (with a timeout) until spills or releases free enough room. How the pipeline
uses it: NOTE [ Host tier wiring ] in ``_device.py``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["HostTier", "round_up"]

B = TypeVar("B")
"""The buffer type: what ``allocate`` returns (a pinned ``torch.Tensor`` in real use)."""

_ALIGN = 4096


def round_up(nbytes: int) -> int:
    """The buffer size the tier uses for ``nbytes`` (rule 2): a multiple of 4 KiB, >= 4 KiB."""
    return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)


class HostTier(Generic[B]):
    """Host buffers for tensors leaving an accelerator, within ``cap_bytes``.

    ``allocate(nbytes)`` returns a new buffer of exactly ``nbytes`` bytes (called
    outside the tier's lock). Keys are the caller's (records); each key holds at most
    one buffer. Call sequence for a tensor::

        victims = tier.make_room(key, n)   # None: bigger than the cap, store it directly
        for v in victims: write v to the store, then tier.release(v)
        buf = tier.take(key)               # blocks until the victims' bytes are back
        ...                                # later: tier.release(key)
    """

    def __init__(self, cap_bytes: int, allocate: Callable[[int], B]) -> None:
        if cap_bytes < 0:
            raise ValueError(f"HostTier: cap_bytes must be >= 0, got {cap_bytes}")
        self.cap_bytes = cap_bytes
        self._allocate = allocate
        self._cond = threading.Condition(threading.Lock())
        self._held: OrderedDict[Hashable, tuple[B, int]] = OrderedDict()  # oldest first
        self._spilling: dict[Hashable, tuple[B, int]] = {}
        self._lent: dict[Hashable, tuple[B, int]] = {}  # reads (rule 5)
        # make_room done, take to come (the buffer: an idle one reused, else None)
        self._pending: dict[Hashable, tuple[B | None, int]] = {}
        # Idle buffers by size, and all of them least recently returned first (rule 2).
        self._idle: dict[int, list[B]] = defaultdict(list)
        self._idle_order: OrderedDict[int, tuple[int, B]] = OrderedDict()  # id -> (size, buf)
        self._used = 0  # bytes of every buffer that exists (rule 1)
        self._reserved = 0  # bytes promised by make_room, not yet allocated
        self.peak_bytes = 0
        """The most bytes the tier has accounted for at once."""
        self.allocations = 0
        """Calls to ``allocate`` (a loop that repeats its sizes stops making them)."""
        self.spills = 0
        """Tensors chosen to spill to the store (rule 3)."""

    # ---------------------------------------------------------------- reading
    @property
    def used_bytes(self) -> int:
        """Bytes of every buffer the tier has now, idle ones included (rule 1)."""
        return self._used

    @property
    def held_bytes(self) -> int:
        """Bytes held for tensors (not spilling, not lent, not idle)."""
        with self._cond:
            return sum(n for _, n in self._held.values())

    def held_keys(self) -> list[Hashable]:
        """Keys held now, oldest first: the order they would spill in."""
        with self._cond:
            return list(self._held)

    def spilling_keys(self) -> list[Hashable]:
        """Keys chosen to spill whose bytes have not been released yet."""
        with self._cond:
            return list(self._spilling)

    def buffer(self, key: Hashable) -> B:
        """The buffer of a held, spilling or lent key (``KeyError`` if it has none)."""
        with self._cond:
            for table in (self._held, self._spilling, self._lent):
                if key in table:
                    return table[key][0]
        raise KeyError(key)

    # ----------------------------------------------------------------- writing
    def make_room(self, key: Hashable, nbytes: int) -> list[Hashable] | None:
        """Reserve room for ``key``'s ``nbytes``; return what must spill for it.

        Returns the keys the caller must now write to the store and release, oldest
        first (often none), or ``None`` when ``nbytes`` can never fit (rule 4). Idle
        buffers are reused or dropped before anything spills (rule 2). Follow with
        :meth:`take` (or :meth:`release` to give the reservation up).
        """
        size = round_up(nbytes)
        if size > self.cap_bytes:
            return None
        victims: list[Hashable] = []
        with self._cond:
            buf = self._pop_idle(size)
            if buf is not None:
                self._pending[key] = (buf, size)
                return victims
            self._pending[key] = (None, size)
            self._reserved += size
            over = self._used + self._reserved - self.cap_bytes
            over -= self._drop_idle(over)
            over -= sum(n for _, n in self._spilling.values())  # already on their way out
            while over > 0 and self._held:
                victim, entry = self._held.popitem(last=False)
                self._spilling[victim] = entry
                victims.append(victim)
                self.spills += 1
                over -= entry[1]
        return victims

    def take(self, key: Hashable, timeout_s: float | None = None) -> B:
        """The buffer reserved for ``key`` by :meth:`make_room`; ``key`` is now held.

        Blocks until the room is there (spilled keys released). Raises
        ``TimeoutError`` after ``timeout_s`` (the reservation is then given up).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            buf, size = self._pending[key]
            while buf is None:
                # A spilled tensor's buffer of the same size is reused (rule 2): a loop
                # that spills every step allocates nothing after its first.
                buf = self._pop_idle(size)
                if buf is not None:
                    break
                self._drop_idle(self._used + size - self.cap_bytes)
                if self._used + size <= self.cap_bytes:
                    self._grow(size)  # a new buffer, made below outside the lock
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    del self._pending[key]
                    self._reserved -= size
                    raise TimeoutError(
                        f"host tier: no room for {size} bytes within {timeout_s}s "
                        f"({self._used} of {self.cap_bytes} bytes in use)"
                    )
                self._cond.wait(left)
            if self._pending[key][0] is None:
                self._reserved -= size
            del self._pending[key]
        got = self._new_buffer(size) if buf is None else buf
        with self._cond:
            self._held[key] = (got, size)
        return got

    def try_take(self, key: Hashable, nbytes: int) -> B | None:
        """Lend a buffer for a read if it fits now, else ``None`` (rule 5: never spills).

        Give it back with :meth:`release` when the read is done with it.
        """
        size = round_up(nbytes)
        with self._cond:
            buf = self._pop_idle(size)
            if buf is None:
                need = self._used + self._reserved + size - self.cap_bytes
                need -= self._drop_idle(need)
                if need > 0:
                    return None
                self._grow(size)
        if buf is None:
            buf = self._new_buffer(size)
        with self._cond:
            self._lent[key] = (buf, size)
        return buf

    def release(self, key: Hashable) -> None:
        """``key`` is done with its buffer (spilled, consumed or freed): it goes idle.

        Also gives up a reservation that was never taken. Releasing a key that holds
        nothing is a no-op (a finalizer may race a spill).
        """
        with self._cond:
            entry = (
                self._held.pop(key, None)
                or self._spilling.pop(key, None)
                or self._lent.pop(key, None)
                or self._pending.pop(key, None)
            )
            if entry is None:
                return
            buf, size = entry
            if buf is None:
                self._reserved -= size
            else:
                self._idle[size].append(buf)
                self._idle_order[id(buf)] = (size, buf)
            self._cond.notify_all()

    def clear(self) -> None:
        """Drop every idle buffer (held ones stay until released)."""
        with self._cond:
            self._drop_idle(self._used)

    # ---------------------------------------------------------------- internals
    def _grow(self, size: int) -> None:
        self._used += size
        self.peak_bytes = max(self.peak_bytes, self._used)
        self.allocations += 1

    def _new_buffer(self, size: int) -> B:
        try:
            return self._allocate(size)
        except BaseException:
            with self._cond:
                self._used -= size
                self._cond.notify_all()
            raise

    def _pop_idle(self, size: int) -> B | None:
        bucket = self._idle.get(size)
        if not bucket:
            return None
        buf = bucket.pop()
        del self._idle_order[id(buf)]
        return buf

    def _drop_idle(self, need: int) -> int:
        """Free idle buffers, least recently returned first, until ``need`` bytes are
        freed (or none is left); returns the bytes freed."""
        freed = 0
        while freed < need and self._idle_order:
            _, (size, buf) = self._idle_order.popitem(last=False)
            bucket = self._idle[size]
            for i, b in enumerate(bucket):
                if b is buf:
                    del bucket[i]
                    break
            self._used -= size
            freed += size
        return freed
