"""Deletes are durable or not acknowledged (NOTE [ Durable deletes ] in
server/_journal.py), and a big session ending holds up nobody (issue 36, findings 2
and 5). Real daemon processes; faults injected with a file-size limit on the daemon
(any machine) and a full tmpfs (root)."""

from __future__ import annotations

import contextlib
import errno
import resource
import threading
from pathlib import Path

import pytest
import torch

from tensorstore_hooks import KeyNotFoundError, StoreUnavailableError
from tensorstore_hooks.storage.daemon._client import DaemonStore, fetch_stats
from tests.daemon_fixtures import (
    Daemon,
    DaemonLauncher,
    daemons,
    free_port,
    raw_connect,
    raw_hello,
    recv_frame,
    send_frame,
    tmpfs,
    wait_until,
)

__all__ = ["daemons"]  # the fixture, re-exported for pytest

KiB = 1 << 10
MiB = 1 << 20
UNLIMITED = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)


def _tensor(i: int, nbytes: int = 64 * KiB) -> torch.Tensor:
    return torch.full((nbytes // 4,), float(i))


def _chunk_files(root: Path) -> int:
    return sum(1 for p in (root / "daemon").glob("seg-*/c/*") if p.is_file())


def _limit_journal_growth(d: Daemon, root: Path) -> None:
    """Every append to the session journal (and any file past its size) now fails
    with EFBIG, as on a full filesystem (Python ignores SIGXFSZ)."""
    size = (root / "daemon" / "sessions" / "journal").stat().st_size
    resource.prlimit(d.pid, resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))


def test_delete_the_journal_cannot_record_is_refused(
    daemons: DaemonLauncher, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    args = ("--listen", f"127.0.0.1:{free_port()}", "--memory-quota", "0",
            "--root", str(root), "--lease", "120")  # fmt: skip
    d = daemons.start(*args)
    store = DaemonStore(d.url, reconnect_deadline_s=60)
    other = DaemonStore(d.url, reconnect_deadline_s=60)
    kept = {store.put(t): t for t in (_tensor(i) for i in range(8))}
    keys = list(kept)
    gone = other.put(_tensor(100))
    other_sid = other.session_id
    files = _chunk_files(root)

    _limit_journal_growth(d, root)
    for key in keys[:4]:
        with pytest.raises(StoreUnavailableError, match="could not record the delete"):
            store.delete(key)
    for key in keys[:4]:  # refused, so still there, bytes and all
        assert torch.equal(store.get(key), kept[key])
    other.close()  # BYE: the session's end cannot be recorded either
    assert _chunk_files(root) == files  # nothing was unlinked
    snap = fetch_stats(d.url)
    assert snap["counters"]["delete_failures"] == 4
    assert snap["counters"]["unrecorded_session_ends"] == 1

    resource.prlimit(d.pid, resource.RLIMIT_FSIZE, UNLIMITED)
    store.delete(keys[0])  # the journal works again: acknowledged, durable
    wait_until(  # housekeeping records the session's end, then frees its tensor
        lambda: fetch_stats(d.url)["counters"]["unrecorded_session_ends"] == 0,
        20,
        "the session's end to be recorded",
    )
    wait_until(lambda: _chunk_files(root) == files - 2, 20, "the chunks to be deleted")
    d.kill()

    d2 = daemons.start(*args)
    assert set(store.keys()) == set(keys[1:])  # the acknowledged delete stayed
    with pytest.raises(KeyNotFoundError):
        store.get(keys[0])
    for key in keys[1:]:
        assert torch.equal(store.get(key), kept[key])
    with raw_connect(d2.url) as sock:  # the ended session stayed ended
        assert raw_hello(sock, session=other_sid)["code"] == "NOT_FOUND"
    assert gone not in set(store.keys())
    log = d2.log()
    assert "are lost" not in log and "Traceback" not in log, log
    store.close()


def _fill(path: Path) -> None:
    """Write to ``path`` until the filesystem is full."""
    block = bytes(4 * KiB)
    with open(path, "ab", buffering=0) as f:
        while True:
            try:
                f.write(block)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                return


def test_deletes_on_a_full_filesystem_are_durable(
    daemons: DaemonLauncher, tmp_path: Path
) -> None:
    with tmpfs(tmp_path / "mnt", "6m") as mnt:
        root = mnt / "root"
        args = ("--listen", f"127.0.0.1:{free_port()}", "--memory-quota", "0",
                "--root", str(root), "--lease", "120")  # fmt: skip
        d = daemons.start(*args)
        store = DaemonStore(d.url, reconnect_deadline_s=60)
        kept = {store.put(t): t for t in (_tensor(i, 16 * KiB) for i in range(40))}
        keys = list(kept)
        filler = mnt / "filler"
        acked: list[str] = []
        refused = 0
        for key in keys[:30]:  # every delete meets a full filesystem
            _fill(filler)
            try:
                store.delete(key)
            except StoreUnavailableError as e:
                assert "could not record the delete" in str(e)
                refused += 1
                continue
            acked.append(key)
            wait_until(
                lambda: _chunk_files(root) == len(keys) - len(acked), 10, "the unlink"
            )
        # The journal's reserve lets deletes through: a full disk does not wedge them.
        assert len(acked) >= 25, (len(acked), refused)
        d.kill()
        filler.unlink()
        d2 = daemons.start(*args)
        listed = set(store.keys())
        for key in acked:
            assert key not in listed
            with pytest.raises(KeyNotFoundError):
                store.get(key)
        for key in set(keys) - set(acked):
            assert torch.equal(store.get(key), kept[key])
        assert "are lost" not in d2.log()
        store.close()
        d2.kill()


def test_a_big_session_ending_holds_up_nobody(daemons: DaemonLauncher, tmp_path: Path) -> None:
    # 20,000 empty tensors on the disk tier: ending the session frees them in batches,
    # serving other requests between them (the old daemon froze every client until
    # all were freed, one journal record each).
    d = daemons.start("--memory-quota", "0", "--root", str(tmp_path / "root"))
    n = 20_000
    big = DaemonStore(d.url)
    with raw_connect(d.url) as sock:
        assert raw_hello(sock, session=big.session_id)["ok"] is True
        meta = {"dtype": "float32", "shape": [0], "stride": [1], "storage_offset": 0,
                "compact": False, "device": "cpu", "requires_grad": False, "nbytes": 0}  # fmt: skip
        window = 256  # pipelined PUTs: quick to fill
        for start in range(0, n, window):
            for i in range(start, min(n, start + window)):
                send_frame(sock, {"op": "put", "id": 10 + i, "meta": meta, "size": 0})
            for _ in range(start, min(n, start + window)):
                got = recv_frame(sock)
                assert got is not None and got[0]["ok"] is True, got
    assert fetch_stats(d.url)["tiers"]["disk"]["tensors"] == n

    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        with contextlib.suppress(StoreUnavailableError):
            while not stop.is_set():
                seen.append(int(fetch_stats(d.url)["tiers"]["disk"]["tensors"]))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        wait_until(lambda: len(seen) >= 3, 30, "the watcher")
        big.close()  # BYE
        wait_until(lambda: seen and seen[-1] == 0, 60, "the session's tensors to be freed")
    finally:
        stop.set()
        watcher.join(timeout=30)
    # Other requests were served while the ended session's tensors were being freed.
    assert any(0 < x < n for x in seen), sorted(set(seen))[:10]
