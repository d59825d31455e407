"""tensorstore-hooks: offload the tensors PyTorch autograd saves for backward.

During forward, saved activations go to a chunked Zarr store (local disk, memory,
any fsspec backend such as S3, or the storage daemon); in backward they are
prefetched and rehydrated onto their original device, bit-identically::

    import tensorstore_hooks as tsh

    with tsh.offload() as hooks:
        loss = model(batch).sum()
    loss.backward()
    print(hooks.stats)
"""

from __future__ import annotations

from ._codec import TensorMeta
from ._config import EffectiveConfig, load_config
from ._hooks import OffloadHooks, offload
from ._policy import Decision, Policy, Rule
from ._registry import open_store, register_store
from ._stats import OffloadStats, RouteStats
from ._store import BlobStore, TensorStore
from ._wrap import unwrap, wrap
from ._zarr_store import ZarrStore
from .errors import (
    ConfigError,
    IntegrityError,
    KeyNotFoundError,
    QuotaExceededError,
    StoreUnavailableError,
    TensorStoreError,
    UnsupportedTensorError,
)

__version__ = "0.1.0"

__all__ = [
    "BlobStore",
    "ConfigError",
    "Decision",
    "EffectiveConfig",
    "IntegrityError",
    "KeyNotFoundError",
    "OffloadHooks",
    "OffloadStats",
    "Policy",
    "QuotaExceededError",
    "RouteStats",
    "Rule",
    "StoreUnavailableError",
    "TensorMeta",
    "TensorStore",
    "TensorStoreError",
    "UnsupportedTensorError",
    "ZarrStore",
    "__version__",
    "load_config",
    "offload",
    "open_store",
    "register_store",
    "unwrap",
    "wrap",
]
