"""Filesystems a test mounts for itself: a small tmpfs, a small ext4 on a loop device,
and a read-only bind mount over a directory (full disks, ENOSPC under ``O_DIRECT``, a
root that turns read-only while in use); and a directory where ``O_DIRECT`` works.

Mounting needs root (or CAP_SYS_ADMIN) on Linux. Where it is refused, or a tool it
needs is missing, the test is skipped with the reason (a skip is never counted as a
pass; the ``*_rlimit`` tests cover full disks without a mount). The context managers
unmount what they mounted when the ``with`` block ends, lazily (``umount -l``), so a
file a daemon still holds open cannot keep the mount, and the test, alive.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

__all__ = ["direct_io_dir", "loop_ext4", "read_only", "tmpfs", "unmount", "writable_again"]

TIMEOUT_S = 60.0
"""The longest a ``mount``, ``umount`` or ``mkfs.ext4`` call may take."""


def _run(argv: Sequence[str], what: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; skip the test (saying ``what`` needed it) where it cannot run."""
    if not sys.platform.startswith("linux"):
        pytest.skip(f"{what} needs Linux")
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=TIMEOUT_S)
    except FileNotFoundError:
        pytest.skip(f"no {argv[0]} command on this machine: {what} needs it")
    except subprocess.TimeoutExpired:
        pytest.skip(f"{argv[0]} did not answer within {TIMEOUT_S:.0f}s: {what} needs it")


def unmount(path: Path, *, lazy: bool = True, check: bool = False) -> None:
    """``umount [-l] path``; ``check``: raise if it fails (a test that must see it go)."""
    argv = ["umount", *(["-l"] if lazy else []), str(path)]
    subprocess.run(argv, check=check, capture_output=True, timeout=TIMEOUT_S)


@contextlib.contextmanager
def _mounted(argv: Sequence[str], path: Path, what: str, refused: str) -> Iterator[Path]:
    """Run the mount command ``argv`` (skip, saying ``refused``, where it fails); yield
    ``path``; unmount it at the end."""
    path.mkdir(parents=True, exist_ok=True)
    r = _run(argv, what)
    if r.returncode != 0:
        pytest.skip(f"{refused}: {r.stderr.strip()}")
    try:
        yield path
    finally:
        unmount(path)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -o size=``: ``"12m"``) mounted at ``path``, which is
    made if missing; unmounted at the end."""
    argv = ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)]
    with _mounted(argv, path, "a tmpfs", "cannot mount a tmpfs (needs root or CAP_SYS_ADMIN)"):
        yield path


@contextlib.contextmanager
def loop_ext4(
    path: Path, image: Path, size_bytes: int, *, reserved_percent: int | None = None
) -> Iterator[Path]:
    """A fresh ext4 filesystem of ``size_bytes`` in the file ``image``, mounted at
    ``path`` through a loop device (``O_DIRECT`` works on it; tmpfs would not test it).
    ``reserved_percent``: ``mkfs.ext4 -m`` (blocks kept for root; ``None``: mkfs's 5%).
    Unmounted at the end; the image stays where the caller put it."""
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 is not installed: a loop-mounted ext4 needs it")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        pytest.skip("a loop-mounted ext4 needs root (mkfs.ext4 + mount -o loop)")
    with open(image, "wb") as f:
        f.truncate(size_bytes)
    reserve = [] if reserved_percent is None else ["-m", str(reserved_percent)]
    made = _run(["mkfs.ext4", "-q", "-F", *reserve, str(image)], "a loop-mounted ext4")
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
    argv = ["mount", "-o", "loop", str(image), str(path)]
    with _mounted(argv, path, "a loop-mounted ext4", "cannot mount a loop device (needs root)"):
        yield path


def read_only(path: Path) -> None:
    """Make ``path`` read-only for every new open: a read-only bind mount over it (files
    already open stay writable, as they would on a real remount). Undo it with
    :func:`writable_again`, or :func:`unmount` where the test failed before that."""
    r = _run(["mount", "--bind", str(path), str(path)], "a read-only bind mount")
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
    r = _run(["mount", "-o", "remount,bind,ro", str(path)], "a read-only bind mount")
    if r.returncode != 0:
        unmount(path, lazy=False)
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")


def writable_again(path: Path) -> None:
    """Undo :func:`read_only` (raises if the bind mount cannot be removed)."""
    unmount(path, lazy=False, check=True)


def direct_io_dir(path: Path) -> Path:
    """Make the directory ``path`` and return it where ``O_DIRECT`` works there; skip
    the test, saying why, where it does not (tmpfs before Linux 6.6, overlayfs, ...)."""
    from tensorstore_hooks.storage.io import probe_direct_io

    path.mkdir(parents=True)
    ok, why = probe_direct_io(str(path))
    if not ok:
        pytest.skip(f"no direct I/O under {path.parent}: {why}")
    return path
