"""The host tier's logic with plain CPU buffers: what is held, what spills, in which
order, and the cap (NOTE [ Host tier ] in ``tensorstore_hooks/pipeline/_host_tier.py``)."""

from __future__ import annotations

import threading

import pytest
import torch

from tensorstore_hooks.pipeline._host_tier import SLAB_BYTES, HostTier, SlabTier, round_up

KiB = 1 << 10


class Alloc:
    """A counting allocator of plain CPU byte tensors (pinned ones in real use)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, n: int) -> torch.Tensor:
        self.calls.append(n)
        return torch.empty(n, dtype=torch.uint8)


def hold(tier: HostTier, key: str, n: int) -> list[object]:
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


def test_holds_within_the_cap_then_spills_oldest_first() -> None:
    tier = HostTier(16 * KiB, Alloc())
    for k in "abcd":
        assert hold(tier, k, 4 * KiB) == []
    assert tier.held_keys() == list("abcd")
    assert hold(tier, "e", 4 * KiB) == ["a"]
    assert hold(tier, "f", 8 * KiB) == ["b", "c"]
    assert tier.held_keys() == ["d", "e", "f"]
    assert tier.used_bytes <= 16 * KiB and tier.peak_bytes <= 16 * KiB
    assert tier.spills == 3


def test_bigger_than_the_cap_is_never_held() -> None:
    tier = HostTier(8 * KiB, Alloc())
    hold(tier, "a", 4 * KiB)
    assert tier.make_room("big", 12 * KiB) is None
    assert tier.held_keys() == ["a"]  # nothing spilled for it
    off = HostTier(0, Alloc())
    assert off.make_room("x", 1) is None


def test_take_waits_for_spilled_bytes() -> None:
    tier = HostTier(8 * KiB, Alloc())
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


def test_buffers_are_recycled_by_size() -> None:
    alloc = Alloc()
    tier = HostTier(64 * KiB, alloc)
    for step in range(3):
        for k in range(4):
            hold(tier, (step, k), (k + 1) * 4 * KiB)
        for k in range(4):
            tier.release((step, k))  # backward freed them
    assert len(alloc.calls) == 4  # only the first step allocated
    assert tier.allocations == 4


def test_idle_buffers_are_dropped_before_anything_spills() -> None:
    alloc = Alloc()
    tier = HostTier(16 * KiB, alloc)
    hold(tier, "a", 4 * KiB)
    hold(tier, "b", 8 * KiB)
    tier.release("b")  # idle 8 KiB, counted in the cap
    assert tier.used_bytes == 12 * KiB
    assert hold(tier, "c", 12 * KiB) == []  # the idle 8 KiB goes, "a" stays
    assert tier.held_keys() == ["a", "c"]
    assert tier.used_bytes == 16 * KiB


def test_reads_never_spill() -> None:
    tier = HostTier(12 * KiB, Alloc())
    hold(tier, "a", 4 * KiB)
    hold(tier, "b", 4 * KiB)
    assert tier.try_take("r1", 4 * KiB) is not None
    assert tier.try_take("r2", 4 * KiB) is None  # full: no buffer lent, nothing spills
    assert tier.held_keys() == ["a", "b"]
    tier.release("a")  # backward consumed "a"
    assert tier.try_take("r2", 4 * KiB) is not None  # reuses a's buffer
    assert tier.held_keys() == ["b"] and tier.used_bytes == 12 * KiB


def test_host_rules_share_the_cap() -> None:
    # Rule 6: a host-rule tensor and a spillable one draw from the same pool.
    tier = HostTier(8 * KiB, Alloc())
    hold(tier, ("host", 0), 4 * KiB)
    hold(tier, ("tier", 1), 4 * KiB)
    assert hold(tier, ("tier", 2), 4 * KiB) == [("host", 0)]
    assert tier.used_bytes == 8 * KiB


def test_release_is_idempotent_and_cancels_a_reservation() -> None:
    tier = HostTier(8 * KiB, Alloc())
    assert tier.make_room("a", 8 * KiB) == []
    tier.release("a")  # never taken: the reservation is given up
    tier.release("a")
    tier.release("nothing")
    assert hold(tier, "b", 8 * KiB) == []
    assert tier.used_bytes == 8 * KiB


def test_failed_allocation_gives_the_room_back() -> None:
    def fail(n: int) -> torch.Tensor:
        raise MemoryError("no pinned memory")

    tier = HostTier(8 * KiB, fail)
    assert tier.make_room("a", 4 * KiB) == []
    with pytest.raises(MemoryError):
        tier.take("a")
    assert tier.used_bytes == 0


def test_concurrent_holders_never_exceed_the_cap() -> None:
    tier = HostTier(32 * KiB, Alloc())
    peak: list[int] = []
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(50):
                key = (w, i)
                victims = tier.make_room(key, 4 * KiB * (1 + (i % 3)))
                assert victims is not None
                for v in victims:
                    tier.release(v)
                tier.take(key, timeout_s=5.0)
                peak.append(tier.used_bytes)
                if i % 2:
                    tier.release(key)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert max(peak) <= 32 * KiB and tier.peak_bytes <= 32 * KiB


def test_bad_cap() -> None:
    with pytest.raises(ValueError, match="cap_bytes"):
        HostTier(-1, Alloc())


# ------------------------------------------ an allocator that keeps what it frees
def pow2(n: int) -> int:
    return 1 << max(n - 1, 4095).bit_length()


def caching_tier(cap: int, alloc: Alloc) -> HostTier[torch.Tensor]:
    """A tier over an allocator like torch's pinned one: power-of-two blocks, cached."""
    return HostTier(cap, alloc, block_bytes=pow2, keeps_freed=True)


