"""Tiers and quotas: spill to disk, QUOTA_EXCEEDED, fallback, leases, concurrency."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks import QuotaExceededError
from tensorstore_hooks.storage.daemon._client import DaemonStore, fetch_stats
from tests.daemon_fixtures import DaemonLauncher, daemons, wait_until

__all__ = ["daemons"]  # the fixture, re-exported for pytest

MiB = 1 << 20
SLACK = 64 << 10  # per-tensor overhead + the disk tier's metadata files
RAM_OVERHEAD = 2048  # NOTE [ What a tensor costs ]


def _mib_tensor(i: int) -> torch.Tensor:
    return torch.full((MiB // 4,), float(i))  # exactly 1 MiB of float32


def test_spill_then_quota_then_fallback(daemons: DaemonLauncher, tmp_path: Path) -> None:
    # Room for 4 + 8 tensors of 1 MiB with their per-tensor overhead (documented in
    # NOTE [ What a tensor costs ]) and the disk tier's metadata files.
    d = daemons.start(
        "--memory-quota", str(4 * MiB + SLACK), "--root", str(tmp_path / "root"),
        "--disk-quota", str(8 * MiB + SLACK),
    )  # fmt: skip
    with DaemonStore(d.url) as store:
        keys = [store.put(_mib_tensor(i)) for i in range(12)]  # 4 in RAM, 8 spilled
        with pytest.raises(QuotaExceededError, match="no room"):
            store.put(_mib_tensor(99))
        snap = store.stats()
        ram, disk = snap["tiers"]["ram"], snap["tiers"]["disk"]
        assert (ram["used"], ram["tensors"]) == (4 * (MiB + RAM_OVERHEAD), 4)
        assert disk["tensors"] == 8
        assert disk["used"] - disk["metadata"] == 8 * MiB  # chunk files: exactly one chunk each
        assert snap["counters"]["spills"] == 8
        assert snap["counters"]["quota_rejected"] == 1
        # The oldest went to disk, the newest stayed in RAM; nothing was lost.
        for i, key in enumerate(keys):
            assert torch.equal(store.get(key), _mib_tensor(i))
        assert len(store) == 12
        # Freeing makes room again, on both tiers.
        store.delete_many(keys[:6])
        store.put(_mib_tensor(100))
        assert torch.equal(store.get(keys[11]), _mib_tensor(11))
        store.delete_many(list(store.keys()))
        wait_until(lambda: store.stats()["tiers"]["disk"]["tensors"] == 0, 10, "disk bytes freed")

    # Training through the full daemon: refused writes become fallbacks, the
    # gradients stay identical and every tensor comes back.
    with DaemonStore(d.url) as hog:  # fill the RAM tier and most of the disk tier
        for i in range(11):
            hog.put(_mib_tensor(i))
        torch.manual_seed(0)
        model = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())))
        x = torch.randn(256, 512)  # each activation is 512 KiB
        ref = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
        # Leaving the context does not wait for the writes (they overlap the
        # step), so flush before checking for the warning: it is issued on the
        # caller's thread at the first hook call or flush after a refusal.
        with pytest.warns(UserWarning, match="could not take a saved tensor"):
            with tsh.offload(d.url, min_bytes=0) as hooks:
                loss = model(x).square().sum()
            hooks.flush()
        got = torch.autograd.grad(loss, list(model.parameters()))
        hooks.close()
        assert hooks.stats.fallbacks > 0
        assert hooks.stats.tensors_offloaded > 0
        for g, r in zip(got, ref, strict=True):
            assert torch.equal(g, r)


def test_memory_quota_zero_is_disk_only(daemons: DaemonLauncher, tmp_path: Path) -> None:
    d = daemons.start("--memory-quota", "0", "--root", f"file://{tmp_path / 'root'}")
    with DaemonStore(d.url) as store:
        tensors = [torch.randn(1000 * (i + 1)) for i in range(5)]
        keys = [store.put(t) for t in tensors]
        snap = store.stats()
        assert snap["tiers"]["ram"]["used"] == 0 and snap["tiers"]["ram"]["quota"] == 0
        assert snap["tiers"]["disk"]["tensors"] == 5
        disk = snap["tiers"]["disk"]
        assert disk["used"] - disk["metadata"] >= sum(t.numel() * 4 for t in tensors)
        for key, t in zip(keys, tensors, strict=True):
            assert torch.equal(store.get(key), t)


def test_concurrent_puts_never_exceed_quota(daemons: DaemonLauncher, tmp_path: Path) -> None:
    d = daemons.start(
        "--memory-quota", str(8 * MiB + SLACK), "--root", str(tmp_path / "root"),
        "--disk-quota", str(16 * MiB + SLACK),
    )  # fmt: skip
    stop = threading.Event()
    violations: list[str] = []
    samples = [0]

    def watch() -> None:
        while not stop.is_set():
            snap = fetch_stats(d.url)
            samples[0] += 1
            for name in ("ram", "disk"):
                t = snap["tiers"][name]
                if t["used"] + t["reserved"] > t["quota"]:
                    violations.append(f"{name}: {t}")

    acked: dict[str, tuple[DaemonStore, torch.Tensor]] = {}
    refused = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []
    stores = [DaemonStore(d.url) for _ in range(6)]

    def writer(w: int) -> None:
        try:
            for i in range(10):
                t = torch.full((MiB // 2,), float(w * 100 + i))  # 2 MiB
                try:
                    key = stores[w].put(t)
                except QuotaExceededError:
                    with lock:
                        refused[0] += 1
                    continue
                with lock:
                    acked[key] = (stores[w], t)
        except BaseException as e:
            errors.append(e)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=writer, args=(w,)) for w in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    stop.set()
    watcher.join(timeout=30)
    try:
        assert not errors, errors
        assert not violations, violations[:3]
        assert samples[0] > 0
        assert len(acked) == 12 and refused[0] == 48  # exactly what fits: 24 MiB / 2 MiB
        for key, (store, t) in acked.items():
            assert torch.equal(store.get(key), t)
    finally:
        for s in stores:
            s.close()


_CLIENT = """
import os, signal, sys, torch
from tensorstore_hooks.storage.daemon._client import DaemonStore
store = DaemonStore(sys.argv[1])
for i in range(3):
    store.put(torch.ones(256, 1024) * i)
