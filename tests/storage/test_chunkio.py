"""The ChunkIO conformance suite (``chunkio_conformance.py``) on each backend.

``FsspecIO`` runs here over fsspec's local and memory filesystems (no network);
``tests/storage/test_s3.py`` runs the same suite over S3 (moto).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from tensorstore_hooks import ConfigError
from tensorstore_hooks.storage.io import (
    ChunkIO,
    FsspecIO,
    LocalIO,
    MemoryIO,
    probe_direct_io,
)
from tensorstore_hooks.storage.io._aligned import BLOCK_BYTES, AlignedBuffer
from tensorstore_hooks.testing import ChunkIOConformance


class TestLocalIO(ChunkIOConformance):
    @pytest.fixture
    def io(self, tmp_path: Path) -> Iterator[ChunkIO]:
        io = LocalIO(str(tmp_path / "root"))
        yield io
        io.close()

    def set_raw(self, io: ChunkIO, path: str, data: bytes) -> None:
        full = Path(io.url.removeprefix("file://"), path)
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_bytes(data)

    def get_raw(self, io: ChunkIO, path: str) -> bytes | None:
        full = Path(io.url.removeprefix("file://"), path)
        return full.read_bytes() if full.is_file() else None

    def test_flags(self, io: ChunkIO) -> None:
        assert io.supports_append and io.supports_rewrite_in_place and io.supports_direct_read
        assert not io.is_private_memory

    def test_rewrite_keeps_the_file(self, io: ChunkIO) -> None:
        """supports_rewrite_in_place: an object rewritten is the same file (inode)."""
        io.write("f", [b"x" * 8192])
        full = os.path.join(io.url.removeprefix("file://"), "f")
        fd = os.open(full, os.O_RDONLY)
        try:
            io.write("f", [b"y" * 8192])
            assert os.fstat(fd).st_nlink == 1  # still linked: not unlinked and recreated
        finally:
            os.close(fd)


def _direct_io(root: Path) -> LocalIO:
    """A LocalIO with O_DIRECT on, or a skip saying why this filesystem refuses it."""
    root.mkdir(parents=True, exist_ok=True)
    ok, why = probe_direct_io(str(root))
    if not ok:
        pytest.skip(f"no direct I/O under {root}: {why}")
    io = LocalIO(str(root))
    assert io.configure_direct_io("on", "probe").enabled
    return io


def _resident_pages(path: str) -> int:
    """Pages of ``path`` in the page cache (mincore(2) over a private mapping)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        anchor = ctypes.c_char.from_buffer(mm)
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
        assert rc == 0, os.strerror(ctypes.get_errno())
        del anchor
        return sum(v & 1 for v in vec)
    finally:
        mm.close()


class TestLocalDirectIO(TestLocalIO):
    """The whole suite again with O_DIRECT chunk I/O turned on (NOTE [ Direct I/O ])."""

    @pytest.fixture
    def io(self, tmp_path: Path) -> Iterator[ChunkIO]:
        io = _direct_io(tmp_path / "root")
        yield io
        io.close()

    def test_aligned_round_trip_sets_the_size(self, io: ChunkIO) -> None:
        out = AlignedBuffer(4 * BLOCK_BYTES)
        out.view[:] = os.urandom(len(out.view))
        io.write_aligned(
            "c/0", [out.view[: 2 * BLOCK_BYTES], out.view[2 * BLOCK_BYTES :]], 16 * BLOCK_BYTES
        )
        raw = self.get_raw(io, "c/0")
        assert raw is not None and len(raw) == 16 * BLOCK_BYTES  # extended to the size asked
        assert raw[: 4 * BLOCK_BYTES] == bytes(out.view) and raw[4 * BLOCK_BYTES :] == bytes(
            12 * BLOCK_BYTES
        )
        back = AlignedBuffer(4 * BLOCK_BYTES)
        assert io.read_aligned("c/0", back.view) == (4 * BLOCK_BYTES, 16 * BLOCK_BYTES)
        assert back.view == out.view
        # Rewritten shorter than it is: cut back to the size asked.
        io.write_aligned("c/0", [out.view[:BLOCK_BYTES]], 2 * BLOCK_BYTES)
        raw = self.get_raw(io, "c/0")
        assert raw is not None and len(raw) == 2 * BLOCK_BYTES
        # A read past the end stops there.
        assert io.read_aligned("c/0", back.view) == (2 * BLOCK_BYTES, 2 * BLOCK_BYTES)
        with pytest.raises(FileNotFoundError):
            io.read_aligned("c/missing", back.view)

    def test_a_new_object_is_extended_with_a_hole(self, io: ChunkIO) -> None:
        buf = AlignedBuffer(BLOCK_BYTES)
        io.write_aligned("h/0", [buf.view], 1 << 20)
        st = os.stat(Path(io.url.removeprefix("file://"), "h/0"))
        assert st.st_size == 1 << 20
        assert st.st_blocks * 512 < 1 << 20  # no zero-fill of the blocks after the data

    def test_writes_really_bypass_the_page_cache(self, io: ChunkIO) -> None:
        """What O_DIRECT is for: the bytes written are not left in RAM (a buffered
        write of the same bytes is, as a control)."""
        buf = AlignedBuffer(1 << 20)
        buf.view[:] = b"\x5a" * len(buf.view)
        io.write_aligned("p/direct", [buf.view], 1 << 20)
        io.write("p/buffered", [buf.view])
        root = io.url.removeprefix("file://")
        assert _resident_pages(os.path.join(root, "p/buffered")) > 0
        assert _resident_pages(os.path.join(root, "p/direct")) == 0

    def test_misaligned_memory_is_refused_by_the_kernel(self, io: ChunkIO) -> None:
        """The write really is O_DIRECT: the kernel refuses memory that is not aligned
        (a buffered write would take it)."""
        buf = AlignedBuffer(2 * BLOCK_BYTES)
        with pytest.raises(OSError) as info:
            io.write_aligned("m/0", [buf.view[64 : 64 + BLOCK_BYTES]], BLOCK_BYTES)
        assert info.value.errno == errno.EINVAL