def test_buffers_are_counted_at_the_allocators_size() -> None:
    # 9 KiB asks take 16 KiB blocks: four fill a 64 KiB cap (not five, as 12 KiB would).
    alloc = Alloc()
    tier = caching_tier(64 * KiB, alloc)
    for k in "abcd":
        assert hold(tier, k, 9 * KiB) == []
    assert alloc.calls == [16 * KiB] * 4 and tier.used_bytes == 64 * KiB
    assert hold(tier, "e", 9 * KiB) == ["a"]
    assert tier.peak_bytes == 64 * KiB


def test_a_caching_allocator_never_gets_buffers_back_and_larger_ones_are_reused() -> None:
    alloc = Alloc()
    tier = caching_tier(64 * KiB, alloc)
    hold(tier, "a", 32 * KiB)
    hold(tier, "b", 16 * KiB)
    tier.release("a")
    tier.release("b")
    # Another size: the idle 32 KiB buffer serves it; nothing is dropped or allocated.
    assert hold(tier, "c", 20 * KiB) == [] and tier.buffer("c").numel() == 32 * KiB
    assert hold(tier, "d", 8 * KiB) == [] and tier.buffer("d").numel() == 16 * KiB
    assert len(alloc.calls) == 2 and tier.used_bytes == 48 * KiB
    tier.clear()
    assert tier.used_bytes == 48 * KiB  # held buffers stay until released


def test_room_in_a_spent_cap_comes_only_as_a_buffer_that_fits() -> None:
    alloc = Alloc()
    tier = caching_tier(64 * KiB, alloc)
    for k in "abcd":
        hold(tier, k, 16 * KiB)
    # The cap is spent and no held buffer is large enough: rule 4, nothing spills for it.
    assert tier.make_room("big", 32 * KiB) is None
    assert tier.held_keys() == list("abcd")
    tier.release("a")
    tier.release("b")
    # Two idle 16 KiB buffers make no 32 KiB one: the allocator would keep them anyway.
    assert tier.make_room("f", 32 * KiB) is None
    assert tier.used_bytes == 64 * KiB and len(alloc.calls) == 4


def test_the_victim_is_the_oldest_held_buffer_that_fits() -> None:
    tier = caching_tier(64 * KiB, Alloc())
    hold(tier, "small", 16 * KiB)
    hold(tier, "large", 32 * KiB)
    hold(tier, "small2", 16 * KiB)
    assert tier.make_room("new", 32 * KiB) == ["large"]
    tier.release("large")
    assert tier.can_take("new")
    tier.take("new", timeout_s=1.0)
    assert tier.held_keys() == ["small", "small2", "new"] and tier.used_bytes == 64 * KiB


def test_can_take_says_whether_take_would_wait() -> None:
    tier = HostTier(8 * KiB, Alloc())
    hold(tier, "a", 8 * KiB)
    assert tier.make_room("b", 8 * KiB) == ["a"]
    assert not tier.can_take("b")
    tier.release("a")
    assert tier.can_take("b")


@pytest.mark.cuda
def test_pinned_buffers_round_trip_a_cuda_tensor() -> None:
    # Real use: pinned buffers; a tensor copied out of the device and back is equal.
    def pinned(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)

    tier = HostTier(64 * KiB, pinned)
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
    assert tier.used_bytes == round_up(4096)


