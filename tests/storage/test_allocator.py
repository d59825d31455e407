"""ChunkAllocator on its own: no disk, no store (NOTE [ Segment layout ],
NOTE [ Spare chunk files ] in ``storage/zarr/_store.py``)."""

from __future__ import annotations

import itertools

import pytest

from tensorstore_hooks.storage.zarr._allocator import (
    MIN_CHUNK_BYTES,
    SEGMENT_CHUNKS,
    ChunkAllocator,
    SegmentFullError,
)

KiB = 1 << 10


def _alloc(**kw: object) -> ChunkAllocator:
    opts: dict[str, object] = {"keep_spares": True, "spare_limit": None, **kw}
    return ChunkAllocator(64 * KiB, **opts)  # type: ignore[arg-type]


def test_size_classes_halve_down_to_4kib() -> None:
    assert _alloc().classes == [64 * KiB, 32 * KiB, 16 * KiB, 8 * KiB, 4 * KiB]
    assert ChunkAllocator(MIN_CHUNK_BYTES, keep_spares=False, spare_limit=None).classes == [4 * KiB]


@pytest.mark.parametrize(
    ("n", "want"),
    [
        (0, (0, 0)),
        (1, (4 * KiB, 1)),
        (4 * KiB, (4 * KiB, 1)),
        (4 * KiB + 1, (4 * KiB, 2)),  # 8 KiB would pad ~half
        (60 * KiB, (32 * KiB, 2)),  # never a class larger than the tensor
        (64 * KiB, (64 * KiB, 1)),
        (200 * KiB, (32 * KiB, 7)),  # 64 KiB x 4 would pad 56 KiB > 200/8
    ],
)
def test_layout_pads_at_most_an_eighth(n: int, want: tuple[int, int]) -> None:
    chunk, count = _alloc().layout(n)
    if n:
        assert (chunk * count - n) * 8 <= n or chunk == MIN_CHUNK_BYTES
    assert (chunk, count) == want


def test_runs_never_overlap_and_freed_runs_are_reused() -> None:
    a = _alloc(keep_spares=False)
    runs = [(16 * KiB, a.alloc(16 * KiB, n), n) for n in (1, 3, 2, 1)]
    starts = sorted((s, s + n) for _, s, n in runs)
    assert all(e1 <= s2 for (_, e1), (s2, _) in itertools.pairwise(starts))
    assert a.live_bytes == 7 * 16 * KiB == a.peak_bytes
    unlink = a.retire([runs[1]])
    assert unlink == [runs[1]]  # no spares: delete the files, then release
    a.release(unlink)
    assert a.alloc(16 * KiB, 3) == runs[1][1]  # same size: the freed run
    assert a.live_bytes == 7 * 16 * KiB


def test_spares_are_rewritten_first_and_bounded_by_the_peak() -> None:
    a = _alloc()
    r1 = (8 * KiB, a.alloc(8 * KiB, 1), 1)
    r2 = (8 * KiB, a.alloc(8 * KiB, 1), 1)
    assert a.retire([r1]) == []  # kept as a spare (peak is 16 KiB)
    assert a.spare_bytes == 8 * KiB
    assert a.alloc(8 * KiB, 1) == r1[1]  # the spare's files are rewritten
    assert a.spare_bytes == 0
    big = (16 * KiB, a.alloc(16 * KiB, 2), 2)  # peak now 48 KiB
    assert a.retire([r2, (8 * KiB, r1[1], 1)]) == []
    assert a.retire([big]) == []  # 16 + 32 = 48 KiB of spares: fits the peak
    assert a.spare_bytes == 48 * KiB


def test_newest_freed_spares_evict_the_least_recently_freed() -> None:
    a = _alloc(spare_limit=16 * KiB)
    old = [(8 * KiB, a.alloc(8 * KiB, 1), 1) for _ in range(2)]
    assert a.retire(old) == []
    new = (16 * KiB, a.alloc(16 * KiB, 1), 1)
    assert sorted(a.retire([new])) == sorted(old)  # both old spares make room
    assert a.spare_bytes == 16 * KiB
    assert a.retire([(64 * KiB, a.alloc(64 * KiB, 1), 1)]) == [(64 * KiB, 0, 1)]  # > limit


def test_cancel_and_drain() -> None:
    a = _alloc()
    run = (4 * KiB, a.alloc(4 * KiB, 2), 2)
    a.cancel(run)
    assert a.live_bytes == 0
    assert a.alloc(4 * KiB, 2) == run[1]
    a.retire([run])
    assert a.drain_spares() == [run] and a.spare_bytes == 0
    assert a.drain_spares() == []


def test_segment_full() -> None:
    a = _alloc()
    a.resume({"k": (4 * KiB, SEGMENT_CHUNKS - 1, 1)}, {"k": 0})
    with pytest.raises(SegmentFullError, match="seg-4096"):
        a.alloc(4 * KiB, 1)


def test_resume_drops_the_older_of_two_overlapping_runs() -> None:
    a = _alloc()
    runs = {
        "1": (8 * KiB, 0, 2),  # deleted, its delete record lost: "3" reused chunk 1
        "2": (8 * KiB, 2, 1),
        "3": (8 * KiB, 1, 1),
        "4": (16 * KiB, 0, 2),  # another class: no overlap with class 8 KiB
    }
    dropped = a.resume(runs, {k: int(k) for k in runs})
    assert dropped == ["1"]
    assert a.live_bytes == 2 * 8 * KiB + 2 * 16 * KiB
    assert a.alloc(8 * KiB, 1) == 3  # past every resumed run
