"""The units of a tier chain, each on its own (NOTE [ Tier chain ] in
``tensorstore_hooks/storage/chain/_core.py``): the cycle planner (Rule 8) as arithmetic, the
ledger's bookkeeping (Rules 1, 3, 4, 6) without any I/O, the I/O helpers, and the
movers over a ledger without a ``TierChain``. The chain as a whole: ``test_chain.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import KeyNotFoundError, StoreClosedError, TensorStore
from tensorstore_hooks._codec import encode
from tensorstore_hooks.storage.chain._io import copy, write
from tensorstore_hooks.storage.chain._ledger import Ledger, Tier
from tensorstore_hooks.storage.chain._movers import Movers
from tensorstore_hooks.storage.chain._plan import CyclePlan
from tensorstore_hooks.testing import WrappedStore

KiB = 1024
T = 16 * KiB  # bytes of one test tensor: 4096 float32


def tensor(i: int) -> torch.Tensor:
    return torch.full((T // 4,), float(i))


# ------------------------------------------------------------------ CyclePlan
def run_cycle(plan: CyclePlan, puts: int, n: int, budgets: list[int]) -> list[int]:
    """One cycle of ``puts`` puts of ``n`` bytes: the tier each is planned to, then
    the chain empties."""
    tiers = []
    for k in range(puts):
        tiers.append(plan.tier_for(n, k * n, budgets))
        plan.landed(tiers[-1], tiers[-1])
        plan.held((k + 1) * n)
    plan.emptied()
    return tiers


def test_plan_places_nothing_below_before_a_cycle_has_ended() -> None:
    plan = CyclePlan(True)
    assert run_cycle(plan, 10, 10, [50]) == [0] * 10
    assert plan.cycle_bytes == 100 and plan.planned_puts == 0


def test_plan_with_the_first_tier_at_half_a_step_sends_the_oldest_half_below() -> None:
    """The NOTE's example: half of a step goes to each tier (the oldest half below)."""
    plan = CyclePlan(True)
    run_cycle(plan, 10, 10, [50])
    assert run_cycle(plan, 10, 10, [50]) == [1] * 5 + [0] * 5
    assert plan.planned_puts == 5


def test_plan_over_three_tiers_fills_each_from_the_bottom_by_age() -> None:
    plan = CyclePlan(True)
    run_cycle(plan, 10, 10, [30, 30])
    # The last 3 puts fit the first tier, the 3 before them the second, the rest go on.
    assert run_cycle(plan, 10, 10, [30, 30]) == [2, 2, 2, 2, 1, 1, 1, 0, 0, 0]
    assert plan.planned_puts == 7


def test_plan_a_cycle_larger_than_the_last_fills_the_first_tier() -> None:
    plan = CyclePlan(True)
    run_cycle(plan, 4, 10, [20])
    assert run_cycle(plan, 8, 10, [20]) == [1, 1, 0, 0, 0, 0, 0, 0]
    assert plan.cycle_bytes == 80  # the larger cycle is the next one's size


def test_plan_off_still_measures_cycles_but_places_every_put_first() -> None:
    plan = CyclePlan(False)
    run_cycle(plan, 10, 10, [50])
    assert run_cycle(plan, 10, 10, [50]) == [0] * 10
    assert plan.cycle_bytes == 100 and plan.planned_puts == 0


def test_plan_emptied_without_a_put_keeps_the_last_cycle() -> None:
    plan = CyclePlan(True)
    run_cycle(plan, 3, 10, [20])
    plan.emptied()  # e.g. a delete of nothing, or of keys of closed hooks
    assert plan.cycle_bytes == 30


