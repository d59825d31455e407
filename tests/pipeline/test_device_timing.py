"""The device path under a GPU's timing (issue 34): one test per finding, over the fake.

``tests/fake_cuda.py`` keeps per-stream pools, a stream pool that aliases, several
devices and graph capture; each test below breaks on the code before its finding's
fix and states the rule it holds.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks.pipeline._device import DeviceStager
from tensorstore_hooks.pipeline._records import HostCopies
from tensorstore_hooks.pipeline._staging import (
    CudaOps,
    StreamSet,
    TorchCuda,
    copy_to_host,
    copy_to_pageable,
    copy_to_pinned,
    span_bytes,
)
from tensorstore_hooks.runtime import _memory
from tests.fake_accelerator import CpuAsAccelerator, expect_broken
from tests.fake_cuda import FakeCuda, Timing
from tests.pipeline.test_cuda_path import fake_hooks, run_chain
from tests.pipeline.test_pipeline import chain_grad, sin_chain

CPU = torch.device("cpu")
KiB = 1 << 10
T_BYTES = 16 * KiB  # each tensor sin_chain saves below


# ------------------------------------------------------------------ G: per-stream pools
@pytest.mark.parametrize("path", ["pinned_buffer", "pageable", "host_rule"])
def test_G_a_tensor_from_another_streams_pool_is_recorded_on_its_producer(path: str) -> None:
    """A saved tensor allocated for stream ``a`` and made on stream ``b``: when the
    library drops it, its block returns to ``a``'s pool, so ``b`` must have been
    ``record_stream``-ed on it (the kernel that saved it may still be pending)."""
    fake = FakeCuda(polls=2)
    a, b = fake.user_stream("a"), fake.user_stream("b")
    streams = StreamSet(fake)
    t = torch.randn(1024)
    expected = t.clone()
    fake.allocated_for(t, a)
    with fake.use_stream(b):
        fake.produced(t)
        if path == "pinned_buffer":
            host, _ = copy_to_host(t, fake.pinned(span_bytes(t)), streams, fake)
        elif path == "pageable":
            host = copy_to_pageable(t, CudaOps(fake).producer_event(t), streams, fake)
        else:
            host, _ = copy_to_pinned(t, fake)
    fake.run_all()  # the copy lands while the library still holds ``t`` (rule 2)
    del t
    fake.run_all()  # ... then the block is freed to ``a``'s pool
    assert fake.violations == []
    assert torch.equal(host, expected)


def test_G_the_fake_reports_a_block_freed_without_its_users_record_stream() -> None:
    fake = FakeCuda()
    a, b = fake.user_stream("a"), fake.user_stream("b")
    t = torch.randn(8)
    fake.allocated_for(t, a)
    with fake.use_stream(b):
        fake.produced(t)
    del t
    fake.run_all()
    assert len(fake.violations) == 1 and "rule 2" in fake.violations[0]


# --------------------------------------------------------------- K: the stream pool
def test_K_pipelines_made_every_step_never_share_a_stream_with_nccl() -> None:
    """torch's pool hands out 32 streams per device round-robin; NCCL took one. Seventeen
    pipelines (hooks made every step) take the process's two copy streams once."""
    fake = FakeCuda(stream_pool=32)
    nccl = fake.pool_stream(torch.device("cpu"))
    used = set()
    for _ in range(17):  # 34 streams: the pool wraps round to NCCL's
        hooks, ops = fake_hooks(ops=CpuAsAccelerator(fake=fake), host_budget="1MiB")
        run_chain(hooks, 1)
        hooks.close()
        used |= {ops.streams.d2h(CPU), ops.streams.h2d(CPU)}
    assert nccl not in used
    assert len(used) == 2
    assert sum(line.startswith("new_stream") for line in fake.log) == 2


# ------------------------------------------------------- I: copies back hold no stream
def test_I_a_tensor_copied_back_is_freed_when_its_own_copy_completed() -> None:
    """A read-ahead dropped after its copy landed frees its block at once; a
    ``record_stream`` on the copy stream would hold it until every read queued after
    it on that stream drained (torch's compiler offload forbids that)."""
    fake = FakeCuda(polls=1000)
    ops = CudaOps(fake)
    hosts = [fake.pinned(64 * KiB).view(torch.float32) for _ in range(3)]
    back = [ops.to_device(h, CPU) for h in hosts]
    assert fake.device_bytes() == 3 * 64 * KiB
    first, done = back.pop(0)
    done.synchronize()  # the first copy landed; the two after it have not
    del first
    assert fake.device_bytes() == 2 * 64 * KiB
    fake.run_all()
    assert fake.violations == []


