"""The pipeline behind one ``OffloadHooks``: the router (keep / host / store for each
saved tensor), the record table, write-behind, prefetch, the I/O pool, device
staging and the host tier, budgets, stats and the timeline.
"""

from __future__ import annotations

from tensorstore_hooks.pipeline._budgets import (
    BUDGET_LABEL,
    PlanMemory,
    derive_windows,
    plan_keep,
)
from tensorstore_hooks.pipeline._iopool import READ, WRITE, IOPool
from tensorstore_hooks.pipeline._ledger import DecisionLedger, Forward
from tensorstore_hooks.pipeline._pipeline import Pipeline
from tensorstore_hooks.pipeline._records import Handle
from tensorstore_hooks.pipeline._router import Host, Kept, Router
from tensorstore_hooks.pipeline._staging import CopyEvent, CudaOps, DeviceOps, PinnedPool
from tensorstore_hooks.pipeline._stats import OffloadStats, RouteStats
from tensorstore_hooks.pipeline._timeline import Timeline

__all__ = [
    "BUDGET_LABEL",
    "CopyEvent",
    "CudaOps",
    "DeviceOps",
    "Handle",
    "Host",
    "Forward",
    "IOPool",
    "Kept",
    "DecisionLedger",
    "OffloadStats",
    "PinnedPool",
    "Pipeline",
    "PlanMemory",
    "READ",
    "RouteStats",
    "Router",
    "Timeline",
    "WRITE",
    "derive_windows",
    "plan_keep",
]
