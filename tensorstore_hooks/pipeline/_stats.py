"""OffloadStats: what the offload hooks did, readable during and after a run.

Per-step figures: ``before = hooks.stats.snapshot()`` ... ``hooks.stats - before``
(or ``hooks.stats.since(before)``) is what happened in between; or
``hooks.stats.reset()`` between steps.

NOTE [ Counts that add up ]
Every tensor autograd saves under the hooks is counted exactly once at pack:

    saves = tensors_offloaded + tensors_kept + tensors_host + dedup_hits + recomputed

(a write that fails later moves its tensor from offloaded to kept and counts a
fallback; a dedup hit is a save of a tensor already offloaded by these hooks,
which costs no new write; a recomputed tensor is a parameter's cast, made again at
unpack: NOTE [ Parameter casts ]). Every unpack of an offloaded tensor counts one of

    prefetch_hits + prefetch_misses + tail_hits + reuse_hits

(a tail hit: served from memory because its write had not finished, which cancels
the write; later unpacks of that tensor, and unpacks of a fallback's, are served
from memory without a count; a reuse hit: served by what an earlier unpack of the
same record brought back, still alive).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorstore_hooks.storage import TensorStore

__all__ = ["OffloadStats", "RouteStats", "count_transfer"]


@dataclass(slots=True)
class RouteStats:
    """Counts for one action or one policy rule."""

    tensors: int = 0
    bytes: int = 0


# Fields that are levels, high-water marks or settings, not counts: a delta keeps the
# later value. Settings in force also survive reset().
_SETTINGS = frozenset({"effective_device_budget", "effective_host_budget", "direct_io"})
_LEVELS = frozenset(
    {
        "held_bytes",
        "peak_held_bytes",
        "peak_host_tier_bytes",
        *_SETTINGS,
    }
)


@dataclass(slots=True)
class OffloadStats:
    """Counters of one :class:`~tensorstore_hooks.OffloadHooks` (its pipeline).

    Updated by the hooks and background threads as they go, so reading them while
    backward runs is fine (each field is individually current). Sizes are payload
    bytes, times are seconds. How the counts add up: NOTE [ Counts that add up ]
    in ``tensorstore_hooks.pipeline._stats``.
    """

    tensors_offloaded: int = 0
    """Saved tensors whose bytes went to the store."""
    bytes_offloaded: int = 0
    tensors_kept: int = 0
    """Saved tensors left where they were (policy ``keep``, small, parameters, unsupported)."""
    bytes_kept: int = 0
    fallbacks: int = 0
    """Tensors kept in memory because the store refused or failed their write."""
    bytes_read: int = 0
    """Bytes read back from the store during backward."""
    prefetch_hits: int = 0
    """Unpacks served by a read that was already finished or running ahead."""
    prefetch_misses: int = 0
    """Unpacks that had to start their own read."""
    pack_stall_s: float = 0.0
    """Time pack spent blocked because ``max_inflight`` bytes were being written."""
    unpack_stall_s: float = 0.0
    """Time unpack spent waiting for bytes to arrive from the store."""
    tensors_host: int = 0
    """Saved tensors moved to (pinned) host memory by a ``host`` rule."""
    bytes_host: int = 0
    dedup_hits: int = 0
    """Saves of a tensor already saved under these hooks (written once)."""
    recomputed: int = 0
    """Saved parameter casts (autocast's weight casts, ``.to(dtype)`` of a parameter)
    made again at unpack instead of moved (NOTE [ Parameter casts ])."""
    bytes_recomputed: int = 0
    tail_hits: int = 0
    """Unpacks served from memory because the write had not finished (write cancelled)."""
    reuse_hits: int = 0
    """Unpacks served by the tensor an earlier unpack of the same record brought back,
    still alive: one copy back per record (rule 8 of NOTE [ Record lifecycle ])."""
    bytes_written: int = 0
    """Bytes that reached the store (writes cancelled by a tail hit or a freed graph
    before they started are not written at all): what the records moved, each view
    of one storage once (NOTE [ Span unions ]). ``bytes_offloaded`` is the payload (the
    saved tensors' elements) beside it."""
    write_s: float = 0.0
    """Time writer threads spent writing to the store (summed over threads)."""
    read_s: float = 0.0
    """Time spent reading from the store (summed over reader threads)."""
    bytes_to_host: int = 0
    """Bytes copied from an accelerator to host memory (pinned or pageable)."""
    bytes_to_device: int = 0
    """Bytes copied from host memory back to an accelerator."""
    direct_io: str = ""
    """How the Zarr store moves chunk files: ``"on"`` (``O_DIRECT``: offloaded bytes
    skip the page cache), ``"off (why)"`` (e.g. tmpfs, ``direct_io="off"``, not a
    local directory), or ``""`` for a store of another kind (NOTE [ Direct I/O ])."""
    bytes_direct: int = 0
    """Of ``bytes_written`` + ``bytes_read``: bytes moved with ``O_DIRECT``."""
    bytes_buffered: int = 0
    """Of ``bytes_written`` + ``bytes_read``: bytes a Zarr store moved without
    ``O_DIRECT`` (through the page cache, or to memory or an object store; on a direct
    store: size classes under 256 KiB and compressed stores)."""
    held_bytes: int = 0
    """Bytes of offloaded tensors the pipeline holds in memory right now: waiting to
    be written, or read ahead and not yet unpacked."""
    peak_held_bytes: int = 0
    """The highest ``held_bytes`` since the hooks were made (or the last ``reset()``)."""
    replans: int = 0
    """Forwards that saved sizes the ``device_budget`` plan had not seen among its last
    few forwards (tensors the plan kept are counted under the ``per_rule`` label
    ``"device_budget"`` and in ``bytes_kept``). NOTE [ Device budget plan ]."""
    effective_device_budget: int | None = None
    """The ``device_budget`` in force, bytes: as given, or as ``auto`` / ``"60%"`` last
    derived it (``None``: no budget, or not derived yet: the first forward)."""
    effective_host_budget: int = 0
    """The ``host_budget`` in force, bytes: as given or as last derived."""
    heap_releases: int = 0
    """Times the I/O threads handed freed heap memory back to the OS (``release_heap_every``)."""
    pinned_allocations: int = 0
    """Pinned host buffers allocated for CUDA staging (pooled: flat after the first step)."""
    tensors_spilled: int = 0
    """Tensors the host tier wrote to the store to make room (``host_budget``), oldest
    first; the rest of what it held never touched the store."""
    bytes_spilled: int = 0
    peak_host_tier_bytes: int = 0
    """The most pinned bytes the host tier had at once (at most ``host_budget``)."""
    per_action: dict[str, RouteStats] = field(default_factory=dict)
    """``keep``/``host``/``store`` -> counts, as the policy decided."""
    per_rule: dict[str, RouteStats] = field(default_factory=dict)
    """Policy rule label (``"rules[0] module=*.lm_head"``, ``"default"``, ...) -> counts."""

    def hold(self, delta_bytes: int) -> None:
        """The pipeline holds ``delta_bytes`` more (or fewer) in memory; tracks the peak.

        Called under the record table's lock (writes in flight, reads ahead).
        """
        held = self.held_bytes + delta_bytes
        self.held_bytes = held
        if held > self.peak_held_bytes:
            self.peak_held_bytes = held

    # ------------------------------------------------------------ per step
    def snapshot(self) -> OffloadStats:
        """A copy of the counters now (to subtract later: ``stats - snap``)."""
        return copy.deepcopy(self)

    def since(self, earlier: OffloadStats) -> OffloadStats:
        """What happened after ``earlier`` (a :meth:`snapshot`): counters subtracted.

        ``held_bytes`` and ``peak_held_bytes`` are levels: the result has the
        current values (the peak is the pipeline's, or since the last ``reset()``).
        """
        out = OffloadStats()
        for f in dataclasses.fields(self):
            name = f.name
            now = getattr(self, name)
            if name in _LEVELS:
                setattr(out, name, now)
            elif isinstance(now, dict):
                before = getattr(earlier, name)
                table = {}
                for key, route in now.items():
                    old = before.get(key, RouteStats())
                    delta = RouteStats(route.tensors - old.tensors, route.bytes - old.bytes)
                    if delta.tensors or delta.bytes:
                        table[key] = delta
                setattr(out, name, table)
            else:
                setattr(out, name, now - getattr(earlier, name))
        return out

    def __sub__(self, earlier: OffloadStats) -> OffloadStats:
        return self.since(earlier)

    def reset(self) -> None:
        """Zero every counter (call between steps); the peak restarts from what is held now.

        Background writes still running count into the new period. The effective
        budgets are settings in force, not counts: they stay.
        """
        for f in dataclasses.fields(self):
            name = f.name
            if name in _SETTINGS or name == "held_bytes":
                continue
            if name == "peak_held_bytes":
                self.peak_held_bytes = self.held_bytes
            elif isinstance(getattr(self, name), dict):
                getattr(self, name).clear()
            else:
                setattr(self, name, type(getattr(self, name))())

    # ------------------------------------------------------------- report
    @property
    def tensors_saved(self) -> int:
        """Every save the hooks saw: offloaded + kept + host + dedup hits + recomputed."""
        return (
            self.tensors_offloaded
            + self.tensors_kept
            + self.tensors_host
            + self.dedup_hits
            + self.recomputed
        )

    def summary(self) -> str:
        """Every counter on one line, for logs (NOTE [ Counts that add up ])."""
        from tensorstore_hooks._units import format_bytes as b

        unpacks = self.prefetch_hits + self.prefetch_misses + self.tail_hits + self.reuse_hits

        def rate(nbytes: int, secs: float) -> str:
            return f", {b(int(nbytes / secs))}/s" if secs > 0 and nbytes else ""

        return (
            f"saved {self.tensors_saved} = offloaded {self.tensors_offloaded} "
            f"({b(self.bytes_offloaded)}) + kept {self.tensors_kept} ({b(self.bytes_kept)}, "
            f"{self.fallbacks} fallbacks) + host {self.tensors_host} ({b(self.bytes_host)}) + "
            f"dedup {self.dedup_hits} + recomputed {self.recomputed} "
            f"({b(self.bytes_recomputed)}); "
            f"unpacked {unpacks} = prefetch hits {self.prefetch_hits} + misses "
            f"{self.prefetch_misses} + tail {self.tail_hits} + reuse {self.reuse_hits}; "
            f"written {b(self.bytes_written)} in {self.write_s:.3f}s"
            f"{rate(self.bytes_written, self.write_s)}, "
            f"read {b(self.bytes_read)} in {self.read_s:.3f}s{rate(self.bytes_read, self.read_s)}; "
            f"stalls pack {self.pack_stall_s:.3f}s unpack {self.unpack_stall_s:.3f}s; "
            f"peak held {b(self.peak_held_bytes)}"
            + (
                f"; direct I/O {self.direct_io}: {b(self.bytes_direct)} direct, "
                f"{b(self.bytes_buffered)} buffered"
                if self.direct_io
                else ""
            )
            + (f"; device_budget replans {self.replans}" if self.replans else "")
            + (
                f"; device_budget {b(self.effective_device_budget)}"
                if self.effective_device_budget is not None
                else ""
            )
            + (
                f"; host_budget {b(self.effective_host_budget)}"
                if self.effective_host_budget
                else ""
            )
            + (
                f"; host tier peak {b(self.peak_host_tier_bytes)}, spilled "
                f"{self.tensors_spilled} ({b(self.bytes_spilled)})"
                if self.peak_host_tier_bytes
                else ""
            )
        )


def count_transfer(stats: OffloadStats, store: TensorStore, key: str, nbytes: int) -> None:
    """Count ``nbytes`` of ``key`` moved to or from ``store`` as ``bytes_direct`` or
    ``bytes_buffered`` (a store whose ``moves_direct`` says nothing counts neither).
    The caller holds its lock on ``stats``."""
    try:
        direct = store.moves_direct(key)
    except Exception:  # the key was deleted meanwhile: nothing to count
        return
    if direct is None:
        return
    if direct:
        stats.bytes_direct += nbytes
    else:
        stats.bytes_buffered += nbytes