print("stored", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_killed_client_is_freed_after_its_lease(daemons: DaemonLauncher) -> None:
    d = daemons.start("--memory-quota", "64MiB", "--lease", "1")
    out = subprocess.run(
        [sys.executable, "-c", _CLIENT, d.url], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == -9 and "stored" in out.stdout, out.stderr
    snap = fetch_stats(d.url)
    # Its tensors may still be there (the lease has not run out yet) ...
    assert snap["tiers"]["ram"]["used"] in (0, 3 * (MiB + RAM_OVERHEAD))

    def freed() -> bool:
        s = fetch_stats(d.url)
        return s["tiers"]["ram"]["used"] == 0 and s["sessions_total"] == 0

    # ... and are freed once it has.
    wait_until(freed, 10, "the dead client's session to expire")
    snap = fetch_stats(d.url)
    assert snap["counters"]["sessions_expired"] == 1
    assert snap["counters"]["expired_bytes"] == 3 * MiB
    assert "lease of 1s expired" in d.log()


def test_live_client_keeps_its_lease(daemons: DaemonLauncher) -> None:
    import time

    d = daemons.start("--memory-quota", "16MiB", "--lease", "0.6")
    with DaemonStore(d.url) as store:
        key = store.put(torch.arange(10))
        time.sleep(2.0)  # idle for > 3 leases: the keepalive thread pings
        assert torch.equal(store.get(key), torch.arange(10))
        assert store.sessions_lost == 0


def test_expired_session_is_replaced_and_reported(daemons: DaemonLauncher) -> None:
    import time

    d = daemons.start("--memory-quota", "16MiB", "--lease", "0.5")
    with DaemonStore(d.url, keepalive=False) as store:
        key = store.put(torch.arange(10))
        old = store.session_id
        time.sleep(1.5)  # silent past the lease: the daemon ends the session
        with pytest.raises(tsh.KeyNotFoundError):
            store.get(key)  # reconnects, cannot resume, opens a new session
        assert store.sessions_lost == 1 and store.session_id != old
        key = store.put(torch.arange(3))  # the new session works
        assert torch.equal(store.get(key), torch.arange(3))
    assert "lease of 0.5s expired" in d.log()


def _dir_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def test_disk_quota_is_exact_under_churn(daemons: DaemonLauncher, tmp_path: Path) -> None:
    # NOTE [ Exact disk quota ]: the directory never holds more than the quota, journal
    # records of deleted tensors included, and stats says what it holds.
    root = tmp_path / "root"
    quota = 4 * MiB
    d = daemons.start("--memory-quota", "0", "--root", str(root), "--disk-quota", str(quota))
    filler = DaemonStore(d.url)
    kept = []
    with contextlib.suppress(QuotaExceededError):
        for i in range(1000):  # fill the disk with live tensors
            kept.append(filler.put(torch.full((64 * 1024 // 4,), float(i))))
    filler.delete_many(kept[:4])  # room for a few small ones
    stop = threading.Event()
    over: list[str] = []
    samples = [0]

    def watch() -> None:
        while not stop.is_set():
            held = _dir_bytes(root)
            snap = fetch_stats(d.url)["tiers"]["disk"]
            samples[0] += 1
            if held > quota:
                over.append(f"directory {held} > quota {quota}")
            if snap["used"] + snap["reserved"] > quota:
                over.append(f"stats {snap}")

    churned = [0]
    errors: list[BaseException] = []

    def churn(w: int) -> None:
        try:
            with DaemonStore(d.url) as store:
                deadline = time.monotonic() + 4.0
                while time.monotonic() < deadline:
                    try:
                        key = store.put(torch.full((1024,), float(w)))  # 4 KiB
                    except QuotaExceededError:
                        continue
                    store.delete(key)
                    churned[0] += 1
        except BaseException as e:
            errors.append(e)

    watcher = threading.Thread(target=watch)
    watcher.start()
    workers = [threading.Thread(target=churn, args=(w,)) for w in range(4)]
    for th in workers:
        th.start()
    for th in workers:
        th.join(timeout=60)
    stop.set()
    watcher.join(timeout=30)
    assert not errors, errors
    assert not over, over[:3]
    # Records of deleted tensors filled the disk, and were compacted away: churn went on.
    assert churned[0] > 200 and samples[0] > 10, (churned, samples)
    assert fetch_stats(d.url)["counters"]["disk_compactions"] >= 1

    # Everything freed: stats says what the directory holds (journals and documents).
    filler.close()

    def agrees() -> bool:
        snap = fetch_stats(d.url)["tiers"]["disk"]
        return snap["tensors"] == 0 and snap["used"] == _dir_bytes(root)

    wait_until(agrees, 10, "stats to say what the directory holds")
