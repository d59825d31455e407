"""The memory there is: container limits (cgroup v1 and v2), the machine's, CUDA's.

Readers only, for ``device_budget: auto`` / ``host_budget: auto``; what the budgets
make of the figures is NOTE [ Auto budgets ] in ``pipeline/_budgets.py``. Every path the
readers use is a parameter (``cgroup_root``, ``proc_self``), so tests point them at
files they wrote.

NOTE [ Container limits ]
1. The process's memory cgroup comes from ``/proc/self/cgroup``: a line whose
   controllers name ``memory`` is cgroup v1 (``ID:memory:/PATH``, files under
   ``ROOT/memory/PATH``); otherwise the unified line ``0::/PATH`` is cgroup v2 (files
   under ``ROOT/PATH``). A hybrid machine (v1 memory controller beside a v2 tree
   without it) is read as v1.
2. Inside a container the group's path is often not visible (the container sees its
   own group as the root): a path that does not exist under the root is read at the
   root itself.
3. The limit is the smallest along the path from the group up to the root (a parent's
   limit bounds its children): v2 ``memory.max`` (``max``: none), v1
   ``memory.limit_in_bytes`` and, where the kernel reports it, ``memory.stat``'s
   ``hierarchical_memory_limit``. A figure of 2**60 or more is v1's "no limit".
4. What the group's other processes use is its anonymous memory (v2 ``memory.stat``
   ``anon``, v1 ``total_rss``) less this process's (``RssAnon``): page cache is left
   out (the kernel reclaims it before it kills).
"""

from __future__ import annotations

import os
import resource
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

__all__ = [
    "CGROUP_ROOT",
    "CgroupMemory",
    "MemoryProbe",
    "MemoryReading",
    "ProcessMemory",
    "SystemMemory",
    "cgroup_memory",
    "memory_cgroup_dir",
    "peak_rss_bytes",
    "process_memory",
]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF = Path("/proc/self")
_NO_LIMIT = 1 << 60  # rule 3: v1 reports "no limit" as PAGE_COUNTER_MAX pages (~2**63)


@dataclass(frozen=True, slots=True)
class CgroupMemory:
    """The memory cgroup a process runs in, as read (NOTE [ Container limits ])."""

    version: int
    """1 or 2."""
    path: Path
    """The group's directory."""
    limit_bytes: int
    """The smallest limit from the group up to the root (rule 3)."""
    anon_bytes: int
    """Anonymous memory charged to the group, every process in it (rule 4)."""


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """This process's resident memory (``/proc/self/status``)."""

    rss_bytes: int
    anon_bytes: int
    """Its anonymous part (``RssAnon``)."""


@dataclass(frozen=True, slots=True)
class MemoryReading:
    """One look at the memory saved tensors may use (NOTE [ Auto budgets ])."""

    limit_bytes: int
    """What this process may use in all: a container's limit less what its other
    processes use, the machine's available memory plus what the process has, or a
    CUDA device's free memory plus what torch's allocator has reserved."""
    peak_bytes: int
    """The process's high-water mark of that memory so far."""
    source: str
    """Where ``limit_bytes`` came from, for the log (``"cgroup v2 /sys/fs/cgroup"``)."""


class MemoryProbe(Protocol):
    """Where the budgets read memory (the seam tests replace)."""

    def read(self, device: torch.device) -> MemoryReading | None:
        """The memory of ``device`` (``cpu``: the host's); ``None``: it cannot be read."""
        ...

    def peak(self, device: torch.device) -> int:
        """The process's high-water mark of ``device``'s memory (cheap: every forward)."""
        ...


