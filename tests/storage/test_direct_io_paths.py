"""Direct I/O as the rest of the system sees it (issue 25, phase B): ranged reads of
rotated streams (the daemon's disk tier), the pipeline's ``stats.direct_io`` and
direct/buffered byte counts, the read-buffer pool sized by the prefetch window and
reused across steps, and the daemon's disk tier on the same path."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import ZarrStore
from tensorstore_hooks._codec import encode
from tensorstore_hooks.storage.daemon._client import DaemonStore, fetch_stats
from tensorstore_hooks.storage.io._aligned import BLOCK_BYTES, address_of
from tensorstore_hooks.storage.zarr._store import DEFAULT_BUFFER_POOL_BYTES
from tests._mounts import direct_io_dir
from tests.daemon_fixtures import DaemonLauncher, daemons

__all__ = ["daemons"]  # the fixture, re-exported for pytest

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def direct_root(tmp_path: Path) -> Path:
    """A directory where O_DIRECT works (skips, saying why, where it does not)."""
    return direct_io_dir(tmp_path / "root")


def _payload_at(n: int, lead: int, seed: int) -> np.ndarray:
    """``n`` random bytes starting ``lead`` bytes past a page boundary."""
    base = np.empty(n + 2 * BLOCK_BYTES, dtype=np.uint8)
    k = (lead - address_of(base)) % BLOCK_BYTES
    out = base[k : k + n]
    out[:] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return out


# ------------------------------------------------------------------ read_range
@pytest.mark.parametrize("direct_io", ["on", "off"])
@pytest.mark.parametrize(("n", "lead"), [(3 * MiB + 5, 64), (1 * MiB, 100), (2 * MiB + 7, 0)])
def test_read_range_gives_payload_bytes_of_rotated_streams(
    direct_root: Path, direct_io: str, n: int, lead: int
) -> None:
    """``read_range`` (how the daemon streams a disk-tier answer) returns the payload's
    bytes, not the stored stream's, for a key written from memory that was not
    page-aligned (stored rotated by ``-address mod 4096``, layout format 4): every
    chunk alone, the first two together, and the whole payload."""
    data = _payload_at(n, lead, seed=n + lead)
    meta, _ = encode(torch.from_numpy(data))
    with ZarrStore(direct_root, namespace="ns", chunk_bytes="256KiB") as store:
        key = store.put_blob(meta, data)
    with ZarrStore(direct_root, namespace="ns", chunk_bytes="256KiB", direct_io=direct_io) as s:
        chunk = s.chunk_class(key)
        assert chunk == 256 * KiB
        starts = list(range(0, n, chunk))
        for start in starts:
            length = min(chunk, n - start)
            got = s.read_range(key, start, length)
            np.testing.assert_array_equal(got, data[start : start + length])
        np.testing.assert_array_equal(s.read_range(key, 0, 2 * chunk), data[: 2 * chunk])
        np.testing.assert_array_equal(s.read_range(key, chunk, 2 * chunk), data[chunk : 3 * chunk])
        np.testing.assert_array_equal(s.read_range(key, 0, n), data)
        del got
        assert s.buffers.in_use_bytes == 0  # every scratch buffer went back


# --------------------------------------------------------------- pipeline stats
def _mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256),
        torch.nn.Tanh(), torch.nn.Linear(256, 1),
    )  # fmt: skip
    return model, torch.randn(512, 256)


def _step(model: torch.nn.Module, x: torch.Tensor, hooks: Any) -> None:
    model.zero_grad(set_to_none=True)
    with hooks if hooks is not None else contextlib.nullcontext():
        loss = model(x).square().sum()
    loss.backward()


@pytest.mark.parametrize("direct_io", ["on", "off"])
def test_stats_say_which_path_and_count_its_bytes(direct_root: Path, direct_io: str) -> None:
    """``stats.direct_io`` says how the store moves chunk files, and every byte written
    or read is counted as direct or buffered (512 KiB+ tensors: direct-size classes)."""
    model, x = _mlp()
    hooks = tsh.offload(str(direct_root), direct_io=direct_io, min_bytes="256KiB")
    try:
        _step(model, x, hooks)
        hooks.flush()
        s = hooks.stats
        moved = s.bytes_written + s.bytes_read
        assert s.bytes_read > 0 and moved > 0
        if direct_io == "on":
            assert s.direct_io == "on"
            assert (s.bytes_direct, s.bytes_buffered) == (moved, 0)
            assert "direct I/O on" in s.summary()
        else:
            assert s.direct_io == "off (direct_io is 'off')"
            assert (s.bytes_direct, s.bytes_buffered) == (0, moved)
        store = hooks.store
        assert isinstance(store, ZarrStore)
        t = store.transfers
        assert t.direct_written + t.buffered_written == s.bytes_written
        assert t.direct_read + t.buffered_read == s.bytes_read
        snap = s.snapshot()
        _step(model, x, hooks)
        since = hooks.stats - snap
        assert since.direct_io == s.direct_io and since.bytes_direct + since.bytes_buffered > 0
        hooks.stats.reset()
        assert hooks.stats.direct_io == s.direct_io and hooks.stats.bytes_direct == 0
    finally:
        hooks.close()


def test_stats_of_a_store_without_direct_io() -> None:
    """A memory store has no such path: it says why, and every byte is buffered."""
    model, x = _mlp()
    hooks = tsh.offload("memory://", min_bytes="256KiB")
    try:
        _step(model, x, hooks)
        hooks.flush()
        s = hooks.stats
        assert s.bytes_read > 0 and s.direct_io == "off (not a local directory)"
        assert (s.bytes_direct, s.bytes_buffered) == (0, s.bytes_written + s.bytes_read)
    finally:
        hooks.close()


# ------------------------------------------------------------------- the pool
def test_read_buffers_follow_the_prefetch_window_and_are_reused(direct_root: Path) -> None:
    """The store a pipeline owns keeps at most ``max(prefetch window, default)`` idle
    read buffers (the window's memory between backward passes), and a steady loop
    reads into reused buffers after its first step (a later step may map one more
    where its reads ahead overlap its live tensors a little more than the first
    did); gradients stay bit-identical."""
    model, x = _mlp()
    _step(model, x, None)
    want = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    big = 512 * MiB  # over the default: the window, not the default, is the bound
    hooks = tsh.offload(str(direct_root), min_bytes="256KiB", prefetch=big)
    store = hooks.store
    assert isinstance(store, ZarrStore)
    try:
        allocations, reuses = [], []
        for _ in range(4):
            _step(model, x, hooks)
            got = [p.grad for p in model.parameters() if p.grad is not None]
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            del got
            allocations.append(store.buffers.allocations)
            reuses.append(store.buffers.reuses)
        assert store.buffers.idle_limit_bytes == big
        mapped, reused = allocations[3] - allocations[0], reuses[3] - reuses[0]
        assert allocations[0] > 0 and mapped <= 2, allocations
        assert reused >= 5 * max(mapped, 1), (allocations, reuses)
    finally:
        hooks.close()
    small = tsh.offload(str(direct_root), min_bytes="256KiB", prefetch="1MiB")
    try:
        _step(model, x, small)
        limit = small.store.buffers.idle_limit_bytes  # type: ignore[attr-defined]
        assert limit == DEFAULT_BUFFER_POOL_BYTES  # never below the store's own default
    finally:
        small.close()


def test_a_store_the_user_passed_keeps_its_pool_size(direct_root: Path) -> None:
    """A store the caller made (and may share) is not resized by a pipeline."""
    model, x = _mlp()
    with ZarrStore(direct_root, namespace="mine", buffer_pool_bytes="8MiB") as store:
        hooks = tsh.offload(store, min_bytes="256KiB", prefetch="512MiB")
        try:
            _step(model, x, hooks)
            assert store.buffers.idle_limit_bytes == 8 * MiB
            assert hooks.stats.direct_io == "on" and hooks.stats.bytes_direct > 0
        finally:
            hooks.close()


# ------------------------------------------------------------------- the daemon
def test_the_daemons_disk_tier_moves_bytes_with_direct_io(
    daemons: DaemonLauncher, direct_root: Path
) -> None:
    """The daemon's disk tier is a ZarrStore on the same path: where the root allows
    ``O_DIRECT``, its stats say so and count the bytes it moved that way, and a
    tensor streamed back (``read_range``, rotated or not) is exact."""
    d = daemons.start("--memory-quota", "0", "--root", str(direct_root / "daemon"))
    t = torch.randn(3 * MiB + 1)  # 12 MiB on disk (memory quota 0)
    with DaemonStore(d.url) as store:
        key = store.put(t)
        assert torch.equal(store.get(key), t)
        snap = fetch_stats(d.url)
    disk = snap["tiers"]["disk"]
    assert disk["direct_io"] is True and disk["direct_io_reason"] == ""
    counters = snap["counters"]
    assert counters["disk_direct_bytes"] >= 2 * t.nbytes  # written and read
    assert counters["disk_buffered_bytes"] == 0
    from tensorstore_hooks.cli.stats import format_stats

    assert "disk I/O     O_DIRECT on: " in format_stats(snap)


# ------------------------------------------------------------ the CUDA path
def test_a_device_tensors_write_is_issued_from_the_pinned_buffer_it_landed_in(
    direct_root: Path,
) -> None:
    """On the fake accelerator (CPU tensors treated as device ones, the real staging
    code): each saved tensor's device-to-host copy lands in a pinned staging buffer,
    and the direct write of its chunks is issued from that buffer's own memory, every
    block but the few bounced ones (< 8 KiB a tensor): no host copy in between."""
    from tests.fake_accelerator import CpuAsAccelerator, broken_rules, on_fake_accelerator

    model, x = _mlp()
    _step(model, x, None)
    want = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    hooks = tsh.offload(str(direct_root), min_bytes="256KiB")
    ops = CpuAsAccelerator()
    on_fake_accelerator(hooks, ops)
    store = hooks.store
    assert isinstance(store, ZarrStore) and store.direct_io.enabled
    writes: list[list[tuple[int, int]]] = []
    real = store._io.write_aligned

    def spy(path: str, views: Any, size: int) -> None:
        writes.append([(address_of(v), len(v)) for v in views])
        real(path, views, size)

    store._io.write_aligned = spy  # type: ignore[method-assign]
    try:
        _step(model, x, hooks)
        hooks.flush()
        got = [p.grad for p in model.parameters() if p.grad is not None]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert ops.to_host_calls > 0 and writes
        spans = [
            (b.untyped_storage().data_ptr(), b.untyped_storage().nbytes()) for b in ops.buffers
        ]

        def pinned(addr: int, n: int) -> bool:
            return any(lo <= addr and addr + n <= lo + size for lo, size in spans)

        inside = sum(n for views in writes for a, n in views if pinned(a, n))
        total = sum(n for views in writes for _, n in views)
        tensors = hooks.stats.tensors_offloaded
        assert total - inside <= tensors * 2 * BLOCK_BYTES, (inside, total, tensors)
        assert hooks.stats.bytes_direct >= hooks.stats.bytes_written > 0
    finally:
        hooks.close()
    assert broken_rules() == []
