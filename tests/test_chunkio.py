"""The ChunkIO conformance suite (``chunkio_conformance.py``) on each backend.

``FsspecIO`` runs here over fsspec's local and memory filesystems (no network);
``tests/test_s3.py`` runs the same suite over S3 (moto).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from tensorstore_hooks._chunkio import ChunkIO, FsspecIO, LocalIO, MemoryIO

from .chunkio_conformance import ChunkIOConformance


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
