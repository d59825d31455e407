"""The host tier: a budgeted pool of (pinned) host buffers with an oldest-first spill order.

Pure logic behind one seam: the allocator is injected (``pin_memory=True`` buffers in
real use, plain CPU tensors, or anything with a size, in tests), so what is held, what
spills and in which order is testable without a device. See NOTE [ Host tier ].

NOTE [ Host tier ]
Rules, numbered so code can cite them:

1. Every byte the tier hands out counts against ``cap_bytes`` (``host_budget``):
   buffers held for a tensor, buffers of tensors being spilled (their bytes are
   still there until the store has them), buffers lent to reads, and idle buffers
   kept for reuse, each at the size the allocator really takes for it
   (``block_bytes``: torch's pinned allocator rounds to a power of two).
   ``used_bytes <= cap_bytes`` at all times.
2. Buffers are recycled: a training loop saves the same sizes every step, so after
   the first step the allocator (a ``cudaHostAlloc`` for pinned memory, ~ms each) is
   not called again. An allocator that frees what it is given back (plain buffers)
   gets idle buffers of another size back, least recently returned first, before
   anything spills. One that keeps freed blocks cached (``keeps_freed``: torch's
   pinned allocator) would free nothing that way, so the tier never drops a buffer
   while it lives and serves a request from the smallest idle buffer that fits.
3. Held tensors spill in the order they were held, oldest first: backward reads
   newest first, so the oldest are needed last. :meth:`make_room` only *chooses*
   the victims (they move to ``spilling``); the caller writes each to the store and
   then calls :meth:`release`, which is when its bytes come back. With
   ``keeps_freed``, bytes come back only as buffers, so the victim is the oldest
   held tensor whose buffer fits the request.
4. A tensor larger than the cap is never held (:meth:`make_room` returns ``None``):
   the caller sends it to the store directly. So is one no buffer can take now
   (``keeps_freed`` with the cap spent on smaller buffers). ``cap_bytes == 0``
   turns the tier off.
5. Reads that bring spilled tensors back (backward's prefetch) borrow buffers
   through :meth:`try_take` only while their copy to the device runs, and never make
   anything spill: a read that finds no room gets ``None`` (the caller then copies
   from pageable memory), so reads cannot evict the tensors backward needs next.
6. ``host`` rules (a tensor moved to pinned memory for backward) draw from the same
   pool through the same calls, so one cap bounds all pinned memory of a pipeline.

Thread-safe: writers, readers and the pack hook call it concurrently; :meth:`take`
blocks (with a timeout) until spills or releases free enough room. How the pipeline
uses it: NOTE [ Host tier wiring ] in ``pipeline/_device.py``.
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
    outside the tier's lock); the tier asks for ``block_bytes(n)`` bytes for a
    request of ``n`` (the allocator's real size; default :func:`round_up`).
    ``keeps_freed``: the allocator keeps blocks it is given back (rule 2). Keys are
    the caller's (records); each key holds at most one buffer, which may be larger
    than asked. Call sequence for a tensor::

        victims = tier.make_room(key, n)   # None: bigger than the cap, store it directly
        for v in victims: write v to the store, then tier.release(v)
        buf = tier.take(key)               # blocks until the victims' bytes are back
        ...                                # later: tier.release(key)
    """

    def __init__(
        self,
        cap_bytes: int,
        allocate: Callable[[int], B],
        *,
        block_bytes: Callable[[int], int] = round_up,
        keeps_freed: bool = False,
    ) -> None:
        if cap_bytes < 0:
            raise ValueError(f"HostTier: cap_bytes must be >= 0, got {cap_bytes}")
        self.cap_bytes = cap_bytes
        self._allocate = allocate
        self._block = block_bytes
        self.keeps_freed = keeps_freed
        """The allocator keeps freed blocks: buffers are never dropped (rule 2)."""
        self._cond = threading.Condition(threading.Lock())
        self._held: OrderedDict[Hashable, tuple[B, int]] = OrderedDict()  # oldest first
        self._spilling: dict[Hashable, tuple[B, int]] = {}
        self._lent: dict[Hashable, tuple[B, int]] = {}  # reads (rule 5)
        # make_room done, take to come: (an idle buffer reused, else None; its size;
        # whether the size counts in _reserved)
        self._pending: dict[Hashable, tuple[B | None, int, bool]] = {}
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
        first (often none), or ``None`` when ``nbytes`` cannot fit (rule 4). Idle
        buffers are reused (or, rule 2, dropped) before anything spills. Follow with
        :meth:`take` (or :meth:`release` to give the reservation up).
        """
        size = self._block(nbytes)
        if size > self.cap_bytes:
            return None
        victims: list[Hashable] = []
        with self._cond:
            got = self._pop_idle(size)
            if got is not None:
                self._pending[key] = (got[0], got[1], False)
                return victims
            if self.keeps_freed and self._used + self._reserved + size > self.cap_bytes:
                return self._room_in_buffers(key, size)
            self._pending[key] = (None, size, True)
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

    def _room_in_buffers(self, key: Hashable, size: int) -> list[Hashable] | None:
        """``keeps_freed`` with no room to grow: wait for a buffer of ``size`` or more to
        come back (rule 3), or ``None`` when none can (rule 4). Lock held."""
        if any(n >= size for _, n in self._spilling.values()):
            self._pending[key] = (None, size, False)  # one is on its way out already
            return []
        for victim, (_, n) in self._held.items():  # oldest first
            if n >= size:
                self._spilling[victim] = self._held.pop(victim)
                self._pending[key] = (None, size, False)
                self.spills += 1
                return [victim]
        return None

    def take(self, key: Hashable, timeout_s: float | None = None) -> B:
        """The buffer reserved for ``key`` by :meth:`make_room`; ``key`` is now held.

        Blocks until the room is there (spilled keys released). Raises
        ``TimeoutError`` after ``timeout_s`` (the reservation is then given up).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            buf, size, reserved = self._pending[key]
            asked = size
            grow = False
            while buf is None:
                # A spilled tensor's buffer is reused (rule 2): a loop that spills every
                # step allocates nothing after its first.
                got = self._pop_idle(asked)
                if got is not None:
                    buf, size = got
                    break
                if not self.keeps_freed:
                    self._drop_idle(self._used + asked - self.cap_bytes)
                if self._used + asked <= self.cap_bytes:
                    self._grow(asked)  # a new buffer, made below outside the lock
                    grow = True
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    del self._pending[key]
                    if reserved:
                        self._reserved -= asked
                    raise TimeoutError(
                        f"host tier: no room for {asked} bytes within {timeout_s}s "
                        f"({self._used} of {self.cap_bytes} bytes in use)"
                    )
                self._cond.wait(left)
            if reserved:
                self._reserved -= asked
            del self._pending[key]
        if grow:
            buf = self._new_buffer(asked)
        assert buf is not None
        with self._cond:
            self._held[key] = (buf, size)
        return buf

    def can_take(self, key: Hashable) -> bool:
        """Whether :meth:`take` for ``key`` (after :meth:`make_room`) would not wait now."""
        with self._cond:
            buf, size, _ = self._pending[key]
            if buf is not None or self._fits_idle(size):
                return True
            freeable = 0 if self.keeps_freed else sum(n for n, _ in self._idle_order.values())
            return self._used - freeable + size <= self.cap_bytes

    def try_take(self, key: Hashable, nbytes: int) -> B | None:
        """Lend a buffer for a read if it fits now, else ``None`` (rule 5: never spills).

        Give it back with :meth:`release` when the read is done with it.
        """
        size = self._block(nbytes)
        with self._cond:
            got = self._pop_idle(size)
            if got is None:
                need = self._used + self._reserved + size - self.cap_bytes
                if not self.keeps_freed:
                    need -= self._drop_idle(need)
                if need > 0:
                    return None
                self._grow(size)
        if got is None:
            buf = self._new_buffer(size)
        else:
            buf, size = got
        with self._cond:
            self._lent[key] = (buf, size)
        return buf

    def release(self, key: Hashable) -> None:
        """``key`` is done with its buffer (spilled, consumed or freed): it goes idle.

        Also gives up a reservation that was never taken. Releasing a key that holds
        nothing is a no-op (a finalizer may race a spill).
        """
        with self._cond:
            entry = self._held.pop(key, None) or self._spilling.pop(key, None)
            entry = entry or self._lent.pop(key, None)
            if entry is not None:
                self._to_idle(*entry)
            else:
                pending = self._pending.pop(key, None)
                if pending is None:
                    return
                buf, size, reserved = pending
                if reserved:
                    self._reserved -= size
                if buf is not None:
                    self._to_idle(buf, size)
            self._cond.notify_all()

    def clear(self) -> None:
        """Drop every idle buffer (held ones stay until released): the tier is done.

        (An allocator that keeps freed blocks, as torch's pinned one does, keeps them
        cached for the process.)
        """
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

    def _to_idle(self, buf: B, size: int) -> None:
        self._idle[size].append(buf)
        self._idle_order[id(buf)] = (size, buf)

    def _fits_idle(self, size: int) -> bool:
        if self._idle.get(size):
            return True
        return self.keeps_freed and any(n > size and b for n, b in self._idle.items())

    def _pop_idle(self, size: int) -> tuple[B, int] | None:
        """An idle buffer for ``size``: of that size, or (``keeps_freed``) the smallest
        larger one (rule 2)."""
        if not self._idle.get(size):
            larger = [n for n, b in self._idle.items() if n > size and b]
            if not self.keeps_freed or not larger:
                return None
            size = min(larger)
        buf = self._idle[size].pop()
        del self._idle_order[id(buf)]
        return buf, size

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
