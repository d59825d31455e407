"""The store conformance suite on local-disk ZarrStores (bare path, file://, temporary)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import tensorstore_hooks as tsh
from tensorstore_hooks import TensorStore, ZarrStore

from .store_conformance import StoreConformance


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