@pytest.mark.parametrize("route", ["pool", "tier", "tier_full"])
def test_I_the_stager_keeps_a_dropped_read_alive_until_its_copy_landed(route: str) -> None:
    """Nobody claims a read (its record was freed): the stager, not the allocator's
    stream bookkeeping, keeps the device tensor until its copy completed."""
    budget = {"pool": 0, "tier": 1 << 20, "tier_full": 4 * KiB}[route]
    ops = CpuAsAccelerator(lazy=True, polls=1000)
    copies = HostCopies(threading.RLock())
    stager = DeviceStager(copies, idle_cap=1 << 20, host_budget=budget, ops=ops)
    t = torch.randn(4096)
    dev, done = stager.to_device(t, CPU)
    del dev
    assert ops.fake.device_bytes() == 16 * KiB  # still held: the copy is running
    assert done is not None
    done.synchronize()
    stager.finish((torch.empty(0), None))
    stager._poll()
    assert ops.fake.device_bytes() == 0
    assert expect_broken(ops) == []


# --------------------------------------------------- J: graph capture on other threads
def test_J_no_thread_queries_an_event_while_a_graph_is_captured() -> None:
    """Global capture mode: an event query from *any* thread invalidates the capture.
    Copies of an earlier forward are still running when the user starts capturing;
    the I/O threads' polls and reaps wait until the capture has ended."""
    hooks, ops = fake_hooks(ops=CpuAsAccelerator(lazy=True, polls=1000), host_budget="1MiB")
    stager = hooks._pipeline.stager
    x = torch.randn(4096, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 4)  # four copies to host, none complete yet
    errors: list[BaseException] = []

    def io_thread() -> None:
        try:
            stager._reap()
            stager._poll()
        except BaseException as e:  # the fake raises as CUDA would
            errors.append(e)

    with ops.fake.capture():
        with hooks:
            captured = sin_chain(x.detach().requires_grad_(), 2)  # kept in place
        t = threading.Thread(target=io_thread)
        t.start()
        t.join()
    assert errors == []
    assert not any("during capture" in line for line in ops.fake.log)
    assert stager.quiet() is False  # the capture ended: polls resume
    captured.backward()
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, 4))
    hooks.close()


def test_J_tsh_capture_refuses_an_append_during_a_graph_capture_clearly(tmp_path: Path) -> None:
    """``tsh.capture`` copying off the device inside a graph capture would record its
    copy into the graph and have its writer wait on events: refused, with the fix."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    ops = CpuAsAccelerator(lazy=True, polls=1000)
    cap = tsh.capture(model, str(tmp_path), modules=["0"], what=("output",))
    cap._writer.ops = ops
    with cap:
        model(torch.randn(2, 4))  # outside a capture: captured as ever
        with ops.fake.capture(), pytest.raises(RuntimeError, match="CUDA graph is being"):
            model(torch.randn(2, 4))
    assert not any("during capture" in line for line in ops.fake.log)


# ------------------------------------------------------------ L: several devices
def test_L_the_capture_check_asks_the_tensors_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capturing on cuda:1 while cuda:0 is the current device: a tensor of cuda:1 is
    kept in place (``is_current_stream_capturing()`` alone asks about cuda:0)."""
    streams = {0: object(), 1: object()}
    capturing = {streams[1]}
    current: list[object] = [streams[0]]  # the current device's current stream

    @contextlib.contextmanager
    def use(stream: object) -> Iterator[None]:
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: streams[d.index])
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current[-1] in capturing)
    assert TorchCuda.capturing(torch.device("cuda", 1))
    assert not TorchCuda.capturing(torch.device("cuda", 0))


# ---------------------------------------------- A: device memory while copies lag
N_SAVED = 16
WINDOW = 4 * T_BYTES


