"""Tier chains: ``open_store([url, url, ...], budgets=[...])`` and ``store: {tiers: [...]}``.

The rules under test are NOTE [ Tier chain ] in ``tensorstore_hooks/storage/chain/_core.py``:
puts land in the first tier, the oldest move down in the background while a tier is
over its budget (counted in bytes actually held), a failed move leaves the tensor
where it was, gets read from the tier that holds the key, and every race (a get or a
delete against a move, close with moves in flight) ends with exact tensors and
nothing left behind. The chain on SeaweedFS is in ``tests/storage/test_seaweedfs.py``.
"""

from __future__ import annotations

import gc
import json
import os
import random
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import (
    ConfigError,
    KeyNotFoundError,
    QuotaExceededError,
    StoreUnavailableError,
    TensorStore,
    TierChain,
)
from tensorstore_hooks.cli import main as cli_main
from tensorstore_hooks.pipeline._iopool import pool_for, shutdown_pool
from tensorstore_hooks.testing import StoreConformance, WrappedStore
from tests.daemon_fixtures import *  # noqa: F403 - the daemon fixtures
from tests.daemon_fixtures import DaemonLauncher
from tests.fake_accelerator import on_fake_accelerator
from tests.pipeline.test_pipeline import chain_grad, sin_chain

KiB = 1024
T = 16 * KiB  # bytes of one test tensor: 4096 float32