def test_plan_counts_a_put_where_it_landed_and_is_set_aside_until_the_cycle_ends() -> None:
    """Rule 8: a planned put refused below falls back to the first tier; it is not a
    planned put there, and the rest of the cycle places every put first."""
    plan = CyclePlan(True)
    run_cycle(plan, 10, 10, [50])
    assert plan.tier_for(10, 0, [50]) == 1
    plan.landed(1, 0)  # the tier below refused it: it fell back to the first tier
    plan.set_aside()
    plan.held(10)
    assert plan.planned_puts == 0 and plan.fallbacks == 1
    assert [plan.tier_for(10, k * 10, [50]) for k in range(1, 5)] == [0] * 4
    plan.held(50)  # what the first tier took; the rest stayed with the caller
    plan.emptied()
    assert plan.cycle_bytes == 50  # the next cycle is planned by what the chain held...
    assert run_cycle(plan, 10, 10, [50]) == [0] * 10  # ...and plans again (none below)
    assert run_cycle(plan, 10, 10, [50]) == [1] * 5 + [0] * 5
    assert plan.planned_puts == 5 and plan.fallbacks == 1


def test_plan_a_put_planned_two_tiers_down_that_lands_one_down_counts() -> None:
    plan = CyclePlan(True)
    plan.landed(2, 1)
    plan.landed(0, 1)  # an unplanned put that spilled: Rule 2, not the plan
    assert plan.planned_puts == 1


# --------------------------------------------------------------------- Ledger
@pytest.fixture
def stores() -> Iterator[list[TensorStore]]:
    made = [tsh.open_store("memory://") for _ in range(3)]
    yield made
    for s in made:
        s.close()


def ledger_of(stores: list[TensorStore], budgets: list[int]) -> Ledger:
    return Ledger([Tier(s, s.url, b, True) for s, b in zip(stores, [*budgets, None], strict=False)])


def put(ledger: Ledger, i: int, n: int, inner: str = "k") -> str:
    with ledger.cond:
        seq = ledger.new_seq()
        assert ledger.reserve(i, n)
        return ledger.placed(seq, i, f"{inner}{seq}", n)


def test_ledger_counts_a_moving_tensor_in_both_tiers(stores: list[TensorStore]) -> None:
    """Rule 1: from the reservation below until the old copy is released."""
    ledger = ledger_of(stores, [100])
    key = put(ledger, 0, 60)
    with ledger.cond:
        assert not ledger.reserve(0, 50)  # 60 + 50 > 100
        job = ledger.take_oldest(0)
        assert job is not None and job.chain_key == key
        assert ledger.tiers[0].outgoing == 60
        assert ledger.reserve(1, 60)
        assert [t.held for t in ledger.tiers[:2]] == [60, 60]
        tier, old, moved = ledger.moved(job, 1, "new")
        assert (tier, old, moved) == (0, "k0", True)
        assert ledger.map[key].tier == 1 and ledger.map[key].key == "new"
        assert ledger.tiers[0].outgoing == 60  # until the old copy is released
        assert not ledger.tiers[0].over()  # held 60, of which 60 on the way out
        ledger.release(tier, 60, moved_out=moved)
        assert [t.held for t in ledger.tiers[:2]] == [0, 60]
        assert [t.tensors for t in ledger.tiers[:2]] == [0, 1]
        assert ledger.tiers[0].outgoing == 0 and ledger.tiers[0].peak == 60
        s = ledger.tiers[0].snapshot()
        assert (s.moved_out, s.bytes_moved_out, s.puts, s.bytes_put) == (1, 60, 1, 60)


def test_ledger_a_moved_tensor_is_the_oldest_of_a_middle_tier(stores: list[TensorStore]) -> None:
    """Rule 3 over three tiers: what moved into tier 1 is what moves on from there."""
    ledger = ledger_of(stores, [100, 100])
    keys = [put(ledger, 0, 10) for _ in range(3)]
    with ledger.cond:
        for _ in range(2):
            job = ledger.take_oldest(0)
            assert job is not None and ledger.reserve(1, 10)
            tier, _, moved = ledger.moved(job, 1, f"in1-{job.chain_key}")
            assert moved
            ledger.release(tier, 10)
        on = ledger.take_oldest(1)
        assert on is not None and (on.chain_key, on.src, on.src_key) == (keys[0], 1, "in1-0")
        assert ledger.take_oldest(0) is not None and ledger.take_oldest(0) is None


