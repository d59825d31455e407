"""What the kernel saw happen to files: inotify through ctypes, for tests that must
prove a process did not touch (open, read, write, remove) what another one owns."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
from pathlib import Path

__all__ = ["Watch"]

_EVENTS = {
    0x00000001: "access",
    0x00000002: "modify",
    0x00000004: "attrib",
    0x00000008: "close_write",
    0x00000010: "close_nowrite",
    0x00000020: "open",
    0x00000040: "moved_from",
    0x00000080: "moved_to",
    0x00000100: "create",
    0x00000200: "delete",
    0x00000400: "delete_self",
    0x00000800: "move_self",
}
_ALL = sum(_EVENTS)
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len


class Watch:
    """Every event on the files and directories under each given tree (each directory
    watched; inotify reports on a directory's entries and on the directory itself).

    Use as a context manager; :meth:`events` returns ``(path, event)`` pairs so far.
    """

    def __init__(self, *trees: Path) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._dirs: dict[int, str] = {}
        directories = [d for tree in trees for d, _, _ in os.walk(tree)]
        for directory in directories:
            wd = libc.inotify_add_watch(self._fd, os.fsencode(directory), _ALL)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory}")
            self._dirs[wd] = directory
        self.events()  # what setting up saw is not the test's

    def events(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while True:
            try:
                raw = os.read(self._fd, 1 << 16)
            except OSError as e:
                if e.errno == errno.EAGAIN:
                    return out
                raise
            pos = 0
            while pos < len(raw):
                wd, mask, _, n = _HEADER.unpack_from(raw, pos)
                name = raw[pos + _HEADER.size : pos + _HEADER.size + n].rstrip(b"\0")
                pos += _HEADER.size + n
                path = os.path.join(self._dirs.get(wd, "?"), os.fsdecode(name))
                out += [(path.rstrip("/"), e) for bit, e in _EVENTS.items() if mask & bit]

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
