"""The fake's several devices and graph capture (issue 34, item 1: ``tests/fake_cuda.py``),
and the library's capture guard (finding J) under the fake's capture model: work queued
while capturing is recorded, not run, and an illegal call from any thread invalidates
the capture, so a guard that slips fails the test even when the thread swallowed the
error."""

from __future__ import annotations

import threading

import pytest
import torch

from tensorstore_hooks.pipeline._device import DeviceStager
from tests.fake_accelerator import CpuAsAccelerator
from tests.fake_cuda import FakeCuda
from tests.pipeline.test_cuda_path import fake_hooks
from tests.pipeline.test_pipeline import chain_grad, sin_chain

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


# ------------------------------------------------------------------ several devices
def test_each_device_has_its_own_current_stream() -> None:
    fake = FakeCuda(devices=2)
    s1 = fake.user_stream("s1", device=1)
    assert fake.current_stream(CUDA0) is fake.default
    with fake.use_stream(s1):  # as torch.cuda.stream: its device is current meanwhile
        assert fake.current_stream(CUDA1) is s1
        assert fake.current_stream(CUDA0) is fake.default
        assert fake.current_device() == 1
    assert fake.current_device() == 0
    with fake.device(1):
        assert fake.current_stream(torch.device("cuda")).name == "default:1"
    seen: list[object] = []
    other = threading.Thread(target=lambda: seen.append(fake.current_stream(CUDA1)))
    with fake.use_stream(s1):
        other.start()
        other.join()
    assert seen[0] is not s1  # current streams are per thread
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        fake.set_device(2)


def test_an_event_belongs_to_the_device_it_was_first_recorded_on() -> None:
    fake = FakeCuda(devices=2)
    event = fake.new_event()
    fake.record(event, fake.default)
    with pytest.raises(RuntimeError, match="does not match recording stream's device"):
        fake.record(event, fake.user_stream("s1", device=1))


def test_a_copy_between_devices_is_refused() -> None:
    fake = FakeCuda(devices=2)
    a = fake.empty(4, torch.float32, CUDA0)
    b = fake.empty(4, torch.float32, CUDA1)
    assert a.device == CUDA0 and b.device == CUDA1
    with pytest.raises(RuntimeError, match="copy between"):
        fake.copy(a, b, non_blocking=True)


def test_a_copy_inside_another_devices_stream_context_is_reported() -> None:
    """``with torch.cuda.stream(s0): t1.to('cpu', non_blocking=True)`` runs on cuda:1's
    current stream, not ``s0``: the waits made on ``s0`` do not order it."""
    fake = FakeCuda(devices=2)
    t = fake.empty(4, torch.float32, CUDA1)
    with fake.use_stream(fake.new_stream(CUDA0)):
        fake.copy(fake.pinned(16).view(torch.float32), t, non_blocking=True)
    assert len(fake.violations) == 1 and "cuda:1 tensor inside copy" in fake.violations[0]


# ------------------------------------------------------------------ graph capture
def test_copies_queued_during_a_capture_run_on_replay() -> None:
    fake = FakeCuda()
    t = torch.randn(8)
    fake.produced(t)
    buf = fake.pinned(32).view(torch.float32)
    with fake.capture() as graph:
        fake.copy(buf, t, non_blocking=True)
        fake.kernel()
    assert graph.ops and graph.ops[-1] is None  # the copy, then the kernel
    fake.run_all()
    assert torch.isnan(buf).all()  # recorded, not run
    graph.replay()
    assert torch.equal(buf, t)
    t.add_(1)
    graph.replay()  # a replay reads the memory as it is then
    assert torch.equal(buf, t) and graph.replays == 2


@pytest.mark.parametrize("call", ["query", "synchronize", "blocking copy"])
def test_an_illegal_call_from_any_thread_invalidates_the_capture(call: str) -> None:
    """The thread swallows CUDA's error; leaving the capture still raises, as
    ``capture_end`` does with ``cudaErrorStreamCaptureInvalidated``."""
    fake = FakeCuda(polls=5)
    event = fake.new_event()
    fake.record(event, fake.default)
    dst = fake.pinned(16).view(torch.float32)
    src = fake.empty(4, torch.float32, torch.device("cpu"))

    def other() -> None:
        try:
            if call == "query":
                event.query()
            elif call == "synchronize":
                event.synchronize()
            else:
                fake.copy(dst, src, non_blocking=False)
        except RuntimeError:
            pass  # swallowed: the capture is invalid all the same

    with (
        pytest.raises(RuntimeError, match="cudaErrorStreamCaptureInvalidated"),
        fake.capture(),
    ):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()


# ------------------------------------------- the library's guard under the fake's capture
def _capture_beside_copies_in_flight(break_guard: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies of an earlier forward still run (lazy fake) when the user captures a
    graph; inside it a forward packs (kept in place) and an I/O thread reaps and polls.
    ``break_guard``: the stager never says it is quiet (the guard removed)."""
    hooks, ops = fake_hooks(ops=CpuAsAccelerator(lazy=True, polls=1000), host_budget="1MiB")
    stager = hooks._pipeline.stager
    if break_guard:
        monkeypatch.setattr(DeviceStager, "quiet", lambda self: False)
    x = torch.randn(4096, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 4)  # four copies to host, none complete yet
    errors: list[BaseException] = []

    def io_thread() -> None:
        try:
            stager._reap()
            stager._poll()
        except RuntimeError as e:
            errors.append(e)

    with ops.fake.capture() as graph:
        with hooks:
            captured = sin_chain(x.detach().requires_grad_(), 2)
        thread = threading.Thread(target=io_thread)
        thread.start()
        thread.join()
    assert graph.invalidated is None and errors == []
    graph.replay()
    captured.backward()
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, 4))
    hooks.close()


def test_J_the_io_threads_make_no_illegal_call_during_a_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _capture_beside_copies_in_flight(False, monkeypatch)


def test_J_without_the_guard_the_capture_is_invalidated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: with the guard removed, the I/O thread's poll queries
    an event during the capture, and leaving the capture raises."""
    with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureInvalidated"):
        _capture_beside_copies_in_flight(True, monkeypatch)
    from tests.fake_accelerator import broken_rules

    broken_rules()  # the copies left by the aborted scenario (nothing broken on purpose)
