"""Span unions: the views of one storage saved in one forward, moved as one record.

NOTE [ Span unions ]
SDPA saves q, k and v cut from one fused qkv projection; SwiGLU saves the gate and
up halves of one projection. Each is a view with gaps (``q`` covers ``d`` of every
``3d`` elements). Moved one by one, each would cross to the host, sit in the host
tier and come back at its whole span (three times its elements), and a view saved
twice under two shapes (``x`` and ``x.view(-1, d)``) would move twice. So the record
table keeps, per storage, the union of what its saved views cover, and a record
moves that union once. Rules, numbered so code can cite them:

1. A view's *pattern* is what it covers: ``n`` rows of ``run`` contiguous elements,
   one every ``period`` elements, from storage offset ``start`` (dimensions of size
   1 or stride 0 add no element). A view whose elements exactly fill one contiguous
   range (any dense layout, an ``expand``-ed one too) is a *region*: one row. A
   view with gaps whose rows do not form one arithmetic sequence (``x[::2, ::2]``)
   has no pattern: it is a record of its own, as any tensor.
2. A record's *span* is a region (it stores every element of ``[start, start +
   length)``) or *periodic* (``n`` rows every ``period`` elements, each holding the
   same merged intervals, relative to ``start``, all within one period).
3. A saved view whose elements a live record's span holds (same storage, dtype and
   version: its bytes are those) shares that record: a new handle, no new bytes
   (``stats.dedup_hits``). A periodic span still *open* (not yet written) takes a
   view of its rows and period in, as new intervals (the union), if the union still
   fits one period; a region view that holds all of an open span takes the span
   over (it becomes that region).
4. A periodic span stays open while views may still join: it is written once it
   covers its whole period (then it is the region ``[start, start + n * period)``),
   or at the first save after ``OPEN_PACKS`` saves without a join, when backward starts
   (the first unpack), at ``flush()`` and ``close()``, and before pack would wait
   for room under ``max_inflight`` (its bytes count in flight from its first view).
5. What moves: a region as the contiguous range; a periodic span as its rows with
   the gaps left out (``n x width``, contiguous). On the host the gaps are left out
   by the writing I/O thread; on an accelerator by one copy on the device when the
   span is written, so the copy to host, the host tier and the store all hold the
   elements of the spans saved, never the gaps.
6. What comes back: the record's tensor in the layout it was moved in, and each
   saved view rebuilt over it (:meth:`Span.rebuild`). A region keeps every stride
   of every view; a periodic span with gaps keeps each view's dimension order and
   inner strides, its rows ``width`` apart instead of ``period``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["OPEN_PACKS", "Pattern", "Span", "View", "pattern_of"]

OPEN_PACKS = 8
"""Saves after which an open periodic span that nobody joined is written (rule 4)."""

View = tuple[tuple[int, ...], tuple[int, ...], int]
"""A saved view over its storage: ``(shape, stride, storage offset)``."""


@dataclass(frozen=True, slots=True)
class Pattern:
    """What a view covers (rule 1): ``n`` rows of ``run`` elements, ``period`` apart."""

    start: int
    n: int
    period: int
    run: int

    @property
    def region(self) -> bool:
        """One contiguous range (``n == 1``)."""
        return self.n == 1


def pattern_of(shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> Pattern | None:
    """The pattern of a view (rule 1), or ``None`` if it has none (or no element)."""
    if 0 in shape:
        return None
    # Dimensions of size 1 or stride 0 add no element: left out.
    dims = sorted((st, size) for size, st in zip(shape, stride, strict=True) if size != 1 and st)
    run = 1
    i = 0
    while i < len(dims) and dims[i][0] == run:  # the contiguous run, innermost first
        run *= dims[i][1]
        i += 1
    if i == len(dims):
        return Pattern(offset, 1, run, run)  # a region
    period, n = dims[i]
    if period < run:
        return None  # rows that overlap
    for st, size in dims[i + 1 :]:
        if st != period * n:
            return None  # rows not one sequence (rule 1): a record of its own
        n *= size
    return Pattern(offset, n, period, run)


class Span:
    """The elements a record moves (rule 2). Changed only by the record table."""

    __slots__ = ("intervals", "n", "period", "start")

    def __init__(self, start: int, n: int, period: int, intervals: list[tuple[int, int]]) -> None:
        self.start = start
        self.n = n
        self.period = period
        self.intervals = intervals
        """Merged, sorted ``[a, b)`` within ``[0, period)``, relative to ``start``."""

    @classmethod
    def of(cls, p: Pattern) -> Span:
        return cls(p.start, p.n, p.period if p.n > 1 else p.run, [(0, p.run)])

    # ---------------------------------------------------------------- reading
    @property
    def region(self) -> bool:
        """Every element of ``[start, start + length)`` (rule 2)."""
        return self.n == 1 or self.intervals == [(0, self.period)]

    @property
    def width(self) -> int:
        """Elements of one row (a region: all of them)."""
        return sum(b - a for a, b in self.intervals)

    @property
    def extent(self) -> int:
        """The end of the last interval of a row."""
        return self.intervals[-1][1]

    @property
    def length(self) -> int:
        """Elements a region covers from ``start``."""
        return self.extent if self.n == 1 else self.n * self.period

    @property
    def elements(self) -> int:
        """Elements the span moves (rule 5)."""
        return self.length if self.region else self.n * self.width

    def covers(self, p: Pattern, view_span: int) -> bool:
        """Whether every element of a view of pattern ``p`` (and span ``view_span``) is
        in this span (rule 3)."""
        rel = p.start - self.start
        if self.region:
            return rel >= 0 and rel + view_span <= self.length
        if p.n != self.n or p.period != self.period or rel < 0:
            return False
        return any(a <= rel and rel + p.run <= b for a, b in self.intervals)

    def fits(self, p: Pattern) -> bool:
        """Whether a view of pattern ``p`` can join this periodic span (rule 3)."""
        if self.region or p.n != self.n or p.period != self.period:
            return False
        rel = p.start - self.start
        return max(self.extent, rel + p.run) - min(0, rel) <= self.period

    def holds_all_of(self, p: Pattern) -> bool:
        """Whether region ``p`` holds every element of this span (rule 3: it takes over)."""
        end = self.start + (self.n - 1) * self.period + self.extent
        return p.region and p.start <= self.start and end <= p.start + p.run

    # ---------------------------------------------------------------- changing
    def join(self, p: Pattern) -> None:
        """Add ``p``'s rows (:meth:`fits` said yes)."""
        rel = p.start - self.start
        if rel < 0:
            self.start = p.start
            self.intervals = [(a - rel, b - rel) for a, b in self.intervals]
            rel = 0
        merged: list[tuple[int, int]] = []
        for a, b in sorted([*self.intervals, (rel, rel + p.run)]):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
            else:
                merged.append((a, b))
        self.intervals = merged

    def become(self, p: Pattern) -> None:
        """Become region ``p`` (it holds all of this span: rule 3)."""
        self.start, self.n, self.period, self.intervals = p.start, 1, p.run, [(0, p.run)]

    # ------------------------------------------------------------ the tensors
    def source(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor the record holds over ``t``'s storage (a view, no copy): a region
        as a 1-D range, a periodic span as ``n`` rows of ``extent`` elements."""
        if self.region:
            return t.as_strided((self.length,), (1,), self.start)
        return t.as_strided((self.n, self.extent), (self.period, 1), self.start)

    def gather(self, src: torch.Tensor) -> torch.Tensor:
        """The rows of :meth:`source` ``src`` with the gaps left out, contiguous (rule 5).
        A region, or a tensor gathered already, comes back as it is."""
        if self.region or src.dim() != 2 or (src.shape[1] == self.width and src.is_contiguous()):
            return src
        if len(self.intervals) == 1:
            a, b = self.intervals[0]
            return src[:, a:b].contiguous()
        return torch.cat([src[:, a:b] for a, b in self.intervals], dim=1)

    def rebuild(self, t: torch.Tensor, view: View) -> torch.Tensor:
        """Saved view ``view`` over ``t``, the record's tensor in the layout it came back
        in (:meth:`source`, :meth:`gather`, or the first view itself; rule 6)."""
        shape, stride, offset = view
        rel = offset - self.start
        if self.region:
            return t.as_strided(shape, stride, t.storage_offset() + rel)
        row, x = divmod(rel, self.period)
        row_stride = t.stride(0)
        if t.shape[1] != self.extent:
            x = self._packed(x)  # gathered rows: the gaps before ``x`` are gone
        new_stride = tuple(
            (st // self.period) * row_stride if st >= self.period else st for st in stride
        )
        return t.as_strided(shape, new_stride, t.storage_offset() + row * row_stride + x)

    def _packed(self, x: int) -> int:
        """Where position ``x`` of a row lies once the gaps are left out."""
        before = 0
        for a, b in self.intervals:
            if a <= x < b:
                return before + x - a
            before += b - a
        raise ValueError(f"position {x} is in no interval of {self!r}")

    def __repr__(self) -> str:
        return f"Span(start={self.start}, n={self.n}, period={self.period}, {self.intervals})"
