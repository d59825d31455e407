"""The disk tier failing under a serving daemon (NOTE [ Disk failures ] in server/_disk.py):
an unwritable session journal, a full filesystem below the quota, a read-only or
deleted root, SIGKILL in the middle of spills. Whatever happens, nothing is
acknowledged (or reported as on disk) that a restart does not serve, a refused PUT
is QUOTA_EXCEEDED (the client keeps the tensor), and the log says it once.

Real daemon processes throughout. The full-tmpfs and read-only tests mount a small
tmpfs and need root; without it they are skipped (never counted as passed), and
``test_file_size_limit_answers_quota_exceeded`` covers a full disk on any machine
(a file-size limit makes writes fail with EFBIG, as ENOSPC would).
"""

from __future__ import annotations

import os
import random
import resource
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from tensorstore_hooks import KeyNotFoundError, QuotaExceededError
from tensorstore_hooks.storage.daemon._client import DaemonStore, fetch_stats
from tests._mounts import read_only, tmpfs, unmount, writable_again
from tests.daemon_fixtures import Daemon, DaemonLauncher, daemons, free_port, raw_heads, wait_until

__all__ = ["daemons"]  # the fixture, re-exported for pytest

KiB = 1 << 10
MiB = 1 << 20


def _tensor(i: int, nbytes: int = MiB) -> torch.Tensor:
    return torch.full((nbytes // 4,), float(i))


def _warnings(d: Daemon) -> list[str]:
    return [line for line in d.log().splitlines() if "cannot take writes" in line]


# ------------------------------------------------ finding 1: a spill not journaled
def test_unjournaled_spill_is_undone(daemons: DaemonLauncher, tmp_path: Path) -> None:
    root = tmp_path / "root"
    args = ("--listen", f"127.0.0.1:{free_port()}", "--memory-quota", "4MiB",
            "--root", str(root), "--disk-quota", "256MiB", "--lease", "120")  # fmt: skip
    d = daemons.start(*args)
    store = DaemonStore(d.url, reconnect_deadline_s=60)
    kept: dict[str, torch.Tensor] = {}
    for i in range(2):  # these stay in RAM: the session journal file is not open yet
        t = _tensor(i)
        kept[store.put(t)] = t
    sid = store.session_id
    assert sid is not None
    assert set(raw_heads(d.url, sid, list(kept)).values()) == {"ram"}

    # The session journal's directory becomes unusable (for any user, root included:
    # a file where the directory was), standing in for a full disk or an I/O error.
    journal_dir = root / "daemon" / "sessions"
    journal_dir.rename(root / "sessions.away")
    journal_dir.write_text("not a directory")
    refused = 0
    for i in range(2, 14):  # 12 PUTs that must spill to find room
        t = _tensor(i)
        try:
            kept[store.put(t)] = t
        except QuotaExceededError as e:  # never INTERNAL: the client keeps the tensor
            assert "no room" in str(e) or "disk" in str(e)
            refused += 1
    said_disk = {k for k, tier in raw_heads(d.url, sid, list(kept)).items() if tier == "disk"}
    assert not said_disk, "reported as on disk while the journal could not record it"
    assert refused > 0  # RAM filled up: the rest went back to the client

    # The journal comes back: after the back-off, spills are journaled again.
    journal_dir.unlink()
    (root / "sessions.away").rename(journal_dir)

    def one_more() -> bool:
        t = _tensor(100 + len(kept))
        try:
            kept[store.put(t)] = t
        except QuotaExceededError:
            return False
        return True

    wait_until(one_more, 30, "a PUT to succeed once the journal is writable again")
    for _ in range(3):
        one_more()
    wait_until(
        lambda: any(v == "disk" for v in raw_heads(d.url, sid, list(kept)).values()),
        30,
        "spills to be journaled",
    )
    on_disk = {k for k, tier in raw_heads(d.url, sid, list(kept)).items() if tier == "disk"}
    d.kill()

    d2 = daemons.start(*args)
    for key in on_disk:  # every tensor the daemon said was on disk survives SIGKILL
        assert torch.equal(store.get(key), kept[key])
    assert store.session_id == sid
    log = d.log()
    assert "Traceback" not in log, log
    assert len(_warnings(d)) == 1, log  # said once, not once per PUT
    assert "takes writes again" in log
    store.close()
    d2.terminate()


# ------------------------------------------------ finding 4: a full filesystem
def test_file_size_limit_answers_quota_exceeded(daemons: DaemonLauncher, tmp_path: Path) -> None:
    # Runs anywhere: RLIMIT_FSIZE makes every write past 1 MiB in a file fail with
    # EFBIG (Python ignores SIGXFSZ), as a full filesystem below the quota would.
    d = daemons.start("--memory-quota", "0", "--root", str(tmp_path / "root"),
                      "--disk-quota", "1GiB")  # fmt: skip
    resource.prlimit(d.pid, resource.RLIMIT_FSIZE, (MiB, MiB))
    with DaemonStore(d.url) as store:
        small = {store.put(t): t for t in (_tensor(i, 16 * KiB) for i in range(3))}
        t0 = time.monotonic()
        for i in range(60):  # 2 MiB each: a chunk file of 2 MiB + 4 bytes cannot be written
            with pytest.raises(QuotaExceededError, match="no room") as info:
                store.put(_tensor(i, 2 * MiB))
        assert "File too large" in str(info.value) or "filesystem is full" in str(info.value)
        assert time.monotonic() - t0 < 20
        snap = store.stats()
        # Backed off: a handful of write attempts for 60 refused PUTs, not 60.
        assert 1 <= snap["counters"]["disk_write_failures"] <= 6, snap["counters"]
        assert snap["tiers"]["disk"]["writable"] is False
        from tensorstore_hooks.cli.stats import format_stats

        assert "disk tier    takes no writes now" in format_stats(snap)
        # Small tensors fit under the limit: once the back-off ends they go to disk.
        t = _tensor(7, 16 * KiB)

        def stored() -> bool:
            try:
                small[store.put(t)] = t
            except QuotaExceededError:
                return False
            return True

        wait_until(stored, 30, "a small PUT after the back-off")
        for key, t in small.items():
            assert torch.equal(store.get(key), t)
    log = d.log()
    assert "Traceback" not in log and "INTERNAL" not in log, log
    assert len(_warnings(d)) == 1, log


def test_full_tmpfs_answers_quota_exceeded(daemons: DaemonLauncher, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "mnt", "12m") as mnt:
        d = daemons.start("--memory-quota", "0", "--root", str(mnt / "root"),
                          "--disk-quota", "1GiB")  # fmt: skip
        try:
            with DaemonStore(d.url) as store:
                acked: dict[str, torch.Tensor] = {}
                refused = 0
                for i in range(200):  # 25 MiB into 12 MiB
                    t = _tensor(i, 128 * KiB)
                    try:
                        acked[store.put(t)] = t
                    except QuotaExceededError:
                        refused += 1
                assert acked and refused, (len(acked), refused)
                for key, t in acked.items():
                    assert torch.equal(store.get(key), t)
                # Freeing room ends the back-off at once.
                store.delete_many(list(acked)[: len(acked) // 2])
                wait_until(
                    lambda: (
                        store.stats()["tiers"]["disk"]["tensors"] == len(acked) - len(acked) // 2
                    ),
                    10,
                    "the deletes",
                )
                t = _tensor(1000, 128 * KiB)
                key = store.put(t)
                assert torch.equal(store.get(key), t)
        finally:
            d.kill()
    log = d.log()
    assert "Traceback" not in log and "INTERNAL" not in log, log
    assert 1 <= len(_warnings(d)) <= 2, _warnings(d)


# ------------------------------------------------ also: the root read-only or deleted
def test_read_only_root_while_serving(daemons: DaemonLauncher, tmp_path: Path) -> None:
    root = tmp_path / "root"
    args = ("--listen", f"127.0.0.1:{free_port()}", "--memory-quota", "0",
            "--root", str(root), "--lease", "120")  # fmt: skip
    d = daemons.start(*args)
    store = DaemonStore(d.url, reconnect_deadline_s=60)
    before = {store.put(t): t for t in (_tensor(i, 256 * KiB) for i in range(4))}
    read_only(root)
    mounted = True
    try:
        with pytest.raises(QuotaExceededError, match="Read-only file system"):
            store.put(_tensor(9, 256 * KiB))
        for key, t in before.items():  # reads go on
            assert torch.equal(store.get(key), t)
        writable_again(root)
        mounted = False
    finally:
        if mounted:
            unmount(root, lazy=False)
    t = _tensor(10, 256 * KiB)
    after: dict[str, torch.Tensor] = {}

    def stored() -> bool:
        try:
            after[store.put(t)] = t
        except QuotaExceededError:
            return False
        return True

    wait_until(stored, 30, "a PUT once the root is writable again")
    d.kill()
    daemons.start(*args)
    for key, t in {**before, **after}.items():  # every acknowledged tensor is kept
        assert torch.equal(store.get(key), t)
    store.close()
    log = d.log()
    assert "Traceback" not in log, log
    assert len(_warnings(d)) == 1 and "takes writes again" in log, log


@pytest.mark.parametrize("gone", ["root", "root/daemon"])
def test_root_deleted_while_serving(daemons: DaemonLauncher, tmp_path: Path, gone: str) -> None:
    root = tmp_path / "root"
    args = ("--listen", f"127.0.0.1:{free_port()}", "--memory-quota", "1MiB",
            "--root", str(root), "--lease", "120")  # fmt: skip
    d = daemons.start(*args)
    store = DaemonStore(d.url, reconnect_deadline_s=60)
    old = [store.put(_tensor(i, 256 * KiB)) for i in range(8)]  # the oldest spill
    sid = store.session_id
    assert sid is not None
    wait_until(lambda: "disk" in raw_heads(d.url, sid, old).values(), 10, "a spill")
    on_disk = [k for k, tier in raw_heads(d.url, sid, old).items() if tier == "disk"]
    shutil.rmtree(tmp_path / gone)  # the root, or the disk tier's directory in it

    # Disk-bound writes are refused with a reason, RAM still takes what fits.
    acked: dict[str, torch.Tensor] = {}
    refused: list[str] = []
    for i in range(8):
        t = _tensor(100 + i, 512 * KiB)
        try:
            acked[store.put(t)] = t
        except QuotaExceededError as e:
            refused.append(str(e))
    assert refused and any("deleted or replaced" in m for m in refused), refused
    with pytest.raises(KeyNotFoundError, match="deleted or replaced"):
        store.get(on_disk[0])
    assert fetch_stats(d.url)["tiers"]["disk"]["writable"] is False
    said_disk = [k for k, tier in raw_heads(d.url, sid, list(acked)).items() if tier == "disk"]
    d.kill()

    daemons.start(*args)  # a fresh root: whatever was acknowledged on disk must be there
    for key in said_disk:
        assert torch.equal(store.get(key), acked[key])
    store.close()
    assert d.log().count("deleted or replaced while the daemon served") == 1, d.log()


# ------------------------------------------------ also: SIGKILL in the middle of spills
def test_sigkill_in_the_middle_of_spills(daemons: DaemonLauncher, tmp_path: Path) -> None:
    args = ("--listen", f"127.0.0.1:{free_port()}", "--memory-quota", "2MiB",
            "--root", str(tmp_path / "root"), "--lease", "120")  # fmt: skip
    d = daemons.start(*args)
    # A short reconnect deadline: the writer's PUT in flight at the kill gives up soon;
    # the reads below start once the new daemon listens, so they reconnect at once.
    store = DaemonStore(d.url, reconnect_deadline_s=2)
    sid = store.session_id
    assert sid is not None
    acked: dict[str, torch.Tensor] = {}
    stop = threading.Event()
    rng = random.Random(0)

    def writer() -> None:
        i = 0
        while not stop.is_set() and i < 400:
            t = _tensor(i, rng.choice((64, 128, 256)) * KiB)
            i += 1
            try:
                acked[store.put(t)] = t
            except Exception:  # the daemon is gone: stop
                return

    th = threading.Thread(target=writer)
    th.start()
    wait_until(lambda: len(acked) > 40, 30, "PUTs that spill")
    surely_on_disk = {k for k, tier in raw_heads(d.url, sid, list(acked)).items() if tier == "disk"}
    time.sleep(0.05 + rng.random() * 0.2)  # spills in flight
    os.kill(d.pid, 9)
    stop.set()
    th.join(timeout=60)
    d.kill()
    assert surely_on_disk

    daemons.start(*args)
    served = 0
    for key, t in list(acked.items()):
        try:
            got = store.get(key)
        except KeyNotFoundError:
            assert key not in surely_on_disk, "a tensor the daemon said was on disk is lost"
            continue
        assert torch.equal(got, t), "a wrong tensor after the restart"
        served += 1
    assert served >= len(surely_on_disk)
    store.close()
