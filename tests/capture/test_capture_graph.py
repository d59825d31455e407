"""``tsh.capture``'s writer beside a user's CUDA graph capture (issue 34, finding J, over
the fake's capture model in ``tests/fake_cuda.py``): the settle tasks of rows appended
before the capture must not wait on an event while it runs (global capture mode: that
would invalidate the user's graph). NOTE [ Capture copy window ] rule 4."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import zarr

import tensorstore_hooks as tsh
from tensorstore_hooks.capture._inflight import Inflight
from tests.fake_accelerator import CpuAsAccelerator, expect_broken
from tests.fake_cuda import FakeGraph


def _until(done: object, limit_s: float = 10.0) -> None:
    """Wait (bounded) for an I/O thread to reach the state ``done()`` says."""
    end = time.monotonic() + limit_s
    while not done() and time.monotonic() < end:  # type: ignore[operator]
        time.sleep(0.001)


def _capture_after_appends(tmp_path: Path, graph_out: list[FakeGraph]) -> Inflight:
    """Rows appended (their copies still running, settle tasks held behind busy I/O
    threads), then a graph capture during which the model's hook refuses and the I/O
    threads are let go."""
    ops = CpuAsAccelerator(lazy=True, polls=1000)
    model = torch.nn.Sequential(torch.nn.Identity())
    cap = tsh.capture(model, str(tmp_path), modules=["0"], what=("output",))
    cap._writer.ops = ops
    inflight = cap._writer.inflight
    gate = threading.Event()
    for _ in range(inflight.pool.threads):
        inflight.submit(gate.wait)
    x = torch.randn(4, 256)
    with cap:
        try:
            model(x)  # a settle task queued behind the gate
            with ops.fake.capture() as graph:
                graph_out.append(graph)
                with pytest.raises(RuntimeError, match="CUDA graph is being"):
                    model(torch.randn(4, 256))
                gate.set()
                _until(lambda: getattr(inflight, "capture_waits", 0) or graph.invalidated)
        finally:
            gate.set()
    arr = zarr.open_array(str(tmp_path / "capture" / "0" / "output"), mode="r")
    assert torch.equal(torch.from_numpy(arr[:]), x)  # the rows before the capture
    expect_broken(ops)
    return inflight


def test_J_capture_writer_waits_for_a_graph_capture_to_end(tmp_path: Path) -> None:
    graphs: list[FakeGraph] = []
    inflight = _capture_after_appends(tmp_path, graphs)
    assert graphs[0].invalidated is None
    assert inflight.capture_waits == 1


def test_J_without_the_wait_the_capture_is_invalidated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: without rule 4 the settle task synchronizes on its
    copy's event during the capture, and leaving the capture raises."""
    monkeypatch.setattr(Inflight, "note_capture", lambda self, stream, still: None)
    graphs: list[FakeGraph] = []
    with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureInvalidated"):
        _capture_after_appends(tmp_path, graphs)
    assert graphs[0].invalidated is not None and "synchronize" in graphs[0].invalidated


def test_L_a_capture_on_the_current_device_refuses_another_devices_rows(tmp_path: Path) -> None:
    """A graph captured on cuda:1 (the current device then) while a hook sees a cuda:0
    tensor: refused with the fix too. Before, the hook asked cuda:0 alone, copied the
    rows and queried events during the capture (global mode: invalid)."""
    from tests.fake_cuda import FakeCuda, devices_accepted, on_device

    fake = FakeCuda(devices=2, polls=1000)
    ops = CpuAsAccelerator(fake=fake)
    model = torch.nn.Sequential(torch.nn.Identity())
    cap = tsh.capture(model, str(tmp_path), modules=["0"], what=("output",))
    cap._writer.ops = ops
    with (
        devices_accepted(),
        cap,
        fake.capture(device=1) as graph,
        pytest.raises(RuntimeError, match="CUDA graph is being"),
    ):
        model(on_device(torch.randn(4, 256), 0))
    assert graph.invalidated is None
    assert not any("during capture" in line for line in fake.log)
