"""Stale namespaces of dead runs, ``tensorstore-hooks clean``, the tmpfs warning."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import zarr

import tensorstore_hooks as tsh
from tensorstore_hooks.cli import main as cli_main
from tensorstore_hooks.storage.zarr import _housekeeping
from tensorstore_hooks.storage.zarr._docs import namespace_doc, root_doc
from tensorstore_hooks.storage.zarr._housekeeping import TEMP_MARKER, find_stale, host_tag

_CHILD = """
import sys, time, torch, tensorstore_hooks as tsh
temp = tsh.open_store(None)            # a temporary store under $TSH_TMPDIR
shared = tsh.open_store(sys.argv[1])   # a namespace under a shared root
for s in (temp, shared):
    s.put(torch.ones(4096))
print(temp.url, shared.namespace, flush=True)
time.sleep(120)
"""


def _dead_pid() -> int:
    pid = 4_000_000
    while psutil.pid_exists(pid):
        pid -= 1
    return pid


def _namespace(root: Path, pid: int, host: str | None = None) -> Path:
    """A namespace as the library leaves it: its own zarr.json, its lock, a segment."""
    ns = root / f"{host or host_tag()}-{pid}-0badcafe"
    ns.mkdir(parents=True)
    (ns / "zarr.json").write_bytes(namespace_doc(2, ns.name, 1 << 20, "none"))
    (ns / "lock").write_text(f"pid {pid} on {host or host_tag()}")
    (ns / "seg-4096" / "c").mkdir(parents=True)
    (ns / "seg-4096" / "c" / "0").write_bytes(b"x" * 4096)
    return ns


def _temp_root(parent: Path, pid: int, name: str = "tensorstore-hooks-abc123") -> Path:
    """A temporary root as the library makes it, left by process ``pid``."""
    root = parent / name
    root.mkdir(parents=True)
    (root / "zarr.json").write_bytes(root_doc(2))
    (root / TEMP_MARKER).write_text(json.dumps({"pid": pid, "host": host_tag()}))
    _namespace(root, pid)
    return root


def test_a_killed_run_is_swept_by_the_next_store_and_by_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    temp_parent, shared = tmp_path / "tmp", tmp_path / "shared"
    temp_parent.mkdir()
    env = dict(os.environ, TSH_TMPDIR=str(temp_parent))
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(shared)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        temp_url, namespace = child.stdout.readline().split()
        temp_root = Path(temp_url.removeprefix("file://"))
        assert temp_root.parent == temp_parent and (shared / namespace).is_dir()
        # Alive: nothing of it is stale, not even to `clean`.
        assert find_stale(str(shared)) == [] and find_stale(str(temp_parent)) == []
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        if child.stdout is not None:
            child.stdout.close()
    assert temp_root.is_dir() and (shared / namespace).is_dir()  # left behind

    assert cli_main(["clean", str(temp_parent), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would remove temporary root {temp_root}" in out and temp_root.is_dir()

    # The next store opened on the shared root sweeps the dead namespace...
    with tsh.open_store(str(shared)) as store:
        assert not (shared / namespace).exists()
        assert (shared / store.namespace).is_dir()  # ... and never its own
    # ... and the next temporary store the dead temporary root.
    monkeypatch.setenv("TSH_TMPDIR", str(temp_parent))
    with tsh.open_store(None) as temp:
        assert not temp_root.exists()
        assert Path(temp.url.removeprefix("file://")).parent == temp_parent


def test_clean_removes_dead_namespaces_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = _namespace(tmp_path, _dead_pid())
    live = _namespace(tmp_path, os.getppid())  # a running process
    other_host = _namespace(tmp_path, _dead_pid(), host="elsewhere-host")
    named = tmp_path / "daemon"
    named.mkdir()
    (named / "zarr.json").write_bytes(namespace_doc(2, "daemon", 1 << 20, "none"))
    not_ours = tmp_path / f"{host_tag()}-{_dead_pid()}-0badcafe-x"
    not_ours.mkdir()

    assert cli_main(["clean", f"file://{tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert f"removed namespace {dead} (pid " in out and "removed 1 stale item(s), 4.31 KiB" in out
    assert not dead.exists()
    assert live.is_dir() and other_host.is_dir() and named.is_dir() and not_ours.is_dir()
    assert cli_main(["clean", str(tmp_path / "missing")]) == 2


def test_a_held_namespace_lock_protects_a_reused_pid(tmp_path: Path) -> None:
    ns = _namespace(tmp_path, _dead_pid())
    fd = os.open(ns / "lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file description: a live holder
        assert find_stale(str(tmp_path)) == []
    finally:
        os.close(fd)
    assert [s.path for s in find_stale(str(tmp_path))] == [str(ns)]


_OWNER = """
import fcntl, json, os, sys, torch
from tensorstore_hooks import ZarrStore
root, ns, temp_root, dead_pid, host = sys.argv[1:6]
shared = ZarrStore(root, namespace=ns)           # named as a dead process's would be
k1 = shared.put(torch.arange(4096.0))
os.makedirs(temp_root)                           # a temporary root whose marker names a
marker = os.open(os.path.join(temp_root, ".tensorstore-hooks-temporary"),   # dead pid
                 os.O_RDWR | os.O_CREAT)
