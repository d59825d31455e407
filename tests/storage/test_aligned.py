"""Page-aligned pooled buffers (NOTE [ Aligned buffers ] in ``storage/io/_aligned.py``)."""

from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tensorstore_hooks.storage.io import _aligned
from tensorstore_hooks.storage.io._aligned import (
    BLOCK_BYTES,
    PAGE_BYTES,
    POOL_MIN_BYTES,
    REUSE_SLACK,
    AlignedBuffer,
    BufferPool,
    address_of,
    aligned_empty,
    round_up,
)

MiB = 1 << 20


def test_round_up_and_alignment_helpers() -> None:
    assert [round_up(n) for n in (0, 1, 4095, 4096, 4097)] == [0, 4096, 4096, 4096, 8192]
    assert round_up(5, 8) == 8
    for n in (1, 100, 4096, 70_001):
        a = aligned_empty(n)
        assert address_of(a) % PAGE_BYTES == 0 and a.nbytes == round_up(n, PAGE_BYTES)


def test_buffers_are_page_aligned_and_private() -> None:
    buf = AlignedBuffer(3 * PAGE_BYTES)
    assert address_of(buf.view) % PAGE_BYTES == 0 and len(buf.view) == 3 * PAGE_BYTES
    buf.view[:4] = b"abcd"
    pid = os.fork()
    if pid == 0:  # a child writing its copy must not change the parent's (MAP_PRIVATE)
        buf.view[:4] = b"XXXX"
        os._exit(0)
    os.waitpid(pid, 0)
    assert bytes(buf.view[:4]) == b"abcd"
    with pytest.raises(ValueError, match="capacity"):
        AlignedBuffer(0)


def test_acquire_reuses_exact_capacities_within_the_idle_limit() -> None:
    pool = BufferPool(idle_limit_bytes=8 * MiB)
    a = pool.acquire(MiB + 1)
    assert a.capacity == MiB + PAGE_BYTES
    pool.release(a)
    assert pool.acquire(MiB + 100) is a  # same capacity: reused
    pool.release(a)
    b = pool.acquire(2 * MiB)  # another capacity: a new one
    assert b is not a
    stats = pool.stats
    assert (stats.allocations, stats.reuses) == (2, 1)
    assert stats.in_use_bytes == 2 * MiB and stats.idle_bytes == MiB + PAGE_BYTES
    assert stats.held_bytes == stats.in_use_bytes + stats.idle_bytes
    pool.release(b)
    assert pool.stats.in_use_bytes == 0


def test_a_request_without_an_exact_match_reuses_the_smallest_idle_buffer_that_fits() -> None:
    pool = BufferPool(idle_limit_bytes=64 * MiB)
    bufs = {n: pool.acquire(n * MiB) for n in (2, 3, 5)}
    for b in bufs.values():
        pool.release(b)
    got = pool.acquire(2 * MiB + 1)  # no exact match: the 3 MiB one (2 MiB is too small)
    assert got is bufs[3] and got.capacity == 3 * MiB
    assert pool.stats.in_use_bytes == 3 * MiB and pool.stats.idle_bytes == 7 * MiB
    # Over REUSE_SLACK times the request: a new buffer, not the 5 MiB one.
    small = pool.acquire(MiB)
    assert small not in bufs.values() and 5 * MiB > REUSE_SLACK * MiB
    pool.release(got)
    pool.release(small)
    assert pool.stats.in_use_bytes == 0
    assert pool.stats.held_bytes == pool.stats.idle_bytes == 11 * MiB
    # Another origin never serves: a direct read's region must start where it asked.
    other = pool.acquire(3 * MiB, front=BLOCK_BYTES)
    assert other.front == BLOCK_BYTES and other not in bufs.values()


def test_dynamic_padding_sizes_do_not_fill_the_idle_pool() -> None:
    # A loop whose read sizes change a little every step (dynamic padding, +-30%):
    # after the first steps the pool serves them from what it holds, and what it holds
    # stays near one step's need instead of growing to the idle limit with last steps'
    # sizes that never come back.
    pool = BufferPool(idle_limit_bytes=256 * MiB)
    rng = np.random.default_rng(0)
    step_need = []
    for _ in range(20):
        scale = rng.uniform(0.8, 1.2)
        loans = [pool.lend(int(scale * n * MiB)) for n in (4, 4, 8, 8, 16)]
        step_need.append(sum(round_up(a.nbytes, PAGE_BYTES) for a, _ in loans))
        del loans
        gc.collect()
    stats = pool.stats
    assert stats.in_use_bytes == 0
    # Exact matches alone: 98 allocations of 100 loans, 5.4x a step's need held.
    assert stats.held_bytes <= 4 * max(step_need), (stats, max(step_need))
    assert stats.allocations <= 25, stats


