"""The CUDA path on CPU: the real staging code over a fake ``torch.cuda``.

``tests/fake_cuda.py`` runs the library's own ``copy_to_host`` / ``copy_to_device`` /
``consume`` on CPU tensors, records every stream, event, copy, wait and
``record_stream`` call, and checks the stream and event rules of NOTE [ Stream
ordering ] (stated in ``docs/life-of-a-saved-tensor.md``, "Streams and events"); a
broken rule both shows in ``fake.violations`` and corrupts data (NaN) as a GPU would.
One test (or group) per finding of the CUDA audit, numbered as the rules are, then
the fake shown to catch deliberately broken orderings, then the same scenarios on a
real GPU (``cuda``-marked). Gradients are compared with ``torch.equal``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks._codec import span_of
from tensorstore_hooks.pipeline import _staging
from tensorstore_hooks.pipeline._device import DeviceStager
from tensorstore_hooks.pipeline._iopool import on_io_thread, pool_for, shutdown_pool
from tensorstore_hooks.pipeline._records import ReadAhead
from tensorstore_hooks.pipeline._staging import Loaded, StreamSet, TorchCuda
from tensorstore_hooks.testing import WrappedStore
from tests.fake_accelerator import CpuAsAccelerator, expect_broken, on_fake_accelerator
from tests.pipeline.test_pipeline import chain_grad, sin_chain

KiB = 1 << 10
T = 16 * KiB  # every tensor sin_chain saves below: 4096 float32


def fake_hooks(
    store: Any = "memory://", ops: CpuAsAccelerator | None = None, **kw: Any
) -> tuple[tsh.OffloadHooks, CpuAsAccelerator]:
    """Hooks over ``store`` that treat CPU tensors as CUDA ones, through the fake."""
    kw.setdefault("min_bytes", 0)
    hooks = tsh.offload(store, **kw)
    ops = ops if ops is not None else CpuAsAccelerator()
    on_fake_accelerator(hooks, ops)
    return hooks, ops


def run_chain(hooks: tsh.OffloadHooks, n: int, numel: int = T // 4) -> torch.Tensor:
    """Forward ``n`` saves under ``hooks``, backward; returns the leaf (its grad checked)."""
    x = torch.randn(numel, requires_grad=True)
    with hooks:
        loss = sin_chain(x, n)
    hooks.flush()
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, n))
    return x


ROUTES = {
    "pool": {},  # no host_budget: staged through a pooled pinned buffer, written, read back
    "tier": {"host_budget": "1MiB"},  # held in the host tier, read back from it
    "host_rule": {"default": "host"},  # a `host` rule without a tier: a pinned copy
}


# ---------------------------------------------------------------- 1: conj and neg bits
def conj_loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # mm saves ``w.mH``: a view with the conj bit; ``.imag`` of a conj view has the neg bit
    out = x @ w.mH
    return out.abs().sum() + (out.conj().imag * 2).exp().sum()


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_1_conj_and_neg_views_come_back_exact(route: str) -> None:
    """Rule 6: copies move bytes, the bits come back as view flags (pytorch#146286)."""
    x = torch.randn(64, 32, dtype=torch.complex64, requires_grad=True)
    w = torch.randn(48, 32, dtype=torch.complex64, requires_grad=True)
    ref = torch.autograd.grad(conj_loss(x, w), [x, w])
    hooks, ops = fake_hooks(ops=CpuAsAccelerator(lazy=True, polls=3), **ROUTES[route])
    with hooks:
        loss = conj_loss(x, w)
    hooks.flush()
    grads = torch.autograd.grad(loss, [x, w])
    assert all(torch.equal(g, r) for g, r in zip(grads, ref, strict=True))
    assert ops.to_host_calls + hooks.stats.tensors_host > 0 and ops.violations == []


# ------------------------------------------------ 2: writes from the device, ordered
class KindsStore(WrappedStore):
    """Records which memory each ``put`` reads (the fake's ``pinned``/``pageable``/
    ``device``); ``gate`` (when given) holds every put until it is set."""

    def __init__(self, ops: CpuAsAccelerator, gate: threading.Event | None = None) -> None:
        super().__init__()
        self.fake = ops.fake
        self.kinds: list[str] = []
        self.gate = gate

    def put(self, tensor: torch.Tensor) -> str:
        self.kinds.append(self.fake.kind(tensor))
        if self.gate is not None:
            assert self.gate.wait(30)
        return super().put(tensor)


def test_2_a_tensor_larger_than_host_budget_is_copied_out_on_the_copy_stream() -> None:
    """Rule 8: under ``torch.cuda.stream(s)`` forward, the big tensor's bytes reach the
    store through the stager's copy stream, after an event on ``s`` (never read from
    the device by an I/O thread)."""
    ops = CpuAsAccelerator(lazy=True, polls=2)
    store = KindsStore(ops)
    hooks, _ = fake_hooks(store, ops, host_budget=T)
    x = torch.randn(T // 4, requires_grad=True)
    big = torch.randn(T, requires_grad=True)  # saved as `big * 2`: 4 T, over the budget
    with ops.fake.use_stream(ops.fake.user_stream("forward")), hooks:
        loss = sin_chain(x, 3) + (big * 2).sin().sum()
    hooks.flush()
    assert store.kinds and "device" not in store.kinds, store.kinds
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, 3))
    assert torch.equal(big.grad, 2 * (big.detach() * 2).cos())
    assert ops.violations == []
    shutdown_pool(store)