fcntl.flock(marker, fcntl.LOCK_EX)               # ... but its owner lives and holds it
os.write(marker, json.dumps({"pid": int(dead_pid), "host": host}).encode())
inner = ZarrStore(temp_root, namespace=ns)
k2 = inner.put(torch.ones(4096))
print("ready", flush=True)
sys.stdin.readline()
same = torch.equal(shared.get(k1), torch.arange(4096.0))
same = same and torch.equal(inner.get(k2), torch.ones(4096))
print("intact" if same else "damaged", flush=True)
"""


def test_nothing_a_live_owner_holds_is_read_or_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36: the lock is taken before anything under a root is read, swept or
    removed. A live process holds the locks of a namespace and of a temporary root
    whose names and marker say their pid is dead (another PID namespace, a reused
    pid): the open-time sweeps and ``clean`` open its lock files to try them, and
    read, write or remove nothing else (the kernel's own record, inotify, says so)."""
    from tests.storage._inotify import Watch

    root, temp_parent = tmp_path / "root", tmp_path / "tmp"
    temp_parent.mkdir()
    dead = _dead_pid()
    ns = f"{host_tag()}-{dead}-0badcafe"
    live_temp = temp_parent / "tensorstore-hooks-live"
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(root), ns, str(live_temp), str(dead), host_tag()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None and owner.stdin is not None
        assert owner.stdout.readline().strip() == "ready"
        trees = [root / ns, live_temp]
        before = {t: sorted(p.relative_to(t) for p in t.rglob("*")) for t in trees}
        with Watch(*trees) as watch:
            assert find_stale(str(root)) == [] and find_stale(str(temp_parent)) == []
            assert cli_main(["clean", str(root)]) == 0
            assert cli_main(["clean", str(temp_parent)]) == 0
            assert capsys.readouterr().out.count("removed 0 stale item(s)") == 2
            with tsh.open_store(str(root)):  # sweeps the root when it opens
                pass
            monkeypatch.setenv("TSH_TMPDIR", str(temp_parent))
            with tsh.open_store(None):  # sweeps the temporary stores' parent
                pass
            events = watch.events()
        locks = {str(root / ns / "lock"), str(live_temp / TEMP_MARKER)}
        tried = {p for p, e in events if e == "open"}
        assert tried == locks, events  # each lock was tried...
        touched = [
            (p, e) for p, e in events if p not in locks or e not in ("open", "close_nowrite")
        ]
        assert touched == []  # ... and nothing else opened, read, written or removed
        for t in trees:
            assert sorted(p.relative_to(t) for p in t.rglob("*")) == before[t]
        owner.stdin.write("check\n")
        owner.stdin.flush()
        assert owner.stdout.readline().strip() == "intact"
    finally:
        owner.kill()
        owner.wait(30)
        for f in (owner.stdin, owner.stdout):
            if f is not None:
                f.close()


