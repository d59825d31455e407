"""Metadata documents are replaced atomically and a damaged one is never overwritten
(NOTE [ Atomic documents ] in ``storage/io/_base.py``).

Write failures are injected at the OS calls (``os.write`` and friends) for the files
of one root: the first ``after`` bytes go through, then the call fails with ENOSPC
(a full disk) or EFBIG (a file size limit), as the kernel does.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import zarr

from tensorstore_hooks import (
    IntegrityError,
    QuotaExceededError,
    TensorStoreError,
    ZarrStore,
)
from tensorstore_hooks.storage.io import LocalIO

_REAL_WRITE, _REAL_PWRITE, _REAL_PWRITEV = os.write, os.pwrite, os.pwritev


class _Faults:
    """Writes to files under ``root`` whose path matches ``match``: ``after`` bytes in
    all go through, then every such write fails with ``err``."""

    def __init__(self, root: Path, after: int, err: int, match: str) -> None:
        self.root, self.left, self.err = str(root), after, err
        self.match = re.compile(match)
        self.failed = 0

    def _ours(self, fd: int) -> bool:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return False
        return path.startswith(self.root) and bool(self.match.search(path))

    def _take(self, fd: int, n: int) -> int:
        """How many of ``n`` bytes may go now (raises once the budget is spent)."""
        if not self._ours(fd):
            return n
        if self.left <= 0:
            self.failed += 1
            raise OSError(self.err, os.strerror(self.err))
        allowed = min(n, self.left)
        self.left -= allowed
        return allowed

    def write(self, fd: int, data: bytes | memoryview) -> int:
        mv = memoryview(data).cast("B")
        return _REAL_WRITE(fd, mv[: self._take(fd, len(mv))])

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        mv = memoryview(data).cast("B")
        return _REAL_PWRITE(fd, mv[: self._take(fd, len(mv))], offset)

    def pwritev(self, fd: int, views: list[memoryview], offset: int) -> int:
        total = sum(len(memoryview(v).cast("B")) for v in views)
        if self._take(fd, total) < total:
            self.failed += 1
            raise OSError(self.err, os.strerror(self.err))  # O_DIRECT: no short writes
        return _REAL_PWRITEV(fd, views, offset)


@contextmanager
def _failing_writes(
    monkeypatch: pytest.MonkeyPatch, root: Path, after: int, err: int, match: str = "zarr\\.json"
) -> Iterator[_Faults]:
    faults = _Faults(root, after, err, match)
    with monkeypatch.context() as m:
        m.setattr(os, "write", faults.write)
        m.setattr(os, "pwrite", faults.pwrite)
        m.setattr(os, "pwritev", faults.pwritev)
        yield faults


_ERRORS = pytest.mark.parametrize(
    ("err", "raised"),
    [(errno.ENOSPC, QuotaExceededError), (errno.EFBIG, QuotaExceededError)],
    ids=["ENOSPC", "EFBIG"],
)
_AFTER = pytest.mark.parametrize("after", [0, 1, 64, 119])  # the root document: 120 bytes


def _whole_json(path: Path) -> dict[str, object]:
    doc = json.loads(path.read_bytes())
    assert isinstance(doc, dict)
    return doc


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name]


# ------------------------------------------------------------------ first writes
@_ERRORS
@_AFTER
def test_a_failed_first_put_leaves_no_torn_root_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, raised: type, after: int
) -> None:
    """The root's zarr.json is written at the first put; a failure leaves none (not a
    torn one that no later put would ever replace)."""
    root = tmp_path / "root"
    with ZarrStore(root, namespace="ns") as store:
        with (
            _failing_writes(monkeypatch, root, after, err, match=r"/root/\.?zarr\.json") as f,
            pytest.raises(raised, match="not stored"),
        ):
            store.put(torch.ones(1024))
        assert f.failed
        assert not (root / "zarr.json").exists() and not _leftovers(root)
        key = store.put(torch.ones(1024))  # room again: the document is written whole
        assert torch.equal(store.get(key), torch.ones(1024))
    assert _whole_json(root / "zarr.json")["attributes"] == {"tensorstore_hooks": {"format": 4}}
    assert zarr.open_group(str(root), mode="r").attrs["tensorstore_hooks"] == {"format": 4}


@_ERRORS
@_AFTER
def test_a_failed_open_leaves_no_torn_namespace_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, raised: type, after: int
) -> None:
    """A store whose namespace document could not be written is not opened, and the
    next open of that namespace works (a torn document would refuse it for good)."""
    root = tmp_path / "root"
    with _failing_writes(monkeypatch, root, after, err) as f, pytest.raises(raised):
        ZarrStore(root, namespace="ns")
    assert f.failed
    assert not (root / "ns" / "zarr.json").exists() and not _leftovers(root)
    with ZarrStore(root, namespace="ns") as store:
        key = store.put(torch.arange(10.0))
        assert torch.equal(store.get(key), torch.arange(10.0))
    assert _whole_json(root / "ns" / "zarr.json")["attributes"]


@_ERRORS
def test_a_failed_segment_document_is_absent_or_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, raised: type
) -> None:
    root = tmp_path / "root"
    with ZarrStore(root, namespace="ns") as store:
        store.put(torch.ones(10))  # the root document and a first size class
        with (
            _failing_writes(monkeypatch, root, 100, err, match=r"seg-\d+/\.?zarr\.json"),
            pytest.raises(raised),
        ):
            store.put(torch.ones(64 << 10))
        segs = sorted(root.glob("ns/seg-*/zarr.json"))
        for doc in segs:
            _whole_json(doc)  # each is whole
        assert len(segs) == 1 and not _leftovers(root)
        key = store.put(torch.ones(64 << 10))
        assert torch.equal(store.get(key), torch.ones(64 << 10))
        seg = f"ns/seg-{store.chunk_class(key)}"
    assert zarr.open_array(str(root / seg), mode="r").shape[0] > 0


# ------------------------------------------------------------------ rewrites
@_ERRORS
@_AFTER
def test_a_failed_rewrite_keeps_the_old_segment_document_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, raised: type, after: int
) -> None:
    """A segment document that differs from what this store writes is replaced; when
    the replacement fails, the old one is still there, byte for byte."""
    root = tmp_path / "root"
    big = torch.ones(64 << 10)  # 256 KiB: a size class of its own
    with ZarrStore(root, namespace="ns") as store:
        store.put(torch.ones(1024))  # stays: the namespace is resumed below
        key = store.put(big)
        seg = root / "ns" / f"seg-{store.chunk_class(key)}" / "zarr.json"
        store.delete(key)  # its size class holds nothing now
    doc = _whole_json(seg)
    doc["attributes"] = {"tensorstore_hooks": {"segment_chunk_bytes": 1}, "note": "x" * 300}
    old = json.dumps(doc).encode()  # differs from what zarr writes from the first byte on
    seg.write_bytes(old)
    with ZarrStore(root, namespace="ns") as store:
        with (
            _failing_writes(monkeypatch, root, after, err, match=r"seg-\d+/\.?zarr\.json"),
            pytest.raises(raised),
        ):
            store.put(big)  # the document differs: replaced, and that fails
        assert seg.read_bytes() == old and not _leftovers(root)
        store.put(big)  # room again: replaced, whole
    assert "note" not in _whole_json(seg)["attributes"]


@_ERRORS
@_AFTER
def test_a_failed_snapshot_keeps_the_old_one_and_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, raised: type, after: int
) -> None:
    root = tmp_path / "root"
    store = ZarrStore(root, namespace="ns")
    keys = [store.put(torch.full((16,), float(i))) for i in range(6)]
    store.compact_index()
    snapshot = root / "ns" / "index" / "snapshot"
    old = snapshot.read_bytes()
    store.delete(keys[0])
    with (
        _failing_writes(monkeypatch, root, after, err, match=r"index/\.?snapshot"),
        pytest.raises(raised, match="snapshot"),
    ):
        store.compact_index()
    assert snapshot.read_bytes() == old and not _leftovers(root)
    store.close()
    with ZarrStore(root, namespace="ns") as again:  # the journal still has the delete
        assert sorted(again.keys()) == sorted(keys[1:])
        assert torch.equal(again.get(keys[5]), torch.full((16,), 5.0))


# ------------------------------------------------------------------ durability
def test_a_document_is_synced_then_renamed_then_its_directory_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ Atomic documents ] rule 1, in this order: the temporary file's bytes
    reach the disk before the rename publishes them, and the rename is synced."""
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        calls.append(("rename", f"{os.path.basename(src)} -> {dst}"))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    io = LocalIO(str(tmp_path))
    io.write_atomic("d/zarr.json", [b'{"a": ', b"1}"])
    assert (tmp_path / "d" / "zarr.json").read_bytes() == b'{"a": 1}'
    (kind0, tmp), (kind1, renamed), (kind2, directory) = calls
    assert kind0 == "fsync" and re.fullmatch(r".*/d/\.zarr\.json\.tmp-\d+-[0-9a-f]{8}", tmp)
    assert kind1 == "rename" and renamed == f"{os.path.basename(tmp)} -> {tmp_path}/d/zarr.json"
    assert kind2 == "fsync" and directory == str(tmp_path / "d")

    calls.clear()  # the index snapshot goes the same way
    store = ZarrStore(tmp_path / "root", namespace="ns")
    store.put(torch.ones(8))
    calls.clear()
    store.compact_index()
    assert [k for k, _ in calls] == ["fsync", "rename", "fsync"]
    assert calls[1][1].endswith("/ns/index/snapshot")
    store.close()


