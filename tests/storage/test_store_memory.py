"""The store conformance suite on ``memory://`` ZarrStores, and their privacy."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import KeyNotFoundError, TensorStore, ZarrStore
from tensorstore_hooks.testing import StoreConformance


class TestMemory(StoreConformance):
    @pytest.fixture
    def store(self) -> Iterator[TensorStore]:
        s = tsh.open_store("memory://")
        assert isinstance(s, ZarrStore)
        yield s
        s.close()


class TestMemorySmallChunksLz4(StoreConformance):
    large_nbytes = 300 << 10

    @pytest.fixture
    def store(self) -> Iterator[TensorStore]:
        s = tsh.open_store("memory://", chunk_bytes="16KiB", codec="lz4")
        yield s
        s.close()


@pytest.mark.parametrize("url", ["memory://", "memory://same/path"])
def test_memory_stores_are_private(url: str) -> None:
    with tsh.open_store(url) as a, tsh.open_store(url) as b:
        ka = a.put(torch.ones(3))
        assert len(b) == 0 and list(b.keys()) == [] and b.nbytes == 0
        assert ka not in b
        kb = b.put(torch.zeros(5))
        assert len(a) == 1
        # Keys are counters: the same key may exist in both, with different tensors.
        assert torch.equal(a.get(ka), torch.ones(3))
        assert torch.equal(b.get(kb), torch.zeros(5))
        if ka == kb:
            a.delete(ka)
            assert kb in b
        else:
            with pytest.raises(KeyNotFoundError):
                b.get(ka)


def test_memory_store_does_not_touch_fsspec_memory_filesystem() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    before = set(fs.store)
    with tsh.open_store("memory://") as s:
        s.put(torch.ones(1000))
        assert set(fs.store) == before