def tensor(i: int) -> torch.Tensor:
    return torch.full((T // 4,), float(i))


def settle(chain: TierChain) -> None:
    assert chain.wait_idle(30), f"moves did not settle: {chain.stats.summary()}"


# --------------------------------------------------------------- conformance
class TestMemoryToFileChain(StoreConformance):
    """The store contract on memory:// (64 KiB) -> a local directory."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[TensorStore]:
        s = tsh.open_store(["memory://", str(tmp_path / "disk")], budgets=["64KiB"])
        yield s
        s.close()


class TestThreeTierChain(StoreConformance):
    """memory:// (32 KiB) -> memory:// (64 KiB) -> a local directory: moves cascade."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[TensorStore]:
        s = tsh.open_store(
            ["memory://", "memory://", str(tmp_path / "disk")], budgets=["32KiB", "64KiB"]
        )
        yield s
        s.close()


# ---------------------------------------------------------------- placement
def test_newest_stay_in_the_first_tier_oldest_move_down(tmp_path: Path) -> None:
    chain = tsh.open_store(["memory://", str(tmp_path / "disk")], budgets=[4 * T])
    assert isinstance(chain, TierChain)
    keys = [chain.put(tensor(i)) for i in range(10)]
    settle(chain)
    assert [chain.tier_of(k) for k in keys] == [1] * 6 + [0] * 4
    s = chain.stats
    assert (s.tiers[0].tensors, s.tiers[0].bytes) == (4, 4 * T)
    assert (s.tiers[1].tensors, s.tiers[1].bytes) == (6, 6 * T)
    assert s.tiers[0].peak_bytes == 4 * T  # never over the budget, not even during moves
    assert s.moves == 6 and s.bytes_moved == 6 * T and s.move_failures == 0
    assert s.tiers[0].moved_out == s.tiers[1].moved_in == 6
    assert s.tiers[0].puts == 10 and s.tiers[1].puts == 0
    assert len(chain) == 10 and chain.nbytes == 10 * T
    assert len(chain.tiers[0]) == 4 and len(chain.tiers[1]) == 6  # each tier holds its part
    for i, k in enumerate(keys):
        assert torch.equal(chain.get(k), tensor(i))
    for k in keys:
        chain.delete(k)
    s = chain.stats
    assert [t.bytes for t in s.tiers] == [0, 0] and len(chain) == 0
    assert len(chain.tiers[0]) == len(chain.tiers[1]) == 0
    assert "tier 0 memory://: 0 tensors" in s.summary()
    chain.close()


def test_three_tiers_keep_age_order(tmp_path: Path) -> None:
    """A move into a full middle tier first moves that tier's oldest further down."""
    chain = tsh.open_store(
        ["memory://", "memory://", str(tmp_path / "disk")], budgets=[2 * T, 4 * T]
    )
    assert isinstance(chain, TierChain)
    keys = [chain.put(tensor(i)) for i in range(10)]
    settle(chain)
    assert [chain.tier_of(k) for k in keys] == [2] * 4 + [1] * 4 + [0] * 2
    s = chain.stats
    assert [t.bytes for t in s.tiers] == [2 * T, 4 * T, 4 * T]
    assert s.tiers[0].peak_bytes <= 2 * T and s.tiers[1].peak_bytes <= 4 * T
    for i, k in enumerate(keys):
        assert torch.equal(chain.get(k), tensor(i))
    chain.close()


def _cycle(chain: TierChain, n: int, first: int = 0) -> list[str]:
    """One cycle (a training step): ``n`` puts, settled; returns the keys."""
    keys = [chain.put(tensor(first + i)) for i in range(n)]
    settle(chain)
    return keys


def _empty(chain: TierChain, keys: list[str]) -> None:
    for i, k in enumerate(keys):
        assert torch.equal(chain.get(k), tensor(i))
    chain.delete_many(keys)
    assert len(chain) == 0


def test_the_next_cycle_writes_the_oldest_straight_down(tmp_path: Path) -> None:
    """Rule 8: the first cycle fills the fast tier and moves its oldest; the next one,
    of the same size, writes those straight to the tier below: same placement, no
    moves, no waiting."""
    chain = tsh.open_store(["memory://", str(tmp_path / "disk")], budgets=[4 * T])
    assert isinstance(chain, TierChain)
    keys = _cycle(chain, 10)
    assert [chain.tier_of(k) for k in keys] == [1] * 6 + [0] * 4
    s = chain.stats
    assert s.moves == 6 and s.planned_puts == 0 and s.cycle_bytes == 0
    _empty(chain, keys)
    assert chain.stats.cycle_bytes == 10 * T
    before = chain.stats
    keys = _cycle(chain, 10)
    assert [chain.tier_of(k) for k in keys] == [1] * 6 + [0] * 4  # what the moves made
    s = chain.stats
    assert s.moves == before.moves and s.put_waits == before.put_waits  # none of either
    assert s.planned_puts == 6 and s.tiers[1].puts == 6
    assert s.tiers[0].peak_bytes <= 4 * T
    _empty(chain, keys)
    # A larger cycle than the last: the plan covers what it knows, moves do the rest.
    keys = _cycle(chain, 12)
    assert [chain.tier_of(k) for k in keys] == [1] * 8 + [0] * 4
    assert chain.stats.moves == before.moves + 2
    _empty(chain, keys)
    assert chain.stats.cycle_bytes == 12 * T
    chain.close()


def test_three_tiers_plan_each_tier(tmp_path: Path) -> None:
    chain = tsh.open_store(
        ["memory://", "memory://", str(tmp_path / "disk")], budgets=[2 * T, 4 * T]
    )
    assert isinstance(chain, TierChain)
    _empty(chain, _cycle(chain, 10))
    moves = chain.stats.moves
    keys = _cycle(chain, 10)
    assert [chain.tier_of(k) for k in keys] == [2] * 4 + [1] * 4 + [0] * 2
    assert chain.stats.moves == moves and chain.stats.planned_puts == 8
    chain.close()


def test_plan_off_moves_every_cycle(tmp_path: Path) -> None:
    chain = TierChain(
        [tsh.open_store("memory://"), tsh.open_store(tmp_path / "disk")], [4 * T], plan=False
    )
    _empty(chain, _cycle(chain, 10))
    keys = _cycle(chain, 10)
    assert [chain.tier_of(k) for k in keys] == [1] * 6 + [0] * 4
    assert chain.stats.moves == 12 and chain.stats.planned_puts == 0
    chain.close()


def test_a_tensor_larger_than_a_budget_goes_down_at_once(tmp_path: Path) -> None:
    chain = tsh.open_store(["memory://", str(tmp_path / "disk")], budgets=[T])
    assert isinstance(chain, TierChain)
    big = torch.randn(T)  # 4 T bytes
    key = chain.put(big)
    assert chain.tier_of(key) == 1
    s = chain.stats
    assert s.spills == 1 and s.put_waits == 0 and s.tiers[1].puts == 1
    assert torch.equal(chain.get(key), big)
    chain.close()


def test_put_wait_zero_writes_down_when_the_tier_is_full(tmp_path: Path) -> None:
    first = tsh.open_store("memory://")
    chain = TierChain([first, tsh.open_store(tmp_path / "disk")], [2 * T], put_wait_s=0)
    keys = [chain.put(tensor(i)) for i in range(4)]
    assert [chain.tier_of(k) for k in keys] == [0, 0, 1, 1]
    assert chain.stats.moves == 0 and chain.stats.spills == 2
    chain.close()


def test_a_put_that_finds_no_room_in_time_goes_down() -> None:
    """put_wait_s: a move that takes too long does not hold the put back for longer."""
    release = threading.Event()

    class SlowForMovers(WrappedStore):
        def put(self, tensor: torch.Tensor) -> str:
            if threading.current_thread().name.startswith("tsh-chain-mover"):
                assert release.wait(30)
            return super().put(tensor)

    lower = SlowForMovers()
    chain = TierChain([tsh.open_store("memory://"), lower], [2 * T], put_wait_s=0.3)
    keys = [chain.put(tensor(i)) for i in range(2)]
    t0 = time.monotonic()
    keys.append(chain.put(tensor(2)))  # no room: waits 0.3 s, then writes to tier 1
    assert 0.25 < time.monotonic() - t0 < 5
    assert chain.tier_of(keys[2]) == 1
    s = chain.stats
    assert s.put_waits == 1 and s.spills == 1 and 0.25 < s.put_wait_s < 5
    release.set()
    settle(chain)
    for i, k in enumerate(keys):
        assert torch.equal(chain.get(k), tensor(i))
    chain.close()


def test_a_tier_that_refuses_passes_the_put_on(tmp_path: Path) -> None:
    class Full(WrappedStore):
        def put(self, tensor: torch.Tensor) -> str:
            raise QuotaExceededError("Full: no room")

    chain = TierChain([Full(), tsh.open_store(tmp_path / "disk")], ["1GiB"])
    key = chain.put(tensor(3))
    assert chain.tier_of(key) == 1 and chain.stats.spills == 1
    assert torch.equal(chain.get(key), tensor(3))
    assert chain.stats.tiers[0].bytes == 0  # the refused put's reservation was given back
    chain.close()


def test_the_last_tiers_failure_reaches_the_caller_and_nothing_is_held(tmp_path: Path) -> None:
    class Down(WrappedStore):
        def put(self, tensor: torch.Tensor) -> str:
            raise StoreUnavailableError("Down: unreachable")

    chain = TierChain([Down(), Down()], [4 * T])
    with pytest.raises(StoreUnavailableError, match="Down: unreachable"):
        chain.put(tensor(0))
    assert len(chain) == 0 and [t.bytes for t in chain.stats.tiers] == [0, 0]
    chain.close()


def test_a_store_bug_in_a_put_gives_the_room_back() -> None:
    class Buggy(WrappedStore):
        def put(self, tensor: torch.Tensor) -> str:
            raise RuntimeError("Buggy: a bug")

    chain = TierChain([Buggy(), WrappedStore()], [4 * T])
    with pytest.raises(RuntimeError, match="Buggy"):
        chain.put(tensor(0))
    assert [t.bytes for t in chain.stats.tiers] == [0, 0] and len(chain) == 0
    chain.close()


# ------------------------------------------------------------ failed moves
class Flaky(WrappedStore):
    """Refuses its first ``failures`` puts with ``StoreUnavailableError``."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def put(self, tensor: torch.Tensor) -> str:
        with self.lock:
            if self.failures > 0:
                self.failures -= 1
                raise StoreUnavailableError("Flaky: not now")
        return super().put(tensor)


def test_a_failed_move_leaves_the_tensor_where_it_was_and_is_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lower = Flaky(failures=2)
    chain = TierChain([tsh.open_store("memory://"), lower], [2 * T], put_wait_s=10)
    keys = [chain.put(tensor(i)) for i in range(2)]
    # No room: the put waits, the move fails (the tensor stays), the put then tries the
    # lower tier itself, which refuses too: the caller gets the error (the hooks would
    # keep that tensor in memory).
    with pytest.raises(StoreUnavailableError, match="Flaky"):
        chain.put(tensor(2))
    s = chain.stats
    assert s.move_failures == 1 and s.moves == 0
    assert [chain.tier_of(k) for k in keys] == [0, 0]
    assert len(chain) == 2 and s.tiers[0].bytes == 2 * T and s.tiers[1].bytes == 0
    deadline = time.monotonic() + 10  # the mover logs after it has told the waiting put
    while not any("from tier 0 to tier 1 failed" in r.message for r in caplog.records):
        assert time.monotonic() < deadline, "the failed move was not logged"
        time.sleep(0.01)
    for i, k in enumerate(keys):
        assert torch.equal(chain.get(k), tensor(i))
    # The next put wants room again: the move is retried (after its backoff) and works.
    keys.append(chain.put(tensor(3)))
    settle(chain)
    assert [chain.tier_of(k) for k in keys] == [1, 0, 0]
    assert chain.stats.moves == 1 and len(lower) == 1
    for k, i in zip(keys, [0, 1, 3], strict=True):
        assert torch.equal(chain.get(k), tensor(i))
    chain.close()


def test_planned_puts_fall_back_to_the_first_tier_while_the_lower_tier_is_down() -> None:
    """Rule 8 with the object store down from the second step on: the plan sends the
    oldest puts below, the lower tier refuses them, and they fall back to the first
    tier while it has room (no hooks fallback for those); the rest of the step takes
    Rule 2's path and the hooks keep what no tier takes. Nothing is lost."""
    lower = Flaky(failures=0)
    chain = TierChain([tsh.open_store("memory://"), lower], [4 * T], put_wait_s=0.5)
    pool_for(chain, 1)  # one I/O thread: the puts run in save order
    n = 8
    x = torch.randn(T // 4, requires_grad=True)
    hooks = tsh.offload(chain, min_bytes=0)
    with hooks:
        loss = sin_chain(x, n)
    hooks.flush()
    settle(chain)
    assert len(chain) == n and chain.stats.tiers[1].tensors >= n - 4
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, n)) and len(chain) == 0
    assert chain.stats.cycle_bytes == n * T
    lower.failures = 1 << 30  # down from now on: every put (and move) into it fails
    x.grad = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hooks:
            loss = sin_chain(x, n)
        hooks.flush()
    assert any("could not take a saved tensor" in str(w.message) for w in caught)
    s = chain.stats
    assert [t.tensors for t in s.tiers] == [4, 0] and s.tiers[0].bytes == 4 * T
    assert hooks.stats.fallbacks == n - 4  # only what the first tier had no room for
    assert s.plan_fallbacks == 1 and s.planned_puts == 0  # then the plan is set aside
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, n))
    assert len(chain) == 0 and [t.bytes for t in chain.stats.tiers] == [0, 0]
    assert chain.stats.cycle_bytes == 4 * T  # the next step is planned by what was held
    hooks.close()
    shutdown_pool(chain)
    chain.close()


