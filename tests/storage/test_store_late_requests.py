"""Object-store requests that land after the client gave up on them.

Found against SeaweedFS (``tests/storage/test_seaweedfs.py``, the volume server stopped and
started again): a PUT that timed out was applied by the S3 gateway once the volume
server was back, over the chunk object that a key written since had been given. The
rule (NOTE [ Requests that land late ] in ``storage/zarr/_store.py``): a chunk run with a
write or delete of unknown outcome is never handed out again. Here an fsspec
filesystem that times out and applies the request later makes it deterministic,
through the real ``FsspecIO`` and ``ZarrStore``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import tensorstore_hooks as tsh
from tensorstore_hooks import StoreUnavailableError


class LateFS(MemoryFileSystem):
    """In-memory objects; while ``down``, chunk writes and deletes time out but are
    kept, to be applied later by :meth:`land` (what an S3 gateway waiting on its
    storage servers does)."""

    protocol = "tshlate"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    down = False
    late: ClassVar[list[tuple[str, bytes | None]]] = []

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> None:
        if LateFS.down and "/seg-" in path:
            LateFS.late.append((path, bytes(value)))
            raise TimeoutError("the gateway is waiting for its volume server")
        super().pipe_file(path, value, *args, **kwargs)

    def rm(self, path: Any, *args: Any, **kwargs: Any) -> None:
        paths = path if isinstance(path, list) else [path]
        if LateFS.down and any("/seg-" in p for p in paths):
            LateFS.late.extend((p, None) for p in paths)
            raise TimeoutError("the gateway is waiting for its volume server")
        super().rm(path, *args, **kwargs)

    @classmethod
    def land(cls) -> int:
        """Apply every request that timed out, now; returns how many."""
        fs = cls()
        for path, data in cls.late:
            if data is None:
                if fs.exists(path):
                    MemoryFileSystem.rm(fs, path)
            else:
                MemoryFileSystem.pipe_file(fs, path, data)
        n = len(cls.late)
        cls.late.clear()
        return n


@pytest.fixture
def late_store() -> Iterator[tsh.TensorStore]:
    fsspec.register_implementation("tshlate", LateFS, clobber=True)
    LateFS.store.clear()
    LateFS.late.clear()
    LateFS.down = False
    store = tsh.open_store("tshlate://bucket/acts", retry_deadline_s=0.2, chunk_bytes="16KiB")
    try:
        yield store
    finally:
        LateFS.down = False
        store.close()
        LateFS.store.clear()


def _tensor(v: float) -> torch.Tensor:
    return torch.full((4096,), v)  # 16 KiB: one chunk


def test_a_put_that_timed_out_and_lands_later_overwrites_nothing(
    late_store: tsh.TensorStore,
) -> None:
    LateFS.down = True
    with pytest.raises(StoreUnavailableError, match="tshlate://bucket/acts"):
        late_store.put(_tensor(1.0))  # the hooks would keep this tensor (a fallback)
    LateFS.down = False
    key = late_store.put(_tensor(2.0))  # same size: must not get the failed put's chunk
    assert LateFS.land() > 0  # the timed-out write is applied now
    assert torch.equal(late_store.get(key), _tensor(2.0))


def test_a_delete_that_timed_out_and_lands_later_removes_nothing(
    late_store: tsh.TensorStore,
) -> None:
    old = late_store.put(_tensor(1.0))
    LateFS.down = True
    late_store.delete(old)  # gone from the index; its chunk's delete timed out
    LateFS.down = False
    key = late_store.put(_tensor(2.0))  # must not be given the chunk still being deleted
    assert LateFS.land() > 0
    assert torch.equal(late_store.get(key), _tensor(2.0))


def test_settled_runs_are_still_reused(late_store: tsh.TensorStore) -> None:
    """Without an uncertain request, a freed chunk run is reused as before."""
    a = late_store.put(_tensor(1.0))
    late_store.delete(a)
    b = late_store.put(_tensor(2.0))
    assert late_store._ns.entry(b).run == (16384, 0, 1)  # type: ignore[attr-defined]
    assert torch.equal(late_store.get(b), _tensor(2.0))
