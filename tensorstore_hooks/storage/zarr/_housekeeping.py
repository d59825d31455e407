"""Housekeeping of local store roots: stale namespaces, the temporary root, tmpfs.

NOTE [ Stale namespaces ]
Every ``ZarrStore`` writes into its own namespace ``[r{rank}-]{host}-{pid}-{random}``
under its root, and a temporary store into its own root
``$TSH_TMPDIR/tensorstore-hooks-*`` (else the system's temporary directory). A
process that dies without closing (SIGKILL, the OOM killer) leaves both behind,
and nothing else would ever remove them. Only what the library itself made is ever
removed, and nothing a live process owns is ever read, so the checks go in this
order, a namespace being *stale* when all of them hold:

1. its name has this host's name and a pid (the pid means nothing elsewhere), no
   process with that pid runs here (``psutil.pid_exists``), and it is a directory,
   not a symbolic link (links are never followed nor removed): all decided without
   opening anything under it;
2. its ``lock`` file, which every local namespace gets before its ``zarr.json``, is
   a regular file that no process holds: the sweeper takes the ``flock`` itself
   (read-only, without following links) *before anything under the namespace is
   read* (the kernel drops a dead process's locks, so a live holder whose pid is
   reused or belongs to another PID namespace keeps its namespace untouched);
3. holding that lock: its ``zarr.json`` is a regular file whose attributes are the
   library's own and name this very namespace (``attributes.tensorstore_hooks.namespace``),
   and the pid still runs nowhere here.

A temporary root is stale when it is a directory (not a link) holding the marker
``.tensorstore-hooks-temporary`` that the library writes when it makes one (whole:
written aside and renamed) and that its store holds locked (``flock``) until it is
removed; the sweeper takes that lock first, then reads the marker, which must name
a pid of this host that no longer runs, and the root must hold nothing but that
marker, the root's own ``zarr.json``, stale namespaces (each claimed as above) and
temporary files of interrupted document writes. Removal holds every lock taken and
checks everything again under them, so a store opening meanwhile keeps its files;
what is reported removed is what is gone from disk. Sweeping happens when a local
store opens (after it has locked its own namespace; once per root and process) and
on demand with ``tensorstore-hooks clean ROOT [--dry-run]``, which measures what it
reports under the same locks. Named namespaces (the daemon's ``daemon``, a user's
``namespace=``) never match rule 1's pattern and are never swept. Object stores are
not swept (listing costs requests).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
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
from tensorstore_hooks.runtime import foreign

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

_NS_NAME = re.compile(r"(?:r\d+-)?[A-Za-z0-9.-]+-\d+-[0-9a-f]{8}")
"""What a default namespace's name looks like (rule 1 checks the host and pid)."""
_ATOMIC_TMP = re.compile(r"\..+\.tmp-\d+-[0-9a-f]{8}")
"""A temporary file of a document write (NOTE [ Atomic documents ]) a crash left."""

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
    nbytes: int = 0
    """Bytes of its files when found (measured holding its locks)."""


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


def _parse_small(fd: int) -> JSON:
    """The JSON of the small regular file open at ``fd`` (``None``: not a regular
    file, too big, unreadable or not JSON)."""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _DOC_MAX_BYTES:
            return None
        raw = os.pread(fd, _DOC_MAX_BYTES + 1, 0)
    except OSError:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _read_json(path: str) -> JSON:
    """A small regular file's JSON (``None`` if it is missing, a link, big or not JSON)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        return _parse_small(fd)
    finally:
        os.close(fd)


def _our_attributes(path: str) -> dict[str, JSON] | None:
    doc = _read_json(os.path.join(path, "zarr.json"))
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    ours = attrs.get("tensorstore_hooks") if isinstance(attrs, dict) else None
    return ours if isinstance(ours, dict) and "format" in ours else None


def _ours(path: str, name: str) -> bool:
    """Rule 3 of NOTE [ Stale namespaces ] for the directory ``path`` named ``name``
    (read only while its lock is held)."""
    attrs = _our_attributes(path)
    return attrs is not None and attrs.get("namespace") == name


@contextlib.contextmanager
def _flocked(path: str) -> Iterator[int | None]:
    """Open the regular file ``path`` (never through a link, read-only: nothing is
    written) and take its ``flock``: yields the descriptor while it is held, or
    ``None`` when it cannot be opened or a live process holds it (rule 2)."""
    import fcntl

    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # missing, a link, not ours to open
        yield None
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            yield None
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield None  # a live holder
            return
        yield fd
    finally:
        os.close(fd)  # drops our lock too


@contextlib.contextmanager
def _claim_namespace(path: str, host: str) -> Iterator[int | str]:
    """Rules 1-3 of NOTE [ Stale namespaces ], the lock taken before anything under
    ``path`` is read: yields the dead writer's pid while this process holds the
    namespace's lock, or why it is not stale (then nothing under it was read)."""
    name = os.path.basename(path)
    pid = _namespace_pid(name, host)
    if pid is None or pid == os.getpid() or not _is_dir(path):
        yield f"{name} is not a namespace of a dead process"
        return
    if _pid_alive(pid):
        yield f"the process of {name} (pid {pid}) runs"
        return
    with _flocked(os.path.join(path, "lock")) as held:
        if held is None:
            yield f"namespace {name} is in use (a process holds its lock)"
        elif not _ours(path, name) or _pid_alive(pid):
            yield f"{name} is not a stale namespace of ours"
        else:
            yield pid


