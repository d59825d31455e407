"""The ``device_budget`` planner: which saved tensors stay, given what a forward saves.

Pure bookkeeping, no torch: the pipeline reports every saved tensor (its size and
whether the rules would move it) and the start of each backward; the planner answers
keep or move. See NOTE [ Device budget plan ].

NOTE [ Device budget plan ]
Rules, numbered so code can cite them:

1. A *forward* is the run of packs between two backward passes: it starts with the
   first pack after an unpack (or the pipeline's first pack) and ends at the next
   unpack. Entering or leaving the hooks does not end one, so ``offload()`` around a
   whole model, ``wrap()`` entering once per block, and several ``with`` blocks per
   step all give the same forwards. Gradient accumulation (forward, backward,
   forward, backward) gives one forward per micro-batch; several forwards before
   one backward (losses summed) are one forward. ``retain_graph`` backward passes
   only unpack, so they never start a forward.
2. Only tensors the rules would move off their device (``store`` or ``host``)
   count. Parameters, tensors below ``min_bytes`` and ``keep`` rules are kept by the
   rules and are not the plan's to spend the budget on.
3. The first forward of a pipeline follows the rules and records, in pack order, the
   sizes of the tensors that count (its *trace*).
4. At the end of a forward whose trace differs from the recorded one (another
   length, or another size anywhere) the new trace replaces it and the plan is made
   again (``replans`` counts it). A forward whose trace matches keeps the plan.
5. The plan keeps the newest tensors of the trace, newest first, as long as their
   running total fits the budget, and moves the rest: a contiguous tail. It stops at
   the first tensor that does not fit rather than skipping it for older, smaller
   ones: backward then consumes the kept tail while the prefetcher reads the stored
   run behind it in one sweep, with no read stall at backward's start.
6. While a forward runs, its ``i``-th counting tensor follows the plan's ``i``-th
   decision only while the forward still matches the trace up to ``i``; from the
   first size that differs (or past the trace's end) the forward follows the rules
   (rule 3's behaviour) until it ends. So a changed model never overspends the
   budget: at worst it offloads more than it needed to for one forward.
7. Deterministic: the decisions depend only on the sequence of sizes and the
   budget, never on timing.

The budget the plan spends is what the pipeline gives it: ``device_budget`` minus the
windows that live in the same memory (see NOTE [ Windows ] in ``_windows.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["BudgetPlanner", "plan_keep"]


def plan_keep(sizes: Sequence[int], budget_bytes: int) -> int:
    """How many of the newest entries of ``sizes`` (pack order) fit ``budget_bytes``.

    The kept tensors are ``sizes[len(sizes) - n:]``: rule 5 of NOTE [ Device budget plan ].
    """
    total = 0
    n = 0
    for size in reversed(sizes):
        if total + size > budget_bytes:
            break
        total += size
        n += 1
    return n


class BudgetPlanner:
    """Keep/move decisions for the tensors of each forward under a byte budget.

    Not thread-safe: the budget control calls it under its own lock. ``budget_bytes`` may
    be changed between forwards (:meth:`set_budget`); the plan is then made again at
    the next forward's start.
    """

    __slots__ = (
        "_budget",
        "_current",
        "_forwarding",
        "_keep_from",
        "_matching",
        "_trace",
        "forwards",
        "replans",
    )

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"BudgetPlanner: budget_bytes must be >= 0, got {budget_bytes}")
        self._budget = budget_bytes
        self._trace: list[int] | None = None  # recorded trace (rule 3); None before the first
        self._keep_from = 0  # trace positions >= this are kept (rule 5)
        self._current: list[int] = []  # the running forward's trace so far
        self._matching = True  # rule 6: the running forward still matches the trace
        self._forwarding = False
        self.forwards = 0
        """Forwards finished (rule 1)."""
        self.replans = 0
        """Plans made again because a forward's trace changed (rule 4)."""

    # ------------------------------------------------------------------ inputs
    def decide(self, nbytes: int, counts: bool) -> bool:
        """Report one saved tensor in pack order; ``True``: keep it (the plan says so).

        ``counts``: the rules would move it (rule 2). For a tensor that does not count
        the answer is always ``False`` (the rules decide it, not the plan).
        """
        if not self._forwarding:
            self._forwarding = True
            self._current = []
            self._matching = self._trace is not None
        if not counts:
            return False
        i = len(self._current)
        self._current.append(nbytes)
        trace = self._trace
        if not self._matching or trace is None:
            return False
        if i >= len(trace) or trace[i] != nbytes:
            self._matching = False  # rule 6
            return False
        return i >= self._keep_from

    def backward_started(self) -> None:
        """An unpack ran: the running forward (if any) is over (rule 1)."""
        if not self._forwarding:
            return
        self._forwarding = False
        self.forwards += 1
        current, self._current = self._current, []
        if self._trace is not None and current != self._trace:
            self.replans += 1  # rule 4
        if self._trace is None or current != self._trace:
            self._trace = current  # rules 3 and 4
        self._replan()  # also applies a budget changed during the forward

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget the plan spends; takes effect from the next forward on."""
        if budget_bytes < 0:
            raise ValueError(f"BudgetPlanner: budget_bytes must be >= 0, got {budget_bytes}")
        self._budget = budget_bytes
        if not self._forwarding:  # a running forward keeps its plan (rule 6)
            self._replan()

    def _replan(self) -> None:
        trace = self._trace or []
        self._keep_from = len(trace) - plan_keep(trace, self._budget)

    # ------------------------------------------------------------------ reading
    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def trace(self) -> tuple[int, ...] | None:
        """The recorded sizes (pack order) the plan is made from; ``None`` before one."""
        return None if self._trace is None else tuple(self._trace)

    @property
    def kept(self) -> tuple[int, ...]:
        """Sizes the plan keeps, oldest first (a tail of :attr:`trace`)."""
        return tuple((self._trace or [])[self._keep_from :])

    @property
    def forward_bytes(self) -> int:
        """Bytes the last recorded forward saved in tensors that count (0 before one)."""
        return sum(self._trace or ())

    @property
    def largest_bytes(self) -> int:
        """The largest counting tensor seen in the recorded or the running forward."""
        return max(max(self._trace or (0,)), max(self._current or (0,)))
