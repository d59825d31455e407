"""The ledger: what the router decided for each saved tensor, per forward.

The router tells a :class:`DecisionLedger` every decision it counts (module path, action, the
rule that decided, payload bytes) and every tensor the rules would move off its
device; ``hooks.report()`` (``hooks/_report.py``) reads the last finished forward
(NOTE [ Report ledger ]). Cheap on the pack path: one lock and one dict update per
saved tensor.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["Forward", "DecisionLedger"]


@dataclass(slots=True)
class Forward:
    rows: dict[tuple[str | None, str, str], list[int]] = field(default_factory=dict)
    """(path, action, label) -> [tensors, payload bytes], in order of first appearance."""
    moves: list[tuple[int, int]] = field(default_factory=list)
    """(device bytes, payload bytes) of each tensor the rules would move, pack order."""
    accelerator: bool = False


class DecisionLedger:
    """Decisions of one pipeline, per forward (NOTE [ Report ledger ]). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current = Forward()
        self._last: Forward | None = None
        self.forwarding = False
        """Whether a forward is being counted (:meth:`backward_started` ends it): an
        attribute, read by every unpack without a call."""
        self.forwards = 0
        """Forwards finished so far."""

    def count(self, path: str | None, action: str, label: str, nbytes: int) -> None:
        """One saved tensor got ``action`` because of ``label`` (the router's count)."""
        with self._lock:
            self.forwarding = True
            row = self._current.rows.get((path, action, label))
            if row is None:
                self._current.rows[(path, action, label)] = [1, nbytes]
            else:
                row[0] += 1
                row[1] += nbytes

    def count_moved(
        self, path: str | None, action: str, label: str, nbytes: int, device_bytes: int
    ) -> None:
        """:meth:`would_move` (of a host tensor) and :meth:`count` under one lock: the
        pack fast path's one call (NOTE [ Pack fast path ] in ``pipeline/_router.py``)."""
        with self._lock:
            self.forwarding = True
            current = self._current
            current.moves.append((device_bytes, nbytes))
            row = current.rows.get((path, action, label))
            if row is None:
                current.rows[(path, action, label)] = [1, nbytes]
            else:
                row[0] += 1
                row[1] += nbytes

    def would_move(self, device_bytes: int, nbytes: int, *, accelerator: bool) -> None:
        """The rules would move this tensor off its device (before any budget plan)."""
        with self._lock:
            self.forwarding = True
            self._current.moves.append((device_bytes, nbytes))
            self._current.accelerator = self._current.accelerator or accelerator

    def backward_started(self) -> None:
        """An unpack ran: a running forward is over (rule 1). Cheap when none runs."""
        if not self.forwarding:
            return
        with self._lock:
            if not self.forwarding:
                return
            self.forwarding = False
            self._last, self._current = self._current, Forward()
            self.forwards += 1

    def view(self) -> tuple[Forward, int, bool]:
        """A copy of the forward a report describes, its number (1-based), and whether
        it has finished."""
        with self._lock:
            if self._last is not None:
                fwd, number, finished = self._last, self.forwards, True
            else:
                fwd, number, finished = self._current, self.forwards + 1, False
            copy = Forward(
                {k: list(v) for k, v in fwd.rows.items()}, list(fwd.moves), fwd.accelerator
            )
        return copy, number, finished
