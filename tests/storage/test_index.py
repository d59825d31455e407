"""The journal/snapshot record format (NOTE [ Journal records ] in ``storage/zarr/_index.py``).

Real files in a temporary directory; damage is done to the bytes on disk.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tensorstore_hooks import IntegrityError, QuotaExceededError, StoreUnavailableError
from tensorstore_hooks.storage.io import LocalIO, MemoryIO
from tensorstore_hooks.storage.zarr._index import (
    HEADER_BYTES,
    MAGIC,
    IndexLog,
    frame_record,
    scan_journal,
)


def _entry(i: int) -> dict[str, Any]:
    return {"seg": 4096, "start": i, "count": 1, "meta": {"n": i}}


def _log(root: Path, **kw: Any) -> IndexLog:
    return IndexLog(LocalIO(str(root)), "ns/index", **kw)


def _write(root: Path, n: int, deletes: tuple[int, ...] = ()) -> list[int]:
    """``n`` puts (keys "0".."n-1"), then deletes; returns each record's start offset."""
    log = _log(root)
    log.load()
    offsets = []
    journal = root / "ns" / "index" / "journal"
    for i in range(n):
        offsets.append(journal.stat().st_size if journal.exists() else 0)
        log.record_put(format(i, "x"), _entry(i))
    for i in deletes:
        offsets.append(journal.stat().st_size)
        log.record_delete(format(i, "x"))
    log.close()
    return offsets


def _journal(root: Path) -> Path:
    return root / "ns" / "index" / "journal"


def test_round_trip_and_deletes(tmp_path: Path) -> None:
    _write(tmp_path, 5, deletes=(1, 3))
    log = _log(tmp_path)
    assert log.load() == {k: _entry(int(k)) for k in ("0", "2", "4")}
    assert log.damage == []
    assert log.retired_keys == {"1", "3"}


def test_torn_tail_is_silent_and_cut_before_the_next_append(tmp_path: Path) -> None:
    _write(tmp_path, 3)
    torn = frame_record(["put", "9", _entry(9)])[:-3]
    with open(_journal(tmp_path), "ab") as f:
        f.write(torn)
    log = _log(tmp_path)
    assert set(log.load()) == {"0", "1", "2"}  # no warning (filterwarnings=error)
    assert log.damage == []
    log.record_put("3", _entry(3))
    log.close()
    log = _log(tmp_path)
    assert set(log.load()) == {"0", "1", "2", "3"}
    assert log.damage == []


@pytest.mark.parametrize("cut", [1, 5, HEADER_BYTES - 1])
def test_tail_torn_inside_the_header_is_silent(tmp_path: Path, cut: int) -> None:
    _write(tmp_path, 2)
    with open(_journal(tmp_path), "ab") as f:
        f.write(frame_record(["put", "9", _entry(9)])[:cut])
    log = _log(tmp_path)
    assert set(log.load()) == {"0", "1"}
    assert log.damage == []


@pytest.mark.parametrize("where", ["magic", "length", "crc", "body"])
def test_one_flipped_bit_loses_only_that_record(tmp_path: Path, where: str) -> None:
    offsets = _write(tmp_path, 6)
    journal = _journal(tmp_path)
    raw = bytearray(journal.read_bytes())
    at = offsets[2] + {"magic": 1, "length": 5, "crc": 9, "body": HEADER_BYTES + 3}[where]
    raw[at] ^= 0x10
    journal.write_bytes(bytes(raw))
    log = _log(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"journal: record 3 at byte \d+ is damaged"):
        entries = log.load()
    assert entries == {k: _entry(int(k)) for k in ("0", "1", "3", "4", "5")}
    [d] = log.damage
    assert d.path.endswith("ns/index/journal")
    assert (d.record, d.offset, d.nbytes) == (3, offsets[2], offsets[3] - offsets[2])


def test_garbage_in_the_middle_loses_only_what_it_overwrote(tmp_path: Path) -> None:
    offsets = _write(tmp_path, 8)
    journal = _journal(tmp_path)
    raw = bytearray(journal.read_bytes())
    # Overwrite records 3 and 4 and the start of 5 with garbage that holds a magic.
    lo, hi = offsets[2], offsets[4] + 7
    raw[lo:hi] = ((b"junk" + MAGIC + b"\xff" * 64) * 8)[: hi - lo]
    journal.write_bytes(bytes(raw))
    log = _log(tmp_path)
    with pytest.warns(RuntimeWarning, match="damaged"):
        entries = log.load()
    assert set(entries) == {"0", "1", "5", "6", "7"}
    assert [d.record for d in log.damage] == [3]
    assert log.damage[0].offset == lo


def test_inserted_garbage_loses_nothing(tmp_path: Path) -> None:
    offsets = _write(tmp_path, 4)
    journal = _journal(tmp_path)
    raw = journal.read_bytes()
    journal.write_bytes(raw[: offsets[2]] + b"\x00" * 100 + raw[offsets[2] :])
    log = _log(tmp_path)
    with pytest.warns(RuntimeWarning):
        assert set(log.load()) == {"0", "1", "2", "3"}
    assert [(d.record, d.nbytes) for d in log.damage] == [(3, 100)]
    assert log.damaged_bytes == 100


