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

NOTE [ Pinned slabs ]
Torch's pinned allocator rounds every request up to a power of two and keeps freed
blocks for a request of the same size: a :class:`HostTier` of pinned buffers held only
77-87% of its budget as tensor bytes. :class:`SlabTier`, the tier the device stager
uses, keeps the rules of NOTE [ Host tier ] over a few large buffers instead:

1. Slabs are powers of two (what the pinned allocator then holds exactly), at most
   ``SLAB_BYTES`` each (a larger tensor gets one of its own), made as they are needed
   while the cap allows: largest first, so the slabs of a budget add up to it, to the
   last slab that can still hold a tensor. They are kept while the tier lives.
2. A tensor takes a range of a slab, rounded up to 4 KiB (buffers stay page-aligned
   for direct I/O): the first free range that fits, else a new slab, else held
   tensors spill, the oldest whose ranges free one contiguous range that fits (the
   window that spills the fewest; rule 3 of NOTE [ Host tier ]). Its range is claimed
   at once, so no other request takes it while the spills are written.
3. So a budget of ``B`` holds about ``B`` of tensor bytes: only the 4 KiB rounding and
   the ranges between tensors of different sizes are lost (``peak_tensor_bytes``).
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


# --------------------------------------------------------------------------- slabs
SLAB_BYTES = 64 << 20
"""The largest slab a :class:`SlabTier` allocates (a larger tensor gets one of its own)."""


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


