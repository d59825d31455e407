"""Hand freed heap memory back to the OS while offloading runs.

NOTE [ Heap release ]
Offloading frees each saved tensor when its write has finished (on an I/O thread, out
of step with forward's own allocations), and backward allocates read buffers on I/O
threads. glibc returns freed memory to the OS only from the top of a heap; freed
blocks below a live one stay mapped and count in the process's RSS. Measured on the
train-step benchmark (8 blocks, d=512, 2 GiB saved per step): at the end of forward
0.19 GiB was live but 0.75 GiB more sat free in glibc's heaps, and the step's peak RSS
was 0.76-0.83 GiB above where it started. ``malloc_trim(0)`` (what glibc itself does
for the heap top, applied to every free block) brought the peak to 0.45-0.47 GiB.
It is not free: the pages it hands back are faulted in again when later buffers
reuse them (the step took 1.18-1.26x of no offloading with it, 1.07x without, at
24% against 40% of the activation memory; BENCHMARKS.md). Memory is what offloading
is for, so it is on by default: the I/O threads call it after every
``release_heap_every`` bytes they move; ``0`` turns it off. Elsewhere than glibc
this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

__all__ = [
    "GLIBC_MMAP_THRESHOLD",
    "HeapReleaser",
    "malloc_trim",
    "release_mmap_threshold",
    "set_mmap_threshold",
]

log = logging.getLogger("tensorstore_hooks")


def _find_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


malloc_trim = _find_malloc_trim()
"""glibc's ``malloc_trim(pad)``, or ``None`` where the C library has none."""

# NOTE [ Mmap threshold ]
# glibc serves a malloc of at least M_MMAP_THRESHOLD bytes with its own mmap and
# gives it back to the OS at free. The threshold starts at 128 KiB but is dynamic:
# each free of an mmapped block raises it to that block's size (up to 32 MiB), so
# after the first step a training loop's 8-32 MiB activations and read buffers come
# from heaps, and freed ones stay mapped wherever a live block sits above them (in
# every I/O thread's arena too) until a ``malloc_trim``. Setting the threshold once
# (``mallopt(M_MMAP_THRESHOLD, n)``) also turns the dynamic rise off: every buffer of
# at least ``n`` bytes leaves RSS the moment it is freed. Measured on the train-step
# benchmark (reduced: batch 2, honest whole-run memory, benchmarks/notes-cpu.md):
# tsh-disk 46% of no offloading without it, 29% with 1 MiB. The price is page faults
# on every such allocation (the kernel zeroes fresh pages), in torch's own kernels
# too. It is process-wide (glibc has no per-thread or per-call setting), so it lasts
# only while some pipeline moves bytes (NOTE [ Process-wide effects ] in
# runtime/_effects.py): a pipeline that stores nothing (an ``auto`` budget with room)
# never sets it. Once set, glibc cannot turn its dynamic threshold on again; what comes
# closest is the ceiling the dynamic rule climbs to (32 MiB, and a trim threshold of
# twice that), which :func:`release_mmap_threshold` sets when the last pipeline that
# moved bytes stops: big buffers come from the heap again, as after a process's first
# large frees without the library. ``pipeline.mmap_threshold: null`` leaves glibc alone.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
GLIBC_MMAP_THRESHOLD = 128 << 10
"""glibc's initial ``M_MMAP_THRESHOLD`` (``DEFAULT_MMAP_THRESHOLD_MIN``)."""
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20
"""The ceiling of glibc's dynamic ``M_MMAP_THRESHOLD`` (HEAP_MAX_SIZE / 2 on 64-bit)."""


def _find_mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).mallopt  # glibc only
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


# Found once: find_library runs ``ldconfig -p`` in a subprocess (a fork of the whole
# training process, milliseconds of the training thread's time), and the threshold is
# set and given back every step a pipeline idles between (NOTE [ Idle hooks ]).
_mallopt_fn = _find_mallopt()


def _mallopt(param: int, value: int) -> bool:
    if _mallopt_fn is None:
        return False
    return bool(_mallopt_fn(param, value))


def set_mmap_threshold(nbytes: int) -> bool:
    """``mallopt(M_MMAP_THRESHOLD, nbytes)`` for this process (glibc; else a no-op).

    See NOTE [ Mmap threshold ]. Returns whether glibc took it.
    """
    if not 0 < nbytes <= GLIBC_MMAP_THRESHOLD_MAX:
        return False
    return _mallopt(_M_MMAP_THRESHOLD, nbytes)


def release_mmap_threshold() -> bool:
    """Give glibc the thresholds its dynamic rule climbs to (``M_MMAP_THRESHOLD`` 32 MiB,
    ``M_TRIM_THRESHOLD`` 64 MiB): the closest to "never set" glibc allows once
    :func:`set_mmap_threshold` ran (NOTE [ Mmap threshold ]). Returns whether it took."""
    mmap = set_mmap_threshold(GLIBC_MMAP_THRESHOLD_MAX)
    return _mallopt(_M_TRIM_THRESHOLD, 2 * GLIBC_MMAP_THRESHOLD_MAX) and mmap


class HeapReleaser:
    """Calls ``malloc_trim(0)`` once every ``every_bytes`` bytes reported by :meth:`note`.

    ``every_bytes == 0`` (or no glibc) disables it. Thread-safe enough for its job: a
    racing update may delay one release, never corrupt anything. Call it outside any
    lock of yours: a release walks glibc's heaps under their locks.
    """

    __slots__ = ("_every", "_moved", "_on_release", "_trim", "releases")

    def __init__(
        self,
        every_bytes: int,
        trim: Callable[[int], int] | None = malloc_trim,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self._every = every_bytes if trim is not None else 0
        self._trim = trim
        self._on_release = on_release  # told after each release (the pipeline's counter)
        self._moved = 0
        self.releases = 0

    @property
    def enabled(self) -> bool:
        """Whether this releaser calls ``malloc_trim`` at all."""
        return bool(self._every)

    def note(self, nbytes: int) -> None:
        """Count ``nbytes`` moved by an I/O thread; release the heap when due."""
        if not self._every:
            return
        self._moved += nbytes
        if self._moved >= self._every:
            self._moved = 0
            self.releases += 1
            if self._on_release is not None:
                self._on_release()
            assert self._trim is not None
            try:
                self._trim(0)
            except Exception:  # pragma: no cover - a libc call that fails changes nothing
                log.debug("malloc_trim failed", exc_info=True)
