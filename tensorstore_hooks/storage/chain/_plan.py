"""A tier chain's cycle planner: NOTE [ Tier chain ] Rule 8 (planned puts).

A *cycle* runs from the chain being empty to it being empty again (a training step:
forward fills it, backward empties it); the most bytes held at once is that cycle's
size. From the second cycle on, :meth:`CyclePlan.tier_for` names the tier a put would
end up in after Rules 2-3 moved it down, so the put is written there straight away;
:meth:`CyclePlan.landed` counts where it was written, and :meth:`CyclePlan.set_aside`
drops the plan for the rest of a cycle whose planned tiers refuse the writes.
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

    __slots__ = ("aside", "cycle_bytes", "cycle_peak", "enabled", "fallbacks", "planned_puts")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.cycle_bytes = 0
        """The last finished cycle's size; 0 before the first cycle ends."""
        self.cycle_peak = 0
        """The current cycle's size so far."""
        self.planned_puts = 0
        """Planned puts written below the first tier (:meth:`landed`)."""
        self.fallbacks = 0
        """Planned puts that every tier from the planned one down refused, tried in the
        tiers above instead (:meth:`set_aside`)."""
        self.aside = False
        """The plan is set aside until this cycle ends: every put is unplanned."""

    def held(self, nbytes: int) -> None:
        """The chain holds ``nbytes`` now (call after each put it keeps)."""
        self.cycle_peak = max(self.cycle_peak, nbytes)

    def emptied(self) -> None:
        """The chain holds nothing now (call after a delete emptied it): a cycle ends,
        unless nothing was put since the last one ended. Either way the next put plans
        again (the tiers that refused may be back)."""
        self.aside = False
        if self.cycle_peak:
            self.cycle_bytes, self.cycle_peak = self.cycle_peak, 0

    def landed(self, planned: int, tier: int) -> None:
        """A put :meth:`tier_for` planned to tier ``planned`` was written to ``tier``:
        it counts as planned only where it landed below the first tier (one that fell
        back to the first tier is an ordinary put there)."""
        if planned and tier:
            self.planned_puts += 1

    def set_aside(self) -> None:
        """A planned put fell back above its planned tier: that tier and all below it
        refused the write (e.g. the object store is down). Until the cycle ends every
        put takes the first tier's path, so the rest of the cycle does not try a tier
        that is failing before each write to one that has room; the cycle's size is
        what the chain held, so the next cycle's plan is made for what the tiers took."""
        self.aside = True
        self.fallbacks += 1

    def tier_for(self, nbytes: int, held: int, budgets: Sequence[int]) -> int:
        """The tier a put of ``nbytes`` should be written to, while the chain holds
        ``held`` bytes; ``budgets``: the bytes each tier but the last may hold.

        0 (the first tier) when planning is off, no cycle has ended yet or the plan is
        set aside; otherwise the first tier that, with all tiers above it, holds this put
        and all the last cycle saved after it (``len(budgets)``, the last tier, when
        none does). Counts nothing: :meth:`landed` does, once the put is written."""
        if not self.enabled or not self.cycle_bytes or self.aside:
            return 0
        after = self.cycle_bytes - held - nbytes  # bytes the last cycle saved after it
        above = 0
        where = len(budgets)
        for i, budget in enumerate(budgets):
            above += budget
            if after + nbytes <= above:  # it and all that follows fit in the tiers so far
                where = i
                break
        return where