def test_tmpfs_refuses_direct_io_once_at_info(caplog: pytest.LogCaptureFixture) -> None:
    """tmpfs accepts O_DIRECT since Linux 6.6 but keeps its files in RAM: buffered,
    said once per root at INFO; ``on`` is a ConfigError naming the reason and the fix."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm here")
    root = shm / f"tsh-test-{uuid.uuid4().hex}"
    root.mkdir()
    try:
        with caplog.at_level(logging.INFO, logger="tensorstore_hooks"):
            first = LocalIO(str(root)).configure_direct_io("auto", "a/probe")
            second = LocalIO(str(root)).configure_direct_io("auto", "b/probe")
        assert not first.enabled and "tmpfs" in first.reason and second == first
        said = [r for r in caplog.records if "direct I/O is off" in r.getMessage()]
        assert (
            len(said) == 1 and said[0].levelno == logging.INFO and "tmpfs" in said[0].getMessage()
        )
        with pytest.raises(ConfigError, match=r"tmpfs.*direct_io='auto'"):
            LocalIO(str(root)).configure_direct_io("on", "c/probe")
        off = LocalIO(str(root)).configure_direct_io("off", "d/probe")
        assert not off.enabled and off.reason == "direct_io is 'off'"
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def test_bad_direct_io_mode_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="auto, on, off"):
        LocalIO(str(tmp_path)).configure_direct_io("yes", "probe")


class TestMemoryIO(ChunkIOConformance):
    @pytest.fixture
    def io(self) -> Iterator[ChunkIO]:
        yield MemoryIO()

    # Raw access to the private dict: the one place a test may, as zarr's
    # MemoryStore tests read its store_dict.
    def set_raw(self, io: ChunkIO, path: str, data: bytes) -> None:
        io._objects[path] = data  # type: ignore[attr-defined]

    def get_raw(self, io: ChunkIO, path: str) -> bytes | None:
        data = io._objects.get(path)  # type: ignore[attr-defined]
        return None if data is None else bytes(data)

    def test_flags_and_privacy(self, io: ChunkIO) -> None:
        assert io.is_private_memory and not io.supports_append
        other = MemoryIO()
        io.write("a", [b"1"])
        assert not other.exists("a")


class _FsspecBase(ChunkIOConformance):
    def set_raw(self, io: ChunkIO, path: str, data: bytes) -> None:
        assert isinstance(io, FsspecIO)
        io.fs.pipe_file(f"{io.root}/{path}", data)

    def get_raw(self, io: ChunkIO, path: str) -> bytes | None:
        assert isinstance(io, FsspecIO)
        full = f"{io.root}/{path}"
        return bytes(io.fs.cat_file(full)) if io.fs.isfile(full) else None


class TestFsspecLocal(_FsspecBase):
    @pytest.fixture
    def io(self, tmp_path: Path) -> Iterator[ChunkIO]:
        fs = fsspec.filesystem("file", auto_mkdir=True)
        io = FsspecIO(fs, str(tmp_path / "root"), f"file://{tmp_path}/root")
        yield io
        io.close()


class TestFsspecMemory(_FsspecBase):
    @pytest.fixture
    def io(self) -> Iterator[ChunkIO]:
        fs = fsspec.filesystem("memory")
        root = f"/chunkio-{uuid.uuid4().hex}"  # fsspec's memory filesystem is global
        io = FsspecIO(fs, root, f"memory://{root}")
        yield io
        io.close()
        if fs.exists(root):
            fs.rm(root, recursive=True)


def test_a_probe_that_may_change_its_answer_is_asked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe file that could not be made (a full disk, permissions) says nothing
    about the filesystem: the next store on that root probes again; a filesystem's own
    answer (tmpfs, EINVAL) is kept for the process."""
    from tensorstore_hooks.storage.io import _local

    no_room = "cannot create a probe file (No space left on device)"
    answers = [_local._Probe(False, no_room, errno.ENOSPC), _local._Probe(True, "", None)]
    calls: list[str] = []

    def fake(directory: str, name: str | None) -> _local._Probe:
        calls.append(directory)
        return answers[min(len(calls), len(answers)) - 1]

    monkeypatch.setattr(_local, "_probe", fake)
    root = tmp_path / "root"
    first = LocalIO(str(root)).configure_direct_io("auto", "ns/probe")
    assert not first.enabled and "No space" in first.reason
    second = LocalIO(str(root)).configure_direct_io("auto", "ns/probe")
    third = LocalIO(str(root)).configure_direct_io("auto", "ns/probe")
    assert second.enabled and third.enabled and len(calls) == 2
