"""The host tier wired into the pipeline: NOTE [ Host tier wiring ].

What is held, what spills and in which order, the cap, reads back through the tier,
``host`` rules in the same pool, and the corners (retain_graph, several graphs,
in-place changes, failed spills, timeouts) — on CPU through the device stager's seam
(``tests/fake_accelerator.py``: CPU tensors treated as accelerator tensors; the
conftest fixture fails any test that breaks a stream or event rule), and the
same scenarios with real CUDA tensors in the ``cuda``-marked tests at the end.
Gradients are always compared with ``torch.equal`` against a run without hooks.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks.pipeline._host_tier import round_up
from tensorstore_hooks.pipeline._iopool import shutdown_pool
from tensorstore_hooks.pipeline._records import State
from tensorstore_hooks.testing import WrappedStore
from tests.fake_accelerator import CpuAsAccelerator, on_fake_accelerator
from tests.pipeline.test_pipeline import GatedStore, sin_chain
from tests.pipeline.test_pipeline import chain_grad as reference_grad

KiB = 1024
T = 16 * KiB  # every saved tensor of sin_chain below: 4096 float32
CAP = 4 * T  # room for four of them


def forward(hooks: tsh.OffloadHooks, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A leaf and the loss of ``n`` saves of T bytes each under ``hooks``, written."""
    x = torch.randn(T // 4, requires_grad=True)
    with hooks:
        loss = sin_chain(x, n)
    hooks.flush()
    return x, loss


def states(hooks: tsh.OffloadHooks) -> list[str]:
    """The state of every live record, in pack order."""
    return [r.state.name for r in hooks._pipeline.table.records()]


def tier_of(hooks: tsh.OffloadHooks) -> Any:
    tier = hooks._pipeline.stager.tier
    assert tier is not None
    return tier


def offload(store: Any = "memory://", ops: CpuAsAccelerator | None = None, **kw: Any) -> Any:
    kw.setdefault("min_bytes", 0)
    kw.setdefault("host_budget", CAP)
    hooks = tsh.offload(store, **kw)
    on_fake_accelerator(hooks, ops)
    return hooks


# ---------------------------------------------------------------- what is held
def test_newest_are_held_oldest_spill_and_gradients_are_equal() -> None:
    store = WrappedStore()
    hooks = offload(store)
    x, loss = forward(hooks, 10)
    # Ten tensors, room for four: the six oldest went to the store, in pack order.
    assert states(hooks) == ["STORED"] * 6 + ["HELD"] * 4
    assert hooks.stats.tensors_spilled == 6 and hooks.stats.bytes_spilled == 6 * T
    assert store.puts == 6 and hooks.stats.bytes_written == 6 * T
    tier = tier_of(hooks)
    assert tier.held_bytes == CAP and tier.used_bytes <= CAP
    assert hooks.stats.tensors_offloaded == 10  # all left the "device"
    loss.backward()
    assert torch.equal(x.grad, reference_grad(x, 10))
    assert 0 < hooks.stats.peak_host_tier_bytes <= CAP
    assert tier.held_keys() == [] and len(store) == 0  # backward freed everything
    assert "host tier peak" in hooks.stats.summary()
    shutdown_pool(store)


def test_nothing_is_written_when_everything_fits() -> None:
    store = WrappedStore()
    hooks = offload(store, host_budget=16 * T)
    x, loss = forward(hooks, 10)
    assert states(hooks) == ["HELD"] * 10
    assert store.puts == 0 and hooks.stats.tensors_spilled == 0
    loss.backward()
    assert torch.equal(x.grad, reference_grad(x, 10))
    assert store.gets == 0 and hooks.stats.bytes_read == 0
    # Backward's read-ahead brought held tensors back from the tier, newest first.
    assert hooks.stats.prefetch_hits > 0
    shutdown_pool(store)


def test_the_cap_holds_through_a_step_and_reads_borrow_within_it() -> None:
    ops = CpuAsAccelerator()
    hooks = offload(ops=ops, prefetch="1MiB")
    x, loss = forward(hooks, 20)
    loss.backward()
    assert torch.equal(x.grad, reference_grad(x, 20))
    tier = tier_of(hooks)
    # Every host buffer of the pipeline came from the tier, never more than the cap.
    assert tier.peak_bytes <= CAP and hooks.stats.peak_host_tier_bytes <= CAP
    # ... its slabs (NOTE [ Pinned slabs ]): all the pinned memory allocated.
    assert ops.allocated_bytes == tier.used_bytes <= CAP
    assert hooks.stats.pinned_allocations == ops.allocations


def test_a_tensor_larger_than_the_cap_is_written_from_the_device() -> None:
    store = WrappedStore()
    hooks = offload(store, host_budget=T)
    x = torch.randn(T // 4, requires_grad=True)
    big = torch.randn(4 * T // 4, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 3) + (big * 2).sin().sum()  # `big * 2` saved by sin: 4 T
    hooks.flush()
    tier = tier_of(hooks)
    assert tier.peak_bytes <= T
    # The big one went straight to the store; the small ones took turns in the tier.
    assert store.puts == 1 + hooks.stats.tensors_spilled
    assert hooks.stats.bytes_written == 4 * T + hooks.stats.bytes_spilled
    loss.backward()
    assert torch.equal(big.grad, torch.full_like(big, 2) * (big.detach() * 2).cos())
    assert torch.equal(x.grad, reference_grad(x, 3))
    shutdown_pool(store)


def test_buffers_are_recycled_across_steps() -> None:
    ops = CpuAsAccelerator()
    hooks = offload(ops=ops)
    x = torch.randn(T // 4, requires_grad=True)
    allocations = []
    for _ in range(4):
        with hooks:
            loss = sin_chain(x, 10)
        hooks.flush()
        loss.backward()
        del loss
        allocations.append(ops.allocations)
    assert allocations[1] == allocations[3], allocations  # no allocation after step 1
    assert allocations[0] <= CAP // round_up(T) + 2  # the tier's slots, a read or two


# ---------------------------------------------------------------- host rules
class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu()).relu().sum()


def test_host_rules_share_the_pool_and_its_cap() -> None:
    torch.manual_seed(0)
    model = TwoLayers()
    x = torch.randn(256, 64)  # saved activations of 64 KiB
    ref = torch.autograd.grad(model(x), list(model.parameters()))
    store = WrappedStore()
    hooks = tsh.offload(
        store,
        model=model,
        min_bytes=0,
        host_budget="96KiB",
        rules=[{"module": "a", "action": "host"}],
    )
    on_fake_accelerator(hooks)
    with hooks:
        loss = model(x)
    hooks.flush()
    stats = hooks.stats
    assert stats.tensors_host == 1  # `a`'s input, counted as the rule decided
    assert stats.tensors_offloaded >= 2
    records = hooks._pipeline.table.records()
    assert [r.host_rule for r in records].count(True) == 1  # a record in the tier
    # Host-rule tensors sit in the same tier: they are records, and they spill too.
    assert tier_of(hooks).peak_bytes <= 96 * KiB
    assert stats.tensors_spilled >= 1
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert all(torch.equal(g, r) for g, r in zip(grads, ref, strict=True))
    shutdown_pool(store)


# ---------------------------------------------------------------- autograd corners
def test_retain_graph_reads_held_and_spilled_tensors_twice() -> None:
    hooks = offload()
    x, loss = forward(hooks, 8)
    (g1,) = torch.autograd.grad(loss, x, retain_graph=True)
    assert states(hooks) == ["STORED"] * 4 + ["HELD"] * 4  # nothing freed yet
    (g2,) = torch.autograd.grad(loss, x)
    ref = reference_grad(x, 8)
    assert torch.equal(g1, ref) and torch.equal(g2, ref)


def test_a_second_graph_spills_the_first_graphs_held_tensors() -> None:
    # Gradient accumulation: forward, forward, backward, backward.
    store = WrappedStore()
    hooks = offload(store)
    x = torch.randn(T // 4, requires_grad=True)
    y = torch.randn(T // 4, requires_grad=True)
    with hooks:
        loss_x = sin_chain(x, 4)
        loss_y = sin_chain(y, 4)
    hooks.flush()
    # The tier holds y's four; x's four, held first, spilled oldest first.
    assert states(hooks) == ["STORED"] * 4 + ["HELD"] * 4
    loss_y.backward()
    loss_x.backward()
    assert torch.equal(x.grad, reference_grad(x, 4))
    assert torch.equal(y.grad, reference_grad(y, 4))
    assert len(store) == 0 and tier_of(hooks).held_keys() == []
    shutdown_pool(store)


def test_device_budget_and_host_budget_together() -> None:
    hooks = offload(device_budget=3 * T)
    x = torch.randn(T // 4, requires_grad=True)
    grads = []
    for _ in range(3):
        x.grad = None
        with hooks:
            loss = sin_chain(x, 10)
        hooks.flush()
        if _ > 0:  # planned: the newest stay on the "device", the rest go to the tier
            assert hooks.stats.per_rule["device_budget"].tensors >= 1
            assert "HELD" in states(hooks)
        loss.backward()
        grads.append(x.grad.clone())
    ref = reference_grad(x, 10)
    assert all(torch.equal(g, ref) for g in grads)


@pytest.mark.parametrize("lazy", [False, True], ids=["sync-copies", "async-copies"])
def test_in_place_change_of_a_held_tensor_raises_torchs_error(lazy: bool) -> None:
    hooks = offload(ops=CpuAsAccelerator(lazy=lazy, polls=1000))
    x = torch.randn(T // 4, requires_grad=True)
    with hooks:
        h = x * 1
        loss = (h.sin() * 2).sum()  # sin saves h
    h.add_(1)  # after pack; with lazy copies before its copy to host ran
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_copy_that_completes_after_an_in_place_change_is_dirty_and_freed() -> None:
    # The copy to host reads the bytes when it runs: a change before that makes the
    # host copy worthless. The record turns DIRTY and its buffer goes back at once.
    hooks = offload(ops=CpuAsAccelerator(lazy=True, polls=2))
    x = torch.randn(T // 4, requires_grad=True)
    with hooks:
        h = x * 1
        loss = h.sin().sum()  # sin saves h; its copy is still "running"
        h.add_(1)
        loss = loss + (x * 3).sin().sum()  # the next pack reaps the finished copy
    assert states(hooks)[0] == "DIRTY"
    tier = tier_of(hooks)
    assert len(tier.held_keys()) == 1  # only the second tensor is held
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_async_copies_keep_the_device_tensor_until_they_complete() -> None:
    # A copy that has not completed leaves the record holding the device tensor
    # (unpack then returns it as is); a spill waits for the copy before writing.
    # (A copy window wide enough for all ten: NOTE [ Copy window ] bounds them otherwise.)
    ops = CpuAsAccelerator(lazy=True, polls=1000)
    store = WrappedStore()
    hooks = offload(store, ops=ops, max_inflight="1MiB")
    x, loss = forward(hooks, 10)
    recs = hooks._pipeline.table.records()
    assert [r.state for r in recs] == [State.STORED] * 6 + [State.HELD] * 4
    assert all(r.source is not None for r in recs[6:])  # copies still "running"
    loss.backward()
    assert torch.equal(x.grad, reference_grad(x, 10))
    shutdown_pool(store)


# ---------------------------------------------------------------- failures
class BrokenWrites(WrappedStore):
    def put(self, tensor: torch.Tensor) -> str:
        raise OSError(28, "No space left on device")


def test_a_failed_spill_keeps_the_tensor_in_memory() -> None:
    store = BrokenWrites()
    hooks = offload(store)
    x = torch.randn(T // 4, requires_grad=True)
    with pytest.warns(UserWarning, match="could not take a saved tensor"):
        with hooks:
            loss = sin_chain(x, 10)
        hooks.flush()
        loss.backward()
    assert hooks.stats.fallbacks == 6 and hooks.stats.tensors_spilled == 6
    assert torch.equal(x.grad, reference_grad(x, 10))
    # The spilled tensors' buffers went back to the tier (the cap still holds).
    assert tier_of(hooks).peak_bytes <= CAP
    shutdown_pool(store)


def test_no_room_in_time_writes_from_the_device() -> None:
    # Spills stuck behind a store that does not answer: pack waits at most
    # hold_timeout_s, then writes the tensor from the device instead of hanging.
    # The wait is read_deadline_s (docs/config.md); shortened here to keep the test fast.
    assert offload(read_deadline_s=7)._pipeline.stager.hold_timeout_s == 7
    store = GatedStore()
    hooks = offload(store, host_budget=2 * T)
    hooks._pipeline.stager.hold_timeout_s = 0.05
    x = torch.randn(T // 4, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 5)
    assert hooks.stats.pack_stall_s >= 0.05
    assert states(hooks).count("HELD") <= 2
    store.gate.set()
    hooks.flush()
    loss.backward()
    assert torch.equal(x.grad, reference_grad(x, 5))
    shutdown_pool(store)


def test_freeing_the_graph_gives_every_buffer_back() -> None:
    store = WrappedStore()
    hooks = offload(store)
    _x, loss = forward(hooks, 10)
    del loss
    tier = tier_of(hooks)
    assert tier.held_keys() == [] and tier.spilling_keys() == []
    assert len(store) == 0
    hooks.close()
    assert tier.used_bytes == 0  # closing drops the idle buffers too
    shutdown_pool(store)


def test_graph_freed_while_its_spill_is_written_gives_the_buffer_back() -> None:
    # A record freed while its spill is being written: the write sees it unwanted,
    # deletes what it wrote and its buffer returns to the tier (else the cap would
    # shrink for good and pack would stall forever).
    store = GatedStore()
    hooks = offload(store, writer_threads=2)
    hooks._pipeline.stager.hold_timeout_s = 0.05
    x = torch.randn(T // 4, requires_grad=True)
    y = torch.randn(T // 4, requires_grad=True)
    with hooks:
        loss_x = sin_chain(x, 1)  # one record, held first
        # The fourth of y's packs spills x's record, whose write blocks at the gate;
        # that pack then times out waiting for the room and writes directly.
        loss_y = sin_chain(y, 4)
    tier = tier_of(hooks)
    first = hooks._pipeline.table.records()[0]
    assert tier.spilling_keys() == [first]
    opener = threading.Timer(0.2, store.gate.set)
    opener.start()
    del loss_x  # waits for the write under way, which deletes what it wrote
    opener.join()
    hooks.flush()
    assert first.state == State.FREED
    assert tier.spilling_keys() == []
    assert len(tier.held_keys()) == 3
    loss_y.backward()
    assert torch.equal(y.grad, reference_grad(y, 4))
    assert len(store) == 0 and tier.held_keys() == []
    shutdown_pool(store)


def test_a_buffer_being_read_is_not_given_back_until_the_read_ends() -> None:
    # Rule 4 of NOTE [ Host tier wiring ]: a held record spilled and written while its
    # copy back to the device still reads its buffer keeps the buffer until the copy
    # ends; giving it back earlier would let the next pack overwrite it mid-copy.
    entered, gate = threading.Event(), threading.Event()

    class SlowCopies(CpuAsAccelerator):
        def to_device(self, *args: Any, **kw: Any) -> Any:
            entered.set()
            assert gate.wait(30)
            return super().to_device(*args, **kw)

    hooks = offload(ops=SlowCopies())
    x = torch.randn(T // 4, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 2)
    pipeline = hooks._pipeline
    stager = pipeline.stager
    rec = pipeline.table.records()[0]
    out: list[Any] = []
    reader = threading.Thread(target=lambda: out.append(stager.from_host(rec)))
    reader.start()
    assert entered.wait(30)
    # What a finished spill or a freed graph does: the record lets go of its copy.
    stager.give_back(rec, pipeline.table.copies.take(rec))
    assert rec in tier_of(hooks).held_keys()  # still lent to the running copy
    gate.set()
    reader.join(30)
    assert rec not in tier_of(hooks).held_keys()
    assert torch.equal(out[0][0], x.detach())
    del loss


def test_without_a_host_budget_staging_goes_through_the_pool() -> None:
    # host_budget 0: each tensor stays in a pooled buffer only while it is written.
    ops = CpuAsAccelerator(lazy=True)
    store = WrappedStore()
    hooks = tsh.offload(store, min_bytes=0)
    stager = on_fake_accelerator(hooks, ops)
    assert stager.tier is None
    x, loss = forward(hooks, 6)
    assert states(hooks) == ["STORED"] * 6 and store.puts == 6
    assert ops.to_host_calls == 6
    loss.backward()
    assert torch.equal(x.grad, reference_grad(x, 6))
    shutdown_pool(store)


def test_the_pipeline_line_and_the_debug_log_name_the_host_tier(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hooks = offload()
    assert "host_budget=64KiB" in hooks._pipeline.describe()
    assert "host_budget=none" in tsh.offload("memory://")._pipeline.describe()
    x = torch.randn(T // 4, requires_grad=True)
    with caplog.at_level(logging.DEBUG, logger="tensorstore_hooks"):
        with hooks:
            loss = sin_chain(x, 5)
        hooks.flush()
    debug = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("pack: host tier") for m in debug) == 5
    assert sum(m.startswith("host tier: spilling record") for m in debug) == 1
    del loss


def test_router_warns_once_per_topic() -> None:
    # What the Paddle hooks use for their one host_budget warning (GPU-only path).
    hooks = offload()
    router = hooks.router
    assert router.host_tier
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        router.warn_once("topic", "tensorstore-hooks: once")
        router.warn_once("topic", "tensorstore-hooks: once")
    assert [str(w.message) for w in seen] == ["tensorstore-hooks: once"]


# ---------------------------------------------------------------- real CUDA
cuda = [pytest.mark.cuda]


class CudaChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x).relu()
        return x.sum()


def _cuda_grads(model: nn.Module, x: torch.Tensor, hooks: Any = None) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    if hooks is None:
        model(x).backward()
    else:
        with hooks:
            loss = model(x)
        hooks.flush()
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.cuda
def test_cuda_host_tier_spills_oldest_and_gradients_are_equal() -> None:
    torch.manual_seed(0)
    model = CudaChain().cuda()
    x = torch.randn(512, 256, device="cuda")  # 512 KiB activations
    ref = _cuda_grads(model, x)
    store = WrappedStore()
    hooks = tsh.offload(store, min_bytes=0, host_budget="2MiB")
    for _ in range(3):
        grads = _cuda_grads(model, x, hooks)
        assert all(torch.equal(g, r) for g, r in zip(grads, ref, strict=True))
    tier = tier_of(hooks)
    assert hooks.stats.tensors_spilled > 0 and store.puts >= hooks.stats.tensors_spilled
    assert tier.peak_bytes <= 2 << 20
    assert tier._slabs and all(slab.buf.is_pinned() for slab in tier._slabs)
    shutdown_pool(store)


@pytest.mark.cuda
def test_cuda_pinned_memory_is_bounded_by_host_budget() -> None:
    # The promise against torch's save_on_cpu: pinned memory never above the budget,
    # however much the step saves, and no pinned allocation after the first step.
    torch.manual_seed(0)
    model = CudaChain().cuda()
    x = torch.randn(2048, 256, device="cuda")  # 2 MiB per activation, ~32 MiB saved
    ref = _cuda_grads(model, x)
    hooks = tsh.offload("memory://", min_bytes=0, host_budget="8MiB")
    allocations = []
    for _ in range(3):
        grads = _cuda_grads(model, x, hooks)
        assert all(torch.equal(g, r) for g, r in zip(grads, ref, strict=True))
        allocations.append(hooks.stats.pinned_allocations)
    assert hooks.stats.peak_host_tier_bytes <= 8 << 20
    assert allocations[1] == allocations[2], allocations


@pytest.mark.cuda
def test_cuda_host_rules_are_capped_by_host_budget() -> None:
    torch.manual_seed(0)
    model = CudaChain().cuda()
    x = torch.randn(2048, 256, device="cuda")
    ref = _cuda_grads(model, x)
    hooks = tsh.offload("memory://", min_bytes=0, host_budget="4MiB", default="host")
    grads = _cuda_grads(model, x, hooks)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref, strict=True))
    assert hooks.stats.tensors_host > 0 and hooks.stats.tensors_spilled > 0
    assert hooks.stats.peak_host_tier_bytes <= 4 << 20


@pytest.mark.cuda
def test_cuda_failed_spill_comes_back_on_the_device() -> None:
    torch.manual_seed(0)
    model = CudaChain().cuda()
    x = torch.randn(512, 256, device="cuda")
    ref = _cuda_grads(model, x)
    store = BrokenWrites()
    hooks = tsh.offload(store, min_bytes=0, host_budget="1MiB")
    with pytest.warns(UserWarning, match="could not take a saved tensor"):
        grads = _cuda_grads(model, x, hooks)
    assert hooks.stats.fallbacks > 0
    assert all(torch.equal(g, r) for g, r in zip(grads, ref, strict=True))
    shutdown_pool(store)


# ---------------------------------------------------------------- mixed load
class MixedSizes(nn.Module):
    """Saved tensors of several sizes (4 KiB .. 64 KiB), some under a ``host`` rule."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(w, w) for w in (16, 64, 32, 128, 8, 96))
        self.host = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = self.host(x[:, :8]).tanh().sum()
        for block in self.blocks:
            w = block.in_features
            h = x[:, :w] if x.shape[1] >= w else x.repeat(1, -(-w // x.shape[1]))[:, :w]
            total = total + block(h).sin().sum()
        return total


@pytest.mark.parametrize("lazy", [False, True], ids=["sync-copies", "async-copies"])
def test_mixed_sizes_many_steps_stay_within_the_cap_and_exact(lazy: bool) -> None:
    # Several steps of a model saving tensors of six sizes, one larger than the cap,
    # with host rules in the pool, two micro-batches per step and async copies: the
    # gradients match, the cap holds, and nothing is left behind after each step.
    torch.manual_seed(0)
    model = MixedSizes()
    batches = [torch.randn(128, 128) for _ in range(2)]

    def grads(hooks: Any = None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        losses = []
        for x in batches:
            if hooks is None:
                losses.append(model(x))
            else:
                with hooks:
                    losses.append(model(x))
        for loss in losses:
            loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = grads()
    store = WrappedStore()
    cap = 48 * KiB  # the 128-wide block saves 64 KiB tensors: larger than the cap
    hooks = tsh.offload(
        store,
        model=model,
        min_bytes=0,
        host_budget=cap,
        prefetch="48KiB",
        rules=[{"module": "host", "action": "host"}],
    )
    on_fake_accelerator(hooks, CpuAsAccelerator(lazy=lazy, polls=3))
    tier = tier_of(hooks)
    for _ in range(4):
        out = grads(hooks)
        assert all(torch.equal(g, r) for g, r in zip(out, ref, strict=True))
        hooks.flush()
        assert tier.held_keys() == [] and tier.spilling_keys() == [] and len(store) == 0
    assert tier.peak_bytes <= cap and hooks.stats.peak_host_tier_bytes <= cap
    assert hooks.stats.tensors_spilled > 0 and hooks.stats.tensors_host > 0
    # The 64 KiB tensors never fit: written from the "device", beside the spills.
    assert hooks.stats.bytes_written >= hooks.stats.bytes_spilled + 4 * 2 * 64 * KiB
    shutdown_pool(store)


# --------------------------------------------------- pinned slabs (NOTE [ Pinned slabs ])
def test_a_host_budget_holds_its_bytes_as_tensor_bytes() -> None:
    """8 MiB of budget, 192 KiB tensors: 42 held (98%); power-of-two buffers (256 KiB
    each) held 32 (75%)."""
    budget = 8 << 20
    n = 48 << 10  # float32: 192 KiB per saved tensor
    ops = CpuAsAccelerator()
    hooks = offload(ops=ops, host_budget=budget)
    x = torch.randn(n, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 60)
    hooks.flush()
    held = [r for r in hooks._pipeline.table.records() if r.state.name == "HELD"]
    assert sum(r.nbytes for r in held) >= 0.97 * budget
    assert ops.allocated_bytes <= budget  # every pinned byte within the budget
    loss.backward()
    assert torch.equal(x.grad, reference_grad(x, 60))