@contextlib.contextmanager
def _claim_temp_root(path: str, host: str) -> Iterator[int | str]:
    """A temporary root's marker locked, then read, then its namespaces claimed
    (NOTE [ Stale namespaces ]): yields the dead owner's pid while every lock is held,
    or why it is not stale."""
    if not _is_dir(path):
        yield "not a directory"
        return
    with contextlib.ExitStack() as held:
        fd = held.enter_context(_flocked(os.path.join(path, TEMP_MARKER)))
        if fd is None:
            yield "no marker of ours, or its store is open"
            return
        marker = _parse_small(fd)
        pid = marker.get("pid") if isinstance(marker, dict) else None
        if not isinstance(marker, dict) or marker.get("host") != host or not isinstance(pid, int):
            yield "not made by the library on this host"  # or by another version
            return
        if pid == os.getpid() or _pid_alive(pid):
            yield f"its process (pid {pid}) runs"
            return
        try:
            names = os.listdir(path)
        except OSError as e:
            yield f"cannot be listed ({e.strerror})"
            return
        for name in names:
            if name == TEMP_MARKER or _ATOMIC_TMP.fullmatch(name):
                continue  # the marker; a document write a crash cut short
            if name == "zarr.json" and _our_attributes(path) is not None:
                continue
            claim = held.enter_context(_claim_namespace(os.path.join(path, name), host))
            if isinstance(claim, str):
                yield f"{name}: {claim}"  # something else lives here: leave it all
                return
        yield pid


def _claim(item_path: str, kind: str, host: str) -> contextlib.AbstractContextManager[int | str]:
    if kind == "namespace":
        return _claim_namespace(item_path, host)
    return _claim_temp_root(item_path, host)


def _candidates(root: str) -> list[tuple[str, str]]:
    """``(path, kind)`` of every entry of ``root`` whose name alone may be stale (the
    name decides; nothing under it is read)."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    out = [(os.path.join(root, n), "namespace") for n in names if _NS_NAME.fullmatch(n)]
    out += [(os.path.join(root, n), "temporary root") for n in names if n.startswith(TEMP_PREFIX)]
    return out


def find_stale(root: str) -> list[Stale]:
    """Stale namespaces under ``root`` and stale temporary roots in it (NOTE [ Stale namespaces ]).

    ``root`` is a local directory: a store root, or the directory temporary stores
    are made in. Nothing is removed; nothing a live process owns is read (each
    candidate's lock is taken first, and released before this returns).
    """
    root = os.path.abspath(root)
    host = host_tag()
    found = []
    for path, kind in _candidates(root):
        with _claim(path, kind, host) as claim:
            if isinstance(claim, int):
                found.append(Stale(path, kind, claim, _tree_bytes(path)))
    return found


@dataclass(frozen=True, slots=True)
class Removal:
    """What :func:`remove` did with one :class:`Stale` item."""

    item: Stale
    error: str | None
    """``None``: it is gone from disk; else why it was left (partly) in place."""


def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):  # never into links
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


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


def remove_stale(found: list[Stale]) -> list[Removal]:
    """Delete what :func:`find_stale` found, checking each again under its locks (taken
    before anything under it is read).

    Returns one :class:`Removal` per item: removed, or why not (already gone counts
    as removed). Never raises for a single item."""
    host = host_tag()
    done: list[Removal] = []
    for item in found:
        if not os.path.lexists(item.path):
            done.append(Removal(item, None))
            continue
        try:
            with _claim(item.path, item.kind, host) as claim:
                error = _remove_tree(item.path) if isinstance(claim, int) else claim
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


def make_temp_root() -> tuple[str, Callable[[], None]]:
    """Create a temporary store root; sweep stale siblings; warn once if it is on tmpfs.

    Returns the root and the function that releases it (call it after removing the
    root): the root's marker stays locked (``flock``) until then, so no sweep by
    another process reads or removes anything under a live temporary root (NOTE
    [ Stale namespaces ]). On tmpfs "disk" is RAM: offloading would save no memory.
    The warning names the fix (``TSH_TMPDIR`` or a path) and is not given when
    ``TSH_TMPDIR`` was chosen.
    """
    global _warned_tmpfs
    parent = temp_parent()
    if os.environ.get(TMPDIR_ENV):
        os.makedirs(parent, exist_ok=True)
    sweep_at_open(parent)
    path = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent)
    try:
        release = _write_marker(path)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
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
    return path, release


def _write_marker(root: str) -> Callable[[], None]:
    """The temporary root's marker, ``{"pid", "host"}``, appearing whole (written to a
    temporary file, synced, renamed: NOTE [ Atomic documents ]) and already locked by
    this process; returns what unlocks it."""
    import fcntl

    marker = {"pid": os.getpid(), "host": host_tag(), "made_by": "tensorstore-hooks"}
    tmp = os.path.join(root, f".{TEMP_MARKER}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the lock belongs to the file
        os.write(fd, json.dumps(marker).encode())
        os.fsync(fd)
        os.rename(tmp, os.path.join(root, TEMP_MARKER))
        dfd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        os.close(fd)
        raise
    held = [fd]

    def release() -> None:
        # The creating process only (NOTE [ Fork safety ]): a forked child's copy of the
        # descriptor shares the lock, and closing it here would drop the parent's lock.
        if held and not foreign(owner):
            os.close(held.pop())

    owner = os.getpid()
    return release
