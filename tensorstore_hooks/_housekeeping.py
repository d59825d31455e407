"""Housekeeping of local store roots: stale namespaces, the temporary root, tmpfs.

NOTE [ Stale namespaces ]
Every ``ZarrStore`` writes into its own namespace ``[r{rank}-]{host}-{pid}-{random}``
under its root, and a temporary store into its own root
``$TSH_TMPDIR/tensorstore-hooks-*`` (else the system's temporary directory). A
process that dies without closing (SIGKILL, the OOM killer) leaves both behind,
and nothing else would ever remove them. A namespace is *stale* when

1. its name has this host's name (the pid means nothing on another host),
2. no process with its pid runs here (``psutil.pid_exists``), and
3. its ``lock`` file, if any, is not held (``flock``: the kernel drops a dead
   process's locks, so a live holder under a reused pid keeps its namespace).

A temporary root is stale when every namespace in it is stale. Sweeping happens
when a local store opens (once per root and process) and on demand with
``tensorstore-hooks clean ROOT [--dry-run]``. Named namespaces (the daemon's
``daemon``, a user's ``namespace=``) never match rule 1's pattern and are never
swept. Object stores are not swept at open (listing costs requests).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from ._warn import warn_user

__all__ = [
    "TEMP_PREFIX",
    "TMPDIR_ENV",
    "Stale",
    "find_stale",
    "make_temp_root",
    "remove",
    "sweep",
    "sweep_at_open",
]

log = logging.getLogger("tensorstore_hooks")

TMPDIR_ENV = "TSH_TMPDIR"
"""Where temporary stores go (default: the system's temporary directory)."""
TEMP_PREFIX = "tensorstore-hooks-"

_RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
_LOCK = threading.Lock()
_swept: set[str] = set()
_warned_tmpfs = False


@dataclass(frozen=True, slots=True)
class Stale:
    """One thing :func:`find_stale` would remove."""

    path: str
    """Absolute path of the namespace directory or temporary root."""
    kind: str
    """``"namespace"`` or ``"temporary root"``."""
    pid: int | None
    """The dead writer's pid (``None`` for an empty temporary root)."""


def host_tag() -> str:
    """This host's name as namespaces spell it (the same rule as ``ZarrStore``)."""
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"


def _namespace_pid(name: str, host: str) -> int | None:
    m = re.fullmatch(rf"(?:r\d+-)?{re.escape(host)}-(\d+)-[0-9a-f]{{8}}", name)
    return int(m.group(1)) if m else None


def _pid_alive(pid: int) -> bool:
    import psutil

    return bool(psutil.pid_exists(pid))


def _lock_free(namespace_dir: str) -> bool:
    """Whether the namespace's ``lock`` file (if any) can be taken: rule 3."""
    path = os.path.join(namespace_dir, "lock")
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: the pid check alone decides
        return True
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops the probe's own lock
    return True


def _stale_namespaces(root: str, host: str) -> Iterator[Stale]:
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        pid = _namespace_pid(name, host)
        path = os.path.join(root, name)
        if pid is None or pid == os.getpid() or not os.path.isfile(os.path.join(path, "zarr.json")):
            continue  # not a namespace of ours (every one has its group document)
        if not _pid_alive(pid) and _lock_free(path):
            yield Stale(path, "namespace", pid)


def _stale_temp_root(path: str, host: str) -> Stale | None:
    try:
        names = [n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n))]
    except OSError:
        return None
    pids = [_namespace_pid(n, host) for n in names]
    if not names or any(p is None for p in pids):
        return None  # being created right now, another host's, or a user's named one
    stale = [Stale(os.path.join(path, n), "namespace", p) for n, p in zip(names, pids, strict=True)]
    if all(not _pid_alive(s.pid) and _lock_free(s.path) for s in stale if s.pid is not None):
        return Stale(path, "temporary root", pids[0])
    return None


def find_stale(root: str) -> list[Stale]:
    """Stale namespaces under ``root`` and stale temporary roots in it (NOTE [ Stale namespaces ]).

    ``root`` is a local directory: a store root, or the directory temporary stores
    are made in. Nothing is removed.
    """
    root = os.path.abspath(root)
    host = host_tag()
    found = list(_stale_namespaces(root, host))
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(root)):
            if name.startswith(TEMP_PREFIX):
                hit = _stale_temp_root(os.path.join(root, name), host)
                if hit is not None:
                    found.append(hit)
    return found


def remove(found: list[Stale]) -> None:
    """Delete what :func:`find_stale` found (already gone: fine)."""
    for item in found:
        shutil.rmtree(item.path, ignore_errors=True)
        log.info("removed stale %s %s (pid %s is gone)", item.kind, item.path, item.pid)


def sweep(root: str) -> list[Stale]:
    """Remove what :func:`find_stale` finds under ``root``; returns it."""
    found = find_stale(root)
    remove(found)
    return found


def sweep_at_open(root: str) -> None:
    """Called when a local store opens: sweep ``root`` once per process; never raises."""
    root = os.path.abspath(root)
    with _LOCK:
        if root in _swept:
            return
        _swept.add(root)
    try:
        sweep(root)
    except Exception:  # housekeeping must never stop a store from opening
        log.debug("sweeping %s failed", root, exc_info=True)


def temp_parent() -> str:
    """Where temporary stores go: ``$TSH_TMPDIR``, else the system's temporary directory."""
    return os.environ.get(TMPDIR_ENV) or tempfile.gettempdir()


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem holding ``path`` (``"ext4"``, ``"tmpfs"``), if known."""
    import psutil

    path = os.path.realpath(path)
    best, fstype = "", None
    with contextlib.suppress(Exception):
        for part in psutil.disk_partitions(all=True):
            mount = part.mountpoint
            inside = path == mount or path.startswith(mount.rstrip(os.sep) + os.sep)
            if inside and len(mount) >= len(best):
                best, fstype = mount, part.fstype
    return fstype


def make_temp_root() -> str:
    """Create a temporary store root; sweep stale siblings; warn once if it is on tmpfs.

    On tmpfs "disk" is RAM: offloading would save no memory. The warning names the
    fix (``TSH_TMPDIR`` or a path) and is not given when ``TSH_TMPDIR`` was chosen.
    """
    global _warned_tmpfs
    parent = temp_parent()
    if os.environ.get(TMPDIR_ENV):
        os.makedirs(parent, exist_ok=True)
    sweep_at_open(parent)
    path = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent)
    log.info("temporary store at %s", path)
    if not os.environ.get(TMPDIR_ENV) and not _warned_tmpfs:
        fstype = filesystem_type(path)
        if fstype in _RAM_FILESYSTEMS:
            _warned_tmpfs = True
            warn_user(
                f"tensorstore-hooks: the temporary store {path} is on {fstype}, which is RAM: "
                "offloaded activations would stay in memory. Set TSH_TMPDIR to a directory "
                "on disk, or give a store path: tsh.offload('/scratch/acts')."
            )
    return path
