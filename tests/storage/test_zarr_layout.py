"""ZarrStore specifics: checksums, plain-zarr readability, namespaces, cleanup, URLs."""

from __future__ import annotations

import importlib.util
import os
import struct
from pathlib import Path
from typing import Any

import crc32c
import msgpack
import numpy as np
import pytest
import torch
import zarr

import tensorstore_hooks as tsh
from tensorstore_hooks import ConfigError, IntegrityError, KeyNotFoundError, ZarrStore
from tensorstore_hooks._codec import TensorMeta, decode
from tensorstore_hooks.testing import assert_same_tensor


def _chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.parent.name == "c")


def _namespaces(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def _records(raw: bytes) -> list[list[Any]]:
    """Framed records as docs/layout.md describes them (magic, u32 length, u32 crc32c
    of the length bytes and the body, msgpack body), parsed without the library."""
    out = []
    pos = 0
    while pos + 12 <= len(raw):
        magic, n, want = struct.unpack_from("<4sII", raw, pos)
        assert magic == b"\xc1TSH"
        body = raw[pos + 12 : pos + 12 + n]
        assert crc32c.crc32c(body, crc32c.crc32c(raw[pos + 4 : pos + 8])) == want
        out.append(msgpack.unpackb(body, raw=False))
        pos += 12 + n
    assert pos == len(raw)
    return out


def _frame(record: list[Any]) -> bytes:
    body = msgpack.packb(record)
    length = struct.pack("<I", len(body))
    check = struct.pack("<I", crc32c.crc32c(body, crc32c.crc32c(length)))
    return b"\xc1TSH" + length + check + body


def _plain_zarr_payload(ns_dir: Path, e: dict[str, Any], n: int) -> np.ndarray:
    """A key's payload read with plain zarr as docs/layout.md says: the stored stream
    at ``start * seg``, rotated right by the entry's ``rot``."""
    seg = zarr.open_array(str(ns_dir / f"seg-{e['seg']}"), mode="r")
    assert seg.dtype == np.uint8 and seg.chunks == (e["seg"],)
    lo = e["start"] * e["seg"]
    return np.roll(seg[lo : lo + n], e["rot"])


def _journal_entries(ns_dir: Path) -> dict[str, dict[str, Any]]:
    """Replay ``index/snapshot`` + ``index/journal`` as docs/layout.md describes."""
    entries: dict[str, dict[str, Any]] = {}
    snap = ns_dir / "index" / "snapshot"
    if snap.exists():
        header, *puts = _records(snap.read_bytes())
        assert header[0] == "snap" and header[2]["records"] == len(puts)
        entries.update((key, entry) for _, key, entry in puts)
    journal = ns_dir / "index" / "journal"
    for op, key, entry in _records(journal.read_bytes() if journal.exists() else b""):
        if op == "put":
            entries[key] = entry
        else:
            entries.pop(key, None)
    return entries


# ---------------------------------------------------------------- integrity
@pytest.mark.parametrize("codec", ["none", "lz4", "zstd:1"])
def test_flipped_byte_is_detected(tmp_path: Path, codec: str) -> None:
    root = tmp_path / "root"
    with ZarrStore(root, chunk_bytes="64KiB", codec=codec) as store:
        t = torch.randn(50_000)  # 200 KB: several chunks
        key = store.put(t)
        other = store.put(torch.ones(10))
        files = _chunk_files(root)
        assert files
        victim = files[1] if len(files) > 1 else files[0]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x40
        victim.write_bytes(bytes(data))
        bad = [k for k in (key, other) if _raises_integrity(store, k)]
        assert len(bad) == 1  # exactly the tensor whose chunk was hit
        with pytest.raises(IntegrityError, match=repr(bad[0])):
            store.get(bad[0])


def _raises_integrity(store: ZarrStore, key: str) -> bool:
    try:
        store.get(key)
    except IntegrityError:
        return True
    return False


@pytest.mark.parametrize("codec", ["none", "zstd:1"])
@pytest.mark.parametrize("cut", [1, 4, "half", "all"])
def test_truncated_chunk_is_detected(tmp_path: Path, codec: str, cut: int | str) -> None:
    root = tmp_path / "root"
    with ZarrStore(root, chunk_bytes="16KiB", codec=codec) as store:
        key = store.put(torch.randn(10_000))
        victim = _chunk_files(root)[-1]
        data = victim.read_bytes()
        keep = len(data) // 2 if cut == "half" else 0 if cut == "all" else len(data) - int(cut)
        victim.write_bytes(data[:keep])
        with pytest.raises(IntegrityError, match=repr(key)):
            store.get(key)


@pytest.mark.parametrize("direct_io", ["on", "off"])
@pytest.mark.parametrize("where", ["first", "middle", "last", "padding", "truncate"])
def test_large_chunks_checksummed_while_written_and_read(
    tmp_path: Path, where: str, direct_io: str
) -> None:
    """Chunks >= OVERLAP_BYTES are checksummed on the helper thread while they are
    written and read (NOTE [ Overlapped checksums ]), with O_DIRECT and without: every
    damage to a tensor's bytes is caught, and the padding after them is no tensor's."""
    from tensorstore_hooks.storage.zarr._checksum import OVERLAP_BYTES

    root = tmp_path / "root"
    gen = torch.Generator().manual_seed(3)
    with ZarrStore(root, chunk_bytes="8MiB", namespace="ns", direct_io=direct_io) as store:
        assert store.direct_io.enabled is (direct_io == "on")
        multi = torch.randn(5 << 20, generator=gen)  # 20 MiB: five 4 MiB chunks
        padded = torch.randn(15 << 17, generator=gen)  # 7.5 MiB: two 4 MiB chunks, padded
        keys = {"multi": store.put(multi), "padded": store.put(padded)}
        entries = _journal_entries(root / "ns")
        assert entries[keys["multi"]]["seg"] == 4 << 20 >= OVERLAP_BYTES
        assert (entries[keys["padded"]]["seg"], entries[keys["padded"]]["count"]) == (4 << 20, 2)
        assert torch.equal(store.get(keys["multi"]), multi)
        assert torch.equal(store.get(keys["padded"]), padded)
        # Plain zarr reads the same bytes (NOTE [ Chunk objects ]).
        for name, t in (("multi", multi), ("padded", padded)):
            raw = _plain_zarr_payload(root / "ns", entries[keys[name]], t.numel() * 4)
            np.testing.assert_array_equal(raw.view(np.float32), t.numpy())
        e = entries[keys["padded"]]
        victim = root / "ns" / f"seg-{e['seg']}" / "c" / str(e["start"] + 1)  # the padded one
        data = bytearray(victim.read_bytes())
        assert len(data) == e["seg"]  # no trailer: exactly the chunk size
        payload = padded.numel() * 4 - e["seg"]  # the payload bytes in that chunk
        pos = {"first": 10, "middle": payload // 2, "last": payload - 1, "padding": payload + 5}
        if where == "truncate":
            data = data[: len(data) // 3]
        else:
            data[pos[where]] ^= 0x01
        victim.write_bytes(bytes(data))
        if where == "padding":  # no tensor's bytes: the tensor still reads back exactly
            assert torch.equal(store.get(keys["padded"]), padded)
        else:
            with pytest.raises(IntegrityError, match=repr(keys["padded"])):
                store.get(keys["padded"])
        assert torch.equal(store.get(keys["multi"]), multi)


def test_running_crc_matches_and_reports_failures() -> None:
    import crc32c

    from tensorstore_hooks.storage.zarr._checksum import RunningCrc

    blob = bytes(range(256)) * 40_000
    pieces = [memoryview(blob)[i : i + 1_000_003] for i in range(0, len(blob), 1_000_003)]
    for background in (False, True):
        running = RunningCrc(background)
        for p in pieces:
            running.feed(p)
        assert running.value() == crc32c.crc32c(blob)
        assert running.trailer() == crc32c.crc32c(blob).to_bytes(4, "little")
    failing = RunningCrc(background=True)
    failing.feed(object())  # not a buffer: the helper's TypeError reaches the caller
    failing.feed(b"more")
    with pytest.raises(TypeError):
        failing.value()


def test_missing_chunk_is_detected(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with ZarrStore(root, chunk_bytes="16KiB") as store:
        key = store.put(torch.randn(10_000))
        _chunk_files(root)[0].unlink()
        with pytest.raises(IntegrityError, match=repr(key)):
            store.get(key)


def test_corrupted_memory_store_is_detected() -> None:
    with ZarrStore("memory://", chunk_bytes="16KiB") as store:
        key = store.put(torch.randn(10_000))
        objects = store._io._objects  # type: ignore[attr-defined]
        path = next(p for p in objects if "/c/" in p)
        data = bytearray(objects[path])
        data[3] ^= 1
        objects[path] = bytes(data)
        with pytest.raises(IntegrityError, match=repr(key)):
            store.get(key)


# ------------------------------------------------------- plain zarr readers
@pytest.mark.parametrize(
    ("codec", "direct_io"), [("none", "on"), ("none", "off"), ("lz4", "auto"), ("zstd:1", "auto")]
)
def test_readable_with_plain_zarr(tmp_path: Path, codec: str, direct_io: str) -> None:
    root = tmp_path / "root"
    tensors = {
        "big": torch.randn(20_000),  # spans several chunks, last one padded
        "small": torch.arange(7, dtype=torch.int16),
        "bf16": torch.randn(33, 3).to(torch.bfloat16),
        "transposed": torch.randn(40, 50).t(),
        "gapped": torch.randn(30, 40)[:, ::3],
        "empty": torch.empty(0, 3),
    }
    with ZarrStore(
        root, chunk_bytes="16KiB", codec=codec, namespace="run", direct_io=direct_io
    ) as store:
        keys = {name: store.put(t) for name, t in tensors.items()}
        doomed = store.put(torch.randn(5000))
        store.delete(doomed)

        # The hierarchy opens as plain zarr groups.
        group = zarr.open_group(str(root), mode="r")
        assert group.attrs["tensorstore_hooks"]["format"] == 4
        assert "run" in list(group.group_keys())

        entries = _journal_entries(root / "run")
        assert set(entries) == set(keys.values())
        for name, t in tensors.items():
            e = entries[keys[name]]
            meta = TensorMeta.from_dict(e["meta"])
            if meta.nbytes == 0:
                assert e["count"] == 0
                raw = np.empty(0, dtype=np.uint8)
            else:
                seg = zarr.open_array(str(root / "run" / f"seg-{e['seg']}"), mode="r")
                # No crc32c codec (since format 3), so every chunk object is block-aligned.
                names = [type(c).__name__ for c in seg.metadata.codecs]
                assert "Crc32cCodec" not in names and names[0] == "BytesCodec"
                raw = _plain_zarr_payload(root / "run", e, meta.nbytes)
            assert raw.nbytes == meta.nbytes
            # The bytes are exactly the codec's payload ...
            assert_same_tensor(decode(meta, raw.copy()), t)
            # ... and for a dense view numpy reads them without our code.
            if not meta.compact and meta.nbytes:
                item = np.dtype(meta.storage_dtype).itemsize
                arr = np.lib.stride_tricks.as_strided(
                    raw.view(meta.storage_dtype),
                    meta.shape,
                    [s * item for s in meta.stride],
                )
                want = t.contiguous()
                want = want.view(torch.int16) if t.dtype is torch.bfloat16 else want
                np.testing.assert_array_equal(arr.view(want.numpy().dtype), want.numpy())
        assert store.get(keys["big"]).shape == (20_000,)


def test_deleted_chunks_read_as_fill_value(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with ZarrStore(root, chunk_bytes="16KiB", namespace="ns", spare_bytes=0) as store:
        key = store.put(torch.full((8192,), 7, dtype=torch.uint8))
        e = _journal_entries(root / "ns")[key]
        store.delete(key)
        assert not _chunk_files(root)
        seg = zarr.open_array(str(root / "ns" / f"seg-{e['seg']}"), mode="r")
        lo = e["start"] * e["seg"]
        assert not seg[lo : lo + 8192].any()


# ---------------------------------------------------------- spare chunk files
def test_spare_chunk_files_are_rewritten_in_place(tmp_path: Path) -> None:
    """A loop of put/delete of the same sizes rewrites the same files (same inodes)."""
    root = tmp_path / "root"
    sizes = (3000, 20_000, 70_000)  # one chunk, a two-chunk run, a longer run
    with ZarrStore(root, chunk_bytes="16KiB", namespace="ns") as store:
        keys = [store.put(torch.full((n,), 1.0)) for n in sizes]
        files = {p: p.stat().st_ino for p in _chunk_files(root)}
        for step in range(2, 6):
            store.delete_many(keys[:1])
            for key in keys[1:]:
                store.delete(key)
            assert {p: p.stat().st_ino for p in _chunk_files(root)} == files
            keys = [store.put(torch.full((n,), float(step))) for n in sizes]
            assert {p: p.stat().st_ino for p in _chunk_files(root)} == files
            for key, n in zip(keys, sizes, strict=True):
                assert torch.equal(store.get(key), torch.full((n,), float(step)))
        for key in keys:
            store.delete(key)
        assert len(store) == 0 and store.nbytes == 0
    # close() unlinks the spares: nothing of the deleted keys is left on disk.
    assert not root.exists() or not _chunk_files(root)


def test_spare_bytes_bounds_the_kept_files(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with ZarrStore(root, chunk_bytes="16KiB", namespace="ns", spare_bytes="32KiB") as store:
        keep = store.put(torch.ones(10))  # keeps the namespace (and its spares) until close
        keys = [store.put(torch.full((4096,), float(i))) for i in range(4)]  # 16 KiB each
        for key in keys:
            store.delete(key)
        # Two 16 KiB chunks fit in 32 KiB of spares; the other two files are gone.
        assert len(_chunk_files(root)) == 1 + 2
        again = [store.put(torch.full((4096,), 9.0)) for _ in range(4)]
        assert len(_chunk_files(root)) == 1 + 4
        for key in again:
            assert torch.equal(store.get(key), torch.full((4096,), 9.0))
        store.delete(again[0])
        assert len(_chunk_files(root)) == 1 + 4  # kept as a spare
    with ZarrStore(root, chunk_bytes="16KiB", namespace="ns") as store:
        assert sorted(store.keys()) == sorted([keep, *again[1:]])
        assert len(_chunk_files(root)) == 1 + 3  # the spare was unlinked at close


def test_newest_freed_runs_displace_old_spares(tmp_path: Path) -> None:
    """Spares of a size no longer used must not keep a new size from being rewritten
    in place: the least recently freed spares make room (store_io's 64 KiB then 8 MiB
    phases found this: every 8 MiB put created its files again)."""
    root = tmp_path / "root"
    with ZarrStore(root, chunk_bytes="16KiB", namespace="ns") as store:
        keep = store.put(torch.ones(10))
        store.delete_many([store.put(torch.zeros(4096)) for _ in range(4)])
        assert len(_chunk_files(root)) == 1 + 4  # 4 x 16 KiB spares: the peak so far
        before = set(_chunk_files(root))
        big = store.put(torch.zeros(4 * 4096))  # a new 4-chunk run
        big_files = sorted(set(_chunk_files(root)) - before)
        assert len(big_files) == 4
        # Open descriptors tell a file rewritten in place (still linked) from one
        # unlinked and created again (inode numbers can be reused; links cannot lie).
        fds = [os.open(p, os.O_RDONLY) for p in big_files]
        try:
            for step in range(3):
                store.delete(big)  # kept as a spare, evicting the oldest small spares
                big = store.put(torch.full((4 * 4096,), float(step)))
                assert sorted(set(_chunk_files(root)) & set(big_files)) == big_files
                assert [os.fstat(fd).st_nlink for fd in fds] == [1] * 4
                assert torch.equal(store.get(big), torch.full((4 * 4096,), float(step)))
            assert len(_chunk_files(root)) <= 1 + 4 + 4
            spare, peak = store._ns.spare_stats()
            assert spare <= peak
        finally:
            for fd in fds:
                os.close(fd)
        store.delete(big)
        assert sorted(store.keys()) == [keep]


def test_memory_store_keeps_no_spares() -> None:
    with ZarrStore("memory://", chunk_bytes="16KiB") as store:
        key = store.put(torch.ones(4096))
        store.delete(key)
        assert not [p for p in store._io._objects if "/c/" in p]  # type: ignore[attr-defined]


def test_bad_spare_bytes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="spare_bytes"):
        ZarrStore(tmp_path, spare_bytes="lots")


@pytest.mark.parametrize("direct_io", ["on", "off"])
def test_read_of_a_key_deleted_and_rewritten_meanwhile_misses(
    tmp_path: Path, direct_io: str
) -> None:
    """Spares are rewritten in place: a read racing its key's delete must not return
    the next tensor's bytes, even when they pass their checksum."""
    store = ZarrStore(tmp_path, chunk_bytes="1MiB", namespace="ns", direct_io=direct_io)
    key = store.put(torch.zeros(1 << 18))  # one 1 MiB chunk: direct I/O when it is on
    name = "read_aligned" if store.direct_io.enabled else "readinto"
    real = getattr(store._io, name)

    def racing(*args: Any) -> Any:
        store.delete(key)
        store.put(torch.ones(1 << 18))  # reuses the spare run: same file, new bytes
        return real(*args)

    setattr(store._io, name, racing)
    try:
        with pytest.raises(KeyNotFoundError, match="deleted while being read"):
            store.get(key)
    finally:
        setattr(store._io, name, real)
        store.close()


# ------------------------------------------------------------- namespaces
def test_namespace_resume(tmp_path: Path) -> None:
    root = tmp_path / "root"
    tensors = [torch.randn(100), torch.randn(5000, 3).t(), torch.arange(10)[::2]]
    with ZarrStore(root, chunk_bytes="16KiB", namespace="job-1") as store:
        keys = [store.put(t) for t in tensors]
        gone = store.put(torch.ones(4))
        store.delete(gone)
        nbytes = store.nbytes
    with ZarrStore(root, chunk_bytes="16KiB", namespace="job-1") as store:
        assert sorted(store.keys()) == sorted(keys)
        assert store.nbytes == nbytes
        assert gone not in store
        for key, t in zip(keys, tensors, strict=True):
            assert_same_tensor(store.get(key), t)
        # New writes never reuse a resumed key or clobber resumed bytes.
        fresh = [store.put(torch.full((4000,), float(i))) for i in range(5)]
        assert not set(fresh) & set(keys) and gone not in fresh
        for key, t in zip(keys, tensors, strict=True):
            assert_same_tensor(store.get(key), t)
        store.delete(keys[0])
    with ZarrStore(root, chunk_bytes="16KiB", namespace="job-1") as store:
        assert keys[0] not in store and keys[1] in store and len(store) == 2 + 5
    # Another namespace under the same root sees none of it.
    with ZarrStore(root, chunk_bytes="16KiB", namespace="job-2") as other:
        assert len(other) == 0
        with pytest.raises(KeyNotFoundError):
            other.get(keys[1])


def test_default_namespaces_are_distinct(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with ZarrStore(root) as a, ZarrStore(root) as b:
        assert a.namespace != b.namespace
        ka = a.put(torch.ones(3))
        assert len(b) == 0
        kb = b.put(torch.zeros(3))
        assert torch.equal(a.get(ka), torch.ones(3)) and torch.equal(b.get(kb), torch.zeros(3))
        assert set(_namespaces(root)) == {a.namespace, b.namespace}


@pytest.mark.parametrize("bad", ["", "a/b", "../up", "x" * 129, "sp ace"])
def test_bad_namespace(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ConfigError, match="namespace"):
        ZarrStore(tmp_path, namespace=bad)


def test_empty_namespace_removed_at_close(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = ZarrStore(root)
    key = store.put(torch.ones(1000))
    assert store.namespace in _namespaces(root)
    store.delete(key)
    store.close()
    assert root.exists() and store.namespace not in _namespaces(root)
    # A namespace still holding keys stays.
    with ZarrStore(root, namespace="keep") as kept:
        kept.put(torch.ones(3))
    assert "keep" in _namespaces(root)


def test_temporary_store_removed_at_close() -> None:
    store = tsh.open_store()
    assert isinstance(store, ZarrStore) and store.temporary
    root = Path(store.url.removeprefix("file://"))
    store.put(torch.randn(10_000))
    assert root.is_dir() and _chunk_files(root)
    store.close()
    assert not root.exists()
    with tsh.open_store() as s2:
        root2 = Path(s2.url.removeprefix("file://"))
        s2.put(torch.ones(3))
    assert not root2.exists()


def test_temporary_store_removed_when_collected() -> None:
    store = tsh.open_store()
    root = Path(store.url.removeprefix("file://"))
    store.put(torch.ones(3))
    del store
    import gc

    gc.collect()
    assert not root.exists()


# ---------------------------------------------------------------- registry
def test_unknown_scheme_lists_known() -> None:
    with pytest.raises(ConfigError) as info:
        tsh.open_store("nosuchscheme://bucket/x")
    msg = str(info.value)
    assert "nosuchscheme" in msg
    for scheme in ("file", "memory", "tsh"):
        assert scheme in msg
    assert isinstance(info.value, ValueError)


_MISSING_FSSPEC = [
    (scheme, package)
    for scheme, package in (
        ("gs", "gcsfs"),
        ("az", "adlfs"),
        ("oci", "ocifs"),
        ("webdav", "webdav4"),
    )
    if importlib.util.find_spec(package) is None
]


@pytest.mark.skipif(not _MISSING_FSSPEC, reason="every candidate fsspec backend is installed")
def test_known_scheme_missing_package() -> None:
    scheme, package = _MISSING_FSSPEC[0]
    with pytest.raises(ConfigError) as info:
        tsh.open_store(f"{scheme}://bucket/prefix")
    msg = str(info.value)
    assert scheme in msg and f"pip install {package}" in msg


def test_existing_store_object_passes_through() -> None:
    with tsh.open_store("memory://") as store:
        assert tsh.open_store(store) is store
        with pytest.raises(ConfigError):
            tsh.open_store(store, codec="lz4")


@pytest.mark.parametrize(
    "options",
    [
        {"codec": "gzip"},
        {"codec": "zstd:99"},
        {"chunk_bytes": 3000},
        {"chunk_bytes": "1KiB"},
        {"chunk_bytes": "lots"},
        {"bogus_option": 1},
    ],
)
def test_bad_options(tmp_path: Path, options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        tsh.open_store(str(tmp_path / "x"), **options)


def test_bare_path_and_file_url_are_the_same_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with tsh.open_store(str(root)) as a:
        a.put(torch.ones(2))
        assert a.url == f"file://{root}"
    with tsh.open_store(f"file://{root}") as b:
        assert b.url == f"file://{root}"


# ---------------------------------------------------------------- journal
def test_journal_compaction_keeps_things_correct(tmp_path: Path) -> None:
    root = tmp_path / "root"
    gen = torch.Generator().manual_seed(1)
    live: dict[str, torch.Tensor] = {}
    issued: set[str] = set()
    with ZarrStore(root, chunk_bytes="16KiB", namespace="churn") as store:
        for i in range(10):
            t = torch.randn(100 + i, generator=gen)
            live[store.put(t)] = t
        journal = root / "churn" / "index" / "journal"
        peak = 0
        for i in range(2600):  # > 4096 records: at least one compaction
            t = torch.randn(int(torch.randint(1, 3000, (1,), generator=gen)), generator=gen)
            key = store.put(t)
            issued.add(key)
            if i % 97 == 0:
                live[key] = t  # a few survive the churn
            else:
                assert_same_tensor(store.get(key), t)
                store.delete(key)
            peak = max(peak, journal.stat().st_size if journal.exists() else 0)
        assert (root / "churn" / "index" / "snapshot").exists()
        assert journal.stat().st_size < peak  # it was truncated
        assert sorted(store.keys()) == sorted(live)
        for key, t in live.items():
            assert_same_tensor(store.get(key), t)
        # Free chunk runs are reused: the segment files did not grow with the churn
        # (~15 MB put in all). Live chunks plus spares (NOTE [ Spare chunk files ]) stay
        # within twice the peak of live bytes (with up to 1/8 padding per tensor).
        peak_live = sum(t.numel() * 4 for t in live.values()) + 3000 * 4
        on_disk = sum(p.stat().st_size - 4 for p in _chunk_files(root))
        assert on_disk <= 2 * (peak_live * 9 // 8 + 4 * 4096)
    assert set(_journal_entries(root / "churn")) == set(live)
    with ZarrStore(root, chunk_bytes="16KiB", namespace="churn") as store:
        assert sorted(store.keys()) == sorted(live)
        for key, t in live.items():
            assert_same_tensor(store.get(key), t)
        assert store.nbytes == sum(t.numel() * 4 for t in live.values())
        # Keys are never reused, not even deleted ones (a stale key must miss).
        assert store.put(torch.ones(1)) not in issued | set(live)


def test_torn_journal_tail_is_ignored(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with ZarrStore(root, namespace="torn") as store:
        key = store.put(torch.arange(10.0))
    journal = root / "torn" / "index" / "journal"
    with open(journal, "ab") as f:
        f.write(_frame(["put", "ff", {"seg": 4096}])[:20])  # a crash mid-append
    with ZarrStore(root, namespace="torn") as store:
        assert list(store.keys()) == [key]
        assert torch.equal(store.get(key), torch.arange(10.0))


def test_index_entries_are_validated(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with ZarrStore(root, namespace="evil") as store:
        store.put(torch.ones(4))
    journal = root / "evil" / "index" / "journal"
    rec = _frame(["put", "ff", {"seg": 4096, "start": 0, "count": 1, "meta": {"dtype": "object"}}])
    with open(journal, "ab") as f:
        f.write(rec)
    with pytest.raises(IntegrityError):
        ZarrStore(root, namespace="evil")


def test_store_files_stay_under_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with ZarrStore(root) as store:
        store.put(torch.randn(3000))
    outside = [p for p in tmp_path.rglob("*") if root not in p.parents and p != root]
    assert outside == []
    assert os.listdir(root)