def _ram_tmp(monkeypatch: pytest.MonkeyPatch) -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and _housekeeping.filesystem_type(shm) == "tmpfs":
        return shm
    monkeypatch.setattr(_housekeeping, "filesystem_type", lambda path: "tmpfs")
    return tempfile.gettempdir()


def test_a_temporary_store_on_tmpfs_warns_once_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_housekeeping, "_warned_tmpfs", False)
    monkeypatch.delenv("TSH_TMPDIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", _ram_tmp(monkeypatch))
    with pytest.warns(UserWarning, match=r"tmpfs, which is RAM.*TSH_TMPDIR") as w:
        hooks = tsh.offload()
    assert w[0].filename == __file__
    hooks.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tsh.open_store(None).close()  # once per process
        monkeypatch.setattr(_housekeeping, "_warned_tmpfs", False)
        monkeypatch.setenv("TSH_TMPDIR", str(tmp_path / "chosen"))
        with tsh.offload() as hooks:  # TSH_TMPDIR chosen: no warning, the store is there
            torch.ones(1, requires_grad=True).exp()
        assert hooks.store.url.startswith(f"file://{tmp_path / 'chosen'}")
        hooks.close()


# ------------------------------------------------- only what the library made
def _foreign_lookalikes(root: Path) -> dict[str, Path]:
    """Files of other programs that look like ours: none may ever be removed."""
    dead = _dead_pid()
    made: dict[str, Path] = {}
    # The user folder: named like a temporary root, with results and one empty
    # subfolder named like a dead namespace.
    experiments = root / "tensorstore-hooks-experiments"
    (experiments / f"{host_tag()}-{dead}-0badcafe").mkdir(parents=True)
    (experiments / "results.csv").write_text("step,loss\n1,6.2\n")
    made["experiments"] = experiments
    # A plain zarr group in a folder named like a dead namespace (no attributes of ours).
    plain = root / f"{host_tag()}-{dead}-0badc0de"
    zarr.open_group(str(plain), mode="w", zarr_format=3).attrs["owner"] = "someone else"
    (plain / "lock").write_text("theirs")
    made["plain zarr"] = plain
    # Our attributes, but naming another namespace (copied from elsewhere).
    copied = root / f"{host_tag()}-{dead}-0badf00d"
    copied.mkdir()
    (copied / "zarr.json").write_bytes(namespace_doc(2, "somewhere-else", 1 << 20, "none"))
    (copied / "lock").write_text("")
    made["copied doc"] = copied
    # Ours in every way but the lock file (every namespace of ours has one).
    lockless = _namespace(root / "lockless-parent", dead)
    (lockless / "lock").unlink()
    made["no lock"] = lockless
    # A temporary root named like ours, with our layout but no marker of ours.
    unmarked = _temp_root(root, dead, name="tensorstore-hooks-unmarked")
    (unmarked / TEMP_MARKER).unlink()
    made["unmarked temp root"] = unmarked
    # A marked temporary root that also holds someone's file.
    shared = _temp_root(root, dead, name="tensorstore-hooks-shared")
    (shared / "notes.txt").write_text("mine")
    made["temp root with a foreign file"] = shared
    return made


