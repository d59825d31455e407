"""The host tier's logic with plain CPU buffers: what is held, what spills, in which
order, and the cap (NOTE [ Host tier ] and NOTE [ Pinned slabs ] in
``tensorstore_hooks/pipeline/_host_tier.py``)."""

from __future__ import annotations

import threading
from collections.abc import Hashable

import pytest
import torch

from tensorstore_hooks.pipeline._host_tier import SLAB_BYTES, SlabTier, round_up

KiB = 1 << 10
MiB = 1 << 20


class Alloc:
    """A counting allocator of plain CPU byte tensors (pinned ones in real use)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, n: int) -> torch.Tensor:
        self.calls.append(n)
        return torch.empty(n, dtype=torch.uint8)


def cut(buf: torch.Tensor, off: int, n: int) -> torch.Tensor:
    return buf[off : off + n]


def slab_tier(cap: int, alloc: Alloc, slab: int = SLAB_BYTES) -> SlabTier[torch.Tensor]:
    return SlabTier(cap, alloc, cut, slab_bytes=slab)


def hold(tier: SlabTier[torch.Tensor], key: Hashable, n: int) -> list[Hashable]:
    victims = tier.make_room(key, n)
    assert victims is not None
    for v in victims:
        tier.release(v)  # the "store" took it at once
    tier.take(key, timeout_s=1.0)
    return victims


def test_round_up() -> None:
    assert round_up(1) == 4 * KiB
    assert round_up(4 * KiB) == 4 * KiB
    assert round_up(4 * KiB + 1) == 8 * KiB


# ------------------------------------------------ the rules (NOTE [ Host tier ])
def test_holds_within_the_cap_then_spills_oldest_first() -> None:
    tier = slab_tier(16 * KiB, Alloc())
    for k in "abcd":
        assert hold(tier, k, 4 * KiB) == []
    assert tier.held_keys() == list("abcd")
    assert hold(tier, "e", 4 * KiB) == ["a"]
    assert hold(tier, "f", 8 * KiB) == ["b", "c"]
    assert tier.held_keys() == ["d", "e", "f"]
    assert tier.used_bytes <= 16 * KiB and tier.peak_bytes <= 16 * KiB
    assert tier.spills == 3


def test_bigger_than_the_cap_is_never_held() -> None:
    tier = slab_tier(8 * KiB, Alloc())
    hold(tier, "a", 4 * KiB)
    assert tier.make_room("big", 12 * KiB) is None
    assert tier.held_keys() == ["a"]  # nothing spilled for it
    off = slab_tier(0, Alloc())
    assert off.make_room("x", 1) is None


def test_take_waits_for_spilled_bytes() -> None:
    tier = slab_tier(8 * KiB, Alloc())
    hold(tier, "a", 8 * KiB)
    victims = tier.make_room("b", 8 * KiB)
    assert victims == ["a"]
    assert tier.spilling_keys() == ["a"]
    with pytest.raises(TimeoutError, match="no room"):
        tier.take("b", timeout_s=0.05)  # the store has not taken "a" yet
    victims = tier.make_room("b", 8 * KiB)
    assert victims == []  # "a" is already on its way out: nothing more spills
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(tier.take("b", timeout_s=5.0)))
    t.start()
    tier.release("a")  # the write finished
    t.join(5.0)
    assert got and tier.held_keys() == ["b"]
    assert tier.used_bytes == 8 * KiB


def test_slabs_are_recycled_across_steps() -> None:
    # Rule 2: a loop that saves the same sizes allocates in its first step only.
    alloc = Alloc()
    tier = slab_tier(64 * KiB, alloc)
    for step in range(3):
        for k in range(4):
            hold(tier, (step, k), (k + 1) * 4 * KiB)
        for k in range(4):
            tier.release((step, k))  # backward freed them
    assert alloc.calls == [64 * KiB]  # one slab, made in the first step
    assert tier.allocations == 1 and tier.spills == 0


def test_a_freed_range_is_taken_before_anything_spills() -> None:
    alloc = Alloc()
    tier = slab_tier(16 * KiB, alloc)
    hold(tier, "a", 4 * KiB)
    hold(tier, "b", 8 * KiB)
    tier.release("b")  # its range is free again, still counted in the cap
    assert tier.used_bytes == 16 * KiB
    assert hold(tier, "c", 12 * KiB) == []  # b's range and the rest after it; "a" stays
    assert tier.held_keys() == ["a", "c"]
    assert tier.used_bytes == 16 * KiB and len(alloc.calls) == 1


def test_reads_never_spill() -> None:
    # Rule 5. A 12 KiB cap makes slabs of 8 and 4 KiB.
    alloc = Alloc()
    tier = slab_tier(12 * KiB, alloc)
    hold(tier, "a", 4 * KiB)
    hold(tier, "b", 4 * KiB)
    assert tier.try_take("r1", 4 * KiB) is not None  # the 4 KiB slab
    assert tier.try_take("r2", 4 * KiB) is None  # full: no buffer lent, nothing spills
    assert tier.held_keys() == ["a", "b"]
    tier.release("a")  # backward consumed "a"
    assert tier.try_take("r2", 4 * KiB) is not None  # reuses a's range
    assert tier.held_keys() == ["b"] and tier.used_bytes == 12 * KiB
    assert alloc.calls == [8 * KiB, 4 * KiB]


def test_reads_never_spill_and_grow_within_the_cap() -> None:
    alloc = Alloc()
    tier = slab_tier(32 * KiB, alloc, slab=16 * KiB)
    hold(tier, "a", 16 * KiB)
    buf = tier.try_take("read", 16 * KiB)  # a second slab, within the cap
    assert buf is not None and alloc.calls == [16 * KiB, 16 * KiB]
    assert tier.try_take("read2", 4 * KiB) is None  # no room, and reads never spill
    assert tier.held_keys() == ["a"]
    tier.release("read")
    assert tier.try_take("read2", 4 * KiB) is not None


def test_host_rules_share_the_cap() -> None:
    # Rule 6: a host-rule tensor and a spillable one draw from the same pool.
    tier = slab_tier(8 * KiB, Alloc())
    hold(tier, ("host", 0), 4 * KiB)
    hold(tier, ("tier", 1), 4 * KiB)
    assert hold(tier, ("tier", 2), 4 * KiB) == [("host", 0)]
    assert tier.used_bytes == 8 * KiB


def test_release_is_idempotent_and_cancels_a_claim() -> None:
    tier = slab_tier(8 * KiB, Alloc())
    assert tier.make_room("a", 8 * KiB) == []
    tier.release("a")  # never taken: the claim is given up
    tier.release("a")
    tier.release("nothing")
    assert hold(tier, "b", 8 * KiB) == []
    assert tier.used_bytes == 8 * KiB


def test_slab_release_is_idempotent_cancels_a_claim_and_clear_drops_idle_slabs() -> None:
    alloc = Alloc()
    tier = slab_tier(64 * KiB, alloc, slab=32 * KiB)
    hold(tier, "a", 32 * KiB)
    hold(tier, "b", 32 * KiB)
    tier.release("a")
    tier.release("a")
    assert tier.make_room("c", 8 * KiB) == []
    tier.release("c")  # the claim given up
    assert tier.make_room("d", 32 * KiB) == []  # the whole free slab again
    tier.release("d")
    tier.clear()
    assert tier.used_bytes == 32 * KiB and tier.held_keys() == ["b"]


class FailsOnce(Alloc):
    """An allocator whose first call fails (no pinned memory left for a moment)."""

    def __call__(self, n: int) -> torch.Tensor:
        if not self.calls:
            self.calls.append(-n)
            raise MemoryError("no pinned memory")
        return super().__call__(n)


def test_a_failed_allocation_gives_the_room_back() -> None:
    alloc = FailsOnce()
    tier = slab_tier(8 * KiB, alloc)
    with pytest.raises(MemoryError):
        tier.make_room("a", 4 * KiB)
    assert tier.used_bytes == 0 and tier.held_keys() == []
    # The failed slab's room is the tier's again: the next request gets the whole cap.
    assert hold(tier, "b", 8 * KiB) == []
    assert alloc.calls == [-8 * KiB, 8 * KiB] and tier.used_bytes == 8 * KiB


def test_bad_cap() -> None:
    with pytest.raises(ValueError, match="cap_bytes"):
        SlabTier(-1, Alloc(), cut)


def test_can_take_says_whether_take_would_wait() -> None:
    tier = slab_tier(8 * KiB, Alloc())
    hold(tier, "a", 8 * KiB)
    assert tier.make_room("b", 8 * KiB) == ["a"]
    assert not tier.can_take("b")
    tier.release("a")
    assert tier.can_take("b")


# --------------------------------------------------------------- under threads
def _run_workers(worker: object, n: int = 4) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(w: int) -> None:
        try:
            worker(w)  # type: ignore[operator]
        except BaseException as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def test_concurrent_holders_keeping_half_never_exceed_the_cap() -> None:
    # Held tensors pile up, so spills are chosen while other threads claim and take.
    tier = slab_tier(32 * KiB, Alloc())
    peak: list[int] = []
    held: list[Hashable] = []

    def worker(w: int) -> None:
        for i in range(50):
            key = (w, i)
            victims = tier.make_room(key, 4 * KiB * (1 + (i % 3)))
            if victims is None:  # every range claimed by the other threads (rule 4)
                continue
            for v in victims:
                tier.release(v)
            tier.take(key, timeout_s=5.0)
            held.append(key)
            peak.append(tier.used_bytes)
            if i % 2:
                tier.release(key)

    errors = _run_workers(worker)
    assert not errors, errors
    assert len(held) > 100  # most of the 200 requests were held
    assert tier.spills > 0  # and the tier was full: the rule was tested under load
    assert max(peak) <= 32 * KiB and tier.peak_bytes <= 32 * KiB


class Gated(Alloc):
    """An allocator whose first call waits for ``go`` (a slow ``cudaHostAlloc``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = threading.Event()
        self.go = threading.Event()

    def __call__(self, n: int) -> torch.Tensor:
        if not self.inside.is_set():  # only the test's first thread calls before it is set
            self.inside.set()
            assert self.go.wait(10)
        return super().__call__(n)


def test_slabs_being_allocated_count_against_the_cap() -> None:
    # Rule 1 while a slab is still being allocated (outside the lock): other requests
    # see its bytes as spent and never grow the tier past the cap.
    alloc = Gated()
    tier = slab_tier(32 * KiB, alloc, slab=16 * KiB)
    first = threading.Thread(target=lambda: tier.make_room("a", 16 * KiB))
    first.start()
    try:
        assert alloc.inside.wait(10)
        assert tier.make_room("b", 16 * KiB) == []  # the other 16 KiB of the cap
        assert tier.make_room("c", 16 * KiB) is None  # none left: rule 4, nothing grows
    finally:
        alloc.go.set()
        first.join(10)
    assert alloc.calls == [16 * KiB, 16 * KiB]
    assert tier.used_bytes == 32 * KiB and tier.peak_bytes == 32 * KiB


def test_concurrent_slab_holders_never_exceed_the_cap() -> None:
    tier = slab_tier(256 * KiB, Alloc(), slab=64 * KiB)

    def worker(w: int) -> None:
        for i in range(50):
            key = (w, i)
            victims = tier.make_room(key, (4 + (i % 5) * 8) * KiB)
            if victims is None:
                continue
            for v in victims:
                tier.release(v)
            tier.take(key, timeout_s=5.0)
            assert tier.used_bytes <= 256 * KiB
            tier.release(key)

    errors = _run_workers(worker)
    assert not errors, errors
    assert tier.peak_bytes <= 256 * KiB and tier.held_keys() == []


# ------------------------------------------------------ slabs (NOTE [ Pinned slabs ])
def test_slabs_are_powers_of_two_that_add_up_to_the_budget() -> None:
    alloc = Alloc()
    tier = slab_tier(100 * MiB, alloc)
    for i in range(25):
        assert hold(tier, i, 4 * MiB) == []
    assert alloc.calls == [64 * MiB, 32 * MiB, 4 * MiB] and tier.used_bytes == 100 * MiB
    assert tier.held_tensor_bytes == 100 * MiB  # every byte of the budget holds a tensor
    assert hold(tier, "next", 4 * MiB) == [0]  # then the oldest spills
    assert tier.allocations == 3


def test_slabs_count_at_the_allocators_size_and_ranges_at_4_kib() -> None:
    # 9 KiB asks take 12 KiB ranges of one 64 KiB slab: five fit where one
    # power-of-two pinned buffer each (16 KiB) fitted four.
    alloc = Alloc()
    tier = slab_tier(64 * KiB, alloc)
    for k in "abcde":
        assert hold(tier, k, 9 * KiB) == []
    assert alloc.calls == [64 * KiB] and tier.used_bytes == 64 * KiB
    assert tier.held_bytes == 60 * KiB and tier.held_tensor_bytes == 45 * KiB
    assert hold(tier, "f", 9 * KiB) == ["a"]
    assert tier.peak_bytes == 64 * KiB


# Measured on the sizes below before the power-of-two tier was removed: one pinned
# buffer per tensor, each a power of two that torch's allocator keeps, held at most
# 78.5% of the budget as tensor bytes, in 33 buffers (NOTE [ Pinned slabs ]).
POW2_FILL = 0.785
POW2_ALLOCATIONS = 33


def test_tensors_of_mixed_sizes_fill_the_budget() -> None:
    """A Llama-like step's sizes, over and over: the tier holds >= 97% of its budget as
    tensor bytes (power-of-two buffers held POW2_FILL) in four slabs."""
    sizes = [4 * MiB, 4 * MiB, 12 * MiB + 1024, 2 * MiB, 4 * MiB, 11 * MiB, 11 * MiB, 3 * MiB]
    budget = 256 * MiB
    tier = slab_tier(budget, Alloc())
    asked: dict[Hashable, int] = {}
    peak = 0
    for _ in range(6):  # steps
        for n in sizes * 8:  # 408 MiB a step: the oldest spill
            asked[len(asked)] = n
            hold(tier, len(asked) - 1, n)
            peak = max(peak, sum(asked[k] for k in tier.held_keys()))
        for k in tier.held_keys():
            tier.release(k)  # backward consumed the step
    fill = peak / budget
    assert fill >= 0.97, f"slabs held {fill:.3f} of the budget (power-of-two: {POW2_FILL})"
    assert fill > POW2_FILL + 0.15
    assert tier.peak_tensor_bytes == peak and tier.used_bytes <= budget
    assert tier.allocations == 4 < POW2_ALLOCATIONS  # 4 x 64 MiB, made in the first step


def test_the_oldest_that_free_one_range_spill_and_their_range_is_claimed() -> None:
    tier = slab_tier(64 * KiB, Alloc(), slab=64 * KiB)
    for k in "abcd":
        hold(tier, k, 16 * KiB)
    # 32 KiB: "a" and "b" (the oldest, side by side) make room; "c" and "d" stay.
    assert tier.make_room("big", 32 * KiB) == ["a", "b"]
    assert tier.held_keys() == ["c", "d"] and set(tier.spilling_keys()) == {"a", "b"}
    assert not tier.can_take("big")
    # The claimed range is no one else's: a read finds no room, another hold spills.
    assert tier.try_take("read", 16 * KiB) is None
    assert tier.make_room("other", 16 * KiB) == ["c"]
    tier.release("a")
    tier.release("b")
    assert tier.can_take("big")
    buf = tier.take("big", timeout_s=1.0)
    assert buf.numel() == 32 * KiB and tier.buffer("big").data_ptr() == buf.data_ptr()
    tier.release("c")
    tier.take("other", timeout_s=1.0)
    assert tier.held_keys() == ["d", "big", "other"] and tier.used_bytes == 64 * KiB


def test_a_spill_frees_one_contiguous_range_oldest_first() -> None:
    tier = slab_tier(64 * KiB, Alloc(), slab=64 * KiB)
    for k, n in (("a", 8), ("b", 16), ("c", 8), ("d", 16), ("e", 16)):
        hold(tier, k, n * KiB)
    # 24 KiB: a+b (oldest, adjacent) free 24 KiB; nothing newer need go.
    assert tier.make_room("x", 24 * KiB) == ["a", "b"]


def test_the_victim_is_the_oldest_held_tensor_whose_range_fits() -> None:
    # Rule 3: "small" is older, but its 16 KiB and free room beside it make no
    # 32 KiB range without "large" too: "large" alone spills, fewest victims.
    tier = slab_tier(64 * KiB, Alloc())
    hold(tier, "small", 16 * KiB)
    hold(tier, "large", 32 * KiB)
    hold(tier, "small2", 16 * KiB)
    assert tier.make_room("new", 32 * KiB) == ["large"]
    tier.release("large")
    assert tier.can_take("new")
    tier.take("new", timeout_s=1.0)
    assert tier.held_keys() == ["small", "small2", "new"] and tier.used_bytes == 64 * KiB


def test_room_in_a_spent_cap_comes_only_as_a_range_that_fits() -> None:
    # Four 16 KiB slabs spend the cap; no range of 32 KiB exists in any of them.
    alloc = Alloc()
    tier = slab_tier(64 * KiB, alloc, slab=16 * KiB)
    for k in "abcd":
        hold(tier, k, 16 * KiB)
    # Rule 4: nothing spills for a tensor no range can take.
    assert tier.fits(32 * KiB) and tier.make_room("big", 32 * KiB) is None
    assert tier.held_keys() == list("abcd")
    tier.release("a")
    tier.release("b")
    # Two free 16 KiB slabs make no 32 KiB range: the slabs are kept (rule 2).
    assert tier.make_room("f", 32 * KiB) is None
    assert tier.used_bytes == 64 * KiB and alloc.calls == [16 * KiB] * 4


def test_freed_ranges_serve_other_sizes_without_allocating() -> None:
    alloc = Alloc()
    tier = slab_tier(64 * KiB, alloc)
    hold(tier, "a", 32 * KiB)
    hold(tier, "b", 16 * KiB)
    tier.release("a")
    tier.release("b")
    # Other sizes: the freed ranges serve them; nothing is dropped or allocated.
    assert hold(tier, "c", 20 * KiB) == [] and tier.buffer("c").numel() == 20 * KiB
    assert hold(tier, "d", 8 * KiB) == [] and tier.buffer("d").numel() == 8 * KiB
    assert alloc.calls == [64 * KiB] and tier.used_bytes == 64 * KiB
    tier.clear()
    assert tier.used_bytes == 64 * KiB  # a slab in use stays until its ranges are released


def test_what_never_fits_and_what_gets_its_own_slab() -> None:
    tier = slab_tier(48 * KiB, Alloc(), slab=16 * KiB)
    assert tier.make_room("x", 40 * KiB) is None  # slabs of 32 + 16 KiB: no 40 KiB range
    assert not tier.fits(40 * KiB) and tier.fits(32 * KiB)
    alloc = Alloc()
    big = slab_tier(1 * MiB, alloc, slab=64 * KiB)
    assert hold(big, "huge", 300 * KiB) == [] and alloc.calls == [512 * KiB]  # its own
    off = slab_tier(0, Alloc())
    assert off.make_room("x", 1) is None


@pytest.mark.cuda
def test_pinned_slabs_round_trip_a_cuda_tensor() -> None:
    # Real use: pinned slabs; a tensor copied out of the device and back is equal.
    def pinned(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)

    tier = SlabTier(64 * KiB, pinned, cut)
    x = torch.randn(1024, device="cuda")
    victims = tier.make_room("x", x.numel() * 4)
    assert victims == []
    buf = tier.take("x")
    assert buf.is_pinned()
    host = buf[: x.numel() * 4].view(torch.float32)
    host.copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host.to("cuda"), x)
    tier.release("x")
    assert tier.used_bytes == 64 * KiB  # the slab is kept (rule 2)
