"""Memory cgroups for benchmark workers: memory as a container sees it.

A container (a Kubernetes pod, a Slurm job) is charged for its processes' RSS *and*
the page cache their files occupy, and a hard limit (``memory.max`` in cgroup v2,
``memory.limit_in_bytes`` in v1) OOM-kills the job when reclaim cannot keep it under.
:class:`ChildGroup` makes one child memory cgroup per benchmark worker (under the
group the orchestrator runs in), starts the worker inside it, and removes it after;
the worker reads its own group through :class:`WorkerGroup` (found through the
environment variable :data:`ENV`): its charge before the first step, its peak charge
since, and optionally a hard limit set right before the first step.

Needs write access to the cgroup filesystem (root, or a delegated v2 subtree).
:func:`detect` says why not when it cannot, and the benchmark reports that instead
of a figure.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ENV", "ChildGroup", "Support", "WorkerGroup", "detect"]

ENV = "TSH_BENCH_MEMCG"
"""``VERSION:PATH`` of the worker's own group, set by :class:`ChildGroup`."""

_V1_ROOT = "/sys/fs/cgroup/memory"
_V2_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class Support:
    """Whether child memory groups can be made here, and where."""

    version: int | None
    """1 or 2; ``None`` when unavailable."""
    parent: str
    """The directory new groups are made in."""
    reason: str
    """Why they cannot be made (empty when they can)."""


def _own_group(controller: str | None) -> str:
    """This process's group path in the v1 ``controller`` hierarchy (v2: ``None``)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if (controller is None and names == "") or (
                controller is not None and controller in names.split(",")
            ):
                return path
    return "/"


def _writable_dir(path: str) -> bool:
    probe = os.path.join(path, f"tsh-bench-probe-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    os.rmdir(probe)
    return True


def detect() -> Support:
    """Find a memory cgroup hierarchy where this process may make child groups."""
    if not os.path.isdir("/sys/fs/cgroup"):
        return Support(None, "", "no /sys/fs/cgroup (not Linux, or no cgroup filesystem)")
    if os.path.isfile(os.path.join(_V1_ROOT, "memory.limit_in_bytes")):
        parent = os.path.normpath(_V1_ROOT + _own_group("memory"))
        if _writable_dir(parent):
            return Support(1, parent, "")
        return Support(None, parent, f"cgroup v1 memory controller at {parent} is not writable")
    if os.path.isfile(os.path.join(_V2_ROOT, "cgroup.controllers")):
        parent = os.path.normpath(_V2_ROOT + _own_group(None))
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
        except OSError as e:
            return Support(None, parent, f"cgroup v2 at {parent}: {e}")
        if "memory" not in enabled:
            try:
                with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                    f.write("+memory")
            except OSError as e:
                return Support(
                    None,
                    parent,
                    f"cgroup v2 at {parent}: cannot enable the memory controller for child "
                    f"groups ({e.strerror}; a group with processes of its own cannot)",
                )
        if _writable_dir(parent):
            return Support(2, parent, "")
        return Support(None, parent, f"cgroup v2 at {parent} is not writable")
    return Support(None, "", "no memory controller mounted under /sys/fs/cgroup")


class ChildGroup:
    """One child memory group for one worker process; remove it with :meth:`remove`."""

    def __init__(self, support: Support, label: str) -> None:
        assert support.version is not None
        self.version = support.version
        safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in label)[:40]
        self.path = os.path.join(support.parent, f"tsh-bench-{safe}-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.path)

    def env(self) -> dict[str, str]:
        """What the worker needs to find its group (:class:`WorkerGroup`)."""
        return {ENV: f"{self.version}:{self.path}"}

    def preexec(self) -> Callable[[], None]:
        """For ``subprocess.Popen(preexec_fn=...)``: the child joins the group before it
        runs anything, so every byte it ever touches is charged to the group."""
        procs = os.path.join(self.path, "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return join

    def oom_kills(self) -> int:
        """OOM kills in the group so far (v1 ``memory.oom_control``, v2 ``memory.events``)."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            with open(os.path.join(self.path, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            pass
        return 0

    def remove(self) -> None:
        """Remove the group (its processes have exited; their charges go to the parent)."""
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)  # a process that just died may still be leaving the group
        with contextlib.suppress(OSError):
            os.rmdir(self.path)


class WorkerGroup:
    """The worker's side: its own group's charge, peak and limit."""

    def __init__(self, version: int, path: str) -> None:
        self.version = version
        self.path = path
        self._usage_fd = os.open(
            os.path.join(path, "memory.usage_in_bytes" if version == 1 else "memory.current"),
            os.O_RDONLY,
        )
        self._peak_fd: int | None = None

    @classmethod
    def from_env(cls) -> WorkerGroup | None:
        spec = os.environ.get(ENV)
        if not spec:
            return None
        version, _, path = spec.partition(":")
        return cls(int(version), path)

    def usage(self) -> int:
        """The group's charge now: RSS + page cache + kernel memory, in bytes."""
        return int(os.pread(self._usage_fd, 64, 0))

    def reset_peak(self) -> None:
        """Start the peak over from the charge now (v1: ``memory.max_usage_in_bytes``;
        v2: ``memory.peak`` of an open file, Linux >= 6.12; else the sampler's peak)."""
        if self.version == 1:
            with open(os.path.join(self.path, "memory.max_usage_in_bytes"), "w") as f:
                f.write("0")
            return
        try:
            fd = os.open(os.path.join(self.path, "memory.peak"), os.O_RDWR)
            os.write(fd, b"reset\n")
            self._peak_fd = fd
        except OSError:
            self._peak_fd = None

    def peak(self) -> int | None:
        """The kernel's peak charge since :meth:`reset_peak` (``None`` if it keeps none)."""
        if self.version == 1:
            with open(os.path.join(self.path, "memory.max_usage_in_bytes")) as f:
                return int(f.read())
        if self._peak_fd is None:
            return None
        return int(os.pread(self._peak_fd, 64, 0))

    def set_limit(self, nbytes: int) -> None:
        """A hard limit: beyond it the kernel reclaims, then OOM-kills the worker."""
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        with open(os.path.join(self.path, name), "w") as f:
            f.write(str(int(nbytes)))