# ------------------------------------------------------------------- races
class Gated(WrappedStore):
    """``put`` blocks until ``gate`` is set; ``entered`` is set when one is waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put(self, tensor: torch.Tensor) -> str:
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().put(tensor)


Pending = tuple[list[str], threading.Thread, list[BaseException]]


def _moving(chain: TierChain, lower: Gated) -> Pending:
    """Two tensors in a 2-T first tier, then a third put in a thread: the oldest starts
    moving and blocks in the lower tier's put. Returns the keys [oldest, second], the
    thread of the third put (it finishes once there is room) and its error, if any."""
    keys = [chain.put(tensor(i)) for i in range(2)]
    errors: list[BaseException] = []

    def third() -> None:
        try:
            keys.append(chain.put(tensor(2)))
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=third, daemon=True)
    t.start()
    assert lower.entered.wait(10), "no move started"
    return keys, t, errors


def test_a_get_during_a_move_reads_the_old_copy() -> None:
    lower = Gated()
    chain = TierChain([tsh.open_store("memory://"), lower], [2 * T])
    keys, third, errors = _moving(chain, lower)
    assert chain.tier_of(keys[0]) == 0  # the map changes only once the new copy exists
    assert torch.equal(chain.get(keys[0]), tensor(0))
    lower.gate.set()
    third.join(10)
    assert not errors
    settle(chain)
    assert chain.tier_of(keys[0]) == 1
    assert torch.equal(chain.get(keys[0]), tensor(0))
    chain.close()


def test_a_get_racing_the_end_of_a_move_reads_the_new_copy() -> None:
    """The get looked the key up in tier 0; the move finishes and deletes that copy
    before the read gets there: the get looks again and reads tier 1."""
    looked_up = threading.Event()
    moved = threading.Event()

    class SlowReads(WrappedStore):
        def get(self, key: str, *, device: Any = None) -> torch.Tensor:
            if threading.current_thread().name == "racing-get":
                looked_up.set()
                assert moved.wait(10)
            return super().get(key, device=device)

    upper, lower = SlowReads(), WrappedStore()
    chain = TierChain([upper, lower], [2 * T])
    keys = [chain.put(tensor(i)) for i in range(2)]
    got: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: got.append(chain.get(keys[0])), name="racing-get")
    reader.start()
    assert looked_up.wait(10)
    keys.append(chain.put(tensor(2)))  # moves keys[0] down and deletes its old copy
    settle(chain)
    assert chain.tier_of(keys[0]) == 1
    moved.set()
    reader.join(10)
    assert got and torch.equal(got[0], tensor(0))
    assert lower.gets == 1  # the second look read the new copy
    chain.close()


def test_a_delete_during_a_move_leaves_nothing_behind() -> None:
    lower = Gated()
    chain = TierChain([tsh.open_store("memory://"), lower], [2 * T])
    keys, third, errors = _moving(chain, lower)
    chain.delete(keys[0])  # the copy being moved: gone from the chain at once
    assert keys[0] not in chain
    with pytest.raises(KeyNotFoundError, match=keys[0]):
        chain.get(keys[0])
    third.join(10)  # the delete made room: the waiting put landed in tier 0
    assert not errors and chain.tier_of(keys[2]) == 0
    lower.gate.set()
    settle(chain)
    assert len(lower) == 0  # the copy the move made was deleted when it finished
    s = chain.stats
    assert s.tiers[1].bytes == 0 and s.tiers[0].bytes == 2 * T and len(chain) == 2
    chain.close()


def test_close_waits_for_the_moves_in_flight() -> None:
    lower = Gated()
    upper = WrappedStore()
    chain = TierChain([upper, lower], [2 * T])
    _, third, errors = _moving(chain, lower)
    closer = threading.Thread(target=chain.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # the move is still writing
    lower.gate.set()
    closer.join(10)
    assert not closer.is_alive()
    third.join(10)
    assert errors and isinstance(errors[0], StoreUnavailableError)  # closed while waiting
    assert not [t for t in threading.enumerate() if t.name.startswith("tsh-chain-mover")]
    with pytest.raises(StoreUnavailableError):
        upper.inner.put(torch.ones(1))  # the owned tiers were closed after the move
    with pytest.raises(StoreUnavailableError):
        chain.put(tensor(0))
    chain.close()  # idempotent


def test_a_waiting_put_is_woken_by_close() -> None:
    lower = Gated()
    chain = TierChain([tsh.open_store("memory://"), lower], [2 * T], close_timeout_s=10)
    _, third, errors = _moving(chain, lower)  # the third put waits for room
    opener = threading.Timer(0.2, lower.gate.set)
    opener.start()
    chain.close()
    third.join(10)
    opener.join()
    assert errors and isinstance(errors[0], tsh.StoreClosedError)


def test_concurrent_puts_gets_deletes_with_moves_lose_nothing(tmp_path: Path) -> None:
    budget = 6 * T
    chain = TierChain(
        [tsh.open_store("memory://"), tsh.open_store("memory://"), tsh.open_store(tmp_path)],
        [budget, 2 * budget],
        move_threads=3,
    )
    errors: list[BaseException] = []
    peaks: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peaks.append(chain.stats.tiers[0].bytes)
            time.sleep(0.001)

    def worker(seed: int) -> None:
        try:
            rng = random.Random(seed)
            mine: dict[str, torch.Tensor] = {}
            for _ in range(60):
                op = rng.random()
                if op < 0.55 or not mine:
                    t = torch.randn(rng.choice([256, 1024, 4096, 9000]))
                    mine[chain.put(t)] = t
                elif op < 0.8:
                    k = rng.choice(list(mine))
                    assert torch.equal(chain.get(k), mine[k])
                else:
                    k = rng.choice(list(mine))
                    chain.delete(k)
                    del mine[k]
            for k, t in mine.items():
                assert torch.equal(chain.get(k), t)
                chain.delete(k)
        except BaseException as e:
            errors.append(e)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    stop.set()
    watcher.join(5)
    assert not any(th.is_alive() for th in threads)
    if errors:
        raise errors[0]
    settle(chain)
    s = chain.stats
    assert len(chain) == 0 and [t.bytes for t in s.tiers] == [0, 0, 0]
    assert all(len(t) == 0 for t in chain.tiers)  # no copy left in any tier
    assert max(peaks) <= budget and s.tiers[0].peak_bytes <= budget
    assert s.tiers[1].peak_bytes <= 2 * budget
    assert s.moves > 0
    chain.close()


# --------------------------------------------------------------- lifecycle
def test_a_dropped_chain_stops_its_movers_and_closes_its_tiers(tmp_path: Path) -> None:
    chain = tsh.open_store([None, str(tmp_path / "disk")], budgets=[T])
    assert isinstance(chain, TierChain)
    temp_root = chain.tiers[0].url.removeprefix("file://")
    for i in range(3):
        chain.put(tensor(i))
    settle(chain)
    assert os.path.isdir(temp_root)
    ref = weakref.ref(chain)
    del chain
    gc.collect()
    assert ref() is None
    deadline = time.monotonic() + 10
    while any(t.name.startswith("tsh-chain-mover") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "movers still running"
        time.sleep(0.01)
    assert not os.path.exists(temp_root)  # the temporary tier was closed (and removed)


def test_a_forked_child_closing_the_chain_touches_nothing(tmp_path: Path) -> None:
    chain = tsh.open_store(["memory://", str(tmp_path / "disk")], budgets=[T])
    assert isinstance(chain, TierChain)
    keys = [chain.put(tensor(i)) for i in range(3)]
    settle(chain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            chain.close()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    for i, k in enumerate(keys):  # the parent's tiers are untouched and open
        assert torch.equal(chain.get(k), tensor(i))
    assert chain.put(tensor(7))
    chain.close()


# ------------------------------------------------------------------ opening
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, r"needs budgets=\[\.\.\.\], one size per tier but the last"),
        ({"budgets": ["1MiB", "2MiB"]}, r"2 tiers need 1 budget\(s\).*got 2"),
        ({"budgets": "1MiB"}, r"budgets must be a list of 1 size"),
        ({"budgets": ["1 parsec"]}, r"budgets\[0\]: expected a whole number of bytes"),
        ({"budgets": [1], "storage_options": [{}]}, r"a list of 2 dicts \(or None\)"),
        ({"budgets": [1], "compression": "zstd"}, r"no tier of the chain takes .* compression"),
        ({"budgets": [1], "move_threads": 0}, r"move_threads must be 1\.\.64"),
    ],
)
def test_open_store_refuses_bad_chains(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        tsh.open_store(["memory://", str(tmp_path)], **kwargs)
    assert not any(t.name.startswith("tsh-chain-mover") for t in threading.enumerate())


def test_open_store_refuses_a_chain_of_one_and_non_urls() -> None:
    with pytest.raises(ConfigError, match="two or more URLs"):
        tsh.open_store(["memory://"], budgets=[])
    with pytest.raises(ConfigError, match="tier 1 of the chain must be a URL"):
        tsh.open_store(["memory://", 42], budgets=[1])
    with pytest.raises(ConfigError, match="two or more TensorStores"):
        TierChain([tsh.open_store("memory://")], [])


def test_options_go_to_the_tiers_that_take_them(tmp_path: Path) -> None:
    chain = tsh.open_store(
        ["memory://", str(tmp_path / "disk")], budgets=["1MiB"], chunk_bytes="64KiB", codec="lz4"
    )
    assert isinstance(chain, TierChain)
    upper, lower = chain.tiers
    assert upper.chunk_bytes == lower.chunk_bytes == 64 * KiB  # type: ignore[attr-defined]
    assert upper.codec == lower.codec == "lz4"  # type: ignore[attr-defined]
    # One namespace name for the chain's Zarr tiers (inspect pairs them by it).
    assert upper.namespace == lower.namespace  # type: ignore[attr-defined]
    # The documented defaults (docs/config.md): two movers, puts wait up to 60 s.
    assert chain._core.movers.threads == 2 and chain._core.put_wait_s == 60.0
    chain.close()
    chain = tsh.open_store(
        ["memory://", str(tmp_path / "disk2")],
        budgets=["1MiB"], move_threads=4, put_wait_s=5, plan=False,
    )  # fmt: skip
    assert isinstance(chain, TierChain)
    assert chain._core.movers.threads == 4 and chain._core.put_wait_s == 5.0
    assert chain._core.plan.enabled is False
    chain.close()


def test_yaml_tier_options_fall_back_to_the_sections(tmp_path: Path) -> None:
    """A tier without storage_options gets the section's; one with its own keeps them."""
    seen: list[tuple[str, dict[str, Any]]] = []

    def factory(url: str, **options: Any) -> TensorStore:
        seen.append((url, options))
        return tsh.open_store("memory://")

    tsh.register_store("tshtestcapture", factory, clobber=True)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "store:\n  storage_options: {token: section}\n  tiers:\n"
        "    - {url: 'tshtestcapture://a', budget: 1MiB, storage_options: {token: own}}\n"
        "    - {url: 'tshtestcapture://b'}\n"
    )
    hooks = tsh.offload(config=cfg)
    assert seen == [
        ("tshtestcapture://a", {"token": "own"}),
        ("tshtestcapture://b", {"token": "section"}),
    ]
    hooks.close()


