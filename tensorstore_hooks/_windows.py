"""The ``prefetch`` and ``max_inflight`` windows: sized from what the hooks have seen.

NOTE [ Windows ]
A window a user gives (``prefetch=``, ``max_inflight=``, or the YAML field) is used as
given. A window left out (``None``) is derived, again after every forward (rule 1 of
NOTE [ Device budget plan ]):

1. ``seen``: the bytes the last forward saved in tensors the rules move (the
   planner's trace), or while the first forward runs, what it has saved so far.
   ``largest``: the largest such tensor.
2. A derived window is ``seen / 8`` (about one block of a model built of blocks),
   at least ``2 * largest`` (one transfer runs while the next tensor is packed or
   consumed) and at most a fixed cap (``max_inflight`` 512 MiB, ``prefetch``
   256 MiB). Before anything was seen it is 0: the first tensors of a
   pipeline are written through, which costs the warm-up step a little time and no
   memory.
3. Windows count against the budget of the memory they live in. On a CPU tensor
   both windows hold RAM, the ``device_budget``'s memory; on an accelerator the
   prefetch window holds device memory (``device_budget``) and the write-behind
   window pinned host memory (``host_budget``, when set). A derived window takes
   at most a quarter of its budget; the plan spends what the windows leave
   (``device_budget - windows``). A given window is subtracted in full (a budget
   smaller than the given windows leaves the plan nothing: everything the rules
   move is moved).
4. The pipeline always lets one tensor through an empty window (else a tensor
   larger than the window would wait forever), so the true bound of a window is
   ``max(window, largest)``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_INFLIGHT", "DEFAULT_PREFETCH", "Windows", "derive_windows"]

DEFAULT_MAX_INFLIGHT = 512 << 20
"""Upper bound of a derived ``max_inflight``."""
DEFAULT_PREFETCH = 256 << 20
"""Upper bound of a derived ``prefetch``."""
_BLOCKS = 8  # rule 2: a forward is taken to be about this many blocks
_BUDGET_SHARE = 4  # rule 3: a derived window takes at most 1/4 of its budget


@dataclass(frozen=True, slots=True)
class Windows:
    """The windows in force and what the device plan may spend."""

    max_inflight: int
    """Bytes written behind before pack blocks."""
    prefetch: int
    """Bytes read ahead during backward."""
    plan_budget: int | None
    """Bytes the ``device_budget`` plan may keep (``None``: no device budget)."""


def _derived(seen: int, largest: int, cap: int, budget: int | None) -> int:
    size = min(max(seen // _BLOCKS, 2 * largest), cap)  # rule 2
    if budget is not None:
        size = min(size, budget // _BUDGET_SHARE)  # rule 3
    return size


def derive_windows(
    *,
    seen_bytes: int,
    largest_bytes: int,
    max_inflight: int | None,
    prefetch: int | None,
    device_budget: int | None,
    host_budget: int = 0,
    accelerator: bool = False,
) -> Windows:
    """The windows and the plan's budget per NOTE [ Windows ].

    ``max_inflight`` / ``prefetch``: the user's sizes, or ``None`` to derive them.
    ``accelerator``: the saved tensors live on a device other than the host (then
    the write-behind window lives in host memory, rule 3).
    """
    inflight_budget = (host_budget or None) if accelerator else device_budget
    mi = (
        max_inflight
        if max_inflight is not None
        else _derived(seen_bytes, largest_bytes, DEFAULT_MAX_INFLIGHT, inflight_budget)
    )
    pf = (
        prefetch
        if prefetch is not None
        else _derived(seen_bytes, largest_bytes, DEFAULT_PREFETCH, device_budget)
    )
    plan: int | None = None
    if device_budget is not None:
        plan = device_budget - pf - (0 if accelerator else mi)
        plan = max(plan, 0)
    return Windows(max_inflight=mi, prefetch=pf, plan_budget=plan)
