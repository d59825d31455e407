"""Who reads which rows of an epoch: the plan of :class:`~tensorstore_hooks.CaptureDataset`.

NOTE [ Capture epochs ]
1. An epoch's rows form one *stream*: the chunk objects of every selected array, in a
   permutation seeded by ``(seed, epoch)`` (in path and chunk order without
   ``shuffle``), each chunk's rows in order. Every process computes the same stream.
2. Rank ``r`` of ``W`` takes the stream's rows ``[r * N // W, (r + 1) * N // W)``: the
   ranks' row counts differ by at most one, whatever the chunk sizes. A rank's rows
   are cut into batches of ``batch_size`` from its first row on (the last one short,
   or dropped with ``drop_last``), and its DataLoader workers take consecutive runs of
   those batches, so a rank reads the same rows in the same number of batches whatever
   its number of workers (which rows share a batch depends on them, rule 4); ranks
   may use different numbers of workers.
3. Equal batch counts on every rank (``even_batches``, default ``"pad"``): counts can
   still differ by one (``N = 1001`` rows over two ranks in batches of 100: 6 and 5),
   and a DDP loop whose ranks run different numbers of steps hangs in its next
   collective. ``"pad"``: a rank one short yields one more batch, of rows of its own
   repeated (as many as the longest rank's last batch holds); ``"drop"``: a rank one
   over leaves its last batch out. Either is logged once, at INFO. ``False``: nothing
   is repeated or dropped, and counts that differ are a :class:`ConfigError` when the
   dataset is made, on every rank alike, never a hang.
4. Within a worker's rows, a *window* is a run of consecutive chunk pieces adding up
   to at least ``shuffle_bytes``; its rows are dealt out in a permutation seeded by
   ``(seed, epoch, shard, window)`` (``shard = rank * workers + worker``), and each batch
   takes the next rows of that order, across windows. Rows of one batch lie in it in
   window order (which rows share a batch is random; a loss over the batch does not
   see their order, and copying rows in address order is 2-3x faster).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import numpy as np

from tensorstore_hooks.errors import ConfigError

__all__ = ["EVEN_MODES", "Piece", "Plan", "RankShare"]

log = logging.getLogger("tensorstore_hooks")

EVEN_MODES = ("pad", "drop", False)
"""What ``CaptureDataset(even_batches=...)`` takes (rule 3)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[lo, hi)`` (served rows: after ``flatten`` folds them) of chunk ``index``
    of array ``array``."""

    array: int
    index: int
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True, slots=True)
class RankShare:
    """What one rank reads each epoch (rules 2 and 3)."""

    start: int
    """Its first row in the stream."""
    rows: int
    """Rows it reads from ``start`` on (after ``drop_last`` and ``"drop"``)."""
    batches: int
    """Batches it yields, pad batch included: the same on every rank unless ``False``."""
    pad_rows: int
    """Rows of its pad batch (0: none)."""


class Plan:
    """The rows of every rank and worker (NOTE [ Capture epochs ]).

    ``chunks``: per array, the served rows of each of its chunks, in order.
    """

    def __init__(
        self,
        chunks: list[list[int]],
        *,
        world_size: int,
        batch_size: int,
        drop_last: bool,
        even: str | bool,
        name: str,
    ) -> None:
        self.units = [(a, c, n) for a, rows in enumerate(chunks) for c, n in enumerate(rows)]
        self.total = sum(n for _, _, n in self.units)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.world_size = world_size
        self.shares = _shares(self.total, world_size, batch_size, drop_last, even, name)

    # ------------------------------------------------------------------ rule 1
    def stream(self, seed: int, epoch: int, shuffle: bool) -> tuple[list[int], list[int]]:
        """The epoch's unit order and the stream position where each unit starts
        (one more entry: the end)."""
        order = list(range(len(self.units)))
        if shuffle and order:
            order = [int(i) for i in np.random.default_rng([seed, epoch]).permutation(len(order))]
        starts = [0]
        for i in order:
            starts.append(starts[-1] + self.units[i][2])
        return order, starts

    def pieces(self, order: list[int], starts: list[int], lo: int, hi: int) -> list[Piece]:
        """The chunk pieces that hold stream rows ``[lo, hi)``, in stream order."""
        out: list[Piece] = []
        k = bisect.bisect_right(starts, lo) - 1
        while lo < hi and k < len(order):
            array, index, rows = self.units[order[k]]
            first = lo - starts[k]
            take = min(rows - first, hi - lo)
            if take > 0:
                out.append(Piece(array, index, first, first + take))
                lo += take
            k += 1
        return out

    # ------------------------------------------------------------------ rule 2
    def worker_rows(self, rank: int, worker: int, workers: int) -> tuple[int, int, bool]:
        """Stream rows ``[lo, hi)`` of ``rank``'s worker ``worker`` of ``workers``, and
        whether that worker yields the rank's pad batch (rule 3)."""
        share = self.shares[rank]
        b = self.batch_size
        natural = -(-share.rows // b)
        first = worker * natural // workers
        last = (worker + 1) * natural // workers
        lo = share.start + min(first * b, share.rows)
        hi = share.start + min(last * b, share.rows)
        # The pad batch goes with the rank's last batch (to worker 0 if it has none).
        busy = [w for w in range(workers) if (w + 1) * natural // workers > w * natural // workers]
        holder = busy[-1] if busy else 0
        return lo, hi, bool(share.pad_rows) and worker == holder

    def pad_pieces(self, order: list[int], starts: list[int], rank: int) -> list[Piece]:
        """The pieces of ``rank``'s pad batch: its own first rows (rule 3), the stream's
        from its start on where it has too few (a rank of no rows: fewer rows than ranks)."""
        share = self.shares[rank]
        out: list[Piece] = []
        pos, need = share.start % max(1, self.total), share.pad_rows
        while need > 0 and self.total:
            take = min(need, self.total - pos)
            out += self.pieces(order, starts, pos, pos + take)
            need -= take
            pos = 0
        return out


def _shares(
    total: int, world: int, b: int, drop_last: bool, even: str | bool, name: str
) -> list[RankShare]:
    """Rules 2 and 3 for every rank."""
    starts = [r * total // world for r in range(world + 1)]
    rows = [starts[r + 1] - starts[r] for r in range(world)]
    natural = [n // b if drop_last else -(-n // b) for n in rows]
    used = [n // b * b if drop_last else n for n in rows]
    if world == 1 or len(set(natural)) == 1:
        return [RankShare(starts[r], used[r], natural[r], 0) for r in range(world)]
    if even is False:
        raise ConfigError(
            f"CaptureDataset({name!r}): with even_batches=False the {world} ranks would get "
            f"{min(natural)} to {max(natural)} batches per epoch ({total} rows, batch_size "
            f"{b}{', drop_last' if drop_last else ''}); a DDP loop would hang in the step "
            "that only some ranks run. Use even_batches='pad' (one batch of repeated rows "
            "on the shorter ranks) or 'drop' (the longer ranks leave their last batch out)"
        )
    if even == "drop":
        target = min(natural)
        out = [RankShare(starts[r], min(used[r], target * b), target, 0) for r in range(world)]
        dropped = sum(used[r] - out[r].rows for r in range(world))
        log.info(
            "CaptureDataset(%r): %d rank(s) leave their last batch out (%d rows an epoch) so "
            "that every rank yields %d batches (even_batches='drop')",
            name,
            sum(n > target for n in natural),
            dropped,
            target,
        )
        return out
    target = max(natural)
    longest = max(used[r] for r in range(world) if natural[r] == target)
    pad = b if drop_last else longest - (target - 1) * b
    out = [
        RankShare(starts[r], used[r], target, pad if natural[r] < target else 0)
        for r in range(world)
    ]
    log.info(
        "CaptureDataset(%r): %d rank(s) yield one batch of %d repeated rows so that every "
        "rank yields %d batches an epoch (even_batches='pad'; 'drop' leaves the extra "
        "batches out instead)",
        name,
        sum(n < target for n in natural),
        pad,
        target,
    )
    return out
