"""Housekeeping of local store roots: stale namespaces, the temporary root, tmpfs.

NOTE [ Stale namespaces ]
Every ``ZarrStore`` writes into its own namespace ``[r{rank}-]{host}-{pid}-{random}``
under its root, and a temporary store into its own root
``$TSH_TMPDIR/tensorstore-hooks-*`` (else the system's temporary directory). A
process that dies without closing (SIGKILL, the OOM killer) leaves both behind,
and nothing else would ever remove them. Only what the library itself made is ever
removed, so a namespace is *stale* when all of these hold:

1. it is a directory, not a symbolic link (links are never followed nor removed),
   and its name has this host's name and a pid (the pid means nothing elsewhere);
2. its ``zarr.json`` is a regular file whose attributes are the library's own and
   name this very namespace (``attributes.tensorstore_hooks.namespace``);
3. its ``lock`` file, which every local namespace gets before its ``zarr.json``,
   is a regular file that no process holds (``flock``: the kernel drops a dead
   process's locks, so a live holder under a reused pid keeps its namespace);
4. no process with its pid runs here (``psutil.pid_exists``).

A temporary root is stale when it is a directory (not a link) holding the marker
``.tensorstore-hooks-temporary`` that the library writes when it makes one, naming
a pid of this host that no longer runs, and nothing but that marker, the root's own
``zarr.json`` and stale namespaces. Removal takes each namespace's lock first and
checks again, so a store opening meanwhile keeps it; what is reported removed is
what is gone from disk. Sweeping happens when a local store opens (once per root
and process) and on demand with ``tensorstore-hooks clean ROOT [--dry-run]``. Named
namespaces (the daemon's ``daemon``, a user's ``namespace=``) never match rule 1's
pattern and are never swept. Object stores are not swept (listing costs requests).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from tensorstore_hooks._warn import warn_user

if TYPE_CHECKING:  # _docs imports zarr, which sweeping and ``clean`` never need
    from tensorstore_hooks.storage.zarr._docs import JSON

__all__ = [
    "TEMP_MARKER",
    "TEMP_PREFIX",
    "TMPDIR_ENV",
    "Stale",
    "find_stale",
    "make_temp_root",
    "remove_stale",
    "sweep",
    "sweep_at_open",
]

log = logging.getLogger("tensorstore_hooks")

TMPDIR_ENV = "TSH_TMPDIR"
"""Where temporary stores go (default: the system's temporary directory)."""
TEMP_PREFIX = "tensorstore-hooks-"
TEMP_MARKER = ".tensorstore-hooks-temporary"
"""The file that says the library made a temporary root: ``{"pid": ..., "host": ...}``."""
_DOC_MAX_BYTES = 64 << 10  # a zarr.json or marker larger than this is not ours

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
    """The dead writer's pid."""


def host_tag() -> str:
    """This host's name as namespaces spell it (the same rule as ``ZarrStore``)."""
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"


def _namespace_pid(name: str, host: str) -> int | None:
    m = re.fullmatch(rf"(?:r\d+-)?{re.escape(host)}-(\d+)-[0-9a-f]{{8}}", name)
    return int(m.group(1)) if m else None


def _pid_alive(pid: int) -> bool:
    import psutil

    return bool(psutil.pid_exists(pid))


def _is_dir(path: str) -> bool:
    """A directory itself, never through a symbolic link."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _read_json(path: str) -> JSON:
    """A small regular file's JSON (``None`` if it is missing, a link, big or not JSON)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _DOC_MAX_BYTES:
            return None
        raw = os.read(fd, _DOC_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _our_attributes(path: str) -> dict[str, JSON] | None:
    doc = _read_json(os.path.join(path, "zarr.json"))
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    ours = attrs.get("tensorstore_hooks") if isinstance(attrs, dict) else None
    return ours if isinstance(ours, dict) and "format" in ours else None


def _ours(path: str, name: str) -> bool:
    """Rules 1-2 of NOTE [ Stale namespaces ] for the directory ``path`` named ``name``."""
    attrs = _our_attributes(path) if _is_dir(path) else None
    return attrs is not None and attrs.get("namespace") == name


@contextlib.contextmanager
def _held_lock(namespace_dir: str) -> Iterator[bool]:
    """Take the namespace's ``lock`` (rule 3): yields whether it is ours to remove now."""
    import fcntl

    path = os.path.join(namespace_dir, "lock")
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # missing, a link, not ours to open
        yield False
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            yield False
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False  # a live holder
            return
        yield True
    finally:
        os.close(fd)  # drops our lock too


def _lock_free(namespace_dir: str) -> bool:
    with _held_lock(namespace_dir) as free:
        return free


def _stale_namespace(path: str, host: str) -> Stale | None:
    name = os.path.basename(path)
    pid = _namespace_pid(name, host)
    if pid is None or pid == os.getpid() or not _ours(path, name):
        return None
    if _pid_alive(pid) or not _lock_free(path):
        return None
    return Stale(path, "namespace", pid)


def _stale_namespaces(root: str, host: str) -> Iterator[Stale]:
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return
    for name in names:
        hit = _stale_namespace(os.path.join(root, name), host)
        if hit is not None:
            yield hit


def _stale_temp_root(path: str, host: str) -> Stale | None:
    if not _is_dir(path):
        return None
    marker = _read_json(os.path.join(path, TEMP_MARKER))
    if not isinstance(marker, dict) or marker.get("host") != host:
        return None  # not made by the library on this host
    pid = marker.get("pid")
    if not isinstance(pid, int) or pid == os.getpid() or _pid_alive(pid):
        return None
    try:
        names = os.listdir(path)
    except OSError:
        return None
    for name in names:
        full = os.path.join(path, name)
        if name == TEMP_MARKER:
            continue
        if name == "zarr.json" and _our_attributes(path) is not None:
            continue
        if _stale_namespace(full, host) is None:
            return None  # something else lives here: leave the whole root alone
    return Stale(path, "temporary root", pid)


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


@dataclass(frozen=True, slots=True)
class Removal:
    """What :func:`remove` did with one :class:`Stale` item."""

    item: Stale
    error: str | None
    """``None``: it is gone from disk; else why it was left (partly) in place."""


def _remove_tree(path: str) -> str | None:
    errors: list[str] = []

    def note(
        func: Callable[..., object],
        failed: str,
        exc_info: tuple[type[BaseException], BaseException, TracebackType],
    ) -> None:
        errors.append(f"{failed}: {exc_info[1]}")

    shutil.rmtree(path, onerror=note)  # never follows links: it unlinks them
    if os.path.lexists(path):
        return "; ".join(errors[:3]) or "still there"
    return None


def _remove_one(item: Stale, host: str) -> str | None:
    """Remove ``item`` holding its namespaces' locks, after checking it again under them."""
    if item.kind == "namespace":
        namespaces = [item.path]
    elif _stale_temp_root(item.path, host) is None:
        return "no longer a stale temporary root"
    else:
        namespaces = [
            os.path.join(item.path, n)
            for n in os.listdir(item.path)
            if n not in (TEMP_MARKER, "zarr.json")
        ]
    with contextlib.ExitStack() as held:
        for path in namespaces:
            name = os.path.basename(path)
            pid = _namespace_pid(name, host)
            if not held.enter_context(_held_lock(path)):
                return f"namespace {name} is in use again"
            if pid is None or _pid_alive(pid) or not _ours(path, name):
                return f"{name} is no longer a stale namespace of ours"
        return _remove_tree(item.path)


def remove_stale(found: list[Stale]) -> list[Removal]:
    """Delete what :func:`find_stale` found, checking each again under its lock.

    Returns one :class:`Removal` per item: removed, or why not (already gone counts
    as removed). Never raises for a single item."""
    host = host_tag()
    done: list[Removal] = []
    for item in found:
        if not os.path.lexists(item.path):
            done.append(Removal(item, None))
            continue
        try:
            error = _remove_one(item, host)
        except OSError as e:
            error = str(e)
        done.append(Removal(item, error))
        if error is None:
            log.info("removed stale %s %s (pid %s is gone)", item.kind, item.path, item.pid)
        else:
            log.info("left stale %s %s: %s", item.kind, item.path, error)
    return done


def sweep(root: str) -> list[Stale]:
    """Remove what :func:`find_stale` finds under ``root``; returns what was removed."""
    return [r.item for r in remove_stale(find_stale(root)) if r.error is None]


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
    marker = {"pid": os.getpid(), "host": host_tag(), "made_by": "tensorstore-hooks"}
    with open(os.path.join(path, TEMP_MARKER), "x") as f:  # NOTE [ Stale namespaces ]
        json.dump(marker, f)
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