# ---------------------------------------------------------------------------- cgroups
def _groups(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(v1 memory path, v2 path) from ``/proc/self/cgroup``'s text (rule 1)."""
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if "memory" in controllers.split(","):
            v1 = path
        elif hid == "0" and controllers == "":
            v2 = path
    return v1, v2


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _NO_LIMIT
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _group_dir(base: Path, path: str) -> Path:
    """The group's directory under ``base`` (rule 2: the base itself when not visible)."""
    here = base / path.lstrip("/")
    return here if here.is_dir() else base


def _smallest_limit(base: Path, group: Path, name: str) -> int:
    """The smallest ``name`` from ``group`` up to ``base`` (rule 3)."""
    limit = _NO_LIMIT
    here = group
    while True:
        value = _read_int(here / name)
        if value is not None:
            limit = min(limit, value)
        if here == base or base not in here.parents:
            return limit
        here = here.parent


def memory_cgroup_dir(
    cgroup_root: Path = CGROUP_ROOT, proc_self: Path = PROC_SELF
) -> tuple[int, Path, Path] | None:
    """``(version, the process's memory cgroup directory, the hierarchy's root)``, or
    ``None`` without a memory controller (rules 1 and 2 of NOTE [ Container limits ])."""
    try:
        text = (proc_self / "cgroup").read_text()
    except OSError:
        return None
    v1, v2 = _groups(text)
    if v1 is not None and (cgroup_root / "memory").is_dir():
        base = cgroup_root / "memory"
        return 1, _group_dir(base, v1), base
    if v2 is not None:
        group = _group_dir(cgroup_root, v2)
        if (group / "memory.max").exists() or (cgroup_root / "memory.max").exists():
            return 2, group, cgroup_root
    return None


def cgroup_memory(
    cgroup_root: Path = CGROUP_ROOT, proc_self: Path = PROC_SELF
) -> CgroupMemory | None:
    """This process's memory cgroup with its limit; ``None`` without a limit (or a cgroup).

    ``cgroup_root``: where the cgroup filesystems are mounted; ``proc_self``: the
    process's ``/proc`` directory (its ``cgroup`` file is read). NOTE [ Container limits ].
    """
    found = memory_cgroup_dir(cgroup_root, proc_self)
    if found is None:
        return None
    version, group, base = found
    if version == 1:
        stat = _stat(group / "memory.stat")
        limit = min(
            _smallest_limit(base, group, "memory.limit_in_bytes"),
            stat.get("hierarchical_memory_limit", _NO_LIMIT),
        )
        anon = stat.get("total_rss", stat.get("rss", 0))
    else:
        limit = _smallest_limit(base, group, "memory.max")
        anon = _stat(group / "memory.stat").get("anon", 0)
    if limit >= _NO_LIMIT:
        return None
    return CgroupMemory(version=version, path=group, limit_bytes=limit, anon_bytes=anon)


# ---------------------------------------------------------------------------- process
def process_memory(proc_self: Path = PROC_SELF) -> ProcessMemory:
    """This process's RSS and its anonymous part (``/proc/self/status``; without it, the
    peak stands in for both)."""
    fields: dict[str, int] = {}
    try:
        text = (proc_self / "status").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon") and value.split():
            fields[key] = int(value.split()[0]) * 1024  # kB
    rss = fields.get("VmRSS", peak_rss_bytes())
    return ProcessMemory(rss_bytes=rss, anon_bytes=fields.get("RssAnon", rss))


def peak_rss_bytes() -> int:
    """The process's high-water RSS (``getrusage``: about a microsecond, so every
    forward may ask)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024  # KiB on Linux


class SystemMemory:
    """The real :class:`MemoryProbe`: cgroups and ``/proc`` for the host, torch for CUDA.

    ``cgroup_root`` / ``proc_self``: as :func:`cgroup_memory` takes them. Only CPU and
    CUDA devices can be read; another device gives ``None``.
    """

    def __init__(self, cgroup_root: Path = CGROUP_ROOT, proc_self: Path = PROC_SELF) -> None:
        self.cgroup_root = cgroup_root
        self.proc_self = proc_self

    def read(self, device: torch.device) -> MemoryReading | None:
        if device.type == "cuda":
            return _cuda_reading(device)
        if device.type != "cpu":
            return None
        me = process_memory(self.proc_self)
        group = cgroup_memory(self.cgroup_root, self.proc_self)
        if group is not None:
            others = max(0, group.anon_bytes - me.anon_bytes)
            return MemoryReading(
                limit_bytes=max(0, group.limit_bytes - others),
                peak_bytes=peak_rss_bytes(),
                source=f"cgroup v{group.version} {group.path} limit, less its other "
                "processes' memory",
            )
        import psutil

        return MemoryReading(
            limit_bytes=int(psutil.virtual_memory().available) + me.rss_bytes,
            peak_bytes=peak_rss_bytes(),
            source="the machine's available memory plus this process's",
        )

    def peak(self, device: torch.device) -> int:
        if device.type == "cuda":
            return _cuda_peak(device, torch.cuda.memory_stats(device))
        return peak_rss_bytes()


_cuda_marks: dict[torch.device, int] = {}  # high-water marks a stats reset cannot lower
_cuda_marks_lock = threading.Lock()


def _cuda_peak(device: torch.device, stats: dict[str, int]) -> int:
    """The device's high-water mark: the caching allocator's *reserved* peak (what
    fragmentation really takes, not only what tensors were allocated), and never
    lower than a mark seen before, since ``torch.cuda.reset_peak_memory_stats()``,
    which training loops commonly call, resets the allocator's own peaks."""
    seen = max(
        int(stats.get("reserved_bytes.all.peak", 0)),
        int(stats.get("allocated_bytes.all.peak", 0)),
        int(stats.get("reserved_bytes.all.current", 0)),
    )
    with _cuda_marks_lock:
        mark = _cuda_marks[device] = max(_cuda_marks.get(device, 0), seen)
    return mark


def _cuda_reading(device: torch.device) -> MemoryReading:
    """Free device memory plus what torch's caching allocator holds; its peak reserve."""
    free, _total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    return MemoryReading(
        limit_bytes=int(free) + reserved,
        peak_bytes=_cuda_peak(device, stats),
        source=f"{device}: free memory plus the caching allocator's reserve",
    )
