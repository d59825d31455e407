"""What :attr:`TierChain.stats <tensorstore_hooks.TierChain.stats>` returns: frozen
snapshots of a chain's tiers and of its moves, puts and plan (NOTE [ Tier chain ] in
``storage/chain/_core.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from tensorstore_hooks._units import format_bytes

__all__ = ["ChainStats", "TierStats"]


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier of a chain, at the moment :attr:`TierChain.stats` was read."""

    url: str
    budget: int | None
    """Bytes the tier may hold; ``None`` for the last tier."""
    tensors: int
    """Chain keys whose copy is in this tier now."""
    bytes: int
    """Payload bytes held now, copies being moved in or out included (Rule 1)."""
    peak_bytes: int
    """The most :attr:`bytes` this tier held at once."""
    puts: int
    """Puts that landed here."""
    bytes_put: int
    moved_in: int
    """Tensors moved here from the tier above."""
    bytes_moved_in: int
    moved_out: int
    """Tensors moved from here to a tier below."""
    bytes_moved_out: int


@dataclass(frozen=True, slots=True)
class ChainStats:
    """What a :class:`TierChain` holds and has done (a snapshot)."""

    tiers: tuple[TierStats, ...]
    moves: int
    """Tensors moved down a tier."""
    bytes_moved: int
    move_failures: int
    """Moves that failed (the tensor stayed; it is moved again later)."""
    move_s: float
    """Time movers spent moving (summed over movers)."""
    put_waits: int
    """Puts that waited for the movers to make room."""
    put_wait_s: float
    spills: int
    """Puts that went past a tier: too large for its budget, no room in time, or the
    tier refused or failed the write."""
    planned_puts: int
    """Puts written straight to a lower tier by the last cycle's size (Rule 8); a
    planned put that fell back to the first tier is not one."""
    plan_fallbacks: int
    """Planned puts that their tier and every tier below refused (Rule 8): each then
    went to a tier above with room (or, with none, back to the caller) and set the
    plan aside until the cycle ends."""
    cycle_bytes: int
    """The last finished cycle's size (Rule 8): the most bytes held at once between two
    moments the chain was empty; 0 before the first cycle ends."""

    def summary(self) -> str:
        """One line for logs."""
        tiers = "; ".join(
            f"tier {i} {t.url}: {t.tensors} tensors, {format_bytes(t.bytes)}"
            + (f" of {format_bytes(t.budget)}" if t.budget is not None else "")
            + f" (peak {format_bytes(t.peak_bytes)})"
            for i, t in enumerate(self.tiers)
        )
        return (
            f"{tiers}; moves {self.moves} ({format_bytes(self.bytes_moved)} in "
            f"{self.move_s:.3f}s, {self.move_failures} failed); puts waited {self.put_waits} "
            f"({self.put_wait_s:.3f}s), spilled past a tier {self.spills}, planned below "
            f"{self.planned_puts}, fell back above {self.plan_fallbacks} (last cycle "
            f"{format_bytes(self.cycle_bytes)})"
        )
