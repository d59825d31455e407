"""Budget control of one pipeline: the planner and the derived windows, wired as one unit.

The router asks :meth:`BudgetControl.keep` for every tensor the policy has decided
(between its ``decide`` and ``account``) and calls :meth:`BudgetControl.backward_started`
on every unpack; the control tells the write-behind and the prefetcher their
windows through the ``apply`` callback. What it decides: NOTE [ Device budget plan ]
(``_planner.py``) and NOTE [ Windows ] (``_windows.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ._planner import BudgetPlanner, plan_keep
from ._windows import DEFAULT_MAX_INFLIGHT, DEFAULT_PREFETCH, Windows, derive_windows

if TYPE_CHECKING:
    from ._config import PipelineSettings
    from ._policy import Policy
    from ._stats import OffloadStats

__all__ = [
    "BUDGET_LABEL",
    "BudgetControl",
    "derive_windows",
    "pinned_idle_cap",
    "plan_keep",
]

BUDGET_LABEL = "device_budget"
"""The stats label (``stats.per_rule``) of tensors the plan kept."""

_MOVES = frozenset(("store", "host"))


class _WritesBehind(Protocol):
    max_inflight: int


class _ReadsAhead(Protocol):
    window_bytes: int


class BudgetControl:
    """Keeps the newest tensors within ``device_budget`` and sizes the windows.

    ``max_inflight`` / ``prefetch``: the user's sizes or ``None`` (derived).
    ``apply(windows)`` is called whenever the windows change (on the thread that
    packs or unpacks; keep it cheap). ``stats.replans`` (when given) follows the
    planner's count. Thread-safe.
    """

    def __init__(
        self,
        *,
        device_budget: int | None,
        host_budget: int,
        max_inflight: int | None,
        prefetch: int | None,
        apply: Callable[[Windows], None],
        stats: OffloadStats | None = None,
    ) -> None:
        self.device_budget = device_budget
        self.host_budget = host_budget
        self._user_inflight = max_inflight
        self._user_prefetch = prefetch
        self._apply = apply
        self._stats = stats
        self._lock = threading.Lock()
        # Without a device budget the planner still records the trace the windows
        # are derived from; its decisions are then ignored.
        self.planner = BudgetPlanner(0)
        self._accelerator = False
        self._seen = 0  # bytes of counting tensors in the running forward
        self._largest = 0
        self._forwarding = False
        self.windows = self._derive(0, 0)
        apply(self.windows)

    @classmethod
    def for_pipeline(
        cls,
        policy: Policy,
        settings: PipelineSettings,
        writer: _WritesBehind,
        prefetcher: _ReadsAhead,
        stats: OffloadStats,
    ) -> BudgetControl:
        """The control of a pipeline: sets ``writer.max_inflight`` and
        ``prefetcher.window_bytes`` (now, and whenever the windows change)."""

        def apply(windows: Windows) -> None:
            writer.max_inflight = windows.max_inflight
            prefetcher.window_bytes = windows.prefetch

        return cls(
            device_budget=policy.device_budget,
            host_budget=settings.host_budget,
            max_inflight=settings.max_inflight,
            prefetch=settings.prefetch,
            apply=apply,
            stats=stats,
        )

    @property
    def derives(self) -> bool:
        """Whether any window is derived (not given by the user)."""
        return self._user_inflight is None or self._user_prefetch is None

    def keep(self, action: str, nbytes: int, *, accelerator: bool) -> bool:
        """One saved tensor the policy sent to ``action``; ``True``: the plan keeps it.

        Only ``store`` and ``host`` tensors count (rule 2 of NOTE [ Device budget plan ]).
        """
        counts = action in _MOVES
        with self._lock:
            self._forwarding = True
            keep = self.planner.decide(nbytes, counts)
            if not counts:
                return False
            self._accelerator = accelerator
            self._seen += nbytes
            self._largest = max(self._largest, nbytes)
            if self.planner.trace is None and self.derives:
                # First forward: the windows grow with what it has saved (NOTE [ Windows ]
                # rule 1); two integer assignments when they change.
                self._set(self._derive(self._seen, self._largest))
            return keep and self.device_budget is not None

    def backward_started(self) -> bool:
        """An unpack ran. ``True`` when it ended a forward (the first unpack of a backward)."""
        if not self._forwarding:  # the common case: one bool read per unpack
            return False
        with self._lock:
            if not self._forwarding:
                return False
            self._forwarding = False
            self.planner.backward_started()
            if self._stats is not None:
                self._stats.replans = self.planner.replans
            self._seen = 0
            trace = self.planner.trace or ()
            windows = self._derive(sum(trace), max(trace, default=0))
            if windows.plan_budget is not None:
                self.planner.set_budget(windows.plan_budget)
            self._set(windows)
            return True

    @property
    def replans(self) -> int:
        return self.planner.replans

    def _derive(self, seen: int, largest: int) -> Windows:
        return derive_windows(
            seen_bytes=seen,
            largest_bytes=largest,
            max_inflight=self._user_inflight,
            prefetch=self._user_prefetch,
            device_budget=self.device_budget,
            host_budget=self.host_budget,
            accelerator=self._accelerator,
        )

    def _set(self, windows: Windows) -> None:
        if windows != self.windows:
            self.windows = windows
            self._apply(windows)


def pinned_idle_cap(settings: PipelineSettings) -> int:
    """Idle pinned staging buffers a pipeline keeps: both windows at their largest."""
    mi = DEFAULT_MAX_INFLIGHT if settings.max_inflight is None else settings.max_inflight
    pf = DEFAULT_PREFETCH if settings.prefetch is None else settings.prefetch
    return int(mi + pf)