def test_ledger_takes_the_oldest_and_skips_stale_entries(stores: list[TensorStore]) -> None:
    """Rule 3: oldest in put order, never a deleted key or one already moving."""
    ledger = ledger_of(stores, [1000])
    keys = [put(ledger, 0, 10) for _ in range(4)]
    with ledger.cond:
        ledger.forget([keys[0]], strict=True)
        first = ledger.take_oldest(0)
        second = ledger.take_oldest(0)
        assert first is not None and second is not None
        assert (first.chain_key, second.chain_key) == (keys[1], keys[2])
        last = ledger.take_oldest(0)
        assert last is not None and last.chain_key == keys[3]
        assert ledger.take_oldest(0) is None
        assert ledger.tiers[0].outgoing == 30


def test_ledger_a_failed_move_leaves_the_tensor_and_queues_it_again(
    stores: list[TensorStore],
) -> None:
    """Rule 4: the map never changed, the room below is given back."""
    ledger = ledger_of(stores, [100])
    key = put(ledger, 0, 40)
    with ledger.cond:
        job = ledger.take_oldest(0)
        assert job is not None
        assert ledger.reserve(1, 40)
        assert ledger.move_failed(job, 1) is True
        p = ledger.map[key]
        assert (p.tier, p.key, p.moving) == (0, "k0", False)
        assert ledger.tiers[1].held == 0 and ledger.tiers[0].outgoing == 0
        again = ledger.take_oldest(0)
        assert again is not None and again.chain_key == key


def test_ledger_a_key_deleted_while_moving_leaves_only_the_new_copy_to_delete(
    stores: list[TensorStore],
) -> None:
    """Rule 6: the delete takes the key out at once; the move deletes what it made."""
    ledger = ledger_of(stores, [100])
    key = put(ledger, 0, 40)
    with ledger.cond:
        job = ledger.take_oldest(0)
        assert job is not None and ledger.reserve(1, 40)
        assert ledger.forget([key], strict=True) == {0: [("k0", 40)]}
        assert ledger.moved(job, 1, "new") == (1, "new", False)
        assert key not in ledger.map and ledger.nbytes == 0
        assert [t.tensors for t in ledger.tiers[:2]] == [0, 0]
        assert ledger.tiers[1].moved_in == 0  # nothing moved
    other = put(ledger, 0, 40)
    with ledger.cond:
        job = ledger.take_oldest(0)
        assert job is not None
        ledger.forget([other], strict=True)
        assert ledger.move_failed(job, -1) is False  # its read lost the race


def test_ledger_forget_strict_and_not(stores: list[TensorStore]) -> None:
    ledger = ledger_of(stores, [100])
    a, b = put(ledger, 0, 10), put(ledger, 1, 20)
    with ledger.cond:
        with pytest.raises(KeyNotFoundError, match="no key 'nope'"):
            ledger.forget(["nope"], strict=True)
        assert ledger.forget([a, "nope", b], strict=False) == {0: [("k0", 10)], 1: [("k1", 20)]}
        assert ledger.nbytes == 0 and not ledger.map


def test_ledger_over_counts_waiting_puts_and_moves_out(stores: list[TensorStore]) -> None:
    """Rule 3: a tier is over while held + wanted - outgoing exceeds its budget."""
    ledger = ledger_of(stores, [100])
    put(ledger, 0, 80)
    tier = ledger.tiers[0]
    with ledger.cond:
        assert not tier.over()
        tier.wanted += 40
        assert tier.over()
        job = ledger.take_oldest(0)
        assert job is not None and not tier.over()  # 80 + 40 - 80 <= 100
        assert not ledger.tiers[1].over()  # the last tier never is