def test_2_a_hold_that_timed_out_is_copied_out_on_the_copy_stream() -> None:
    gate = threading.Event()
    ops = CpuAsAccelerator()
    store = KindsStore(ops, gate)
    hooks, _ = fake_hooks(store, ops, host_budget=2 * T)
    hooks._pipeline.stager.hold_timeout_s = 0.05  # spills stuck at the gate: no room in time
    x = torch.randn(T // 4, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 5)
    gate.set()
    hooks.flush()
    assert hooks.stats.pack_stall_s >= 0.05
    assert "device" not in store.kinds, store.kinds
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, 5))
    assert ops.violations == []
    shutdown_pool(store)


# ---------------------------------------------------------- 3: an unpack racing fill
def test_3_an_unpack_that_claims_a_read_being_submitted_gets_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two threads unpacking at once (a model over two devices): one starts the read
    ahead, the other claims that read before its submission returned. It must get
    the read's result, not wait forever on a future nobody completes."""
    store = WrappedStore()
    hooks = tsh.offload(store, min_bytes=0, prefetch="1MiB")
    router, prefetcher = hooks.router, hooks._pipeline.prefetcher
    x = torch.randn(1024)
    handles = [router.pack(x * i) for i in range(1, 4)]
    hooks.flush()
    window, prefetcher.window_bytes = prefetcher.window_bytes, 0
    router.backward_step()  # the forward is over; nothing read ahead yet
    prefetcher.window_bytes = window

    pool = prefetcher._io()
    submitting, go, claimed = threading.Event(), threading.Event(), threading.Event()
    real_submit = pool.submit

    def slow_submit(priority: int, fn: Callable[..., Any], *args: Any) -> Any:
        submitting.set()
        assert go.wait(30)
        return real_submit(priority, fn, *args)

    table = hooks._pipeline.table
    real_claim = table.claim_for_unpack

    def claim(rec: Any, token: object = None) -> Any:
        out = real_claim(rec, token)
        claimed.set()
        return out

    monkeypatch.setattr(pool, "submit", slow_submit)
    monkeypatch.setattr(table, "claim_for_unpack", claim)
    filler = threading.Thread(target=prefetcher.fill, daemon=True)
    filler.start()
    assert submitting.wait(30)  # the newest record is planned; its read not yet submitted
    got: list[torch.Tensor] = []
    unpacker = threading.Thread(
        target=lambda h=handles[-1]: got.append(router.load(h)), daemon=True
    )
    unpacker.start()
    assert claimed.wait(30)
    go.set()
    unpacker.join(10)
    assert not unpacker.is_alive(), "unpack waits forever on the read-ahead's placeholder"
    assert torch.equal(got[0], x * 3)
    filler.join(10)
    handles.clear()
    shutdown_pool(store)