# ------------------------------------------------------ slabs (NOTE [ Pinned slabs ])
MiB = 1 << 20


def cut(buf: torch.Tensor, off: int, n: int) -> torch.Tensor:
    return buf[off : off + n]


def slab_tier(cap: int, alloc: Alloc, slab: int = SLAB_BYTES) -> SlabTier[torch.Tensor]:
    return SlabTier(cap, alloc, cut, slab_bytes=slab)


def test_slabs_are_powers_of_two_that_add_up_to_the_budget() -> None:
    alloc = Alloc()
    tier = slab_tier(100 * MiB, alloc)
    for i in range(25):
        assert hold(tier, i, 4 * MiB) == []
    assert alloc.calls == [64 * MiB, 32 * MiB, 4 * MiB] and tier.used_bytes == 100 * MiB
    assert tier.held_tensor_bytes == 100 * MiB  # every byte of the budget holds a tensor
    assert hold(tier, "next", 4 * MiB) == [0]  # then the oldest spills
    assert tier.allocations == 3


def test_tensors_of_mixed_sizes_fill_the_budget() -> None:
    """A Llama-like step's sizes, over and over: the tier holds >= 97% of its budget as
    tensor bytes (power-of-two buffers held 77-87%)."""
    sizes = [4 * MiB, 4 * MiB, 12 * MiB + 1024, 2 * MiB, 4 * MiB, 11 * MiB, 11 * MiB, 3 * MiB]
    for tier in (slab_tier(256 * MiB, Alloc()), caching_tier(256 * MiB, Alloc())):
        key = 0
        peak = 0
        for _ in range(6):  # steps
            for n in sizes * 8:  # 408 MiB a step: the oldest spill
                victims = tier.make_room(key, n)
                assert victims is not None
                for v in victims:
                    tier.release(v)
                tier.take(key, timeout_s=1.0)
                key += 1
                held = sum(sizes[k % len(sizes)] for k in tier.held_keys())  # type: ignore[operator]
                peak = max(peak, held)
            for k in tier.held_keys():
                tier.release(k)  # backward consumed the step
        if isinstance(tier, SlabTier):
            assert peak >= 0.97 * 256 * MiB, peak / (256 * MiB)
            assert tier.peak_tensor_bytes == peak and tier.used_bytes <= 256 * MiB
        else:
            assert peak < 0.9 * 256 * MiB  # what power-of-two buffers hold


def test_the_oldest_that_free_one_range_spill_and_their_range_is_claimed() -> None:
    tier = slab_tier(64 * KiB, Alloc(), slab=64 * KiB)
    for k in "abcd":
        hold(tier, k, 16 * KiB)
    # 32 KiB: "a" and "b" (the oldest, side by side) make room; "c" and "d" stay.
    assert tier.make_room("big", 32 * KiB) == ["a", "b"]
    assert tier.held_keys() == ["c", "d"] and sorted(tier.spilling_keys()) == ["a", "b"]
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


def test_what_never_fits_and_what_gets_its_own_slab() -> None:
    tier = slab_tier(48 * KiB, Alloc(), slab=16 * KiB)
    assert tier.make_room("x", 40 * KiB) is None  # slabs of 32 + 16 KiB: no 40 KiB range
    assert not tier.fits(40 * KiB) and tier.fits(32 * KiB)
    alloc = Alloc()
    big = slab_tier(1 * MiB, alloc, slab=64 * KiB)
    assert hold(big, "huge", 300 * KiB) == [] and alloc.calls == [512 * KiB]  # its own
    off = slab_tier(0, Alloc())
    assert off.make_room("x", 1) is None


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


def test_a_failed_slab_allocation_gives_the_room_back() -> None:
    def fail(n: int) -> torch.Tensor:
        raise RuntimeError("no pinned memory")

    tier = slab_tier(64 * KiB, Alloc())
    tier._allocate = fail  # type: ignore[assignment]
    with pytest.raises(RuntimeError):
        tier.make_room("a", 4 * KiB)
    assert tier.used_bytes == 0 and tier._growing == 0


def test_concurrent_slab_holders_never_exceed_the_cap() -> None:
    tier = slab_tier(256 * KiB, Alloc(), slab=64 * KiB)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
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
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert tier.peak_bytes <= 256 * KiB and tier.held_keys() == []