# ------------------------------------------------------------- damaged documents
def _damage(path: Path) -> bytes:
    bad = b'{"zarr_format": 3, "node_type": "gr'  # cut off mid-write by an older version
    path.write_bytes(bad)
    return bad


def test_a_damaged_namespace_document_is_refused_and_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with ZarrStore(root, namespace="ns") as store:
        key = store.put(torch.arange(100.0))
    doc = root / "ns" / "zarr.json"
    bad = _damage(doc)
    with pytest.raises(IntegrityError) as info:
        ZarrStore(root, namespace="ns")
    msg = str(info.value)
    assert "ns/zarr.json cannot be parsed" in msg and "never overwritten" in msg
    assert "zarr.json.damaged" in msg  # how to recover
    assert doc.read_bytes() == bad
    doc.rename(doc.with_name("zarr.json.damaged"))  # what the message says to do
    with ZarrStore(root, namespace="ns") as store:  # the tensors were never at risk
        assert torch.equal(store.get(key), torch.arange(100.0))
    _whole_json(doc)


def _check_damaged_doc_warning(
    path: Path, act: Callable[[], object], what: str
) -> None:
    bad = _damage(path)
    with pytest.warns(RuntimeWarning, match="cannot be parsed") as caught:
        act()
    (w,) = [w for w in caught if "cannot be parsed" in str(w.message)]
    assert what in str(w.message) and "never overwritten" in str(w.message)
    assert path.read_bytes() == bad


