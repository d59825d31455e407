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
"""

from __future__ import annotations

import logging
import os
import stat

from tensorstore_hooks.errors import ConfigError

__all__ = ["DAEMON_UMASK", "check_root_dir", "prepare_root"]

log = logging.getLogger("tensorstore_hooks.server")

DAEMON_UMASK = 0o077
"""The daemon's process umask: new files 0600, new directories 0700."""


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


def prepare_root(location: str) -> None:
    """Create or check the local root ``location`` (NOTE [ Private root ]).

    Sets the process umask to :data:`DAEMON_UMASK`. Raises ConfigError for a root
    that another user owns or can write, or that is not a directory.
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
