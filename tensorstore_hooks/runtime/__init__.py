"""Process-wide matters: effects that live only while a pipeline does (signal
shield, mmap threshold, heap release), the memory there is, fork safety, and the
frames dynamo must never compile.
"""

from __future__ import annotations

from tensorstore_hooks.runtime._eager import never_compiled
from tensorstore_hooks.runtime._effects import PipelineEffects, say_once, shield_signals
from tensorstore_hooks.runtime._forks import foreign
from tensorstore_hooks.runtime._heap import HeapReleaser
from tensorstore_hooks.runtime._memory import MemoryProbe, MemoryReading, SystemMemory
from tensorstore_hooks.runtime._signals import shielded

__all__ = [
    "HeapReleaser",
    "MemoryProbe",
    "MemoryReading",
    "PipelineEffects",
    "SystemMemory",
    "foreign",
    "never_compiled",
    "say_once",
    "shield_signals",
    "shielded",
]
