"""Stale namespaces of dead runs, ``tensorstore-hooks clean``, the tmpfs warning."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import psutil
import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import _housekeeping
from tensorstore_hooks._housekeeping import find_stale, host_tag
from tensorstore_hooks.cli import main as cli_main

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
    ns = root / f"{host or host_tag()}-{pid}-0badcafe"
    ns.mkdir(parents=True)
    (ns / "zarr.json").write_text("{}")
    return ns


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
    (named / "zarr.json").write_text("{}")
    not_ours = tmp_path / f"{host_tag()}-{_dead_pid()}-0badcafe-x"
    not_ours.mkdir()

    assert cli_main(["clean", f"file://{tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert f"removed namespace {dead}" in out and "removed 1 stale item(s)" in out
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
