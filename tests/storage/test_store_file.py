"""The store conformance suite on local-disk ZarrStores (bare path, file://, temporary)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import tensorstore_hooks as tsh
from tensorstore_hooks import TensorStore, ZarrStore
from tensorstore_hooks.testing import StoreConformance
from tests._mounts import direct_io_dir


class TestBarePath(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[TensorStore]:
        s = tsh.open_store(str(tmp_path / "root"))
        assert isinstance(s, ZarrStore)
        yield s
        s.close()


class TestFileURL(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[TensorStore]:
        s = tsh.open_store(f"file://{tmp_path / 'root'}")
        assert isinstance(s, ZarrStore)
        yield s
        s.close()


class TestTemporary(StoreConformance):
    @pytest.fixture
    def store(self) -> Iterator[TensorStore]:
        s = tsh.open_store()
        assert isinstance(s, ZarrStore) and s.temporary
        yield s
        s.close()


class TestSmallChunksZstd(StoreConformance):
    """Many chunks per tensor and a compressor: the generic (non-readinto) read path."""

    large_nbytes = 300 << 10

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[TensorStore]:
        s = tsh.open_store(str(tmp_path / "root"), chunk_bytes="16KiB", codec="zstd:1")
        yield s
        s.close()


# ------------------------------------------------------ NOTE [ Direct I/O ]
class TestDirectIOOn(StoreConformance):
    """Every chunk, whatever its size class, through O_DIRECT (the size floor below
    which chunks stay buffered is lowered to the smallest class for this suite)."""

    @pytest.fixture
    def store(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TensorStore]:
        from tensorstore_hooks.storage.zarr import _chunkcodec

        monkeypatch.setattr(_chunkcodec, "DIRECT_MIN_CHUNK_BYTES", 4096)
        root = direct_io_dir(tmp_path / "root")
        s = tsh.open_store(str(root), direct_io="on", chunk_bytes="1MiB")
        assert isinstance(s, ZarrStore) and s.direct_io.enabled
        yield s
        s.close()


class TestDirectIODefaults(StoreConformance):
    """direct_io="on" with the library's own size floor (small classes buffered)."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[TensorStore]:
        s = tsh.open_store(str(direct_io_dir(tmp_path / "root")), direct_io="on")
        assert isinstance(s, ZarrStore) and s.direct_io.enabled
        yield s
        s.close()


class TestDirectIOOff(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[TensorStore]:
        s = tsh.open_store(str(tmp_path / "root"), direct_io="off")
        assert isinstance(s, ZarrStore) and not s.direct_io.enabled
        assert s.direct_io.reason == "direct_io is 'off'"
        yield s
        s.close()


class TestTmpfsFallback(StoreConformance):
    """A root on tmpfs (/dev/shm): direct_io "auto" falls back to buffered I/O."""

    @pytest.fixture
    def store(self) -> Iterator[TensorStore]:
        import shutil
        import uuid

        shm = Path("/dev/shm")
        if not shm.is_dir():
            pytest.skip("no /dev/shm here")
        root = shm / f"tsh-test-{uuid.uuid4().hex}"
        s = tsh.open_store(str(root))
        try:
            assert isinstance(s, ZarrStore)
            assert not s.direct_io.enabled and "tmpfs" in s.direct_io.reason
            yield s
        finally:
            s.close()
            shutil.rmtree(root, ignore_errors=True)
