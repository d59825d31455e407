"""Direct I/O from aligned pooled buffers (issue 25): the store side.

NOTE [ Direct I/O ] (``storage/io/_local.py``), NOTE [ Chunk objects ]
(``storage/zarr/_chunkcodec.py``), NOTE [ Aligned buffers ] (``storage/io/_aligned.py``).
The store conformance suite runs with ``direct_io`` on, off and on tmpfs in
``test_store_file.py``.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import ConfigError, IntegrityError, KeyNotFoundError, ZarrStore
from tensorstore_hooks._codec import encode
from tensorstore_hooks.storage.io import probe_direct_io
from tensorstore_hooks.storage.io._aligned import BLOCK_BYTES, AlignedBuffer, address_of
from tensorstore_hooks.storage.zarr._docs import namespace_doc, root_doc
from tensorstore_hooks.testing import assert_same_tensor
from tests._mounts import direct_io_dir, loop_ext4
from tests.storage.test_zarr_layout import _journal_entries, _plain_zarr_payload

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def direct_root(tmp_path: Path) -> Path:
    """A directory where O_DIRECT works (skips, saying why, where it does not)."""
    return direct_io_dir(tmp_path / "root")


@pytest.fixture
def every_class_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Send chunks of every size class through O_DIRECT, not only >= 256 KiB."""
    from tensorstore_hooks.storage.zarr import _chunkcodec

    monkeypatch.setattr(_chunkcodec, "DIRECT_MIN_CHUNK_BYTES", 4096)


def entries_rot_addr(root: Path, key: str) -> int:
    """Where a key's storage starts modulo 4 KiB when read back: ``-rot`` (NOTE
    [ Chunk objects ] rule 4)."""
    return -_journal_entries(root / "ns")[key]["rot"] % BLOCK_BYTES