# ------------------------------------------------ 4: out of memory in a read ahead
class OomReadAhead(CpuAsAccelerator):
    """Copies onto the "device" run out of memory on I/O threads (reads ahead)."""

    def __init__(self) -> None:
        super().__init__()
        self.ooms = 0

    def to_device(self, *args: Any, **kw: Any) -> Loaded:
        if on_io_thread():
            self.ooms += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 KiB (fake)")
        return super().to_device(*args, **kw)


@pytest.mark.parametrize("route", ["pool", "tier"])
def test_4_a_read_ahead_out_of_memory_falls_back_to_reading_on_demand(route: str) -> None:
    ops = OomReadAhead()
    hooks, _ = fake_hooks(ops=ops, prefetch="1MiB", **ROUTES[route])
    run_chain(hooks, 6)
    assert ops.ooms >= 1
    assert hooks.stats.prefetch_misses >= 1
    assert ops.violations == []


# ------------------------------------------------------- 5: views and real bytes
class SavedStorage(torch.autograd.Function):
    """Saves its input; backward records the bytes of the saved tensor's storage."""

    seen: list[int] = []  # noqa: RUF012 - a test probe

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        SavedStorage.seen.append(x.untyped_storage().nbytes())
        return g * 2 + 0 * x


@pytest.mark.parametrize("route", ["pool", "tier"])
def test_5_a_view_comes_back_with_a_storage_of_its_own_span(route: str) -> None:
    """Rule 7: a 4 KiB view at the end of a 364 KiB storage comes back with 4 KiB."""
    leaf = torch.randn(91 * 1024, requires_grad=True)
    hooks, ops = fake_hooks(**ROUTES[route])
    SavedStorage.seen.clear()
    with hooks:
        base = leaf * 1
        loss = SavedStorage.apply(base[-1024:]).sum()
    hooks.flush()
    loss.backward()
    assert SavedStorage.seen == [4 * KiB]
    assert torch.equal(leaf.grad[-1024:], torch.full((1024,), 2.0))
    assert ops.violations == []


def test_5_device_bytes_count_a_views_storage_and_the_allocators_rounding() -> None:
    from tensorstore_hooks.pipeline._staging import device_bytes

    big = torch.randn(16 * 1024)  # 64 KiB
    assert device_bytes(big[:1024]) == 64 * KiB  # a kept view keeps its whole storage
    assert device_bytes(torch.randn(3)) == 12  # CPU: no rounding
    assert _staging.alloc_bytes(12, torch.device("cuda", 0)) == 512  # the caching allocator's
    assert _staging.alloc_bytes(513, torch.device("cuda", 0)) == 1024


def test_5_device_budget_counts_the_storage_each_kept_view_holds() -> None:
    """Four 4 KiB views of four 64 KiB storages: keeping a view keeps 64 KiB."""
    hooks = tsh.offload(
        "memory://", min_bytes=0, device_budget="96KiB", prefetch="4KiB", max_inflight="4KiB"
    )
    leaf = torch.randn(16 * 1024, requires_grad=True)

    def step() -> None:
        with hooks:
            loss = sum((leaf * (i + 1))[:1024].sin().sum() for i in range(4))
        hooks.flush()
        loss.backward()

    step()  # the first forward records what it saves; the plan keeps from the second on
    before = hooks.stats.snapshot()
    step()
    kept = (hooks.stats - before).per_rule["device_budget"].tensors
    assert kept * 64 * KiB <= 96 * KiB  # the budget holds in real bytes
    assert kept == 1


