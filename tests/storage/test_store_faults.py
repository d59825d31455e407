"""ZarrStore under faults: a full disk, damaged index records, swapped chunk files,
two writers on one namespace.

How the full disk is made, and why:

* ``small_fs``: a 20 MiB tmpfs the test mounts itself (``mount -t tmpfs``). It is a
  real filesystem that runs out of space the way a disk does (ENOSPC, partial
  writes), for chunk files and journal alike. It needs root or CAP_SYS_ADMIN; where
  mounting is not allowed those tests skip and say so.
* The ``*_rlimit`` variants run without mounting anything, so they run everywhere:
  a child process lowers ``RLIMIT_FSIZE`` (with SIGXFSZ ignored, a write past the
  limit fails with EFBIG) to just above the journal's size. Chunk files are smaller
  than the limit, so it is precisely the journal append that fails, mid-record.
  (A fault-injecting fsspec filesystem would not exercise the local append path,
  which is where the journal lives.)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

import tensorstore_hooks as tsh
from tensorstore_hooks import (
    IntegrityError,
    KeyNotFoundError,
    QuotaExceededError,
    StoreUnavailableError,
    ZarrStore,
)
from tensorstore_hooks.testing import assert_same_tensor
from tests._mounts import tmpfs

# ----------------------------------------------------------------- fixtures


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 20 MiB tmpfs mounted for this test (skips, saying why, where mount is refused;
    the ``*_rlimit`` tests cover the same behaviour without a mount)."""
    with tmpfs(tmp_path / "small-fs", "20m") as mnt:
        yield mnt


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill(path: Path) -> Path:
    """Write a filler file until the filesystem is full; returns it."""
    filler = path / f"filler-{uuid.uuid4().hex}"
    block = b"\xab" * (64 << 10)
    with open(filler, "wb", buffering=0) as f:
        for size in (len(block), 4096, 512, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(block[:size])
    assert _free(path) < 4096
    return filler


def _tensor(i: int, n: int) -> torch.Tensor:
    return torch.full((n,), float(i)) + torch.arange(n, dtype=torch.float32) / 1024


def _check_reopened(
    store: ZarrStore, acked: dict[str, torch.Tensor], issued: dict[str, torch.Tensor]
) -> None:
    """Every acknowledged live key reads back exactly; no key ever reads back as
    another tensor (a deleted key may reappear only if it reads back as itself)."""
    for key, t in acked.items():
        assert key in store, key
        assert_same_tensor(store.get(key), t)
    for key in store.keys():  # noqa: SIM118 - TensorStore has no __iter__
        if key in acked:
            continue
        assert key in issued, f"unknown key {key!r} after reopening"
        try:
            got = store.get(key)
        except (IntegrityError, KeyNotFoundError):
            continue  # its chunks are gone or belong to another key: refused, not wrong
        assert_same_tensor(got, issued[key])


# ------------------------------------------------------------- disk full, store API
def test_disk_full_during_journal_append_tmpfs(small_fs: Path) -> None:
    """Chunks are rewritten in place (spares) on a full disk while the journal must
    grow: appends fail, mid-record. No put is acknowledged unless its record is
    whole; every failure is a TensorStoreError; a failed put leaves no bytes behind;
    reopening never returns a tensor under another key; space back -> writes work."""
    root = small_fs / "root"
    store = ZarrStore(root, namespace="ns", chunk_bytes="64KiB")
    journal = root / "ns" / "index" / "journal"
    issued: dict[str, torch.Tensor] = {}
    acked: dict[str, torch.Tensor] = {}
    for i in range(4):
        key = store.put(_tensor(i, 3000))
        issued[key] = acked[key] = _tensor(i, 3000)
    churn = [store.put(_tensor(100 + i, 3000)) for i in range(4)]
    for k in churn:
        store.delete(k)  # their runs become spares: rewritten in place below
    filler = _fill(small_fs)
    failures: list[BaseException] = []
    live: list[str] = []
    for i in range(400):
        t = _tensor(1000 + i, 3000)
        size = journal.stat().st_size
        free = _free(small_fs)
        try:
            key = store.put(t)
        except Exception as e:
            failures.append(e)
            assert journal.stat().st_size == size  # no torn record left behind
            assert _free(small_fs) >= free  # the space it took was given back
            continue
        issued[key] = acked[key] = t
        live.append(key)
        if len(live) > 2:  # a training-like churn: the oldest goes
            old = live.pop(0)
            store.delete(old)
            del acked[old]
    assert failures and acked.keys() - issued.keys() == set()
    assert all(isinstance(e, QuotaExceededError) for e in failures), failures[:3]
    assert "filesystem is full" in str(failures[0])
    assert len(live) >= 1  # some puts fit in the journal's last page before it filled
    for key, t in acked.items():
        assert_same_tensor(store.get(key), t)
    store.close()  # the disk is still full: late delete records may be lost
    with ZarrStore(root, namespace="ns", chunk_bytes="64KiB") as again:
        _check_reopened(again, acked, issued)
        filler.unlink()  # space returns: writes work again
        key = again.put(_tensor(7, 3000))
        assert_same_tensor(again.get(key), _tensor(7, 3000))


_RLIMIT_CHILD = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    import torch
    from tensorstore_hooks import ZarrStore, TensorStoreError

    root, out = sys.argv[1], sys.argv[2]
    def tensor(i):
        return torch.full((900,), float(i)) + torch.arange(900, dtype=torch.float32) / 1024
    store = ZarrStore(root, namespace="ns", chunk_bytes="4KiB")
    journal = os.path.join(root, "ns", "index", "journal")
    issued, acked, live, errors = {}, [], [], []
    for i in range(80):  # the journal grows past the chunk files' size (4100 bytes)
        key = store.put(tensor(i)); issued[key] = i; acked.append(key)
    for key in acked[40:]:
        store.delete(key)
    acked = acked[:40]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = os.path.getsize(journal) + 700  # room for a few records, then EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    unchanged = True
    for i in range(100, 160):
        size = os.path.getsize(journal)
        try:
            key = store.put(tensor(i))
        except TensorStoreError as e:
            errors.append(type(e).__name__ + ": " + str(e))
            unchanged = unchanged and os.path.getsize(journal) == size
            continue
        except OSError as e:
            errors.append("RAW " + repr(e)); continue
        issued[key] = i; acked.append(key); live.append(key)
        if len(live) > 2:
            old = live.pop(0); store.delete(old); acked.remove(old)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    with open(out, "w") as f:
        json.dump({"issued": issued, "acked": acked, "errors": errors,
                   "unchanged": unchanged, "limit": limit}, f)
    os._exit(0)  # like a crash: no close()
    """
)


def test_disk_full_during_journal_append_rlimit(tmp_path: Path) -> None:
    """The same as the tmpfs test without a mount: RLIMIT_FSIZE in a child process
    makes journal appends fail mid-record (EFBIG); the child then dies without
    close(), and the parent replays what it left."""
    root, out = tmp_path / "root", tmp_path / "out.json"
    subprocess.run(
        [sys.executable, "-c", _RLIMIT_CHILD, str(root), str(out)], check=True, timeout=120
    )
    res = json.loads(out.read_text())
    assert res["errors"], "the journal never filled up"
    assert not [e for e in res["errors"] if e.startswith("RAW")], res["errors"][:3]
    assert all(e.startswith("QuotaExceededError") for e in res["errors"]), res["errors"][:3]
    assert res["unchanged"]  # a failed append left the journal as it was
    assert (root / "ns" / "index" / "journal").stat().st_size <= res["limit"]

    def tensor(i: int) -> torch.Tensor:
        return torch.full((900,), float(i)) + torch.arange(900, dtype=torch.float32) / 1024

    issued = {k: tensor(i) for k, i in res["issued"].items()}
    acked = {k: issued[k] for k in res["acked"]}
    with ZarrStore(root, namespace="ns", chunk_bytes="4KiB") as store:
        assert store.damage == []  # a failed append is no damage
        _check_reopened(store, acked, issued)
        fresh = store.put(tensor(999))
        assert fresh not in issued  # keys are never reused
        assert_same_tensor(store.get(fresh), tensor(999))


# ------------------------------------------------------ journal full during training
class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh()) for _ in range(6)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _grads(model: torch.nn.Module, x: torch.Tensor, hooks: tsh.OffloadHooks | None) -> list[Any]:
    model.zero_grad()
    if hooks is None:
        loss = model(x).square().sum()
    else:
        with hooks:
            loss = model(x).square().sum()
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_journal_full_during_training_leaks_nothing_tmpfs(small_fs: Path) -> None:
    root = small_fs / "acts"
    model = _Net()
    x = torch.randn(64, 256)
    want = _grads(model, x, None)
    hooks = tsh.offload(str(root), min_bytes=0)
    for _ in range(2):  # warm-up: the chunk files exist, later steps rewrite them
        assert all(torch.equal(a, b) for a, b in zip(_grads(model, x, hooks), want, strict=True))
    hooks.flush()
    filler = _fill(small_fs)
    with pytest.warns(UserWarning, match="could not take a saved tensor"):
        for _ in range(30):
            got = _grads(model, x, hooks)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        hooks.flush()
        assert hooks.stats.fallbacks > 0
        hooks.close()
    namespaces = [p for p in root.iterdir() if p.is_dir()]
    assert namespaces == []  # no key leaked: the namespace was emptied and removed
    filler.unlink()
    hooks = tsh.offload(str(root), min_bytes=0)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(_grads(model, x, hooks), want, strict=True))
    hooks.flush()
    assert hooks.stats.fallbacks == 0 and hooks.stats.tensors_offloaded > 0
    hooks.close()
    assert [p for p in root.iterdir() if p.is_dir()] == []


_TRAIN_CHILD = textwrap.dedent(
    """
    import json, os, resource, signal, sys, warnings
    import torch
    import tensorstore_hooks as tsh

    root, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(40)])
    x = torch.randn(8, 32)
    def grads(hooks):
        model.zero_grad()
        if hooks is None:
            loss = model(x).square().sum()
        else:
            with hooks:
                loss = model(x).square().sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]
    want = grads(None)
    store = tsh.ZarrStore(root, namespace="train", chunk_bytes="4KiB")
    hooks = tsh.offload(store, min_bytes=0)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(grads(hooks), want))
    hooks.flush()
    journal = os.path.join(root, "train", "index", "journal")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(
        resource.RLIMIT_FSIZE, (os.path.getsize(journal) + 500, resource.RLIM_INFINITY)
    )
    exact = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(10):
            exact = exact and all(torch.equal(a, b) for a, b in zip(grads(hooks), want))
        hooks.flush()
        fallbacks = hooks.stats.fallbacks
        hooks.close()
    left = len(store)
    store.close()
    ns_left = os.path.exists(os.path.join(root, "train"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    hooks = tsh.offload(root, min_bytes=0)
    for _ in range(2):
        exact = exact and all(torch.equal(a, b) for a, b in zip(grads(hooks), want))
    hooks.flush()
    after = hooks.stats.fallbacks
    hooks.close()
    with open(out, "w") as f:
        json.dump({"exact": exact, "fallbacks": fallbacks, "left": left,
                   "ns_left": ns_left, "after": after}, f)
    """
)


def test_journal_full_during_training_leaks_nothing_rlimit(tmp_path: Path) -> None:
    """Without a mount: RLIMIT_FSIZE just above the journal's size in a child makes
    the journal full while chunk files (4 KiB) still fit."""
    root, out = tmp_path / "root", tmp_path / "out.json"
    subprocess.run(
        [sys.executable, "-c", _TRAIN_CHILD, str(root), str(out)], check=True, timeout=300
    )
    res = json.loads(out.read_text())
    assert res["exact"]
    assert res["fallbacks"] > 0
    assert res["left"] == 0 and not res["ns_left"]
    assert res["after"] == 0


# ---------------------------------------------------- damaged index records (store)
def _journal(root: Path, ns: str) -> Path:
    return root / ns / "index" / "journal"


def _record_offsets(raw: bytes) -> list[int]:
    from tensorstore_hooks.storage.zarr._index import MAGIC

    offsets, pos = [], 0
    while pos < len(raw):
        assert raw[pos : pos + 4] == MAGIC
        offsets.append(pos)
        pos += 12 + int.from_bytes(raw[pos + 4 : pos + 8], "little")
    return offsets


@pytest.mark.parametrize("bit", range(0, 8 * 40, 7))
def test_flipped_bit_in_an_index_record_never_gives_a_wrong_tensor(
    tmp_path: Path, bit: int
) -> None:
    root = tmp_path / "root"
    tensors = {}
    with ZarrStore(root, namespace="ns") as store:
        for i in range(4):
            t = torch.full((100,), float(i))  # zeros, ones, ...: a swap would be silent
            tensors[store.put(t)] = t
    journal = _journal(root, "ns")
    raw = bytearray(journal.read_bytes())
    offsets = _record_offsets(bytes(raw))
    pos = offsets[1] + bit // 8  # somewhere in the second record (header or body)
    raw[pos] ^= 1 << (bit % 8)
    journal.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match=r"ns/index/journal: record 2 at byte"):
        store = ZarrStore(root, namespace="ns")
    with store:
        assert [(d.record, d.offset) for d in store.damage] == [(2, offsets[1])]
        second = list(tensors)[1]
        assert sorted(store.keys()) == sorted(set(tensors) - {second})
        with pytest.raises(KeyNotFoundError):
            store.get(second)
        for key in store.keys():  # noqa: SIM118 - TensorStore has no __iter__
            assert_same_tensor(store.get(key), tensors[key])
        new = store.put(torch.ones(3))
        assert new not in tensors  # not even the lost key is reused


def test_garbage_in_the_middle_of_the_journal_loses_only_damaged_records(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    tensors = {}
    with ZarrStore(root, namespace="ns") as store:
        for i in range(10):
            t = torch.full((50,), float(i))
            tensors[store.put(t)] = t
    journal = _journal(root, "ns")
    raw = bytearray(journal.read_bytes())
    offsets = _record_offsets(bytes(raw))
    raw[offsets[3] + 5 : offsets[5] + 2] = os.urandom(offsets[5] + 2 - offsets[3] - 5)
    journal.write_bytes(bytes(raw))
    keys = list(tensors)
    with pytest.warns(RuntimeWarning, match="record 4"):
        store = ZarrStore(root, namespace="ns")
    with store:
        assert sorted(store.keys()) == sorted(set(keys) - set(keys[3:6]))
        for key in store.keys():  # noqa: SIM118 - TensorStore has no __iter__
            assert_same_tensor(store.get(key), tensors[key])


def test_lost_delete_record_never_resurrects_a_key_with_another_tensors_bytes(
    tmp_path: Path,
) -> None:
    """The issue's case: A deleted, B reuses A's chunk file (a spare rewritten in
    place), then A's delete record is damaged. A must not come back as B."""
    root = tmp_path / "root"
    with ZarrStore(root, namespace="ns") as store:
        keep = store.put(torch.zeros(10))
        a = store.put(torch.zeros(3000))
        store.delete(a)
        b = store.put(torch.ones(3000))  # rewrites A's spare chunk file
    journal = _journal(root, "ns")
    raw = bytearray(journal.read_bytes())
    offsets = _record_offsets(bytes(raw))
    raw[offsets[2] + 14] ^= 0xFF  # the third record: "del a" (its body)
    journal.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match="damaged"), ZarrStore(root, namespace="ns") as store:
        assert sorted(store.keys()) == sorted([keep, b])
        assert torch.equal(store.get(b), torch.ones(3000))
        with pytest.raises(KeyNotFoundError):
            store.get(a)
    # And when B's put record is lost too, A's entry points at B's bytes: refused.
    raw = bytearray(journal.read_bytes())
    offsets = _record_offsets(bytes(raw))
    raw[offsets[3] + 20] ^= 0xFF  # "put b"
    journal.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match="damaged"), ZarrStore(root, namespace="ns") as store:
        assert a in store and b not in store
        with pytest.raises(IntegrityError, match="not this key's chunk 0"):
            store.get(a)