def _bytes_tensor(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


# Not multiples of 512 or 4096, exact multiples, one byte around each chunk size class.
SIZES = [
    1, 511, 512, 513, 4095, 4096, 4097, 12289, 49147, 65535, 65537, 262143, 262144, 262145,
    300001, 524287, 524289, 1048575, 1048576, 1048577, 3 * MiB + 7,
]  # fmt: skip


# ------------------------------------------------------------ sizes and layout
@pytest.mark.usefixtures("every_class_direct")
@pytest.mark.parametrize("direct_io", ["on", "off"])
def test_odd_sizes_in_every_size_class(direct_root: Path, direct_io: str) -> None:
    """Every size class, sizes that are not multiples of 512 or 4096, zero-size: exact
    bytes back, chunk files exactly one class long (no trailer: block-aligned)."""
    with ZarrStore(direct_root, chunk_bytes="1MiB", namespace="ns", direct_io=direct_io) as store:
        assert store.direct_io.enabled is (direct_io == "on")
        tensors = {n: _bytes_tensor(n, n) for n in SIZES}
        keys = {n: store.put(t) for n, t in tensors.items()}
        empty = store.put(torch.empty(0, 7))
        for n, t in tensors.items():
            got = store.get(keys[n])
            assert torch.equal(got, t), n
            # Read in place: the storage keeps the source's address modulo 4 KiB.
            assert got.data_ptr() % BLOCK_BYTES == entries_rot_addr(direct_root, keys[n])
        assert_same_tensor(store.get(empty), torch.empty(0, 7))
        entries = _journal_entries(direct_root / "ns")
        classes = {e["seg"] for e in entries.values() if e["count"]}
        assert classes == {MiB >> i for i in range(9)}  # 1 MiB down to 4 KiB: all of them
        for e in entries.values():
            for i in range(e["count"]):
                f = direct_root / "ns" / f"seg-{e['seg']}" / "c" / str(e["start"] + i)
                assert f.stat().st_size == e["seg"]
        # Plain zarr reads the same bytes.
        for n, t in tensors.items():
            raw = _plain_zarr_payload(direct_root / "ns", entries[keys[n]], n)
            np.testing.assert_array_equal(raw, t.numpy())


@pytest.mark.parametrize("direct_io", ["on", "off"])
def test_read_lands_in_the_returned_tensors_storage(direct_root: Path, direct_io: str) -> None:
    """No copy on the way back: the tensor's storage is the pooled read buffer (it is
    counted as in use while the tensor lives), at the source's address modulo 4 KiB
    when it was written from the source's memory (its alignment kept), its strides
    are the original's, and the buffer returns to the pool when the tensor dies."""
    with ZarrStore(direct_root, namespace="ns", direct_io=direct_io) as store:
        t = torch.randn(512, 1024).t()  # 2 MiB, transposed: a dense view, offset 0
        key = store.put(t)
        rot = _journal_entries(direct_root / "ns")[key]["rot"]
        assert rot == (-t.data_ptr() % BLOCK_BYTES if direct_io == "on" else 0)
        before = store.buffers
        got = store.get(key)
        assert_same_tensor(got, t)
        assert got.stride() == t.stride() and not got.is_contiguous()
        held = store.buffers
        # A rotated stream lands one block in: the buffer has a block in front.
        assert held.in_use_bytes == before.in_use_bytes + 2 * MiB + (BLOCK_BYTES if rot else 0)
        want = t.data_ptr() % BLOCK_BYTES if rot else 0  # unrotated: page-aligned
        assert got.untyped_storage().data_ptr() % BLOCK_BYTES == want
        del got
        gc.collect()
        assert store.buffers.in_use_bytes == before.in_use_bytes
        assert store.buffer_bytes == store.buffers.held_bytes


@pytest.mark.parametrize("direct_io", ["on", "off"])
def test_views_with_offsets_and_gaps_come_back_exactly(direct_root: Path, direct_io: str) -> None:
    base = torch.randn(1000, 300)
    views = {
        "offset": base[7:],  # storage offset 2100 elements
        "offset_transposed": base[3:900].t(),
        "gapped": base[:, ::3],
        "expanded": torch.randn(1, 300).expand(700, 300),
        "offset_odd_bytes": torch.randint(0, 255, (300_007,), dtype=torch.uint8)[5:],
    }
    with ZarrStore(direct_root, namespace="ns", direct_io=direct_io) as store:
        for name, v in views.items():
            assert_same_tensor(store.get(store.put(v)), v), name


def test_no_allocation_per_tensor_after_the_first_step(direct_root: Path) -> None:
    """A training-like loop: after the first step, read buffers all come
    from the pool (rule 4 of NOTE [ Aligned buffers ])."""
    sizes = [3 * MiB, 8 * MiB, 8 * MiB, 1 * MiB + 4096, 300 * KiB]
    with ZarrStore(direct_root, namespace="ns", buffer_pool_bytes="64MiB") as store:
        allocations = []
        for step in range(4):
            keys = [store.put(torch.full((n // 4,), float(step))) for n in sizes]
            for key in reversed(keys):
                got = store.get(key)
                assert got[0].item() == float(step)
                del got
                store.delete(key)
            allocations.append(store.buffers.allocations)
        assert allocations[1] == allocations[0] and allocations[3] == allocations[0]
        assert store.buffers.reuses > 0 and store.buffers.in_use_bytes == 0
        assert store.buffers.idle_bytes <= 64 * MiB


def test_spare_chunk_files_are_rewritten_in_place_with_direct_io(direct_root: Path) -> None:
    """NOTE [ Spare chunk files ] holds with O_DIRECT: a put/delete loop of the same
    sizes rewrites the same files (still linked: never unlinked and created again),
    whose size stays the chunk size, and reads back each step's bytes."""
    sizes = [1 << 18, 3 << 18, (1 << 20) + 7]  # 1 MiB, 3 MiB, 4 MiB + 28 bytes (floats)
    with ZarrStore(direct_root, namespace="ns", direct_io="on") as store:
        keys = [store.put(torch.full((n,), 0.0)) for n in sizes]
        files = sorted(p for p in direct_root.rglob("*") if p.is_file() and p.parent.name == "c")
        fds = [os.open(p, os.O_RDONLY) for p in files]
        try:
            for step in range(1, 4):
                store.delete_many(keys)
                keys = [store.put(torch.full((n,), float(step))) for n in sizes]
                assert [os.fstat(fd).st_nlink for fd in fds] == [1] * len(fds)
                for key, n in zip(keys, sizes, strict=True):
                    assert torch.equal(store.get(key), torch.full((n,), float(step)))
            now = sorted(p for p in direct_root.rglob("*") if p.is_file() and p.parent.name == "c")
            assert now == files
            for path, fd in zip(files, fds, strict=True):  # exactly the class: seg-C/c/I
                assert os.fstat(fd).st_size == int(path.parent.parent.name.removeprefix("seg-"))
        finally:
            for fd in fds:
                os.close(fd)


def test_buffer_pool_bytes_bounds_idle_buffers(direct_root: Path) -> None:
    with ZarrStore(direct_root, namespace="ns", buffer_pool_bytes=0) as store:
        key = store.put(torch.ones(MiB))
        got = store.get(key)
        assert store.buffers.in_use_bytes == 4 * MiB + BLOCK_BYTES  # a rotated stream
        del got
        assert store.buffers.held_bytes == 0 and store.buffers.idle_limit_bytes == 0
    with pytest.raises(ConfigError, match="buffer_pool_bytes"):
        ZarrStore(direct_root, buffer_pool_bytes="lots")


# ------------------------------------------------------ writes from the tensor
def _at_offset(n: int, lead: int, seed: int) -> torch.Tensor:
    """``n`` random bytes in a storage of their own (storage offset 0) that starts
    ``lead`` bytes past a page boundary."""
    base = np.empty(n + 2 * BLOCK_BYTES, dtype=np.uint8)
    k = (lead - address_of(base)) % BLOCK_BYTES
    t = torch.from_numpy(base[k : k + n])
    t.copy_(_bytes_tensor(n, seed))
    assert t.data_ptr() % BLOCK_BYTES == lead
    return t


@pytest.mark.parametrize(
    ("n", "lead", "chunks"),
    [
        (8 * MiB, 64, 1),  # a torch allocation's usual place; n a multiple of 4 KiB
        (20 * MiB + 100, 64, 11),  # several 2 MiB chunks, the last one partial
        (8 * MiB + 100, 64, 9),  # 1 MiB chunks: the bounced bytes straddle two chunks
        (3 * MiB + 5, 4032, 13),  # rot 64, 256 KiB chunks
        (5 * MiB, 0, 5),  # page-aligned already: no rotation, nothing but a tail
    ],
)
def test_a_direct_put_writes_from_the_tensors_own_memory(
    direct_root: Path, n: int, lead: int, chunks: int
) -> None:
    """NOTE [ Chunk objects ] rule 4: one pwritev per chunk file, every block but the
    last few straight from the tensor's memory, the rest (< 8 KiB) through a bounce
    buffer; no copy buffer; the run is exactly what n bytes need (an 8 MiB tensor
    64 bytes past a page boundary is one 8 MiB chunk); each chunk file holds the
    stored stream and then zeros (nothing from memory around the tensor)."""
    t = _at_offset(n, lead, seed=n)
    lo, hi = t.data_ptr(), t.data_ptr() + n
    with ZarrStore(direct_root, namespace="ns", direct_io="on") as store:
        calls: list[tuple[str, list[tuple[int, int]]]] = []
        real = store._io.write_aligned

        def spy(path: str, views: Any, size: int) -> None:
            calls.append((path, [(address_of(v), len(v)) for v in views]))
            real(path, views, size)

        store._io.write_aligned = spy  # type: ignore[method-assign]
        before = store.buffers.allocations + store.buffers.reuses
        key = store.put(t)
        assert store.buffers.allocations + store.buffers.reuses == before  # nothing copied
        e = _journal_entries(direct_root / "ns")[key]
        rot = -lead % BLOCK_BYTES
        assert (e["rot"], e["count"]) == (rot, chunks)
        assert [c[0].rsplit("/", 1)[1] for c in calls] == [
            str(e["start"] + i) for i in range(chunks)
        ]  # one request per chunk file, in order
        inside = sum(ln for _, views in calls for a, ln in views if lo <= a and a + ln <= hi)
        bounced = sum(ln for _, views in calls for a, ln in views if not lo <= a < hi)
        assert inside == (n - rot) // BLOCK_BYTES * BLOCK_BYTES and bounced <= 2 * BLOCK_BYTES
        assert inside + bounced == sum(
            -(-min(e["seg"], n - i * e["seg"]) // BLOCK_BYTES) * BLOCK_BYTES for i in range(chunks)
        )
        stream = np.roll(t.numpy(), -rot)
        for i in range(chunks):
            f = direct_root / "ns" / f"seg-{e['seg']}" / "c" / str(e["start"] + i)
            data = np.fromfile(f, dtype=np.uint8)
            assert data.size == e["seg"]
            piece = stream[i * e["seg"] : (i + 1) * e["seg"]]
            np.testing.assert_array_equal(data[: piece.size], piece)
            assert not data[piece.size :].any()  # zeros after the stream: never foreign bytes
        got = store.get(key)
        assert torch.equal(got, t) and got.data_ptr() % BLOCK_BYTES == lead


def test_copied_writes_store_the_same_tensors(direct_root: Path) -> None:
    """The alternative write (``zero_copy`` off: one copy into a pooled buffer) stores
    unrotated streams that read back the same, from the same namespace."""
    ts = [_at_offset(n, 64, seed=n) for n in (3 * MiB + 5, 8 * MiB)]
    with ZarrStore(direct_root, namespace="ns", direct_io="on") as store:
        zero = [store.put(t) for t in ts]
        store._codec.zero_copy = False
        copied = [store.put(t) for t in ts]
        assert store.buffers.allocations >= 1  # a copy buffer was used
        entries = _journal_entries(direct_root / "ns")
        assert [entries[k]["rot"] for k in zero] == [4032, 4032]
        assert [entries[k]["rot"] for k in copied] == [0, 0]
        for t, a, b in zip(ts, zero, copied, strict=True):
            assert torch.equal(store.get(a), t) and torch.equal(store.get(b), t)


def test_memory_the_kernel_cannot_pin_is_written_through_a_copy(direct_root: Path) -> None:
    """A direct write from memory the kernel refuses to take part in I/O (EFAULT: a
    device mapping, say) is not an error: the put is written again through a copy
    buffer, unrotated, and reads back exactly."""
    t = _at_offset(3 * MiB + 5, 64, seed=1)
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel()
    with ZarrStore(direct_root, namespace="ns", direct_io="on") as store:
        real = store._io.write_aligned

        def refuse_the_tensors_memory(path: str, views: Any, size: int) -> None:
            if any(lo <= address_of(v) < hi for v in views):
                raise OSError(errno.EFAULT, "Bad address")
            real(path, views, size)

        store._io.write_aligned = refuse_the_tensors_memory  # type: ignore[method-assign]
        key = store.put(t)
        assert _journal_entries(direct_root / "ns")[key]["rot"] == 0
        assert torch.equal(store.get(key), t)


def test_rotated_keys_read_back_without_direct_io(direct_root: Path) -> None:
    """A namespace written with direct I/O (rotated streams) reopened with it off (or
    where it is unavailable) reads back every key exactly: the rotation is the
    layout's, not the read path's."""
    ts = [_at_offset(n, lead, seed=n) for n, lead in ((3 * MiB + 5, 64), (2 * MiB + 3, 128))]
    with ZarrStore(direct_root, namespace="ns", direct_io="on") as store:
        keys = [store.put(t) for t in ts]
    with ZarrStore(direct_root, namespace="ns", direct_io="off") as store:
        for key, t in zip(keys, ts, strict=True):
            got = store.get(key)
            assert torch.equal(got, t) and got.data_ptr() % BLOCK_BYTES == t.data_ptr() % 4096


# ----------------------------------------------------------- put_aligned (phase B)
@pytest.mark.parametrize("n", [2 * MiB, 2 * MiB + 1000, 9 * MiB + 5])
def test_put_aligned_writes_from_the_callers_buffer(direct_root: Path, n: int) -> None:
    """The CUDA path's entry point, on CPU: a page-aligned buffer that already holds a
    tensor's bytes (where a device-to-host copy lands) is what the direct writes are
    issued from, block for block: no copy buffer, no host copy."""
    t = torch.randint(0, 255, (n,), dtype=torch.uint8)
    meta, payload = encode(t)
    with ZarrStore(direct_root, namespace="ns", direct_io="on") as store:
        buf = AlignedBuffer(n + 2 * BLOCK_BYTES)
        buf.view[:n] = payload.data
        buf.view[n:] = b"\xff" * (len(buf.view) - n)  # garbage after the payload
        issued: list[tuple[int, int]] = []
        real = store._io.write_aligned

        def spy(path: str, views: Any, size: int) -> None:
            issued.extend((address_of(v), len(v)) for v in views)
            real(path, views, size)

        store._io.write_aligned = spy  # type: ignore[method-assign]
        before = store.buffers.allocations + store.buffers.reuses
        key = store.put_aligned(meta, buf.view)
        assert store.buffers.allocations + store.buffers.reuses == before  # nothing copied
        start = address_of(buf.view)
        assert issued and all(start <= a and a + ln <= start + len(buf.view) for a, ln in issued)
        assert issued[0][0] == start and sum(ln for _, ln in issued) == -(-n // 4096) * 4096
        assert torch.equal(store.get(key), t)


def test_put_aligned_from_a_read_buffer_and_without_direct_io(tmp_path: Path) -> None:
    """Any aligned writable buffer works, e.g. one get_into filled; with direct I/O
    off it is an ordinary put."""
    t = torch.randn(3 * MiB // 4)  # a whole number of blocks
    for mode in ("auto", "off"):
        with ZarrStore(tmp_path / mode, namespace="ns", direct_io=mode) as store:
            buf = AlignedBuffer(3 * MiB)
            meta = store.get_into(store.put(t), buf.view)
            again = store.put_aligned(meta, buf.view)
            assert torch.equal(store.get(again), t)


def test_put_aligned_refuses_buffers_it_cannot_write_from(direct_root: Path) -> None:
    meta, _ = encode(torch.randn(1024))
    buf = AlignedBuffer(2 * BLOCK_BYTES)
    with ZarrStore(direct_root, namespace="ns") as store:
        with pytest.raises(ConfigError, match="start on a 4096-byte boundary"):
            store.put_aligned(meta, buf.view[64 : 64 + BLOCK_BYTES])
        with pytest.raises(ConfigError, match="at least 4096 bytes"):
            store.put_aligned(meta, buf.view[:2048])
        with pytest.raises(ConfigError, match="read-only"):
            store.put_aligned(meta, memoryview(bytes(BLOCK_BYTES)))
        with pytest.raises(ConfigError, match="expected a buffer"):
            store.put_aligned(meta, 42)
        assert len(store) == 0  # nothing was written


@pytest.mark.parametrize("direct_io", ["on", "off"])
def test_get_into_reads_into_the_callers_buffer(direct_root: Path, direct_io: str) -> None:
    """The read side of the CUDA path: a key written from aligned memory (put_aligned,
    as the staging path writes) lands in a page-aligned buffer the caller owns (a
    pinned staging buffer), with direct I/O straight from the disk. A key written
    from a tensor's own memory (stored rotated) reads back exactly too, through a
    pooled buffer and a copy."""
    t = torch.randint(0, 255, (9 * MiB + 5,), dtype=torch.uint8)
    meta_in, payload = encode(t)
    with ZarrStore(direct_root, namespace="ns", direct_io=direct_io) as store:
        src = AlignedBuffer(10 * MiB)
        src.view[: t.numel()] = payload.data
        key = store.put_aligned(meta_in, src.view)
        buf = AlignedBuffer(10 * MiB)
        landed: list[int] = []
        real = store._io.read_aligned

        def spy(path: str, view: memoryview) -> tuple[int, int]:
            landed.append(address_of(view))
            return real(path, view)

        store._io.read_aligned = spy  # type: ignore[method-assign]
        before = store.buffers.allocations + store.buffers.reuses
        meta = store.get_into(key, buf.view)
        assert meta.nbytes == t.numel()
        assert np.array_equal(np.frombuffer(buf.view, np.uint8, count=t.numel()), t.numpy())
        assert store.buffers.allocations + store.buffers.reuses == before  # no buffer of ours
        start = address_of(buf.view)
        if direct_io == "on":
            assert landed[0] == start and all(start <= a < start + 10 * MiB for a in landed)
        else:
            assert not landed
        rotated = store.put(t)
        out = AlignedBuffer(10 * MiB)
        store.get_into(rotated, out.view)
        assert np.array_equal(np.frombuffer(out.view, np.uint8, count=t.numel()), t.numpy())
        with pytest.raises(ConfigError, match="get_into: the buffer must be writable"):
            store.get_into(key, buf.view[4096 : 4096 + 9 * MiB])  # one block short
        store.set_buffer_pool_bytes(0)
        assert store.buffers.idle_bytes == 0 and store.buffers.idle_limit_bytes == 0


def test_get_into_from_a_compressed_store(tmp_path: Path) -> None:
    t = torch.arange(300_000, dtype=torch.float32)
    with ZarrStore(tmp_path, namespace="ns", codec="zstd:1", chunk_bytes="256KiB") as store:
        buf = AlignedBuffer(2 * MiB)
        meta = store.get_into(store.put(t), buf.view)
        got = np.frombuffer(buf.view, dtype=np.float32, count=meta.nbytes // 4)
        assert np.array_equal(got, t.numpy())


# --------------------------------------------------------- modes and reporting
def test_direct_io_modes_and_where_it_cannot_be_had(tmp_path: Path) -> None:
    with ZarrStore("memory://") as mem:
        assert not mem.direct_io.enabled and mem.direct_io.reason == "not a local directory"
    with pytest.raises(ConfigError, match="direct_io='on' needs a local directory"):
        ZarrStore("memory://", direct_io="on")
    with pytest.raises(ConfigError, match=r"direct_io.*'auto'.*got 'sometimes'"):
        ZarrStore(tmp_path, direct_io="sometimes")
    with ZarrStore(tmp_path / "b", direct_io=False) as off:  # YAML's `off`
        assert off.direct_io.mode == "off" and not off.direct_io.enabled


def test_tmpfs_root_falls_back_and_says_so() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm here")
    root = shm / f"tsh-test-{uuid.uuid4().hex}"
    try:
        with ZarrStore(root) as store:
            assert not store.direct_io.enabled and "tmpfs" in store.direct_io.reason
            assert torch.equal(store.get(store.put(torch.ones(MiB))), torch.ones(MiB))
            from tensorstore_hooks.cli.inspect import inspect_root

            assert inspect_root(str(root))["direct_io"].startswith("off (the root is on tmpfs")
        with pytest.raises(ConfigError, match="tmpfs"):
            ZarrStore(root, direct_io="on")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_config_and_offload_keyword_reach_the_store(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.yaml"
    for text, want in (("on", "on"), ("off", "off"), ("auto", "auto"), ('"off"', "off")):
        cfg_file.write_text(f"store:\n  direct_io: {text}\n")
        assert tsh.load_config(cfg_file).store.direct_io == want
    cfg_file.write_text("store:\n  direct_io: sometimes\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: store.direct_io: expected 'auto'"):
        tsh.load_config(cfg_file)
    from tensorstore_hooks.config._settings import dump_config

    assert "direct_io: auto" in dump_config(tsh.EffectiveConfig())
    with tsh.offload(str(tmp_path / "kw"), direct_io="off") as hooks:
        assert hooks.store.direct_io.mode == "off"  # type: ignore[attr-defined]
    cfg_file.write_text(f"store:\n  url: {tmp_path / 'yaml'}\n  direct_io: off\n")
    with tsh.offload(config=cfg_file) as hooks:
        assert hooks.store.direct_io.mode == "off"  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="direct_io='on' needs a local directory"):
        tsh.offload("memory://", direct_io="on")


# ------------------------------------------------------------------ formats
def _old_format_namespace(root: Path, ns: str) -> None:
    """A namespace as format 2 wrote it: crc32c trailers, the codec in the metadata."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "zarr.json").write_bytes(root_doc(2))
    (root / ns).mkdir()
    (root / ns / "zarr.json").write_bytes(namespace_doc(2, ns, 8 * MiB, "none"))


def test_a_namespace_of_an_older_format_is_refused_naming_its_version(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _old_format_namespace(root, "old")
    with pytest.raises(ConfigError, match=r"namespace 'old' is in layout format 2.*format 4"):
        ZarrStore(root, namespace="old")
    assert (root / "old" / "zarr.json").exists()  # refused, not touched
    # The rest of an older root is usable: a new namespace is format 4.
    with ZarrStore(root, namespace="new") as store:
        key = store.put(torch.arange(10))
        assert torch.equal(store.get(key), torch.arange(10))
    doc = json.loads((root / "new" / "zarr.json").read_text())
    assert doc["attributes"]["tensorstore_hooks"]["format"] == 4


def test_inspect_lists_namespaces_of_both_formats(tmp_path: Path) -> None:
    from tensorstore_hooks.cli.inspect import inspect_root

    root = tmp_path / "root"
    _old_format_namespace(root, "old")
    with ZarrStore(root, namespace="new") as store:
        store.put(torch.ones(3))
        listing = inspect_root(str(root))
    names = {n["name"]: n for n in listing["namespaces"]}
    assert names["new"]["tensors"] == 1 and names["old"]["tensors"] == 0
    assert (names["new"]["format"], names["old"]["format"]) == (4, 2)
    done = subprocess.run(
        [sys.executable, "-m", "tensorstore_hooks", "inspect", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "namespace old  (format 2, not readable by this version" in done.stdout
    want = "available" if probe_direct_io(str(root))[0] else "off ("
    assert f"direct I/O: {want}" in done.stdout and listing["direct_io"].startswith(want)
    assert "namespace new  (format 4, chunk" in done.stdout


def test_offloaded_bytes_leave_the_page_cache(direct_root: Path, tmp_path: Path) -> None:
    """What direct I/O is for: a stored tensor's chunk files are not in RAM (with
    direct_io off they are); chunks of the small classes stay buffered by design."""
    from tests.storage.test_chunkio import _resident_pages

    def resident(root: Path, store: ZarrStore, key: str) -> int:
        e = _journal_entries(root / "ns")[key]
        seg = root / "ns" / f"seg-{e['seg']}" / "c"
        return sum(_resident_pages(str(seg / str(e["start"] + i))) for i in range(e["count"]))

    with ZarrStore(direct_root, namespace="ns", direct_io="on") as store:
        big = store.put(torch.randn(3 * MiB))  # 12 MiB: 8 MiB + 4 MiB chunks
        small = store.put(torch.randn(16 * KiB))  # one 64 KiB chunk: below the floor
        assert resident(direct_root, store, big) == 0
        assert resident(direct_root, store, small) > 0
    buffered_root = tmp_path / "buffered"
    with ZarrStore(buffered_root, namespace="ns", direct_io="off") as store:
        big = store.put(torch.randn(3 * MiB))
        assert resident(buffered_root, store, big) > 0


# ------------------------------------------------------------ faults and crashes
@pytest.fixture
def small_ext4(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB ext4 filesystem (O_DIRECT works on it; tmpfs would not test it)."""
    with loop_ext4(tmp_path / "ext4", tmp_path / "ext4.img", 24 * MiB) as mnt:
        yield mnt


def test_a_full_disk_is_never_acknowledged_with_direct_io(small_ext4: Path) -> None:
    """ENOSPC in the middle of O_DIRECT chunk writes: the put raises
    QuotaExceededError and is not stored, what was acknowledged reads back exactly
    (also after reopening), and once space is back, writes work again."""
    from tensorstore_hooks import QuotaExceededError

    root = small_ext4 / "root"
    acked: dict[str, torch.Tensor] = {}
    failures: list[BaseException] = []
    with ZarrStore(root, namespace="ns", direct_io="on", spare_bytes=0) as store:
        for i in range(40):  # 1.5 MiB each: far more than the filesystem holds
            t = torch.full((3 * MiB // 8,), float(i))
            try:
                key = store.put(t)
            except Exception as e:
                failures.append(e)
                continue
            acked[key] = t
        assert failures and acked
        assert all(isinstance(e, QuotaExceededError) for e in failures), failures[:2]
        assert "not stored" in str(failures[0])
        for key, t in acked.items():
            assert torch.equal(store.get(key), t)
        assert len(store) == len(acked)
    with ZarrStore(root, namespace="ns", direct_io="on") as again:
        assert sorted(again.keys()) == sorted(acked)
        for key, t in acked.items():
            assert torch.equal(again.get(key), t)
        again.delete_many(list(acked)[:4])
        fresh = again.put(torch.ones(3 * MiB // 8))
        assert torch.equal(again.get(fresh), torch.ones(3 * MiB // 8))


def _fill(directory: Path) -> Path:
    """Fill the filesystem of ``directory`` to the last block (as root: the reserved
    blocks too); returns the file that holds the space."""
    filler = directory / "filler"
    chunk = b"\xff" * MiB
    with open(filler, "wb", buffering=0) as f:
        for size in (MiB, 4 * KiB, 512):
            while True:
                try:
                    f.write(chunk[:size])
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
            os.fsync(f.fileno())
    return filler


def _a_namespace_on_a_full_disk(fs: Path) -> Path:
    """A namespace with one key (its documents, index and lock in place), on a
    filesystem then filled to the last block: opening it again writes nothing new but
    the direct-I/O probe."""
    root = fs / "root"
    with ZarrStore(root, namespace="ns", direct_io="off") as store:
        store.put(torch.ones(16))
    _fill(fs)
    return root


def test_a_probe_a_full_disk_kept_from_running_runs_again(small_ext4: Path) -> None:
    """Issue 36, finding 12: ``direct_io="auto"`` opened when the disk had no room for
    the probe file is buffered only until there is room again, not for the store's
    whole life (NOTE [ Direct I/O ] rule 2)."""
    root = _a_namespace_on_a_full_disk(small_ext4)
    with ZarrStore(root, namespace="ns", direct_io="auto") as store:
        status = store.direct_io
        assert not status.enabled and "No space left" in status.reason
        assert "probed again" in status.reason
        (small_ext4 / "filler").unlink()  # room again
        time.sleep(1.1)  # the probe runs again at most once a second
        t = torch.randn(2 * MiB)  # 8 MiB: a size class that goes direct
        key = store.put(t)
        assert store.direct_io.enabled and store.direct_io.reason == ""
        assert store.moves_direct(key)
        assert torch.equal(store.get(key), t)
        moved = store.transfers
        assert moved.direct_written == t.nbytes and moved.direct_read == t.nbytes


def test_direct_io_on_a_full_disk_is_a_disk_full_error(small_ext4: Path) -> None:
    """Issue 36, finding 12: ``direct_io="on"`` on a full disk is the disk-full error
    a put would meet (free space and retry), not a ConfigError saying the filesystem
    cannot do O_DIRECT (it can); once there is room, it opens with direct I/O on."""
    from tensorstore_hooks import QuotaExceededError

    root = _a_namespace_on_a_full_disk(small_ext4)
    with pytest.raises(QuotaExceededError) as info:
        ZarrStore(root, namespace="ns", direct_io="on")
    assert not isinstance(info.value, ConfigError)
    msg = str(info.value)
    assert "filesystem is full" in msg and "probe" in msg and "free space" in msg
    (small_ext4 / "filler").unlink()
    with ZarrStore(root, namespace="ns", direct_io="on") as store:
        assert store.direct_io.enabled
        assert torch.equal(store.get(store.put(torch.ones(MiB))), torch.ones(MiB))


_CRASH_CHILD = textwrap.dedent(
    """
    import sys, torch
    from tensorstore_hooks import ZarrStore

    root, progress = sys.argv[1], sys.argv[2]
    def tensor(i):
        return torch.full((300_000,), float(i)) + torch.arange(300_000, dtype=torch.float32)
    store = ZarrStore(root, namespace="ns", direct_io="on")
    live = []
    with open(progress, "w", buffering=1) as out:
        for i in range(100_000):
            key = store.put(tensor(i))  # keys are issued in order: key i is tensor(i)
            out.write(f"ack {key}\\n")
            live.append(key)
            if len(live) > 3:  # deletes make spares: later puts rewrite them in place
                old = live.pop(0)
                store.delete(old)
                out.write(f"del {old}\\n")
    """
)


def test_sigkill_mid_write_never_gives_wrong_bytes(direct_root: Path, tmp_path: Path) -> None:
    """A writer killed with SIGKILL while it rewrites spare chunk files with O_DIRECT:
    on reopening, every key acknowledged and not deleted reads back exactly, and no
    key ever reads back as another tensor's bytes."""
    progress = tmp_path / "progress"
    child = subprocess.Popen([sys.executable, "-c", _CRASH_CHILD, str(direct_root), str(progress)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if progress.exists() and progress.read_text().count("del ") >= 12:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the writer made no progress")
        time.sleep(0.013)  # somewhere inside a put
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    acked: set[str] = set()
    for line in progress.read_text().splitlines():
        op, _, key = line.partition(" ")
        if op == "ack":
            acked.add(key)
        elif op == "del" and key:
            acked.discard(key)

    def tensor(i: int) -> torch.Tensor:
        return torch.full((300_000,), float(i)) + torch.arange(300_000, dtype=torch.float32)

    with ZarrStore(direct_root, namespace="ns", direct_io="on") as store:
        assert acked <= set(store.keys())
        for key in store.keys():  # noqa: SIM118 - TensorStore has no __iter__
            try:
                got = store.get(key)
            except (IntegrityError, KeyNotFoundError):
                assert key not in acked  # only a put the crash cut short may be unreadable
                continue
            assert torch.equal(got, tensor(int(key, 16))), key


def test_io_threads_do_not_keep_the_last_tensor_they_read(direct_root: Path) -> None:
    """A tensor read on an I/O thread comes back to the pool as soon as its owner drops
    it: the idle thread holds no reference to its last result (it held one until its
    next task, which kept up to one read buffer per thread out of the pool)."""
    import weakref

    from tensorstore_hooks.pipeline._iopool import READ, IOPool

    pool = IOPool(2)
    try:
        with ZarrStore(direct_root, namespace="ns") as store:
            key = store.put(torch.randn(MiB))
            fut = pool.submit(READ, store.get, key)
            got = weakref.ref(fut.result())
            del fut
            gc.collect()
            assert got() is None
            assert store.buffers.in_use_bytes == 0
    finally:
        pool.shutdown()


# ------------------------------------------------------------------ gradients
@pytest.mark.parametrize("direct_io", ["on", "off"])
def test_gradients_are_bit_identical(direct_root: Path, direct_io: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.LayerNorm(1024),
        torch.nn.Linear(1024, 512), torch.nn.Tanh(), torch.nn.Linear(512, 1),
    )  # fmt: skip
    x = torch.randn(700, 512)

    def grads(hooks: Any) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with hooks if hooks is not None else contextlib.nullcontext():
            loss = model(x).square().sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want = grads(None)
    hooks = tsh.offload(str(direct_root), direct_io=direct_io, min_bytes="64KiB")
    store = hooks.store
    assert isinstance(store, ZarrStore) and store.direct_io.enabled is (direct_io == "on")
    try:
        got = grads(hooks)
        assert hooks.stats.tensors_offloaded >= 4 and hooks.stats.bytes_read > 0
        assert store.buffers.reuses + store.buffers.allocations > 0  # read into pooled buffers
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    finally:
        hooks.close()