def test_clean_and_the_open_time_sweep_remove_only_what_the_library_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    foreign = _foreign_lookalikes(root)
    dead_ns = _namespace(root, _dead_pid())
    dead_temp = _temp_root(root, _dead_pid(), name="tensorstore-hooks-deadbeef")
    before = {name: sorted(p.rglob("*")) for name, p in foreign.items()}

    assert cli_main(["clean", str(root)]) == 0
    out = capsys.readouterr().out
    assert not dead_ns.exists() and not dead_temp.exists()
    assert f"removed namespace {dead_ns} " in out
    assert f"removed temporary root {dead_temp} " in out
    assert "removed 2 stale item(s)" in out
    for name, path in foreign.items():
        assert sorted(path.rglob("*")) == before[name], f"{name} was touched"
        assert str(path) not in out, f"{name} reported"
    # The sweep a store does when it opens, on the root and on the temporary parent:
    monkeypatch.setenv("TSH_TMPDIR", str(root))
    with tsh.open_store(str(root)), tsh.open_store(None):
        pass
    for name, path in foreign.items():
        assert sorted(path.rglob("*")) == before[name], f"{name} was touched by a sweep"


def test_symlinks_are_never_followed_nor_reported_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    target = _namespace(elsewhere, _dead_pid())  # a real dead namespace of ours
    link = root / target.name
    link.symlink_to(target, target_is_directory=True)
    temp_target = _temp_root(elsewhere, _dead_pid(), name="tensorstore-hooks-target")
    temp_link = root / "tensorstore-hooks-link"
    temp_link.symlink_to(temp_target, target_is_directory=True)
    inner = _namespace(root / "inner-parent", _dead_pid())
    (inner / "data-link").symlink_to(elsewhere)  # a link inside a namespace of ours

    assert find_stale(str(root)) == []
    assert cli_main(["clean", str(root)]) == 0
    out = capsys.readouterr().out
    assert "removed 0 stale item(s)" in out
    assert str(link) not in out and str(temp_link) not in out
    assert link.is_symlink() and target.is_dir() and temp_link.is_symlink() and temp_target.is_dir()
    # Removing a namespace of ours unlinks links inside it, never what they point at.
    assert [s.path for s in find_stale(str(root / "inner-parent"))] == [str(inner)]
    assert cli_main(["clean", str(root / "inner-parent")]) == 0
    assert not inner.exists() and target.is_dir() and temp_target.is_dir()


def test_clean_reports_exactly_what_it_could_not_remove(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gone, stuck = _namespace(tmp_path, _dead_pid()), _namespace(tmp_path / "b", _dead_pid())
    stuck = tmp_path / (stuck.name.replace("0badcafe", "0badcaff"))
    (tmp_path / "b" / gone.name).rename(stuck)
    (stuck / "zarr.json").write_bytes(namespace_doc(2, stuck.name, 1 << 20, "none"))
    real_rmtree = shutil.rmtree

    def refuse_one(path: str, onerror: Any = None, **kw: Any) -> None:
        if os.fspath(path) == str(stuck):
            denied = PermissionError(13, "denied")
            onerror(os.unlink, str(stuck / "lock"), (PermissionError, denied, None))
            return
        real_rmtree(path, onerror=onerror, **kw)

    monkeypatch.setattr(_housekeeping.shutil, "rmtree", refuse_one)
    assert cli_main(["clean", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert f"removed namespace {gone} " in out and str(stuck) not in out
    assert "removed 1 stale item(s)" in out
    assert f"clean: left namespace {stuck}: " in err and "denied" in err
    assert stuck.is_dir() and not gone.exists()


def test_a_temporary_root_is_locked_while_its_store_lives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The marker of a live temporary root is held (``flock``), so a sweep by any
    process meets the lock before reading anything under it; closing releases it."""
    monkeypatch.setenv("TSH_TMPDIR", str(tmp_path))
    store = tsh.open_store(None)
    root = Path(store.url.removeprefix("file://"))
    marker = root / TEMP_MARKER
    assert json.loads(marker.read_text())["pid"] == os.getpid()
    fd = os.open(marker, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        store.close()
        assert not root.exists()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with the root
    finally:
        os.close(fd)
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary file of the marker