def test_ledger_closed_refuses_new_puts_once(stores: list[TensorStore]) -> None:
    ledger = ledger_of(stores, [100])
    with ledger.cond:
        assert ledger.close() is True
        assert ledger.close() is False
        with pytest.raises(StoreClosedError, match="is closed; open a new one"):
            ledger.new_seq()
        with pytest.raises(StoreClosedError):
            ledger.forget(["0"], strict=False)


# ------------------------------------------------------------------------ I/O
def test_copy_between_byte_stores_moves_the_bytes_without_decoding(
    stores: list[TensorStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = stores[0], stores[1]
    assert isinstance(src, tsh.BlobStore) and isinstance(dst, tsh.BlobStore)
    t = tensor(3).view(64, 64).t()  # a non-contiguous view: its layout goes across
    key = src.put(t)

    def no_decode(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("copy decoded a tensor between two byte-level stores")

    monkeypatch.setattr(src, "get", no_decode)
    new = copy(src, key, dst)
    assert src.get_blob(key)[0] == dst.get_blob(new)[0]
    assert bytes(src.get_blob(key)[1]) == bytes(dst.get_blob(new)[1])
    monkeypatch.undo()
    got = dst.get(new)
    assert torch.equal(got, t) and got.stride() == t.stride()


def test_copy_and_write_through_a_tensor_store(stores: list[TensorStore]) -> None:
    user = WrappedStore(stores[2])  # a TensorStore that is not a BlobStore
    t = tensor(5)
    meta, payload = encode(t)
    key = write(user, t, meta, payload)
    assert user.puts == 1 and torch.equal(user.get(key), t)
    new = copy(user, key, stores[0])
    assert torch.equal(stores[0].get(new), t)
    back = copy(stores[0], new, user)
    assert user.puts == 2 and torch.equal(user.get(back), t)


def test_write_to_a_byte_store_writes_the_encoded_bytes(
    stores: list[TensorStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    t = tensor(7)
    meta, payload = encode(t)

    def no_encode(tensor: torch.Tensor) -> str:
        raise AssertionError("write encoded the tensor again")

    monkeypatch.setattr(stores[0], "put", no_encode)
    key = write(stores[0], t, meta, payload)
    assert torch.equal(stores[0].get(key), t)


# --------------------------------------------------------------------- Movers
def test_movers_over_a_ledger_move_the_oldest_down_and_stop(stores: list[TensorStore]) -> None:
    """Rule 3 without a TierChain: 4 tensors in a 2-tensor tier -> the 2 oldest move."""
    ledger = ledger_of(stores[:2], [2 * T])
    movers = Movers(ledger, 2)
    keys = []
    for i in range(4):
        t = tensor(i)
        meta, payload = encode(t)
        with ledger.cond:
            seq = ledger.new_seq()
            ledger.tiers[0].hold(T)  # over budget on purpose: the movers must fix it
        inner = write(stores[0], t, meta, payload)
        with ledger.cond:
            keys.append(ledger.placed(seq, 0, inner, T))
            movers.wake()
    assert movers.wait_idle(30)
    with ledger.cond:
        assert [ledger.map[k].tier for k in keys] == [1, 1, 0, 0]
        assert [t.held for t in ledger.tiers] == [2 * T, 2 * T]
        assert (movers.moves, movers.bytes_moved, movers.moving) == (2, 2 * T, 0)
    for i, k in enumerate(keys):
        p = ledger.map[k]
        assert torch.equal(ledger.tiers[p.tier].store.get(p.key), tensor(i))
    assert len(list(stores[0].keys())) == 2  # the old copies are gone
    with ledger.cond:
        ledger.close()
        ledger.cond.notify_all()
    assert movers.stop(10)
    assert movers.wait_idle(1) is True  # nothing over budget, nothing in flight
