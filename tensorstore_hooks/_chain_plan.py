"""A tier chain's cycle planner: NOTE [ Tier chain ] Rule 8 (planned puts).

A *cycle* runs from the chain being empty to it being empty again (a training step:
forward fills it, backward empties it); the most bytes held at once is that cycle's
size. From the second cycle on, :meth:`CyclePlan.tier_for` names the tier a put would
end up in after Rules 2-3 moved it down, so the put is written there straight away.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CyclePlan"]


class CyclePlan:
    """Measures each cycle's size and places puts by the last one (Rule 8).

    Pure bookkeeping, no I/O and no lock of its own: the chain calls every method
    under its lock. Cycles are measured whether or not ``enabled`` (``cycle_bytes``
    is in the chain's stats either way); only :meth:`tier_for` looks at ``enabled``.
    """

    __slots__ = ("cycle_bytes", "cycle_peak", "enabled", "planned_puts")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.cycle_bytes = 0
        """The last finished cycle's size; 0 before the first cycle ends."""
        self.cycle_peak = 0
        """The current cycle's size so far."""
        self.planned_puts = 0
        """Puts :meth:`tier_for` sent below the first tier."""

    def held(self, nbytes: int) -> None:
        """The chain holds ``nbytes`` now (call after each put it keeps)."""
        self.cycle_peak = max(self.cycle_peak, nbytes)

    def emptied(self) -> None:
        """The chain holds nothing now (call after a delete emptied it): a cycle ends,
        unless nothing was put since the last one ended."""
        if self.cycle_peak:
            self.cycle_bytes, self.cycle_peak = self.cycle_peak, 0

    def tier_for(self, nbytes: int, held: int, budgets: Sequence[int]) -> int:
        """The tier a put of ``nbytes`` should be written to, while the chain holds
        ``held`` bytes; ``budgets``: the bytes each tier but the last may hold.

        0 (the first tier) when planning is off or no cycle has ended yet; otherwise
        the first tier that, with all tiers above it, holds this put and all the last
        cycle saved after it (``len(budgets)``, the last tier, when none does). A put
        sent below the first tier counts in :attr:`planned_puts`."""
        if not self.enabled or not self.cycle_bytes:
            return 0
        after = self.cycle_bytes - held - nbytes  # bytes the last cycle saved after it
        above = 0
        where = len(budgets)
        for i, budget in enumerate(budgets):
            above += budget
            if after + nbytes <= above:  # it and all that follows fit in the tiers so far
                where = i
                break
        if where:
            self.planned_puts += 1
        return where
