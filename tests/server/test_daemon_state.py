"""The daemon's storage side, hardened: finished sessions, file permissions, journal
damage at restart, quotas (zero-byte tensors, what the directory holds, a lower quota
at restart, per-session quotas).

Every daemon here is a real ``tensorstore-hooks serve`` process (``daemon_fixtures``).
"""

from __future__ import annotations

import os
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorstore_hooks import KeyNotFoundError, QuotaExceededError
from tensorstore_hooks.storage.daemon._client import DaemonStore, fetch_stats
from tests.daemon_fixtures import DaemonLauncher, daemons, free_port, wait_until

__all__ = ["daemons"]  # the fixture, re-exported for pytest

KiB = 1 << 10
MiB = 1 << 20


def _chunk_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and "/c/" in p.as_posix()]


# ------------------------------------------------------------ finished sessions
_FORGETFUL_CLIENT = """
import sys, torch, tensorstore_hooks as tsh
store = tsh.open_store(sys.argv[1])
store.put(torch.ones(1000))
model = torch.nn.Linear(64, 64)
with tsh.offload(sys.argv[1], min_bytes=0):
    loss = model(torch.randn(8, 64)).sum()
loss.backward()
print("done", flush=True)
# exits without closing either store
"""


def test_finished_client_leaves_stats_at_once(daemons: DaemonLauncher) -> None:
    d = daemons.start("--memory-quota", "16MiB", "--lease", "120")
    out = subprocess.run(
        [sys.executable, "-c", _FORGETFUL_CLIENT, d.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    t0 = time.monotonic()
    wait_until(
        lambda: fetch_stats(d.url)["sessions_total"] == 0,
        5,
        "the finished client's sessions to leave stats (lease is 120 s)",
    )
    snap = fetch_stats(d.url)
    assert snap["tiers"]["ram"]["used"] == 0 and snap["tiers"]["ram"]["tensors"] == 0
    assert snap["counters"]["sessions_expired"] == 0
    assert time.monotonic() - t0 < 5
    assert d.log().count("closed by the client") == 2


# ------------------------------------------------------------ file permissions
def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in root.rglob("*")} | {
        ".": stat.S_IMODE(root.stat().st_mode)
    }


def test_root_and_files_are_private(daemons: DaemonLauncher, tmp_path: Path) -> None:
    root = tmp_path / "root"
    d = daemons.start("--memory-quota", "1MiB", "--root", str(root), "--disk-quota", "64MiB")
    with DaemonStore(d.url) as store:
        keys = [store.put(torch.full((64 * KiB,), float(i))) for i in range(12)]  # 3 MiB
        wait_until(lambda: store.stats()["counters"]["spills"] > 0, 10, "spills")
        store.delete_many(keys[:2])
        assert torch.equal(store.get(keys[5]), torch.full((64 * KiB,), 5.0))
        assert d.terminate() == 0  # the drain compacts the journal into a snapshot
    modes = _modes(root)
    files = [p for p in root.rglob("*") if p.is_file()]
    assert any("/c/" in p.as_posix() for p in files), "no chunk files were written"
    assert any(p.name == "journal" for p in files) and any(p.name == "snapshot" for p in files)
    assert modes["."] == 0o700
    wrong = {
        name: oct(mode)
        for name, mode in modes.items()
        if mode != (0o700 if (root / name).is_dir() else 0o600)
    }
    assert not wrong, wrong


def test_writable_or_foreign_root_refused(daemons: DaemonLauncher, tmp_path: Path) -> None:
    open_root = tmp_path / "open"
    open_root.mkdir()
    open_root.chmod(0o777)
    out = daemons.run("--listen", "127.0.0.1:0", "--root", str(open_root))
    assert out.returncode == 2
    assert "writable by other users (mode 0777)" in out.stderr and "chmod 700" in out.stderr
    group_root = tmp_path / "group"
    group_root.mkdir()
    group_root.chmod(0o770)
    out = daemons.run("--listen", "127.0.0.1:0", "--root", str(group_root))
    assert out.returncode == 2 and "writable by other users (mode 0770)" in out.stderr
    if os.geteuid() == 0:  # only root can give a directory away
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
        out = daemons.run("--listen", "127.0.0.1:0", "--root", str(foreign))
        assert out.returncode == 2 and "owned by uid 65534" in out.stderr, out.stderr
    # The rule itself, for any uid (the test may not be able to act as another user).
    from tensorstore_hooks.server._root import check_root_dir

    st = os.stat(tmp_path)
    assert check_root_dir("/r", st, st.st_uid) is None
    assert "owned by uid" in (check_root_dir("/r", st, st.st_uid + 1) or "")


def test_readable_root_of_our_own_is_tightened(daemons: DaemonLauncher, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    (root / "notes").write_text("left by an older version")
    (root / "notes").chmod(0o644)
    d = daemons.start("--memory-quota", "0", "--root", str(root))
    with DaemonStore(d.url) as store:
        store.put(torch.ones(1000))
    modes = _modes(root)
    assert modes["."] == 0o700 and modes["notes"] == 0o600
    assert "tightened to 0700" in d.log()


# ------------------------------------------------------------ journal damage
def _records(path: Path) -> list[tuple[int, int]]:
    """(offset, total length) of each framed record in a journal file."""
    raw = path.read_bytes()
    out = []
    pos = 0
    while pos < len(raw):
        assert raw[pos : pos + 4] == b"\xc1TSH", "unexpected journal framing"
        (n,) = struct.unpack_from("<I", raw, pos + 4)
        out.append((pos, 12 + n))
        pos += 12 + n
    return out


def _disk_daemon(daemons: DaemonLauncher, root: Path, port: int) -> Any:
    return daemons.start(
        "--listen", f"127.0.0.1:{port}", "--memory-quota", "0", "--root", str(root)
    )


def _fill(store: DaemonStore, n: int) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i in range(n):
        t = torch.full((1000 + i,), float(i))
        out.append((store.put(t), t))
    return out


def _served(store: DaemonStore, items: list[tuple[str, torch.Tensor]]) -> list[bool]:
    ok = []
    for key, t in items:
        try:
            ok.append(torch.equal(store.get(key), t))
        except KeyNotFoundError:
            ok.append(False)
    return ok


@pytest.mark.parametrize("damaged", [4, 1])
def test_flipped_bit_in_session_journal_costs_one_record(
    daemons: DaemonLauncher, tmp_path: Path, damaged: int
) -> None:
    root = tmp_path / "root"
    port = free_port()
    d = _disk_daemon(daemons, root, port)
    store = DaemonStore(d.url, reconnect_deadline_s=60)
    items = _fill(store, 20)  # journal: 1 session record + 20 key records
    d.kill()
    journal = root / "daemon" / "sessions" / "journal"
    recs = _records(journal)
    assert len(recs) == 21
    raw = bytearray(journal.read_bytes())
    off, n = recs[damaged - 1]
    raw[off + n - 3] ^= 0x10  # one bit inside the record's body
    journal.write_bytes(bytes(raw))

    d2 = _disk_daemon(daemons, root, port)
    served = _served(store, items)
    log = d2.log()
    assert f"sessions/journal: record {damaged} at byte {off} is damaged" in log, log
    if damaged == 1:  # the session's own record: restored from its 20 key records
        assert all(served)
        assert "restored from its 20 intact key records" in log
    else:  # record 4 is the third tensor's ownership record: only that tensor is lost
        assert served == [i != 2 for i in range(20)]
        assert f"key {items[2][0]} of session {store.session_id[:8]}" in log  # named
        assert "deleted 1 disk-tier tensors" in log
    assert len(store) == sum(served)
    store.close()


def test_garbage_in_disk_index_costs_only_its_records(
    daemons: DaemonLauncher, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    port = free_port()
    d = _disk_daemon(daemons, root, port)
    store = DaemonStore(d.url, reconnect_deadline_s=60)
    items = _fill(store, 20)
    d.kill()
    index = root / "daemon" / "index" / "journal"
    recs = _records(index)
    assert len(recs) == 20
    raw = bytearray(index.read_bytes())
    off11 = recs[10][0]
    raw[off11 + 20 : off11 + 28] = b"\xde\xad\xbe\xef" * 2  # 8 garbage bytes over record 11
    off5 = recs[4][0]
    raw[off5:off5] = b"GARBAGE!"  # and 8 more inserted before record 5
    index.write_bytes(bytes(raw))
    chunks_before = len(_chunk_files(root))

    d2 = _disk_daemon(daemons, root, port)
    served = _served(store, items)
    log = d2.log()
    assert served == [i != 10 for i in range(20)], log
    assert "index/journal: record 5" in log and "index/journal: record 11" in log, log
    assert "1 acknowledged tensors are lost" in log
    assert f"session {store.session_id[:8]}: keys {items[10][0]}" in log
    # The lost tensor's chunk files are gone, the others' are all there.
    assert len(_chunk_files(root)) == chunks_before - 1
    store.close()


def test_bad_dtype_record_is_quarantined(daemons: DaemonLauncher, tmp_path: Path) -> None:
    from tensorstore_hooks.storage.zarr._index import frame_record

    root = tmp_path / "root"
    port = free_port()
    d = _disk_daemon(daemons, root, port)
    store = DaemonStore(d.url, reconnect_deadline_s=60)
    items = _fill(store, 5)
    d.kill()
    index = root / "daemon" / "index" / "journal"
    import msgpack

    off, n = _records(index)[3]
    _, disk_key, entry = msgpack.unpackb(index.read_bytes()[off + 12 : off + n], raw=False)
    entry["meta"]["dtype"] = "uintX"
    with open(index, "ab") as f:
        f.write(frame_record(["put", disk_key, entry]))  # valid framing, bad content

    for _ in range(2):  # and the next start is clean
        d2 = _disk_daemon(daemons, root, port)
        assert _served(store, items) == [i != 3 for i in range(5)]
        d2.terminate()
    log = (tmp_path / "daemon-2.log").read_text()
    assert "index/journal record 6 (key" in log and "uintX" in log and "quarantined" in log, log
    assert "uintX" not in d2.log()
    store.close()


def test_record_with_unrebuildable_metadata_is_quarantined(
    daemons: DaemonLauncher, tmp_path: Path
) -> None:
    # A disk-index record whose metadata a GET could not rebuild (a 2**48-element
    # storage offset: NOTE [ Storable metadata ]) is quarantined at start like a bad dtype.
    import msgpack

    from tensorstore_hooks.storage.zarr._index import frame_record

    root = tmp_path / "root"
    port = free_port()
    d = _disk_daemon(daemons, root, port)
    store = DaemonStore(d.url, reconnect_deadline_s=60)
    items = _fill(store, 3)
    d.kill()
    index = root / "daemon" / "index" / "journal"
    off, n = _records(index)[1]
    _, disk_key, entry = msgpack.unpackb(index.read_bytes()[off + 12 : off + n], raw=False)
    entry["meta"]["storage_offset"] = 2**48
    with open(index, "ab") as f:
        f.write(frame_record(["put", disk_key, entry]))
    d2 = _disk_daemon(daemons, root, port)
    assert _served(store, items) == [True, False, True]
    assert "quarantined" in d2.log() and "max_tensor" in d2.log(), d2.log()
    store.close()


# ------------------------------------------------------------ quotas
RAM_OVERHEAD = 2048  # NOTE [ What a tensor costs ]


def _fill_until_refused(store: DaemonStore, make: Any, limit: int) -> list[str]:
    keys = []
    for i in range(limit):
        try:
            keys.append(store.put(make(i)))
        except QuotaExceededError:
            return keys
    pytest.fail(f"{limit} PUTs and none refused")


def test_zero_byte_tensors_count(daemons: DaemonLauncher) -> None:
    d = daemons.start("--memory-quota", "64KiB")
    with DaemonStore(d.url) as store:
        keys = _fill_until_refused(store, lambda i: torch.empty(0), 1000)
        assert len(keys) == 64 * KiB // RAM_OVERHEAD
        ram = store.stats()["tiers"]["ram"]
        assert (ram["used"], ram["tensors"]) == (len(keys) * RAM_OVERHEAD, len(keys))
        store.delete_many(keys[:4])
        assert torch.equal(store.get(store.put(torch.empty(0))), torch.empty(0))


def _dir_bytes(root: Path) -> int:
    return sum(p.lstat().st_size for p in root.rglob("*") if p.is_file())


def test_disk_quota_counts_what_the_directory_holds(
    daemons: DaemonLauncher, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    quota = 256 * KiB
    d = daemons.start("--memory-quota", "0", "--root", str(root), "--disk-quota", str(quota))
    with DaemonStore(d.url) as store:
        # 4000-byte payloads occupy a 4 KiB chunk each, plus journal records.
        keys = _fill_until_refused(store, lambda i: torch.full((1000,), float(i)), 1000)
        disk = store.stats()["tiers"]["disk"]
        held = _dir_bytes(root)
        assert held <= quota, (held, len(keys))
        assert disk["used"] >= held - 4 * KiB  # counted: within a record or two of the files
        assert disk["used"] + disk["reserved"] <= quota
        assert len(keys) >= 50
        # Deletes give the room back.
        store.delete_many(keys[:10])
        store.put(torch.ones(1000))


def test_lower_quota_at_restart_is_honoured(daemons: DaemonLauncher, tmp_path: Path) -> None:
    root = tmp_path / "root"
    port = free_port()

    def start(disk_quota: str) -> Any:
        return daemons.start(
            "--listen", f"127.0.0.1:{port}", "--memory-quota", "0",
            "--root", str(root), "--disk-quota", disk_quota,
        )  # fmt: skip

    d = start("4MiB")
    store = DaemonStore(d.url, reconnect_deadline_s=60)
    items = [(store.put(t), t) for t in (torch.full((16 * KiB,), float(i)) for i in range(10))]
    assert d.terminate() == 0  # 10 x 64 KiB on disk

    d2 = start("256KiB")
    assert _served(store, items) == [True] * 10  # existing data kept
    with pytest.raises(QuotaExceededError, match="no room"):
        store.put(torch.ones(10))
    disk = store.stats()["tiers"]["disk"]
    assert disk["used"] > disk["quota"] == 256 * KiB
    assert "more than its quota of 256.00 KiB" in d2.log()
    store.delete_many([k for k, _ in items[:8]])  # 2 x 64 KiB left: under the quota
    key = store.put(torch.ones(10))
    assert torch.equal(store.get(key), torch.ones(10))
    assert _dir_bytes(root) <= 256 * KiB
    store.close()


def test_session_quota(daemons: DaemonLauncher) -> None:
    d = daemons.start("--memory-quota", "8MiB", "--session-quota", "1MiB")
    quarter = lambda i: torch.full((64 * KiB,), float(i))  # noqa: E731 - 256 KiB
    with DaemonStore(d.url) as a, DaemonStore(d.url) as b:
        keys_a = _fill_until_refused(a, quarter, 10)
        assert len(keys_a) == MiB // (256 * KiB + RAM_OVERHEAD)  # 3
        with pytest.raises(QuotaExceededError, match="session quota"):
            a.put(quarter(0))
        # Another session keeps its own room ...
        keys_b = _fill_until_refused(b, quarter, 10)
        assert len(keys_b) == len(keys_a)
        # ... zero-byte tensors count too ...
        with pytest.raises(QuotaExceededError, match="session quota"):
            for _ in range(200):
                a.put(torch.empty(0))
        # ... and freeing gives the session its room back.
        a.delete_many(keys_a[:1] + [k for k in list(a.keys()) if k not in keys_a])
        a.put(quarter(1))
        assert fetch_stats(d.url)["counters"]["quota_rejected"] >= 3
