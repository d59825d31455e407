"""Capture's own copies off the device under a GPU's timing (issue 34, finding A on
``tsh.capture``'s path): NOTE [ Capture copy window ] in ``capture/_inflight.py``."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import zarr

import tensorstore_hooks as tsh
from tests.fake_accelerator import CpuAsAccelerator
from tests.fake_cuda import FakeCuda, Timing

KiB = 1 << 10
ROWS, WIDTH = 4, 1024  # one hook call: 4 rows of 1024 float32, 16 KiB
CALL_BYTES = ROWS * WIDTH * 4
CALLS = 32
WINDOW = 4 * CALL_BYTES


def lagging_capture(tmp_path: Path, lag: float) -> tuple[int, list[torch.Tensor], list[str], Path]:
    """``CALLS`` hook calls captured while copies run ``lag`` times one kernel and the
    capture's I/O threads are busy (gated: the settle tasks that used to drop device
    tensors wait behind them). Returns the most device bytes capture's copies held
    after any call, the inputs, the host blocks on this thread, and the root."""
    fake = FakeCuda(timing=Timing.lagging(lag, CALL_BYTES))
    ops = CpuAsAccelerator(fake=fake)
    model = torch.nn.Sequential(torch.nn.Identity())
    cap = tsh.capture(model, str(tmp_path), modules=["0"], what=("output",), max_inflight="64KiB")
    cap._writer.ops = ops
    me = threading.get_ident()
    blocks: list[str] = []
    fake.on_block = lambda what: blocks.append(what) if threading.get_ident() == me else None
    gate = threading.Event()
    inflight = cap._writer.inflight
    for _ in range(inflight.pool.threads):
        inflight.submit(gate.wait)
    inputs, most = [], 0
    try:
        with cap:
            for _ in range(CALLS):
                x = torch.randn(ROWS, WIDTH)
                inputs.append(x)
                model(x)
                most = max(most, fake.live_bytes())
            gate.set()
    finally:
        gate.set()
    return most, inputs, blocks, tmp_path


def test_capture_copies_hold_at_most_the_window_under_16x_lag(tmp_path: Path) -> None:
    """Figures (32 calls of 16 KiB, 16x lag, a 64 KiB window, I/O threads busy): the
    device bytes capture's copies hold stay <= 64 KiB; before the window they grew with
    every call to all 512 KiB (nothing dropped them until a settle task ran). No
    host block on the training thread; every row lands intact."""
    most, inputs, blocks, root = lagging_capture(tmp_path, 16)
    assert most <= WINDOW, f"capture's copies held {most // KiB} KiB on the device"
    assert blocks == []
    arr = zarr.open_array(str(root / "capture" / "0" / "output"), mode="r")
    assert torch.equal(torch.from_numpy(arr[:]), torch.cat(inputs))


def test_capture_copies_at_1x_lag_are_dropped_as_they_complete(tmp_path: Path) -> None:
    """At 1x lag each copy has completed by the next call: the hook drops it then (one
    call's bytes, plus the newest)."""
    most, _, blocks, _ = lagging_capture(tmp_path, 1)
    assert most <= 2 * CALL_BYTES, most
    assert blocks == []


@pytest.mark.cuda
def test_cuda_capture_copies_stay_within_the_window(tmp_path: Path) -> None:
    """64 hook calls of 16 MiB with a 64 MiB window on a GPU: the device bytes capture's
    copies to host hold never pass the window; every row lands intact."""
    mib = 1 << 20
    model = torch.nn.Sequential(torch.nn.Identity())
    cap = tsh.capture(
        model, str(tmp_path), modules=["0"], what=("output",), max_inflight="256MiB"
    )
    cap._writer.inflight.copies.window = 64 * mib
    inputs = []
    with cap:
        for _ in range(64):
            x = torch.randn(4, mib, device="cuda")
            inputs.append(x.cpu())
            model(x)
    assert cap._writer.inflight.copies.peak_bytes <= 64 * mib
    arr = zarr.open_array(str(tmp_path / "capture" / "0" / "output"), mode="r")
    assert torch.equal(torch.from_numpy(arr[:]), torch.cat(inputs))
