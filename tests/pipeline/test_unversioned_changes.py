"""A saved tensor changed without a version bump while it is written (NOTE [ In-place
checks ] in ``pipeline/_writebehind.py``): ``batch_norm`` saves its running statistics and then
updates them in place, unversioned. Torch's backward sees the live tensor; so must
ours, and a write that raced the change must never turn into a checksum error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import ZarrStore


class _UsesSaved(torch.autograd.Function):
    """``w * 2`` forward; backward reads the saved ``s`` (so a stale ``s`` shows)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(s)
        return w * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (s,) = ctx.saved_tensors
        return g * s, None


def _grad(hooks: tsh.OffloadHooks | None, change: Any) -> torch.Tensor:
    w = torch.ones(16, requires_grad=True)
    s = torch.zeros(16)
    if hooks is None:
        out = _UsesSaved.apply(w, s)
        change(s)
    else:
        with hooks:
            out = _UsesSaved.apply(w, s)
        hooks.flush()
    out.sum().backward()
    assert w.grad is not None
    return w.grad


def test_a_tensor_changed_unversioned_mid_write_comes_back_live(tmp_path: Path) -> None:
    def change(s: torch.Tensor) -> None:
        s.data.add_(1)  # ``.data``: the same memory, a counter of its own (no bump)

    want = _grad(None, change)
    store = tsh.open_store(f"file://{tmp_path / 'root'}")
    assert isinstance(store, ZarrStore)
    hooks = tsh.offload(store, min_bytes=0)
    saved: list[torch.Tensor] = []
    real = hooks._pipeline.router.store

    def remember(t: torch.Tensor, nbytes: int, **kw: Any) -> Any:
        saved.append(t)
        return real(t, nbytes, **kw)

    hooks._pipeline.router.store = remember  # type: ignore[method-assign]
    write = store._io.write_sized
    changed: list[str] = []

    def change_between_checksum_and_write(path: str, parts: Any, size: int) -> None:
        # The chunk's crc32c is taken; the bytes change before they reach the file:
        # the race a batch_norm update runs with a write of its running statistics.
        if not changed:
            changed.append(path)
            change(saved[0])
        write(path, parts, size)

    store._io.write_sized = change_between_checksum_and_write  # type: ignore[method-assign]
    try:
        got = _grad(hooks, change)
        assert changed, "the write did not go through the local buffered path"
        assert torch.equal(got, want)  # the live tensor, as torch without hooks
        assert hooks.stats.tensors_kept >= 1 and hooks.stats.fallbacks == 0
        assert len(store) == 0  # the racing write's bytes were discarded
    finally:
        hooks.close()


def test_batch_norm_running_statistics_never_fail_a_read(tmp_path: Path) -> None:
    """The case that found it: channels-last conv + batch norm, everything offloaded,
    many runs (a race: it failed about one run in fifteen before)."""
    for i in range(30):
        torch.manual_seed(i)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()
        ).to(memory_format=torch.channels_last)
        x = torch.randn(2, 3, 16, 16).contiguous(memory_format=torch.channels_last)
        hooks = tsh.offload(f"file://{tmp_path / str(i)}", min_bytes=0)
        try:
            with hooks:
                loss = model(x).sum()
            hooks.flush()
            loss.backward()  # an IntegrityError here is the bug
        finally:
            hooks.close()
