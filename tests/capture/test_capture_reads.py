"""``CaptureDataset``'s reader (issue 35, finding 8: read-back at disk speed): each piece
of a window is read and scattered into its batches by one task, the reads overlapping
the copies of pieces read before them, with a stated bound on the buffers it holds
(NOTE [ Capture reads ] rules 4 and 5 in ``capture/_chunks.py``)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks.capture import _chunks
from tests.capture.test_capture_epochs import _write


def _ids(t: torch.Tensor) -> list[int]:
    assert torch.equal(t, t[:, :1].expand_as(t)), "a row was torn"
    return t[:, 0].long().tolist()


def _expected(ds: tsh.CaptureDataset, epoch: int) -> list[list[int]]:
    """The batches NOTE [ Capture epochs ] rule 4 promises, computed from the plan
    alone: each window's rows dealt out in its seeded permutation, each batch taking
    the next rows of it across windows, a batch's rows in window order."""
    order, starts = ds.plan.stream(ds.seed, epoch, ds.shuffle)
    lo, hi, _ = ds.plan.worker_rows(ds.rank, 0, 1)
    pieces = ds.plan.pieces(order, starts, lo, hi)
    rows_per_chunk = ds.arrays[0].chunk_rows
    batches: list[list[int]] = [[]]
    for w, window in enumerate(ds._windows(pieces)):
        rows = [p.index * rows_per_chunk + r for p in window for r in range(p.lo, p.hi)]
        perm = np.random.default_rng([ds.seed, epoch, 0, w]).permutation(len(rows))
        pos = 0
        while pos < len(rows):
            take = min(ds.batch_size - len(batches[-1]), len(rows) - pos)
            batches[-1] += [rows[i] for i in sorted(perm[pos : pos + take])]
            pos += take
            if len(batches[-1]) == ds.batch_size:
                batches.append([])
    return [b for b in batches if b]


@pytest.mark.parametrize(
    ("read_ahead", "threads", "map_bytes"), [(0, 1, 0), (1, 2, "1GiB"), (3, 3, 0)]
)
def test_every_row_once_in_the_promised_order(
    tmp_path: Path, read_ahead: int, threads: int, map_bytes: int | str
) -> None:
    rows = _write(tmp_path, [333, 500, 171])  # 1004 rows in 8 chunks, the last partial
    ds = tsh.CaptureDataset(
        str(tmp_path),
        "0/output",
        batch_size=37,  # batches span windows and pieces
        seed=5,
        shuffle_bytes="6KiB",  # windows of two chunks (pieces of 128 rows)
        read_ahead=read_ahead,
        threads=threads,
        map_bytes=map_bytes,
    )
    seen = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        got = [_ids(b) for b in ds]
        assert sorted(i for b in got for i in b) == list(range(rows))  # every row once
        assert [len(b) for b in got] == [37] * (rows // 37) + [rows % 37]
        assert got == _expected(ds, epoch)
        seen.append(got)
    assert seen[0] != seen[1] != seen[2] != seen[0]  # a new order each epoch
    ds.set_epoch(1)
    assert [_ids(b) for b in ds] == seen[1]


def test_a_piece_is_copied_while_the_next_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One reader thread, one window of four pieces: the rows of the first piece reach
    their batches before the last piece is read (before, every piece of a window was
    read before any row was copied, so a cold read waited for the disk and then for the
    copy)."""
    _write(tmp_path, [512])
    events: list[str] = []
    read, take = _chunks.ChunkReader.read, np.take

    def reading(self: _chunks.ChunkReader, *args: int) -> np.ndarray:  # type: ignore[type-arg]
        events.append("read")
        return read(self, *args)  # type: ignore[arg-type]

    def copying(*args: object, **kw: object) -> object:  # rows are copied with numpy.take
        events.append("copy")
        return take(*args, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(_chunks.ChunkReader, "read", reading)
    monkeypatch.setattr(np, "take", copying)
    ds = tsh.CaptureDataset(
        str(tmp_path), "0/output", batch_size=100, threads=1, map_bytes=0, shuffle_bytes="1MiB"
    )
    assert len(ds._windows(ds.shard())) == 1
    got = [_ids(b) for b in ds]
    assert sorted(i for b in got for i in b) == list(range(512))
    assert events.count("read") == 4
    last_read = len(events) - 1 - events[::-1].index("read")
    assert "copy" in events[:last_read], events


def test_the_buffer_pool_holds_at_most_pool_bytes(tmp_path: Path) -> None:
    """The bound, stated (buffers of 256 KiB and more are pooled): rows of 32 KiB,
    chunks of 32 rows (1 MiB + its crc: 1 MiB + 4 KiB), batches of 8 rows (256 KiB),
    windows of at most 2 MiB + a chunk, so 12 + 2 batches each: the batches of
    ``read_ahead + 1 = 2`` windows (2 x 14 x 256 KiB), a chunk per reader thread
    (2 x (1 MiB + 4 KiB)) and 4 batches the consumer may still hold (1 MiB)."""
    rows = _write(tmp_path, [90, 110], width=8192, chunk_bytes="1MiB")  # 7 chunks
    ds = tsh.CaptureDataset(
        str(tmp_path), "0/output", batch_size=8, shuffle_bytes="2MiB", map_bytes=0, threads=2
    )
    chunk, batch = (1 << 20) + 4096, 256 << 10
    assert ds.pool_bytes == 2 * 14 * batch + 2 * chunk + 4 * batch  # 10,493,952
    for epoch in range(3):
        ds.set_epoch(epoch)
        n = 0
        for b in ds:  # each batch dropped after its step
            n += len(b)
        assert n == rows
        del b
        stats = ds._buffers().stats
        assert 0 < stats.peak_held_bytes <= ds.pool_bytes
        assert stats.in_use_bytes == 0  # every chunk and batch buffer came back
        assert stats.idle_limit_bytes == ds.pool_bytes
    assert stats.reuses > 2 * stats.allocations  # later epochs take no new pages


def test_a_failed_chunk_reaches_the_consumer_and_stops_the_readers(tmp_path: Path) -> None:
    """A damaged piece fails its task; the batches it feeds raise, naming the chunk,
    and the other tasks of its window finish (no thread is left waiting)."""
    _write(tmp_path, [640])
    chunk = tmp_path / "capture/0/output/c/3/0"
    data = bytearray(chunk.read_bytes())
    data[7] ^= 0x01
    chunk.write_bytes(bytes(data))
    ds = tsh.CaptureDataset(str(tmp_path), "0/output", batch_size=50, threads=3, map_bytes=0)
    with pytest.raises(tsh.IntegrityError, match=r"c/3/0 .*checksum mismatch"):
        list(ds)
    assert not [
        t for t in threading.enumerate() if t.name.startswith("tsh-capture-read") and t.is_alive()
    ]
