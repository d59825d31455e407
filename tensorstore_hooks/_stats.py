"""OffloadStats: what the offload hooks did, readable during and after a run."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["OffloadStats", "RouteStats"]


@dataclass(slots=True)
class RouteStats:
    """Counts for one action or one policy rule."""

    tensors: int = 0
    bytes: int = 0


@dataclass(slots=True)
class OffloadStats:
    """Counters of one :class:`~tensorstore_hooks.OffloadHooks` session.

    Updated by the hooks and background threads as they go, so reading them while
    backward runs is fine (each field is individually current). Sizes are payload
    bytes, times are seconds.
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
    """Saves of a tensor already saved in this session (written once)."""
    tail_hits: int = 0
    """Unpacks served from memory because the write had not finished (write cancelled)."""
    heap_releases: int = 0
    """Times the I/O threads handed freed heap memory back to the OS (``release_heap_every``)."""
    pinned_allocations: int = 0
    """Pinned host buffers allocated for CUDA staging (pooled: flat after the first step)."""
    per_action: dict[str, RouteStats] = field(default_factory=dict)
    """``keep``/``host``/``store`` -> counts, as the policy decided."""
    per_rule: dict[str, RouteStats] = field(default_factory=dict)
    """Policy rule label (``"rules[0] module=*.lm_head"``, ``"default"``, ...) -> counts."""

    def summary(self) -> str:
        """One line for logs."""
        from ._units import format_bytes

        return (
            f"offloaded {self.tensors_offloaded} ({format_bytes(self.bytes_offloaded)}), "
            f"kept {self.tensors_kept} ({format_bytes(self.bytes_kept)}), "
            f"host {self.tensors_host}, fallbacks {self.fallbacks}, "
            f"read {format_bytes(self.bytes_read)}, prefetch {self.prefetch_hits}/"
            f"{self.prefetch_hits + self.prefetch_misses} hits, "
            f"stalls pack {self.pack_stall_s:.3f}s unpack {self.unpack_stall_s:.3f}s"
        )