# ------------------------------------------------------- chunks bound to their place
def _chunk(root: Path, ns: str, seg: int, i: int) -> Path:
    return root / ns / f"seg-{seg}" / "c" / str(i)


@pytest.mark.parametrize("codec", ["none", "zstd:1"])
def test_swapped_chunk_files_are_an_integrity_error(tmp_path: Path, codec: str) -> None:
    root = tmp_path / "root"
    with ZarrStore(root, namespace="ns", chunk_bytes="16KiB", codec=codec) as store:
        a = store.put(torch.zeros(4096))  # one 16 KiB chunk each
        b = store.put(torch.ones(4096))
        multi = store.put(torch.arange(8192.0))  # two chunks
        ca, cb = _chunk(root, "ns", 16384, 0), _chunk(root, "ns", 16384, 1)
        tmp = ca.with_name("swap")
        ca.rename(tmp)
        cb.rename(ca)
        tmp.rename(cb)
        for key in (a, b):
            with pytest.raises(IntegrityError, match="not this key's chunk 0"):
                store.get(key)
        # Chunks of one tensor swapped with each other.
        c2, c3 = _chunk(root, "ns", 16384, 2), _chunk(root, "ns", 16384, 3)
        data2, data3 = c2.read_bytes(), c3.read_bytes()
        c2.write_bytes(data3)
        c3.write_bytes(data2)
        with pytest.raises(IntegrityError, match="swapped, moved or rewritten"):
            store.get(multi)
        c2.write_bytes(data2)
        c3.write_bytes(data3)
        assert torch.equal(store.get(multi), torch.arange(8192.0))


