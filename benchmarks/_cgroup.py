"""A child memory cgroup for one benchmark process: made, limited, read, removed.

Root only (making a cgroup needs it). The child is made under this process's own
memory cgroup (v1 ``memory`` controller or v2), so it is bounded by whatever bounds
the benchmark. A process joins it before it starts (:meth:`ChildGroup.argv` wraps
its command in ``sh -c 'echo $$ > cgroup.procs; exec ...'``), so every byte it
allocates is charged to the child; the process itself may then set a limit
relative to its own charge (:func:`limit_above_charge`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import time
import uuid
from pathlib import Path

from tensorstore_hooks._memory import memory_cgroup_dir

__all__ = ["ChildGroup", "limit_above_charge", "unavailable"]

# version -> (limit, usage now, peak usage, the file whose "oom_kill N" line counts kills)
_FILES = {
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.max_usage_in_bytes",
        "memory.oom_control"),
    2: ("memory.max", "memory.current", "memory.peak", "memory.events"),
}  # fmt: skip


def unavailable() -> str | None:
    """Why a child memory cgroup cannot be made here (``None``: it can)."""
    if os.geteuid() != 0:
        return "not root"
    if memory_cgroup_dir() is None:
        return "no memory cgroup controller"
    return None


class ChildGroup:
    """A new memory cgroup below this process's; :meth:`remove` it when done."""

    def __init__(self, prefix: str = "tsh-bench") -> None:
        found = memory_cgroup_dir()
        if found is None:
            raise RuntimeError("ChildGroup: no memory cgroup controller")
        self.version, parent, _ = found
        self.path = parent / f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()

    def argv(self, command: list[str]) -> list[str]:
        """``command`` run inside the group from its first instruction."""
        procs = shlex.quote(str(self.path / "cgroup.procs"))
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *command]

    def read(self, which: int) -> int:
        """0: the limit, 1: the charge now, 2: the peak charge (bytes; -1 if unreadable)."""
        try:
            text = (self.path / _FILES[self.version][which]).read_text().strip()
        except OSError:
            return -1
        return 1 << 62 if text == "max" else int(text)

    def oom_kills(self) -> int:
        """Processes of the group the kernel killed for memory."""
        with contextlib.suppress(OSError):
            for line in (self.path / _FILES[self.version][3]).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> None:
        """Remove the (empty) group; retries while the kernel finishes with its last task."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        self.path.rmdir()


def limit_above_charge(extra_bytes: int) -> int:
    """Limit the calling process's memory cgroup to its charge now plus ``extra_bytes``;
    returns the limit (bytes). For a process started by :meth:`ChildGroup.argv`."""
    found = memory_cgroup_dir()
    if found is None:
        raise RuntimeError("limit_above_charge: no memory cgroup controller")
    version, path, _ = found
    limit_file, usage_file = _FILES[version][0], _FILES[version][1]
    limit = int((path / usage_file).read_text()) + extra_bytes
    (path / limit_file).write_text(str(limit))
    return limit


def group_of_this_process() -> Path:
    """This process's memory cgroup directory (for the record)."""
    found = memory_cgroup_dir()
    return found[1] if found is not None else Path("/")
