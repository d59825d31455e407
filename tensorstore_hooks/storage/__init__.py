"""Stores: the :class:`TensorStore` API with its declared capabilities, the registry
behind ``open_store`` (one entry per URL scheme), URLs and the one retry loop;
the backends live in ``zarr/``, ``io/``, ``chain/`` and ``daemon/``.
"""

from __future__ import annotations

from tensorstore_hooks.storage._registry import (
    chain_from_settings,
    check_packages,
    check_url,
    open_store,
    options_from_config,
    register_store,
)
from tensorstore_hooks.storage._retry import (
    Retrier,
    RetriesExhausted,
    RetryPolicy,
    classify_store_read,
)
from tensorstore_hooks.storage._store import BlobStore, TensorStore
from tensorstore_hooks.storage._urls import (
    DAEMON_SCHEMES,
    DEFAULT_PORT,
    BadURLError,
    scheme_of,
    split_url,
)

__all__ = [
    "BadURLError",
    "BlobStore",
    "DAEMON_SCHEMES",
    "DEFAULT_PORT",
    "Retrier",
    "RetriesExhausted",
    "RetryPolicy",
    "TensorStore",
    "chain_from_settings",
    "check_packages",
    "check_url",
    "classify_store_read",
    "open_store",
    "options_from_config",
    "register_store",
    "scheme_of",
    "split_url",
]
