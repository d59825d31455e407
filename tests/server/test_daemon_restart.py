"""Crash and restart: SIGKILL, restart on the same root, resume, orphan collection."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from tensorstore_hooks import KeyNotFoundError, StoreUnavailableError
from tensorstore_hooks.storage.daemon._client import DaemonStore, fetch_stats
from tests.daemon_fixtures import (
    DaemonLauncher,
    daemons,
    free_port,
    raw_connect,
    raw_hello,
    recv_frame,
    send_frame,
    wait_until,
)

__all__ = ["daemons"]  # the fixture, re-exported for pytest

MiB = 1 << 20


def _chunk_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and "/c/" in p.as_posix()]


def test_sigkill_restart_serves_disk_tensors(daemons: DaemonLauncher, tmp_path: Path) -> None:
    root = tmp_path / "root"
    args = ("--listen", f"127.0.0.1:{free_port()}", "--memory-quota", "0", "--root", str(root))
    d = daemons.start(*args)
    store = DaemonStore(d.url, reconnect_deadline_s=60)
    tensors = [torch.randn(100, 7)[:, 1:5], torch.arange(10), torch.randn(5 * MiB)]  # 20 MiB
    keys = [store.put(t) for t in tensors]
    sid = store.session_id
    d.kill()  # SIGKILL: no drain, no journal flush

    d2 = daemons.start(*args)
    assert d2.url == d.url
    # The same client object reconnects on its own and resumes its session.
    for key, t in zip(keys, tensors, strict=True):
        got = store.get(key)
        assert torch.equal(got, t) and got.stride() == t.stride()
    assert store.session_id == sid
    assert len(store) == 3 and sorted(store.keys()) == sorted(keys)
    key = store.put(torch.ones(4))
    assert torch.equal(store.get(key), torch.ones(4))
    assert "recovered 1 sessions and 3 disk-tier tensors" in d2.log()
    store.close()
    wait_until(lambda: not _chunk_files(root), 10, "the closed session's chunks to be deleted")


def test_restart_loses_only_what_was_in_ram(daemons: DaemonLauncher, tmp_path: Path) -> None:
    args = (
        "--listen", f"127.0.0.1:{free_port()}",
        "--memory-quota", "2MiB", "--root", str(tmp_path / "root"),
    )  # fmt: skip
    d = daemons.start(*args)
    with DaemonStore(d.url) as store:
        tensors = [torch.full((MiB // 4,), float(i)) for i in range(4)]  # 1 MiB each
        keys = [store.put(t) for t in tensors]
        # The oldest spill to disk; above 7/8 of the RAM quota the daemon spills ahead
        # down to 3/4, which leaves only the newest tensor in RAM.
        wait_until(lambda: store.stats()["tiers"]["disk"]["tensors"] == 3, 10, "spills to settle")
        d.kill()
        daemons.start(*args)
        for key, t in zip(keys[:3], tensors[:3], strict=True):
            assert torch.equal(store.get(key), t)
        with pytest.raises(KeyNotFoundError, match="restarted"):
            store.get(keys[3])
        assert len(store) == 3


def test_orphans_collected_after_lease(daemons: DaemonLauncher, tmp_path: Path) -> None:
    root = tmp_path / "root"
    port = free_port()
    d = daemons.start("--listen", f"127.0.0.1:{port}", "--memory-quota", "0", "--root", str(root))
    store = DaemonStore(d.url, reconnect_deadline_s=1)
    for i in range(3):
        store.put(torch.full((1000,), float(i)))
    d.kill()
    store.close()  # the client goes away for good (its BYE cannot reach anyone)
    assert len(_chunk_files(root)) == 3

    d2 = daemons.start(
        "--listen", f"127.0.0.1:{port}", "--memory-quota", "0", "--root", str(root), "--lease", "1"
    )
    snap = fetch_stats(d2.url)
    assert snap["tiers"]["disk"]["tensors"] in (0, 3)  # adopted until the lease runs out

    def collected() -> bool:
        s = fetch_stats(d2.url)
        disk = s["tiers"]["disk"]
        return s["sessions_total"] == 0 and disk["used"] - disk["metadata"] == 0

    wait_until(collected, 10, "the orphaned session to expire")
    wait_until(lambda: not _chunk_files(root), 10, "its chunk files to be deleted")
    assert d2.terminate() == 0
    # A third start finds nothing to recover.
    d3 = daemons.start("--memory-quota", "0", "--root", str(root))
    assert fetch_stats(d3.url)["tiers"]["disk"]["tensors"] == 0


def test_dead_daemon_raises_after_the_deadline(daemons: DaemonLauncher) -> None:
    d = daemons.start("--memory-quota", "16MiB")
    store = DaemonStore(d.url, reconnect_deadline_s=1.0)
    key = store.put(torch.ones(3))
    d.kill()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        store.get(key)
    assert 0.9 < time.monotonic() - t0 < 10
    assert d.url in str(info.value) and "unreachable" in str(info.value)
    assert isinstance(info.value, ConnectionError)
    store.close()  # does not raise either


def test_two_racing_resumes_of_one_session(daemons: DaemonLauncher, tmp_path: Path) -> None:
    args = ("--listen", f"127.0.0.1:{free_port()}", "--memory-quota", "0",
            "--root", str(tmp_path / "root"))  # fmt: skip
    d = daemons.start(*args)
    store = DaemonStore(d.url, reconnect_deadline_s=60)
    t = torch.randn(1000)
    key = store.put(t)
    sid = store.session_id
    assert sid is not None
    d.kill()
    d2 = daemons.start(*args)

    socks = [raw_connect(d2.url) for _ in range(2)]
    barrier = threading.Barrier(2)
    welcomes: list[dict[str, object]] = []

    def resume(sock: object) -> None:
        barrier.wait()
        welcomes.append(raw_hello(sock, session=sid))

    threads = [threading.Thread(target=resume, args=(s,)) for s in socks]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    try:
        assert len(welcomes) == 2
        for w in welcomes:
            assert w["ok"] is True and w["resumed"] is True and w["session"] == sid, w
        snap = fetch_stats(d2.url)
        assert snap["sessions_total"] == 1 and snap["sessions"][0]["connections"] == 2
        for i, s in enumerate(socks):  # both see the session's tensor
            send_frame(s, {"op": "get", "id": 10 + i, "key": key, "head": False})
            got = recv_frame(s)
            assert got is not None and got[0]["ok"] is True
            assert got[1] == t.numpy().tobytes()
        # One ends the session: the other is told, and the session is gone for everyone.
        send_frame(socks[0], {"op": "bye", "id": 20})
        bye = recv_frame(socks[0])
        assert bye is not None and bye[0]["ok"] is True
        kicked = recv_frame(socks[1])
        assert kicked is not None and kicked[0]["code"] == "NOT_FOUND" and kicked[0]["fatal"]
        with raw_connect(d2.url) as late:
            assert raw_hello(late, session=sid)["code"] == "NOT_FOUND"
        assert fetch_stats(d2.url)["sessions_total"] == 0
    finally:
        for s in socks:
            s.close()
    with pytest.raises(KeyNotFoundError):
        store.get(key)
    store.close()