def _pow2_ceil(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


class _Seg(Generic[B]):
    """An occupied range of a slab: ``kind`` is ``held``, ``spilling`` or ``lent``."""

    __slots__ = ("asked", "key", "kind", "off", "size", "slab")

    def __init__(
        self, slab: _Slab[B], off: int, size: int, key: Hashable, kind: str, asked: int
    ) -> None:
        self.slab, self.off, self.size, self.key, self.kind = slab, off, size, key, kind
        self.asked = asked  # the tensor's bytes (``size`` is them rounded to 4 KiB)


class _Slab(Generic[B]):
    __slots__ = ("buf", "segs", "size")

    def __init__(self, buf: B, size: int) -> None:
        self.buf = buf
        self.size = size
        self.segs: list[_Seg[B]] = []  # occupied ranges, by offset


class SlabTier(Generic[B]):
    """A host tier that sub-allocates from large pinned slabs (NOTE [ Pinned slabs ]).

    The interface of :class:`HostTier` (``make_room``, ``take``, ``try_take``,
    ``release``, ...) over ``allocate(nbytes)`` (a new buffer of exactly ``nbytes``,
    always a power of two here: torch's pinned allocator then holds just that) and
    ``cut(buf, offset, nbytes)`` (a view of a slab). Thread-safe.
    """

    keeps_freed = True
    """Slabs are kept while the tier lives (torch caches freed pinned blocks anyway)."""

    def __init__(
        self,
        cap_bytes: int,
        allocate: Callable[[int], B],
        cut: Callable[[B, int, int], B],
        *,
        block_bytes: Callable[[int], int] = round_up,
        slab_bytes: int = SLAB_BYTES,
    ) -> None:
        if cap_bytes < 0:
            raise ValueError(f"SlabTier: cap_bytes must be >= 0, got {cap_bytes}")
        self.cap_bytes = cap_bytes
        self._allocate = allocate
        self._cut = cut
        self._block = block_bytes
        self._slab_bytes = slab_bytes
        self._cond = threading.Condition(threading.Lock())
        self._slabs: list[_Slab[B]] = []
        self._where: dict[Hashable, _Seg[B]] = {}
        self._held: OrderedDict[Hashable, None] = OrderedDict()  # oldest first (rule 3)
        self._claims: dict[Hashable, tuple[_Slab[B], int, int, int]] = {}  # make_room'd
        self._used = 0  # bytes of every slab (rule 1)
        self._growing = 0  # bytes of slabs being allocated
        self.peak_bytes = 0
        """The most bytes the tier has had at once (its slabs)."""
        self.peak_tensor_bytes = 0
        """The most tensor bytes (as asked, unrounded) held at once."""
        self.allocations = 0
        """Slabs allocated."""
        self.spills = 0

    # ---------------------------------------------------------------- reading
    @property
    def used_bytes(self) -> int:
        """Bytes of every slab the tier has (rule 1)."""
        return self._used

    @property
    def held_bytes(self) -> int:
        """Bytes held for tensors (rounded to 4 KiB; not spilling, not lent)."""
        with self._cond:
            return sum(self._where[k].size for k in self._held)

    @property
    def held_tensor_bytes(self) -> int:
        """Tensor bytes held, as asked (what NOTE [ Pinned slabs ] rule 3 counts)."""
        with self._cond:
            return sum(self._where[k].asked for k in self._held)

    def held_keys(self) -> list[Hashable]:
        """Keys held now, oldest first: the order they would spill in."""
        with self._cond:
            return list(self._held)

    def spilling_keys(self) -> list[Hashable]:
        """Keys chosen to spill whose bytes have not been released yet."""
        with self._cond:
            return [k for k, s in self._where.items() if s.kind == "spilling"]

    def buffer(self, key: Hashable) -> B:
        """The buffer of a held, spilling or lent key (``KeyError`` if it has none)."""
        with self._cond:
            seg = self._where[key]
            return self._cut(seg.slab.buf, seg.off, seg.size)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` could ever be held under the cap (rule 4)."""
        size = self._block(nbytes)
        return (size <= self._slab_bytes and size <= self.cap_bytes) or (
            _pow2_ceil(size) <= self.cap_bytes
        )

    # ---------------------------------------------------------------- writing
    def make_room(self, key: Hashable, nbytes: int) -> list[Hashable] | None:
        """Claim room for ``key``'s ``nbytes``; return what must spill for it, oldest
        first (often none), or ``None`` when it cannot fit (rule 4). A free range of a
        slab is taken first, then a new slab, then held tensors spill: the oldest that
        free one contiguous range (rule 3). Follow with :meth:`take`."""
        size = self._block(nbytes)
        if not self.fits(nbytes):
            return None
        with self._cond:
            found = self._free_range(size)
            if found is not None:
                self._claims[key] = (*found, size, nbytes)
                return []
            grow = self._slab_size(size)
            self._growing += grow
        if grow:
            slab = self._new_slab(grow)
            with self._cond:
                self._claims[key] = (slab, 0, size, nbytes)
            return []
        with self._cond:
            chosen = self._choose(size)
            if chosen is None:
                return None
            slab, off, victims = chosen
            for victim in victims:
                del self._held[victim]
                self._where[victim].kind = "spilling"
                self.spills += 1
            self._claims[key] = (slab, off, size, nbytes)
            return victims

    def take(self, key: Hashable, timeout_s: float | None = None) -> B:
        """The buffer claimed for ``key`` by :meth:`make_room`; ``key`` is now held.

        Blocks until the spilled keys in its range are released. Raises
        ``TimeoutError`` after ``timeout_s`` (the claim is then given up).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            slab, off, size, asked = self._claims[key]
            while self._occupied(slab, off, size):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    del self._claims[key]
                    self._cond.notify_all()
                    raise TimeoutError(
                        f"host tier: no room for {size} bytes within {timeout_s}s "
                        f"({self._used} of {self.cap_bytes} bytes in slabs)"
                    )
                self._cond.wait(left)
            del self._claims[key]
            self._occupy(slab, off, size, key, "held", asked)
            self._held[key] = None
            held = sum(self._where[k].asked for k in self._held)
            self.peak_tensor_bytes = max(self.peak_tensor_bytes, held)
            return self._cut(slab.buf, off, size)

    def can_take(self, key: Hashable) -> bool:
        """Whether :meth:`take` for ``key`` (after :meth:`make_room`) would not wait now."""
        with self._cond:
            slab, off, size, _ = self._claims[key]
            return not self._occupied(slab, off, size)

    def try_take(self, key: Hashable, nbytes: int) -> B | None:
        """Lend a buffer for a read if one fits now (a free range, or a new slab), else
        ``None`` (rule 5: never spills). Give it back with :meth:`release`."""
        size = self._block(nbytes)
        with self._cond:
            found = self._free_range(size)
            if found is not None:
                self._occupy(*found, size, key, "lent", nbytes)
                return self._cut(found[0].buf, found[1], size)
            grow = self._slab_size(size) if self.fits(nbytes) else 0
            self._growing += grow
        if not grow:
            return None
        slab = self._new_slab(grow)
        with self._cond:
            self._occupy(slab, 0, size, key, "lent", nbytes)
        return self._cut(slab.buf, 0, size)

    def release(self, key: Hashable) -> None:
        """``key`` is done with its range (spilled, consumed or freed): it is free again.
        Also gives up a claim never taken; releasing a key holding nothing is a no-op."""
        with self._cond:
            seg = self._where.pop(key, None)
            if seg is not None:
                seg.slab.segs.remove(seg)
                self._held.pop(key, None)
            else:
                self._claims.pop(key, None)
            self._cond.notify_all()

    def clear(self) -> None:
        """Drop every slab nothing uses (the tier is done; torch keeps them cached)."""
        with self._cond:
            claimed = {id(c[0]) for c in self._claims.values()}
            keep = [s for s in self._slabs if s.segs or id(s) in claimed]
            self._used -= sum(s.size for s in self._slabs if s not in keep)
            self._slabs = keep

    # ---------------------------------------------------------------- internals
    def _slab_size(self, size: int) -> int:
        """The slab to add for a request of ``size`` (0: none fits the cap). Lock held."""
        room = self.cap_bytes - self._used - self._growing
        slab = _pow2_floor(min(room, self._slab_bytes))
        if slab >= size:
            return slab
        slab = _pow2_ceil(size)  # larger than a slab: one of its own
        return slab if size > self._slab_bytes and slab <= room else 0

    def _new_slab(self, size: int) -> _Slab[B]:
        try:
            buf = self._allocate(size)
        except BaseException:
            with self._cond:
                self._growing -= size
                self._cond.notify_all()
            raise
        slab = _Slab(buf, size)
        with self._cond:
            self._growing -= size
            self._used += size
            self._slabs.append(slab)
            self.peak_bytes = max(self.peak_bytes, self._used)
            self.allocations += 1
        return slab

    def _occupy(
        self, slab: _Slab[B], off: int, size: int, key: Hashable, kind: str, asked: int
    ) -> None:
        seg = _Seg(slab, off, size, key, kind, asked)
        slab.segs.append(seg)
        slab.segs.sort(key=lambda s: s.off)
        self._where[key] = seg

    @staticmethod
    def _overlaps(a: int, b: int, c: int, d: int) -> bool:
        return a < d and c < b

    def _occupied(self, slab: _Slab[B], off: int, size: int) -> bool:
        return any(self._overlaps(off, off + size, s.off, s.off + s.size) for s in slab.segs)

    def _blocked(
        self, slab: _Slab[B], free: Callable[[_Seg[B]], bool]
    ) -> list[tuple[int, int]]:
        """Ranges of ``slab`` nothing may take now: occupied segments ``free`` does not
        let go of, and other keys' claims; sorted."""
        out = [(s.off, s.off + s.size) for s in slab.segs if not free(s)]
        out += [(off, off + size) for sl, off, size, _ in self._claims.values() if sl is slab]
        return sorted(out)

    def _runs(self, slab: _Slab[B], free: Callable[[_Seg[B]], bool]) -> list[tuple[int, int]]:
        """The maximal ranges of ``slab`` outside :meth:`_blocked`."""
        runs, at = [], 0
        for a, b in self._blocked(slab, free):
            if a > at:
                runs.append((at, a))
            at = max(at, b)
        if at < slab.size:
            runs.append((at, slab.size))
        return runs

    def _free_range(self, size: int) -> tuple[_Slab[B], int] | None:
        """The first free range of ``size`` (lowest slab, lowest offset). Lock held."""
        for slab in self._slabs:
            for a, b in self._runs(slab, lambda s: False):
                if b - a >= size:
                    return slab, a
        return None

    def _choose(self, size: int) -> tuple[_Slab[B], int, list[Hashable]] | None:
        """Where ``size`` goes once the oldest held tensors that free one contiguous
        range spill (rule 3): ``(slab, offset, victims)``, or ``None``. Lock held.

        Marks held tensors oldest first; after each, only the marked one's slab can
        have gained a range, so only it is looked at again.
        """
        order = list(self._held)
        marked: set[Hashable] = set()

        def free(s: _Seg[B]) -> bool:
            return s.kind == "spilling" or s.key in marked

        slabs: list[_Slab[B]] = list(self._slabs)
        for n in range(len(order) + 1):
            if n:
                marked.add(order[n - 1])
                slabs = [self._where[order[n - 1]].slab]
            for slab in slabs:
                found = self._window(slab, size, free)
                if found is not None:
                    start, victims = found
                    return slab, start, sorted(victims, key=order.index)
        return None

    def _window(
        self, slab: _Slab[B], size: int, free: Callable[[_Seg[B]], bool]
    ) -> tuple[int, list[Hashable]] | None:
        """The window of ``size`` in ``slab``'s free-or-freeable ranges that spills the
        fewest held tensors (lowest offset on a tie), and those; ``None``: none."""
        best: tuple[int, int, list[Hashable]] | None = None
        held = [s for s in slab.segs if s.kind == "held"]
        for a, b in self._runs(slab, free):
            if b - a < size:
                continue
            starts = [a] + [s.off + s.size for s in slab.segs if a < s.off + s.size <= b - size]
            for start in starts:
                end = start + size
                victims = [s.key for s in held if s.off < end and start < s.off + s.size]
                if best is None or (len(victims), start) < best[:2]:
                    best = (len(victims), start, victims)
                    if not victims:
                        return start, victims
        return None if best is None else (best[1], best[2])
