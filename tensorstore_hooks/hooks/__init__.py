"""The public entry points: ``offload()`` and ``OffloadHooks``, ``wrap()``/``unwrap()``,
their composition with checkpointing and ``torch.compile``, the module scope, and
``hooks.report()``.
"""

from __future__ import annotations

from tensorstore_hooks.hooks._offload import (
    ConfigSource,
    HooksBase,
    OffloadHooks,
    make_pipeline,
    offload,
)
from tensorstore_hooks.hooks._report import step_figures
from tensorstore_hooks.hooks._scope import ModuleScope
from tensorstore_hooks.hooks._wrap import WrapHooks, unwrap, wrap

__all__ = [
    "ConfigSource",
    "HooksBase",
    "ModuleScope",
    "OffloadHooks",
    "WrapHooks",
    "make_pipeline",
    "offload",
    "step_figures",
    "unwrap",
    "wrap",
]