def lagging_step(lag: float, **kw: object) -> tuple[int, int, int]:
    """One step of ``N_SAVED`` saves of ``T_BYTES`` each, under copies ``lag`` times
    slower than a kernel: (device bytes the library holds at the end of forward, all
    device bytes then, the step's device peak)."""
    fake = FakeCuda(timing=Timing.lagging(lag, T_BYTES))
    kw.setdefault("host_budget", "1MiB")
    hooks, _ = fake_hooks(ops=CpuAsAccelerator(fake=fake), max_inflight=WINDOW, **kw)
    x = torch.randn(T_BYTES // 4, requires_grad=True)
    with hooks:
        loss = sin_chain(x, N_SAVED)
    records = hooks._pipeline.table.records()
    held = sum(r.device_nbytes for r in records if r.source is not None)
    at_end = fake.live_bytes()
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, N_SAVED))
    fake.live_bytes()
    hooks.close()
    return held, at_end, fake.peak_bytes


@pytest.mark.parametrize("lag", [1, 4, 16])
@pytest.mark.parametrize("route", ["tier", "pool"])
def test_A_device_bytes_stay_within_the_window_while_copies_lag(lag: int, route: str) -> None:
    """Figures (16 saves of 16 KiB, window 64 KiB, host tier): held at the end of
    forward 16 / 64 / 64 KiB at 1x / 4x / 16x lag, all device bytes then 32 / 80 / 80,
    the step's peak 64 / 112 / 112 KiB against no offloading's 256. Before the window:
    held 16 / 208 / 256 KiB (at 16x every saved tensor), peak 64 / 256 / 256. Through
    the pool the writes wait for each copy on an I/O thread: held 0 at every lag."""
    held, at_end, peak = lagging_step(lag, **({} if route == "tier" else {"host_budget": 0}))
    no_offloading = N_SAVED * T_BYTES
    assert held <= WINDOW, (held, at_end, peak)
    assert at_end <= WINDOW + T_BYTES  # + the leaf ``x`` the caller holds
    assert peak <= no_offloading, (held, at_end, peak)


# ------------------------------------------------ M: device_budget auto's readings
def test_M_auto_reads_the_reserved_peak_and_survives_a_peak_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fragmentation: the allocator reserved 10 GiB for 6 GiB of tensors; the room
    must leave the 10. Then the user resets the peak stats: the mark stays."""
    GiB = 1 << 30
    stats = {
        "reserved_bytes.all.current": 8 * GiB,
        "reserved_bytes.all.peak": 10 * GiB,
        "allocated_bytes.all.peak": 6 * GiB,
    }
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (20 * GiB, 40 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d=None: dict(stats))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 6 * GiB)
    monkeypatch.setattr(_memory, "_cuda_marks", {})
    device = torch.device("cuda", 3)
    probe = _memory.SystemMemory()
    reading = probe.read(device)
    assert reading is not None and reading.limit_bytes == 28 * GiB
    assert reading.peak_bytes == 10 * GiB and probe.peak(device) == 10 * GiB
    stats.update({"reserved_bytes.all.peak": 8 * GiB, "allocated_bytes.all.peak": GiB})
    assert probe.peak(device) == 10 * GiB  # torch.cuda.reset_peak_memory_stats()


# --------------------------------------------------------------- on a real GPU
@pytest.mark.cuda
@pytest.mark.parametrize("host_budget", ["1GiB", 0])
def test_cuda_A_the_copy_window_bounds_device_bytes_at_the_end_of_forward(
    host_budget: object,
) -> None:
    """32 saves of 16 MiB with a 64 MiB window: at the end of forward the library holds
    at most the window on the device (copies lag the sin kernels ~10x on PCIe), and
    gradients are bit-identical."""
    torch.manual_seed(0)
    mib = 1 << 20
    x = torch.randn(4 * mib, device="cuda", requires_grad=True)
    hooks = tsh.offload(
        "memory://", min_bytes=0, host_budget=host_budget, max_inflight="64MiB"
    )
    with hooks:
        loss = sin_chain(x, 32)
    records = hooks._pipeline.table.records()
    held = sum(r.device_nbytes for r in records if r.source is not None)
    assert held <= 64 * mib, held
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, 32))
    hooks.close()


@pytest.mark.cuda
def test_cuda_K_pipelines_share_their_copy_streams() -> None:
    x = torch.randn(1 << 16, device="cuda", requires_grad=True)
    seen = set()
    for _ in range(20):
        hooks = tsh.offload("memory://", min_bytes=0, host_budget="64MiB")
        with hooks:
            loss = sin_chain(x, 2)
        loss.backward()
        streams = hooks._pipeline.stager.ops.streams  # type: ignore[attr-defined]
        seen.add((streams.d2h(x.device).stream_id, streams.h2d(x.device).stream_id))
        hooks.close()
    assert len(seen) == 1