def test_damaged_last_record_is_reported_not_taken_for_a_torn_tail(tmp_path: Path) -> None:
    _write(tmp_path, 3)
    journal = _journal(tmp_path)
    raw = bytearray(journal.read_bytes())
    raw[-1] ^= 1
    journal.write_bytes(bytes(raw))
    log = _log(tmp_path, warn=False)
    assert set(log.load()) == {"0", "1"}
    assert [d.record for d in log.damage] == [3]


def test_snapshot_round_trip_and_per_record_damage(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.load()
    live = {format(i, "x"): _entry(i) for i in range(5)}
    log.snapshot(live)
    log.record_put("5", _entry(5))
    log.close()
    log = _log(tmp_path)
    assert log.load() == {**live, "5": _entry(5)}
    snap = tmp_path / "ns" / "index" / "snapshot"
    raw = bytearray(snap.read_bytes())
    records = scan_journal(bytes(raw), "x").records
    assert records[0] == ("snap", "", {"records": 5})
    raw[-3] ^= 0x40  # damage the last put record of the snapshot
    snap.write_bytes(bytes(raw))
    log = _log(tmp_path, warn=False)
    assert set(log.load()) == {"0", "1", "2", "3", "5"}
    [d] = log.damage
    assert d.path.endswith("ns/index/snapshot") and d.record == 6


def test_truncated_snapshot_is_reported(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.load()
    log.snapshot({format(i, "x"): _entry(i) for i in range(4)})
    log.close()
    snap = tmp_path / "ns" / "index" / "snapshot"
    records = snap.read_bytes()
    one = len(frame_record(["put", "3", _entry(3)]))
    snap.write_bytes(records[:-one])  # a whole record missing: no torn bytes
    log = _log(tmp_path, warn=False)
    assert set(log.load()) == {"0", "1", "2"}
    assert "1 of 4 records missing" in log.damage[0].reason


def test_format1_files_are_refused(tmp_path: Path) -> None:
    body = msgpack.packb(["put", "0", _entry(0)])
    _journal(tmp_path).parent.mkdir(parents=True)
    _journal(tmp_path).write_bytes(struct.pack("<I", len(body)) + body)
    with pytest.raises(IntegrityError, match=r"format 1.*remove the namespace directory"):
        _log(tmp_path).load()
    _journal(tmp_path).unlink()
    (tmp_path / "ns" / "index" / "snapshot").write_bytes(msgpack.packb({"0": _entry(0)}))
    with pytest.raises(IntegrityError, match="snapshot is in format 1"):
        _log(tmp_path).load()


class _FullFile:
    """A journal file whose writes stop after ``room`` bytes with ENOSPC (like a full
    disk: a partial write first), and whose truncate really truncates."""

    def __init__(self, path: Path, io: _FullIO) -> None:
        self._f = open(path, "ab", buffering=0)  # noqa: SIM115 - closed by close()
        self.io = io

    def write(self, data: Any) -> int:
        import errno

        if self.io.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = self._f.write(bytes(data)[: self.io.room])
        self.io.room -= n
        return n

    def seek(self, *a: Any) -> int:
        return self._f.seek(*a)

    def truncate(self, size: int) -> int:
        return self._f.truncate(size)

    def close(self) -> None:
        self._f.close()


class _FullIO(LocalIO):
    room = 0

    def open_append(self, path: str) -> Any:
        full = self._full(path)
        Path(full).parent.mkdir(parents=True, exist_ok=True)
        return _FullFile(Path(full), self)


def test_a_failed_append_is_refused_and_leaves_no_bytes(tmp_path: Path) -> None:
    _write(tmp_path, 2)
    size = _journal(tmp_path).stat().st_size
    io = _FullIO(str(tmp_path))
    io.room = 10  # part of the next record fits, then ENOSPC
    log = IndexLog(io, "ns/index")
    log.load()
    with pytest.raises(QuotaExceededError, match="filesystem is full"):
        log.record_put("2", _entry(2))
    assert _journal(tmp_path).stat().st_size == size  # the space was given back
    log.record_delete("0")  # deferred, not raised
    log.close()
    log = _log(tmp_path)
    assert set(log.load()) == {"0", "1"}
    assert log.damage == []
    # Space returns: the deferred delete is written before the next record.
    log2 = IndexLog(io, "ns/index")
    log2.load()
    io.room = 0
    with pytest.raises(QuotaExceededError):
        log2.record_put("2", _entry(2))
    log2.record_delete("0")
    io.room = 1 << 20  # the disk has room again
    log2.record_put("2", _entry(2))
    log2.close()
    log = _log(tmp_path)
    assert set(log.load()) == {"1", "2"}
    assert log.retired_keys == {"0"}


def test_other_os_errors_are_store_errors(tmp_path: Path) -> None:
    (tmp_path / "ns" / "index").mkdir(parents=True)
    (tmp_path / "ns" / "index" / "journal").mkdir()
    log = _log(tmp_path)
    with pytest.raises(IntegrityError, match="is a directory"):
        log.load()
    log = _log(tmp_path)
    with pytest.raises(StoreUnavailableError, match="opening journal"):
        log.record_put("0", _entry(0))


def test_private_memory_persists_nothing() -> None:
    io = MemoryIO()
    log = IndexLog(io, "ns/index")
    log.record_put("0", _entry(0))
    log.snapshot({"0": _entry(0)})
    assert io.listdir("") == []
    assert log.load() == {}