def test_5_read_ahead_counts_the_device_bytes_of_what_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A view with gaps in two directions (no span union can leave them out: NOTE
    [ Span unions ], rule 1) comes back with its span (about four times its elements):
    the prefetch window counts that."""
    planned: list[int] = []  # records being read ahead, after each plan
    real_plan = ReadAhead.plan

    def plan(self: ReadAhead, window_bytes: int) -> Any:
        out = real_plan(self, window_bytes)
        planned.append(sum(r is not None and r.fetch is not None for r in self._order))
        return out

    monkeypatch.setattr(ReadAhead, "plan", plan)
    hooks = tsh.offload("memory://", min_bytes=0, prefetch="40KiB")
    leaf = torch.randn(64, 128, requires_grad=True)
    with hooks:
        loss = sum((leaf * (i + 1))[::2, ::2].sin().sum() for i in range(4))  # 8 KiB each
    hooks.flush()
    loss.backward()
    span = span_of((32, 64), (256, 2)) * 4  # what one view takes when it comes back
    assert span > 3 * 8 * KiB
    assert planned and max(planned) * span <= 40 * KiB  # one view at a time, never two


# ------------------------------------------- 6: reads ahead of tensors still in memory
def test_6_read_ahead_skips_held_tensors_whose_device_copy_is_still_there() -> None:
    """Copies to host that have not been seen complete leave the device tensor in its
    record: backward uses it; reading the host copy back would make a second device
    copy at peak memory that unpack never uses. (A copy window wide enough for all
    four: NOTE [ Copy window ] bounds them otherwise.)"""
    ops = CpuAsAccelerator(lazy=True, polls=1000)
    hooks, _ = fake_hooks(ops=ops, host_budget="1MiB", prefetch="1MiB", max_inflight="1MiB")
    run_chain(hooks, 4)
    stats = hooks.stats
    assert ops.to_device_calls == stats.prefetch_hits + stats.prefetch_misses == 0
    assert ops.violations == []


# -------------------------------------------------- 7: real pinned bytes, host_budget
def test_7_host_budget_bounds_the_pinned_memory_the_allocator_holds() -> None:
    """torch's pinned allocator rounds each buffer up to a power of two and keeps freed
    blocks cached: the tier counts what the allocator holds, over changing sizes."""
    ops = CpuAsAccelerator()
    hooks, _ = fake_hooks(ops=ops, host_budget="64KiB", prefetch="1MiB")
    for numel in (2304, 2304, 5000, 3000, 2304, 1200):  # 9 KiB, 19.5 KiB, 11.7 KiB, ...
        run_chain(hooks, 8, numel)
    assert ops.fake.pinned_peak_bytes <= 64 * KiB, ops.fake.pinned_peak_bytes
    assert hooks.stats.peak_host_tier_bytes <= 64 * KiB
    assert hooks.stats.tensors_spilled > 0
    assert ops.violations == []


# ---------------------------------------------- 8: allocate for the consuming stream
@pytest.mark.parametrize("route", ["pool", "tier"])
def test_8_unpacked_tensors_are_allocated_for_the_consuming_stream(route: str) -> None:
    """Rule 5: a tensor coming back is allocated on the stream that uses it (not the
    copy stream, whose cached blocks the next forward could not reuse)."""
    ops = CpuAsAccelerator(lazy=True, polls=2)
    hooks, _ = fake_hooks(ops=ops, prefetch="1MiB", **ROUTES[route])
    x = torch.randn(T // 4, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 6)
    hooks.flush()
    with ops.fake.use_stream(ops.fake.user_stream("backward")):  # rule 4: record_stream
        loss.backward()
    assert torch.equal(x.grad, chain_grad(x, 6))
    assert ops.to_device_calls > 0
    assert ops.violations == []


# ---------------------------------------------------------------- 9: no host blocking
@pytest.mark.parametrize("route", ["pool", "tier"])
def test_9_unpack_and_release_never_block_the_training_thread(route: str) -> None:
    """A prefetch miss reads on the backward thread: it queues its copies and the
    consumer waits on the device, never on the host; a buffer still being copied is
    given back when its copy completes (polled), not waited for; nothing blocks while
    the record table's lock is held."""
    ops = CpuAsAccelerator(lazy=True, polls=3)
    hooks, _ = fake_hooks(ops=ops, prefetch=0, **ROUTES[route])  # every unpack misses
    table = hooks._pipeline.table
    main = threading.current_thread()
    blocked: list[tuple[str, bool, str]] = []
    x = torch.randn(T // 4, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 6)
    hooks.flush()
    ops.fake.on_block = lambda what: blocked.append(
        (threading.current_thread().name, table._lock._is_owned(), what)
    )
    loss.backward()
    del loss
    assert torch.equal(x.grad, chain_grad(x, 6))
    assert hooks.stats.prefetch_misses > 0
    assert [b for b in blocked if b[0] == main.name] == []
    assert [b for b in blocked if b[1]] == []
    assert ops.violations == []


def test_9_torch_cuda_events_are_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread that waits on an event sleeps rather than spinning a core."""
    made: list[dict[str, Any]] = []

    class Event:
        def __init__(self, **kw: Any) -> None:
            made.append(kw)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    TorchCuda.new_event()
    assert made == [{"blocking": True}]


# ---------------------------------------------------------- 10: CUDA graph capture
def test_10_pack_while_capturing_keeps_tensors_in_place() -> None:
    hooks, ops = fake_hooks(host_budget="1MiB")
    x = torch.randn(T // 4, requires_grad=True)
    with ops.fake.capture(), hooks:
        loss = sin_chain(x, 4)
    assert hooks.stats.per_rule["cuda graph capture"].tensors == 4
    assert hooks.stats.tensors_offloaded == 0 and ops.to_host_calls == 0
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, 4))


def test_10_a_backward_captured_with_its_forward_works() -> None:
    hooks, ops = fake_hooks(host_budget="1MiB", prefetch="1MiB")
    x = torch.randn(T // 4, requires_grad=True)
    with ops.fake.capture():
        with hooks:
            loss = sin_chain(x, 4)
        loss.backward()  # nothing starts reading ahead: that would wait on events
    assert torch.equal(x.grad, chain_grad(x, 4))
    assert hooks.stats.per_rule["cuda graph capture"].tensors == 4


def test_10_unpack_of_an_offloaded_tensor_while_capturing_refuses_clearly() -> None:
    hooks, ops = fake_hooks(host_budget="1MiB")
    x = torch.randn(T // 4, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 4)
    hooks.flush()
    with ops.fake.capture(), pytest.raises(RuntimeError, match="CUDA graph is being captured"):
        loss.backward()
    assert not any("during capture" in line for line in ops.fake.log)


# ---------------------------------------------- 11: pack and unpack on other streams
@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("forward_on", ["side", "default"])
def test_11_pack_and_unpack_on_different_streams_are_ordered(route: str, forward_on: str) -> None:
    """Forward under ``torch.cuda.stream(s)`` and backward on the default stream (or
    the other way round): the copy back waits for the copy to host wherever each ran.
    A ``host`` rule's copy to host runs on the producing stream and records an event
    there; the unpack's stream waits on it before copying back (rules 3 and 8)."""
    ops = CpuAsAccelerator(lazy=True, polls=2)
    hooks, _ = fake_hooks(ops=ops, prefetch="1MiB", **ROUTES[route])
    fake = ops.fake
    forward = fake.user_stream("forward") if forward_on == "side" else fake.default
    backward = fake.default if forward_on == "side" else fake.user_stream("backward")
    x = torch.randn(T // 4, requires_grad=True)
    with fake.use_stream(forward), hooks:
        loss = sin_chain(x, 4)
    hooks.flush()
    with fake.use_stream(backward):
        loss.backward()
    assert torch.equal(x.grad, chain_grad(x, 4))
    assert ops.violations == []
    if route == "host_rule":
        assert hooks.stats.tensors_host == 4


def test_11_a_host_rules_copy_unpacked_on_another_stream_waits_for_its_event() -> None:
    """The order the fake records: the copy to host, then an event on the producing
    stream; at unpack the consuming stream waits on that event, then copies back."""
    ops = CpuAsAccelerator(lazy=True, polls=1000)  # copies land only when waited for
    hooks, _ = fake_hooks(ops=ops, **ROUTES["host_rule"])
    fake = ops.fake
    x = torch.randn(T // 4, requires_grad=True)
    with fake.use_stream(fake.user_stream("forward")), hooks:
        y = x.sin()
    start = len(fake.log)
    saved = y.grad_fn._saved_self  # unpacked on the default stream
    assert torch.equal(saved, x.detach())
    record = next(line for line in fake.log[:start] if line.startswith("record "))
    event = record.split()[1]
    assert record.startswith(f"record {event} on forward@"), fake.log[:start]
    log = [line for line in fake.log[start:] if not line.startswith(("new_", "empty "))]
    assert log[:2] == [
        f"default waits {event}",
        "copy#2 on default: pinned -> device, 16384 B",
    ], log
    assert ops.violations == []


# ------------------------------------------------------ what the fake records and sees
def test_the_fake_records_the_staging_order_of_one_tensor() -> None:
    hooks, ops = fake_hooks(host_budget="1MiB")
    x = torch.randn(T // 4, requires_grad=True)
    with hooks:
        loss = x.sin().sum()
    log = [line for line in ops.fake.log if not line.startswith(("pinned", "new_"))]
    assert log[:6] == [
        "record event1 on default@1",  # the producer, captured before the copy stream
        "enter copy2",
        "copy2 waits event1",
        "copy#1 on copy2: device -> pinned, 16384 B",
        "record event3 on copy2@2",
        "exit copy2",
    ], log
    loss.backward()
    assert ops.violations == []


def broken_copy_to_host(t: torch.Tensor, buf: torch.Tensor, streams: StreamSet, rt: Any) -> Loaded:
    """``copy_to_host`` with the producing stream captured *inside* the copy stream's
    context (the bug torchtune had): "the producer" is then the copy stream itself."""
    src, conj, neg = _staging.physical(t.detach())
    span = span_of(tuple(src.shape), tuple(src.stride()))
    copy_stream = streams.d2h(t.device)
    with rt.use_stream(copy_stream):
        producer = rt.current_stream(t.device)  # BROKEN: this is copy_stream
        ready = rt.new_event()
        rt.record(ready, producer)
        rt.wait(copy_stream, ready)
        flat = src.as_strided((span,), (1,), src.storage_offset())
        dst = buf[: span * src.element_size()].view(src.dtype)
        rt.copy(dst, flat, non_blocking=True)
        done = rt.new_event()
        rt.record(done, copy_stream)
    return _staging.with_bits(dst.as_strided(t.shape, t.stride(), 0), conj, neg), done


_real_started = DeviceStager._started


def drop_sources_early(self: DeviceStager, rec: Any, t: torch.Tensor, buf: torch.Tensor) -> None:
    """The record lets go of its device tensor as soon as the copy to host is queued."""
    _real_started(self, rec, t, buf)
    rec._drop_source()  # BROKEN: the copy to host still reads it


def give_back_at_once(self: DeviceStager, event: Any, release: Callable[[], None]) -> None:
    """Buffers go back to their pool before the copies using them have completed."""
    release()


_real_consume = _staging.consume


def consume_late(t: torch.Tensor, done: Any, rt: Any) -> torch.Tensor:
    """The real consumer, after the read-ahead has had time to reuse a buffer: a wait
    on the copy (which lands it) would otherwise often come first and hide rule 3."""
    time.sleep(0.02)
    return _real_consume(t, done, rt)


def consume_without_waiting(t: torch.Tensor, done: Any, rt: Any) -> torch.Tensor:
    rt.record_stream(t, rt.current_stream(t.device))
    return t


POOL: dict[str, Any] = {"prefetch": 4 * T}  # staged, written, read back ahead
TIER: dict[str, Any] = {"host_budget": 8 * T, "prefetch": 4 * T}  # held: copies land late

BREAKAGES: dict[str, tuple[Any, str, Any, str, dict[str, Any]]] = {
    "producer captured inside the copy stream": (
        _staging,
        "copy_to_host",
        broken_copy_to_host,
        "rule 1:",
        POOL,
    ),
    "source dropped before its copy completed": (
        DeviceStager,
        "_started",
        drop_sources_early,
        "rule 2:",
        TIER,
    ),
    "buffer given back before its copy completed": (
        DeviceStager,
        "_after",
        give_back_at_once,
        "rule 3:",
        POOL,
    ),
    "consumer does not wait for the copy": (
        _staging,
        "consume",
        consume_without_waiting,
        "rule 4:",
        POOL,
    ),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_the_fake_catches_a_broken_ordering(
    breakage: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each breakage of a rule is reported by the fake, and corrupts the gradients."""
    owner, name, broken, rule, options = BREAKAGES[breakage]
    monkeypatch.setattr(owner, name, broken)
    if rule == "rule 3:":
        monkeypatch.setattr(_staging, "consume", consume_late)
    ops = CpuAsAccelerator(lazy=True, polls=3)
    store = WrappedStore()
    pool_for(store, 1)  # one I/O thread: reads ahead run one after the other
    hooks, _ = fake_hooks(store, ops, **options)
    x = torch.randn(T // 4, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 8)
    hooks.flush()
    loss.backward()
    grad_ok = torch.equal(x.grad, chain_grad(x, 8))
    shutdown_pool(store)
    broken = expect_broken(ops)  # broken on purpose: the conftest fixture would fail it
    with capsys.disabled():
        print(f"\n[{breakage}] first violation: {broken[:1]}")
    assert any(v.startswith(rule) for v in broken), broken
    assert not grad_ok


# ------------------------------------------------------------------ real CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_cuda_1_conj_and_neg_views_come_back_exact(route: str) -> None:
    x = torch.randn(256, 128, dtype=torch.complex64, device="cuda", requires_grad=True)
    w = torch.randn(192, 128, dtype=torch.complex64, device="cuda", requires_grad=True)
    ref = torch.autograd.grad(conj_loss(x, w), [x, w])
    hooks = tsh.offload("memory://", min_bytes=0, **ROUTES[route])
    with hooks:
        loss = conj_loss(x, w)
    hooks.flush()
    grads = torch.autograd.grad(loss, [x, w])
    assert all(torch.equal(g, r) for g, r in zip(grads, ref, strict=True))


@pytest.mark.cuda
def test_cuda_2_big_tensors_under_a_side_stream_forward_are_exact() -> None:
    torch.manual_seed(0)
    x = torch.randn(1 << 20, device="cuda", requires_grad=True)  # 4 MiB saves
    hooks = tsh.offload("memory://", min_bytes=0, host_budget="1MiB")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), hooks:
        loss = sin_chain(x * 1, 4)
    torch.cuda.current_stream().wait_stream(side)
    hooks.flush()
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, 4))


@pytest.mark.cuda
def test_cuda_4_a_read_ahead_out_of_memory_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _staging.CudaOps.to_device
    ooms = []

    def to_device(self: Any, *args: Any, **kw: Any) -> Loaded:
        if on_io_thread():
            ooms.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(self, *args, **kw)

    monkeypatch.setattr(_staging.CudaOps, "to_device", to_device)
    hooks = tsh.offload("memory://", min_bytes=0, prefetch="1MiB")
    x = torch.randn(T // 4, device="cuda", requires_grad=True)
    with hooks:
        loss = sin_chain(x, 6)
    hooks.flush()
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, 6)) and ooms


@pytest.mark.cuda
@pytest.mark.parametrize("route", ["pool", "tier"])
def test_cuda_5_a_view_comes_back_with_its_own_span(route: str) -> None:
    leaf = torch.randn(91 * 1024, device="cuda", requires_grad=True)
    hooks = tsh.offload("memory://", min_bytes=0, **ROUTES[route])
    SavedStorage.seen.clear()
    with hooks:
        loss = SavedStorage.apply((leaf * 1)[-1024:]).sum()
    hooks.flush()
    loss.backward()
    assert SavedStorage.seen == [4 * KiB]


@pytest.mark.cuda
def test_cuda_6_read_ahead_copies_only_what_unpack_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = _staging.CudaOps.to_device

    def to_device(self: Any, *args: Any, **kw: Any) -> Loaded:
        calls.append(1)
        return real(self, *args, **kw)

    monkeypatch.setattr(_staging.CudaOps, "to_device", to_device)
    hooks = tsh.offload("memory://", min_bytes=0, host_budget="1MiB", prefetch="1MiB")
    x = torch.randn(T // 4, device="cuda", requires_grad=True)
    with hooks:
        loss = sin_chain(x, 8)
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, 8))
    assert len(calls) == hooks.stats.prefetch_hits + hooks.stats.prefetch_misses


@pytest.mark.cuda
def test_cuda_7_pinned_memory_stays_within_host_budget() -> None:
    # What torch's pinned allocator holds, cached blocks included.
    stats = torch.cuda.memory.host_memory_stats
    before = stats().get("allocated_bytes.current", 0)
    hooks = tsh.offload("memory://", min_bytes=0, host_budget="4MiB")
    for numel in (300_000, 300_000, 700_000, 400_000):  # ~1.1, 2.7, 1.5 MiB saves
        x = torch.randn(numel, device="cuda", requires_grad=True)
        with hooks:
            loss = sin_chain(x, 6)
        hooks.flush()
        loss.backward()
        assert torch.equal(x.grad, chain_grad(x, 6))
    assert stats().get("allocated_bytes.current", 0) - before <= 4 << 20
    assert hooks.stats.peak_host_tier_bytes <= 4 << 20


@pytest.mark.cuda
def test_cuda_8_reserved_memory_is_flat_across_steps() -> None:
    hooks = tsh.offload("memory://", min_bytes=0, prefetch="1MiB")
    x = torch.randn(1 << 18, device="cuda", requires_grad=True)
    reserved = []
    for _ in range(5):
        x.grad = None
        with hooks:
            loss = sin_chain(x, 8)
        hooks.flush()
        loss.backward()
        del loss
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[2] == reserved[4], reserved


@pytest.mark.cuda
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_cuda_11_a_tensor_saved_on_a_side_stream_unpacked_on_another_is_exact(
    route: str,
) -> None:
    """Saved under ``torch.cuda.stream(side)`` while ``side`` is busy (its copy to host
    lands late), unpacked on the default stream at once: the copy back must wait.
    (Autograd runs each backward op on its forward's stream, so the unpack is called
    directly here, as code reading ``grad_fn._saved_*`` does.)"""
    x = torch.randn(1 << 20, device="cuda")
    leaf = (x * 1).requires_grad_()
    hooks = tsh.offload("memory://", min_bytes=0, **ROUTES[route])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), hooks:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of work queued on side before the save
        y = leaf.sin()
    hooks.flush()
    saved = y.grad_fn._saved_self  # on the default stream
    assert torch.equal(saved, x)
    torch.cuda.current_stream().wait_stream(side)
    y.sum().backward()
    assert torch.equal(leaf.grad, x.cos())


@pytest.mark.cuda
def test_cuda_10_capture_keeps_tensors_in_place() -> None:
    hooks = tsh.offload("memory://", min_bytes=0)
    x = torch.randn(T // 4, device="cuda", requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph), hooks:
        y = x.sin().cos()
    assert hooks.stats.per_rule["cuda graph capture"].tensors >= 1
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x.detach().sin().cos())