def test_idle_buffers_beyond_the_limit_are_unmapped_oldest_first() -> None:
    pool = BufferPool(idle_limit_bytes=3 * MiB)
    bufs = [pool.acquire(MiB) for _ in range(4)]
    for b in bufs:
        pool.release(b)
    assert pool.stats.idle_bytes == 3 * MiB  # the first one returned went
    assert pool.acquire(MiB) is bufs[3]  # newest first
    big = pool.acquire(4 * MiB)
    pool.release(big)  # larger than the whole limit: never kept
    assert pool.stats.idle_bytes == 2 * MiB
    pool.set_idle_limit(MiB)
    assert pool.stats.idle_bytes == MiB
    with pytest.raises(ValueError):
        pool.set_idle_limit(-1)
    with pytest.raises(ValueError):
        BufferPool(-1)


def test_a_lent_buffer_comes_back_only_when_nothing_can_reach_it() -> None:
    """Rule 3: views, reshapes and tensors made from a lent array keep its buffer."""
    pool = BufferPool(idle_limit_bytes=64 * MiB)
    arr, region = pool.lend(4 * MiB)
    assert arr.nbytes == 4 * MiB and address_of(arr) % PAGE_BYTES == 0
    assert len(region) == 4 * MiB and address_of(region) == address_of(arr)
    assert pool.stats.in_use_bytes == 4 * MiB
    t = torch.from_numpy(arr).view(torch.float32)[16:].reshape(-1, 4).t()
    view = arr[100:200]
    del arr, region
    gc.collect()
    assert pool.stats.in_use_bytes == 4 * MiB  # the tensor and the view still use it
    del view
    gc.collect()
    assert pool.stats.in_use_bytes == 4 * MiB
    t.fill_(1.0)  # still its own memory, writable
    del t
    assert pool.stats.in_use_bytes == 0 and pool.stats.idle_bytes == 4 * MiB
    again, again_region = pool.lend(4 * MiB)
    assert pool.stats.reuses == 1 and pool.stats.allocations == 1
    del again, again_region


def test_small_loans_come_from_the_heap_and_are_not_pooled() -> None:
    pool = BufferPool(idle_limit_bytes=64 * MiB)
    arr, region = pool.lend(POOL_MIN_BYTES - 1)
    assert address_of(arr) % PAGE_BYTES == 0 and len(region) == round_up(POOL_MIN_BYTES - 1)
    assert pool.stats.held_bytes == 0
    empty, region0 = pool.lend(0)
    assert empty.nbytes == 0 and len(region0) == BLOCK_BYTES


def test_closed_pool_drops_what_comes_back() -> None:
    pool = BufferPool(idle_limit_bytes=64 * MiB)
    kept = pool.acquire(MiB)
    lent, region = pool.lend(MiB)
    pool.close()
    assert pool.stats.idle_bytes == 0
    pool.release(kept)
    del lent, region
    assert pool.stats.idle_bytes == 0 and pool.stats.in_use_bytes == 0


def test_pool_is_thread_safe() -> None:
    pool = BufferPool(idle_limit_bytes=16 * MiB)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(200):
                n = int(rng.integers(POOL_MIN_BYTES, 2 * MiB))
                if rng.random() < 0.5:
                    b = pool.acquire(n)
                    b.view[:1] = b"x"
                    pool.release(b)
                else:
                    arr, region = pool.lend(n)
                    arr[:1] = 1
                    del arr, region
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    gc.collect()
    assert not errors, errors[:1]
    stats = pool.stats
    assert stats.in_use_bytes == 0 and stats.idle_bytes <= 16 * MiB
    assert stats.allocations + stats.reuses == 800