def test_a_store_object_tier_is_not_closed_by_the_chain(tmp_path: Path) -> None:
    mine = tsh.open_store(tmp_path / "mine")
    chain = tsh.open_store(["memory://", mine], budgets=[T])
    key = chain.put(tensor(1))
    chain.close()
    assert torch.equal(mine.get(mine.put(tensor(2))), tensor(2))  # still open
    mine.close()
    del key


def test_a_daemon_in_the_chain_passes_what_it_refuses_down(
    daemons: DaemonLauncher, tmp_path: Path
) -> None:
    """accelerator -> (host) -> the daemon's RAM and disk tiers -> a chain's next tier:
    when both of the daemon's quotas are full it refuses, and the chain writes below."""
    mib = 1 << 20
    slack = 64 * KiB  # per-tensor overhead + the disk tier's metadata (test_daemon_quota)
    d = daemons.start(
        "--memory-quota", str(2 * mib + slack), "--root", str(tmp_path / "root"),
        "--disk-quota", str(2 * mib + slack),
    )  # fmt: skip
    chain = tsh.open_store([d.url, str(tmp_path / "disk")], budgets=["1GiB"])
    assert isinstance(chain, TierChain)
    tensors = [torch.full((mib // 4,), float(i)) for i in range(6)]
    keys = [chain.put(t) for t in tensors]
    where = [chain.tier_of(k) for k in keys]
    assert where[:4] == [0] * 4 and where[4:] == [1, 1]  # 2 in RAM, 2 on the daemon's disk
    assert chain.stats.spills == 2
    for k, t in zip(keys, tensors, strict=True):
        assert torch.equal(chain.get(k), t)
    chain.close()


# --------------------------------------------------------------- with hooks
class Logged(WrappedStore):
    """Appends ``(name, key)`` to a log shared by several stores, for each get."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        super().__init__()
        self.name = name
        self.log = log

    def get(self, key: str, *, device: Any = None) -> torch.Tensor:
        with self.lock:
            self.log.append((self.name, key))
        return super().get(key, device=device)


def test_prefetch_reads_the_fast_tier_first() -> None:
    reads: list[tuple[str, str]] = []
    upper, lower = Logged("upper", reads), Logged("lower", reads)
    chain = TierChain([upper, lower], [4 * T])
    pool_for(chain, 1)  # one I/O thread: the read-ahead runs one read at a time
    n = 10
    x = torch.randn(T // 4, requires_grad=True)
    hooks = tsh.offload(chain, min_bytes=0, prefetch="1GiB")
    with hooks:
        loss = sin_chain(x, n)
    hooks.flush()
    settle(chain)
    assert [t.tensors for t in chain.stats.tiers] == [4, 6]
    reads.clear()  # the moves read tier 0
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, n))
    # Newest first: the four tensors the fast tier kept are the first four reads.
    assert [name for name, _ in reads] == ["upper"] * 4 + ["lower"] * 6
    assert hooks.stats.prefetch_hits == n
    assert len(chain) == 0
    # The next step: the oldest six go straight to tier 1 (Rule 8), the same reads.
    moves = chain.stats.moves
    x.grad = None
    with hooks:
        loss = sin_chain(x, n)
    hooks.flush()
    settle(chain)
    assert [t.tensors for t in chain.stats.tiers] == [4, 6] and chain.stats.moves == moves
    reads.clear()
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, n))
    assert [name for name, _ in reads] == ["upper"] * 4 + ["lower"] * 6
    hooks.close()
    shutdown_pool(chain)
    chain.close()


def test_host_budget_above_a_chain_makes_one_path(tmp_path: Path) -> None:
    """accelerator -> pinned host (host_budget) -> memory tier -> disk tier: the newest
    stay on the host, the next in the chain's first tier, the oldest on disk."""
    chain = tsh.open_store(["memory://", str(tmp_path / "disk")], budgets=[3 * T])
    assert isinstance(chain, TierChain)
    hooks = tsh.offload(chain, min_bytes=0, host_budget=2 * T)
    on_fake_accelerator(hooks)
    n = 10
    x = torch.randn(T // 4, requires_grad=True)
    with hooks:
        loss = sin_chain(x, n)
    hooks.flush()
    settle(chain)
    states = [r.state.name for r in hooks._pipeline.table.records()]
    assert states == ["STORED"] * 8 + ["HELD"] * 2  # two on the host, eight spilled
    assert [t.tensors for t in chain.stats.tiers] == [3, 5]
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, n))
    assert len(chain) == 0 and hooks.stats.fallbacks == 0
    hooks.close()
    chain.close()


# --------------------------------------------------------------- YAML + CLI
CHAIN_YAML = """
store:
  tiers:
    - {{url: "{upper}", budget: 48KiB}}
    - url: "{lower}"
  chunk_bytes: 16KiB
policy:
  min_bytes: 0
"""


def test_yaml_tiers_make_a_chain_for_offload(tmp_path: Path) -> None:
    cfg = tmp_path / "chain.yaml"
    lower = tmp_path / "disk"
    cfg.write_text(CHAIN_YAML.format(upper="memory://", lower=lower))
    hooks = tsh.offload(config=cfg)
    chain = hooks.store
    assert isinstance(chain, TierChain) and chain.budgets == (48 * KiB,)
    assert chain.tiers[1].chunk_bytes == 16 * KiB  # type: ignore[attr-defined]
    n = 12
    x = torch.randn(T // 4, requires_grad=True)
    with hooks:
        loss = sin_chain(x, n)
    hooks.flush()
    settle(chain)
    assert chain.stats.moves > 0
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, n))
    hooks.close()  # the hooks opened the chain: they close it
    with pytest.raises(StoreUnavailableError):
        chain.put(tensor(0))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("store:\n  tiers:\n    - {url: 'memory://'}\n    - {url: 'memory://'}\n",
         r"cfg.yaml:\d+: store: tiers\[0\].budget is missing: every tier but the last"),
        ("store:\n  url: memory://\n  tiers:\n    - {url: 'memory://', budget: 1}\n"
         "    - {url: 'memory://'}\n", r"url and tiers are exclusive"),
        ("store:\n  tiers:\n    - {url: 'memory://', budget: 1}\n"
         "    - {url: 'memory://', budget: 2}\n", r"tiers\[1\] is the last tier and takes no"),
        ("store:\n  tiers:\n    - {url: 'memory://', budget: 1}\n", r"two or more tiers"),
        ("store:\n  tiers:\n    - {url: 'memory://', budget: 1Gb/s}\n    - {url: 'memory://'}\n",
         r"cfg.yaml:3: store.tiers\[0\].budget: expected a whole number of bytes"),
        ("store:\n  tiers:\n    - {url: 'nope://x', budget: 1}\n    - {url: 'memory://'}\n",
         r"store.tiers\[0\].url: unknown URL scheme 'nope'"),
        ("store:\n  tiers:\n    - {url: 'memory://', budget: 1, speed: fast}\n"
         "    - {url: 'memory://'}\n",
         r"unknown key 'speed'; allowed keys here: url, budget, storage_options"),
    ],
)  # fmt: skip
def test_yaml_tier_errors_name_the_file_and_field(tmp_path: Path, text: str, match: str) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=match):
        tsh.load_config(cfg)