def test_chunk_moved_to_another_array_is_an_integrity_error(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with ZarrStore(root, namespace="ns", chunk_bytes="16KiB") as store:
        small = store.put(torch.zeros(1024))  # 4 KiB class
        store.put(torch.zeros(2048))  # 8 KiB class
        src = _chunk(root, "ns", 8192, 0)
        dst = _chunk(root, "ns", 4096, 0)
        shutil.copy(src, dst)
        with pytest.raises(IntegrityError):
            store.get(small)


def test_outside_readers_verify_chunks_against_the_index(tmp_path: Path) -> None:
    """What docs/layout.md says an outside reader can check: chunk objects carry no
    checksum of their own (since format 3), so plain zarr reads a corrupted or swapped chunk
    without complaint; comparing the crc32c of the bytes it read with the index
    entry's ``crc`` for that position catches both."""
    import crc32c

    root = tmp_path / "root"
    with ZarrStore(root, namespace="ns", chunk_bytes="16KiB") as store:
        store.put(torch.zeros(4096))
        store.put(torch.ones(4096))
    from tests.storage.test_zarr_layout import _journal_entries

    entries = sorted(_journal_entries(root / "ns").values(), key=lambda e: e["start"])
    seg = root / "ns" / "seg-16384"

    def index_says_intact(i: int) -> bool:
        arr = zarr.open_array(str(seg), mode="r")
        raw = arr[i * 16384 : i * 16384 + entries[i]["meta"]["nbytes"]].tobytes()
        return crc32c.crc32c(raw).to_bytes(4, "little") == entries[i]["crc"][:4]

    assert index_says_intact(0) and index_says_intact(1)
    c0, c1 = seg / "c" / "0", seg / "c" / "1"
    d0, d1 = c0.read_bytes(), c1.read_bytes()
    c0.write_bytes(d1)
    c1.write_bytes(d0)
    arr = zarr.open_array(str(seg), mode="r")
    assert np.frombuffer(arr[:16384].tobytes(), np.float32)[0] == 1.0  # zarr: no error
    assert not index_says_intact(0) and not index_says_intact(1)
    bad = bytearray(d0)
    bad[10] ^= 1
    c0.write_bytes(bytes(bad))
    zarr.open_array(str(seg), mode="r")[:16384]  # zarr: still no error
    assert not index_says_intact(0)


# ------------------------------------------------------------ one writer per namespace
def test_second_store_on_a_namespace_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    s1 = ZarrStore(root, namespace="shared")
    try:
        with pytest.raises(StoreUnavailableError, match=r"namespace 'shared' is open.*pid \d+"):
            ZarrStore(root, namespace="shared")
        key = s1.put(torch.ones(3))
        assert torch.equal(s1.get(key), torch.ones(3))
    finally:
        s1.close()
    with ZarrStore(root, namespace="shared") as s2:  # released at close
        assert key in s2


def test_namespace_lock_holds_across_processes_and_dies_with_its_holder(tmp_path: Path) -> None:
    root = tmp_path / "root"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, tensorstore_hooks as tsh\n"
            "s = tsh.ZarrStore(sys.argv[1], namespace='shared')\n"
            "print('open', flush=True)\n"
            "sys.stdin.read()\n",
            str(root),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "open"
        with pytest.raises(StoreUnavailableError, match=f"pid {child.pid}"):
            ZarrStore(root, namespace="shared")
    finally:
        child.kill()  # SIGKILL: no close(); the kernel drops the lock
        child.communicate(timeout=30)
    with ZarrStore(root, namespace="shared") as store:
        assert len(store) == 0


def test_collected_store_releases_its_namespace(tmp_path: Path) -> None:
    import gc

    store = ZarrStore(tmp_path, namespace="ns")
    store.put(torch.ones(2))
    del store
    gc.collect()
    with ZarrStore(tmp_path, namespace="ns") as again:
        assert len(again) == 1


# ------------------------------------------------------- OS errors are store errors
def test_unreadable_chunk_is_a_store_error(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with ZarrStore(root, namespace="ns", chunk_bytes="16KiB") as store:
        key = store.put(torch.ones(100))
        chunk = _chunk(root, "ns", 4096, 0)
        chunk.unlink()
        chunk.mkdir()  # EISDIR on read: damage that will not heal, not an outage
        with pytest.raises(IntegrityError, match="is not a file"):
            store.get(key)
        chunk.rmdir()