def test_a_damaged_root_document_is_reported_and_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with ZarrStore(root, namespace="a") as store:
        store.put(torch.ones(4))
    with ZarrStore(root, namespace="b") as store:
        holder: list[str] = []
        _check_damaged_doc_warning(
            root / "zarr.json", lambda: holder.append(store.put(torch.ones(4))), "the root"
        )
        assert torch.equal(store.get(holder[0]), torch.ones(4))  # the store goes on


def test_a_damaged_segment_document_is_reported_and_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "root"
    big = torch.ones(64 << 10)
    with ZarrStore(root, namespace="ns") as store:
        store.put(torch.ones(1024))
        key = store.put(big)
        seg = root / "ns" / f"seg-{store.chunk_class(key)}" / "zarr.json"
        store.delete(key)
    with ZarrStore(root, namespace="ns") as store:
        holder: list[str] = []
        _check_damaged_doc_warning(seg, lambda: holder.append(store.put(big)), "segment array")
        assert torch.equal(store.get(holder[0]), big)


def test_a_failed_write_is_a_store_error_naming_the_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    with (
        _failing_writes(monkeypatch, root, 0, errno.ENOSPC),
        pytest.raises(TensorStoreError, match="filesystem is full"),
    ):
        ZarrStore(root, namespace="ns")
