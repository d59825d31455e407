"""The host tier: a budgeted pool of (pinned) host memory with an oldest-first spill order.

Pure logic behind one seam: the allocator is injected (``pin_memory=True`` slabs in
real use, plain CPU tensors, or anything with a size, in tests), so what is held, what
spills and in which order is testable without a device. See NOTE [ Host tier ].

NOTE [ Host tier ]
Rules, numbered so code can cite them:

1. Every byte the tier allocates counts against ``cap_bytes`` (``host_budget``): its
   slabs, whole, whatever their ranges hold (tensors held, tensors being spilled,
   whose bytes are still there until the store has them, buffers lent to reads) or
   if they hold nothing. ``used_bytes <= cap_bytes`` at all times.
2. Memory is recycled: a training loop saves the same sizes every step, so after the
   first step the allocator (a ``cudaHostAlloc`` for pinned memory, ~ms each) is not
   called again. Slabs are kept while the tier lives, and a freed range serves the
   next request it fits, of any size, before anything spills.
3. Held tensors spill in the order they were held, oldest first: backward reads
   newest first, so the oldest are needed last. :meth:`SlabTier.make_room` only
   *chooses* the victims (they move to ``spilling``); the caller writes each to the
   store and then calls :meth:`SlabTier.release`, which is when its bytes come back.
   Bytes come back only as ranges of a slab, so the victims are the oldest held
   tensors that free one contiguous range the request fits in (NOTE [ Pinned slabs ]
   rule 2).
4. A tensor larger than the cap is never held (:meth:`SlabTier.make_room` returns
   ``None``): the caller sends it to the store directly. So is one no range can take
   now (the cap spent on slabs too small for it, or their ranges claimed or lent).
   ``cap_bytes == 0`` turns the tier off.
5. Reads that bring spilled tensors back (backward's prefetch) borrow buffers
   through :meth:`SlabTier.try_take` only while their copy to the device runs, and
   never make anything spill: a read that finds no room gets ``None`` (the caller then
   copies from pageable memory), so reads cannot evict the tensors backward needs next.
6. ``host`` rules (a tensor moved to pinned memory for backward) draw from the same
   pool through the same calls, so one cap bounds all pinned memory of a pipeline.

Thread-safe: writers, readers and the pack hook call it concurrently;
:meth:`SlabTier.take` blocks (with a timeout) until spills or releases free its range.
How the pipeline uses it: NOTE [ Host tier wiring ] in ``pipeline/_device.py``.

NOTE [ Pinned slabs ]
Torch's pinned allocator rounds every request up to a power of two and keeps freed
blocks for a request of the same size: a pinned buffer per tensor holds only 77-87%
of a budget as tensor bytes. :class:`SlabTier` keeps the rules of NOTE [ Host tier ]
over a few large buffers instead:

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
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["SLAB_BYTES", "SlabTier", "round_up"]

B = TypeVar("B")
"""The buffer type: what ``allocate`` returns (a pinned ``torch.Tensor`` in real use)."""

_ALIGN = 4096


def round_up(nbytes: int) -> int:
    """The range the tier takes for ``nbytes`` (NOTE [ Pinned slabs ] rule 2): a
    multiple of 4 KiB, >= 4 KiB."""
    return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)


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

    ``allocate(nbytes)`` returns a new slab of exactly ``nbytes`` bytes (always a power
    of two: torch's pinned allocator then holds just that; called outside the tier's
    lock) and ``cut(buf, offset, nbytes)`` a view of a slab. Keys are the caller's
    (records); each key holds at most one range. Call sequence for a tensor::

        victims = tier.make_room(key, n)   # None: it cannot fit, store it directly
        for v in victims: write v to the store, then tier.release(v)
        buf = tier.take(key)               # blocks until the victims' bytes are back
        ...                                # later: tier.release(key)

    Thread-safe.
    """

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
        """Tensors chosen to spill to the store (NOTE [ Host tier ] rule 3)."""

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
