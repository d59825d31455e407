"""The daemon's root directory: private to the daemon's user, checked before use.

NOTE [ Private root ]
The root holds tensors (activations of someone's model) and the session journal,
whose session ids grant access to those tensors with the token. So:

1. The root is created mode 0700, and an existing root must be a directory owned
   by the daemon's own uid that no other user can write (no group/world write bit):
   otherwise another user could replace its files (a journal naming their own
   session, chunk files with bytes of their choosing) or swap the directory. Such a
   root is refused with a ConfigError saying why and what to do.
2. An existing root of our own that others can read or traverse (0755, as older
   versions created it) is *tightened*, not refused: chmod 0700, and every file and
   directory under it loses its group/other bits (0600 / 0700). A warning says so.
3. Files the daemon creates later go through the library's ``LocalIO`` (plain
   ``open``/``os.open`` with mode 0644 and the process umask). The daemon sets its
   process umask to 077 before opening the disk tier, so each new file is 0600 and
   each new directory 0700 without the library knowing about the daemon. The daemon
   runs as its own process (``serve``), so this umask is its own; an embedding
   program that calls :func:`~tensorstore_hooks.server.serve` gets the same umask
   for the daemon's lifetime (and after: a umask is process-wide and the daemon does
   not restore it while files of its root may still be created).

The check is on the root itself; parents are the operator's business (a root under
a directory another user can write could still be renamed away: put it under the
daemon user's home or a 0700 directory).

NOTE [ One daemon per root ]
A daemon's start reads the root's journals, retires records, deletes chunk files no
index entry covers and tightens modes; on a root that a live daemon serves, that
would delete the files of its PUTs in flight. So:

1. The daemon takes the root's lock (``flock`` on ``ROOT/daemon.lock``, holding the
   text "pid N on HOST since TIME") after checking the root directory itself (a
   ``stat``) and before anything under it is read, swept, changed or removed, and
   holds it until it exits (the kernel drops it if the daemon dies, so SIGKILL leaves
   no stale lock).
2. A second daemon that finds the lock held exits at once (exit 2) saying the root is
   in use and by which pid, having touched nothing under the root.
3. The lock file is the daemon's own: ``clean`` and the stores' sweeps never remove
   it (it is not a namespace), and the disk quota counts it (NOTE [ Exact disk quota ]).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import stat
import time
from collections.abc import Callable

from tensorstore_hooks.errors import ConfigError

__all__ = ["DAEMON_UMASK", "ROOT_LOCK", "check_root_dir", "lock_root", "prepare_root"]

log = logging.getLogger("tensorstore_hooks.server")

DAEMON_UMASK = 0o077
"""The daemon's process umask: new files 0600, new directories 0700."""
ROOT_LOCK = "daemon.lock"
"""The root's lock file (NOTE [ One daemon per root ])."""


def check_root_dir(path: str, st: os.stat_result, uid: int) -> str | None:
    """Why ``path`` (with ``st``) must not be the daemon root of user ``uid``; None if fine.

    Pure (no I/O), so the ownership rule is testable without a second user.
    """
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != uid:
        return (
            f"{path} is owned by uid {st.st_uid}, not by the daemon's uid {uid}: its owner "
            "could read or replace the daemon's files; use a directory the daemon's user owns"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}): they "
            f"could replace the daemon's files; chmod 700 {path} or use another directory"
        )
    return None


def prepare_root(location: str) -> Callable[[], None]:
    """Create or check the local root ``location`` and lock it (NOTE [ Private root ],
    NOTE [ One daemon per root ]); returns the function that releases the lock.

    Sets the process umask to :data:`DAEMON_UMASK`. Raises ConfigError for a root
    that another user owns or can write, that is not a directory, or that another
    daemon holds (nothing under it is touched then).
    """
    os.umask(DAEMON_UMASK)
    path = os.path.abspath(location)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"daemon config: root {path}: cannot create it: {e}") from e
    st = os.stat(path)
    why = check_root_dir(path, st, os.geteuid())
    if why is not None:
        raise ConfigError(f"daemon config: refusing root {why}")
    unlock = lock_root(path)  # rule 1: before anything under the root is touched
    try:
        if stat.S_IMODE(st.st_mode) & 0o077:
            old = stat.S_IMODE(st.st_mode)
            tightened = _tighten(path)
            log.warning(
                "root %s was mode %04o (other users could read it): tightened to 0700, and "
                "%d files and directories under it to 0600/0700",
                path,
                old,
                tightened,
            )
    except BaseException:
        unlock()
        raise
    return unlock


def lock_root(path: str) -> Callable[[], None]:
    """Take the lock of the root directory ``path`` (NOTE [ One daemon per root ]);
    returns the function that releases it. Raises ConfigError if another process
    holds it (naming it) or the lock file cannot be made."""
    lock_path = os.path.join(path, ROOT_LOCK)
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(lock_path, flags, 0o600)
    except OSError as e:
        raise ConfigError(
            f"daemon config: root {path}: cannot open its lock file {lock_path}: {e}"
        ) from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(
                f"daemon config: root {path}: {lock_path} is not a regular file; remove it"
            )
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "a process"
        os.close(fd)
        raise ConfigError(
            f"daemon config: root {path} is in use by another daemon ({holder}); two daemons "
            "on one root would delete each other's files. Stop that daemon and wait for it "
            "to exit (it drains for up to limits.drain_timeout), or give this one another "
            "--root"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    with contextlib.suppress(OSError):
        since = time.strftime("%Y-%m-%dT%H:%M:%S")
        me = f"pid {os.getpid()} on {socket.gethostname()} since {since}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode(), 0)
    held = [fd]

    def release() -> None:
        if held:  # idempotent: never close a descriptor number twice
            with contextlib.suppress(OSError):
                os.close(held.pop())  # closing drops the flock

    return release


def _tighten(path: str) -> int:
    """chmod ``path`` 0700 and strip group/other bits below it; returns how many changed."""
    os.chmod(path, 0o700)
    changed = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in (*dirnames, *filenames):
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode) or not stat.S_IMODE(st.st_mode) & 0o077:
                continue
            os.chmod(full, stat.S_IMODE(st.st_mode) & 0o700)
            changed += 1
    return changed