def _huge_kib_of(address: int) -> int:
    """AnonHugePages (KiB) of the mapping that holds ``address``."""
    with open("/proc/self/smaps") as f:
        text = f.read()
    total = 0
    current = False
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = lo <= address < hi
        elif current and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_large_buffers_put_their_origin_on_a_huge_page_boundary() -> None:
    """Rule 1: a buffer whose direct reads land one block in (a rotated stream) still
    gets whole huge pages from there, and only there: its 8 MiB after the origin are
    four huge pages, the block before it a small page (no 2 MiB charged for it)."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    buf = AlignedBuffer(8 * MiB + BLOCK_BYTES, BLOCK_BYTES)
    origin = address_of(buf.view) + BLOCK_BYTES
    assert origin % (2 * MiB) == 0 and len(buf.view) == 8 * MiB + BLOCK_BYTES
    buf.view[:] = b"\x01" * len(buf.view)  # touch every page
    assert _huge_kib_of(origin) == 8 * 1024  # the 8 MiB after the origin
    assert _huge_kib_of(origin - 1) == 0  # the block before it: small pages
    assert bytes(buf.exporter()[:2]) == b"\x01\x01"  # the exporter starts at the view
    pool = BufferPool(idle_limit_bytes=64 * MiB)
    a = pool.acquire(3 * MiB, front=BLOCK_BYTES)
    pool.release(a)
    assert pool.acquire(3 * MiB) is not a  # another origin: another bucket
    assert pool.acquire(3 * MiB, front=BLOCK_BYTES) is a
    with pytest.raises(ValueError, match="front"):
        AlignedBuffer(BLOCK_BYTES, BLOCK_BYTES)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc (Linux)")
def test_park_hands_back_the_pages_of_idle_buffers_and_keeps_the_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_aligned, "PARK_AFTER_S", 0.0)
    pool = BufferPool(idle_limit_bytes=128 * MiB)
    loans = [pool.lend(16 * MiB)[0] for _ in range(4)]
    for loan in loans:
        loan[:] = 7  # touched: resident
    del loans, loan
    gc.collect()
    assert pool.stats.resident_idle_bytes == pool.stats.idle_bytes == 64 * MiB
    before = _rss_bytes()
    assert pool.park() == 64 * MiB
    assert before - _rss_bytes() >= 56 * MiB  # the pages left the process
    stats = pool.stats
    assert stats.resident_idle_bytes == 0 and stats.idle_bytes == 64 * MiB
    assert pool.park() == 0  # nothing lent since: nothing to do
    arr = pool.lend(16 * MiB)[0]  # the same buffer again, its bytes zeroed pages
    assert pool.stats.allocations == 4 and not arr.any()
    del arr
    gc.collect()
    assert pool.stats.resident_idle_bytes == 16 * MiB  # used again: resident


def test_park_leaves_buffers_that_just_came_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # A store alternating puts and gets takes its read buffer again at once: parking
    # it would cost a refault per get.
    pool = BufferPool(idle_limit_bytes=64 * MiB)
    arr = pool.lend(8 * MiB)[0]
    arr[:] = 1
    del arr
    gc.collect()
    monkeypatch.setattr(_aligned, "PARK_AFTER_S", 60.0)  # "just": however slow this machine
    assert pool.park() == 0 and pool.stats.resident_idle_bytes == 8 * MiB
    time.sleep(0.01)
    monkeypatch.setattr(_aligned, "PARK_AFTER_S", 0.005)
    assert pool.park() == 8 * MiB and pool.stats.resident_idle_bytes == 0


def test_a_store_parks_its_idle_read_buffers_at_its_next_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A training loop: backward's reads leave buffers idle; forward's first write
    # hands their pages back, so they are not resident through the forward.
    from tensorstore_hooks.storage.zarr._store import ZarrStore

    monkeypatch.setattr(_aligned, "PARK_AFTER_S", 0.0)
    with ZarrStore(str(tmp_path), namespace="ns", buffer_pool_bytes="64MiB") as store:
        keys = [store.put(torch.full((2 * MiB,), float(i))) for i in range(3)]
        for key in keys:
            assert store.get(key)[0].item() == float(keys.index(key))
        gc.collect()
        assert store.buffers.resident_idle_bytes == store.buffers.idle_bytes > 0
        store.put(torch.ones(MiB))
        assert store.buffers.resident_idle_bytes == 0 and store.buffers.idle_bytes > 0
        assert torch.equal(store.get(keys[1]), torch.full((2 * MiB,), 1.0))