def test_the_example_chain_config_loads_and_round_trips() -> None:
    import yaml

    from tensorstore_hooks.config._settings import config_from_dict, dump_config

    cfg = tsh.load_config(Path(__file__).resolve().parents[2] / "configs" / "chain.yaml")
    assert len(cfg.store.tiers) == 2 and cfg.store.tiers[0].budget == 64 << 30
    again = config_from_dict(yaml.safe_load(dump_config(cfg, redact=False)))
    assert again.to_dict() == cfg.to_dict()
    secret = config_from_dict(
        {"store": {"tiers": [{"url": "memory://", "budget": 1},
                             {"url": "s3://b/p", "storage_options": {"secret": "s3cr3t"}}]}}
    )  # fmt: skip
    shown = dump_config(secret)  # a secret in a tier's options is masked when printed
    assert "s3cr3t" not in shown and "secret: '***'" in shown


def test_inspect_shows_the_chain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    upper, lower = f"file://{tmp_path / 'nvme'}", f"file://{tmp_path / 'disk'}"
    chain = tsh.open_store([upper, lower], budgets=[2 * T])
    assert isinstance(chain, TierChain)
    for i in range(5):
        chain.put(tensor(i))
    settle(chain)
    try:
        assert cli_main(["inspect", upper, lower]) == 0
        out = capsys.readouterr().out
        assert "tier chain of 2 stores, fastest first" in out
        assert f"tier 0: {upper}: 2 tensors, 32.00 KiB" in out
        assert f"tier 1: {lower}: 3 tensors, 48.00 KiB" in out
        ns = chain.tiers[0].namespace  # type: ignore[attr-defined]
        assert f"namespace {ns}: tier 0 2 (32.00 KiB), tier 1 3 (48.00 KiB)" in out
        assert "--- tier 1 ---" in out
        # The same from a config: budgets shown.
        cfg = tmp_path / "chain.yaml"
        cfg.write_text(CHAIN_YAML.format(upper=upper, lower=lower))
        assert cli_main(["inspect", "--config", str(cfg)]) == 0
        assert f"tier 0: {upper}, budget 48.00 KiB: 2 tensors" in capsys.readouterr().out
        assert cli_main(["inspect", "--json", upper, lower]) == 0
        listing = json.loads(capsys.readouterr().out)
        assert [t["totals"]["tensors"] for t in listing["tiers"]] == [2, 3]
        # Misuse: both, neither, a memory tier.
        assert cli_main(["inspect", "--config", str(cfg), upper]) == 1
        assert "give URLs or --config, not both" in capsys.readouterr().err
        assert cli_main(["inspect"]) == 1
        assert "give a store URL" in capsys.readouterr().err
        assert cli_main(["inspect", "memory://", lower]) == 1
        assert "private to the process" in capsys.readouterr().err
    finally:
        chain.close()
