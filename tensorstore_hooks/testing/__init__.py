"""Conformance suites shipped for users' stores (``StoreConformance``, ``ChunkIOConformance``)."""

from __future__ import annotations

import pytest

# The suites' asserts explain their failures only if pytest rewrites them, and it
# rewrites a non-test module only when told before the module is imported.
pytest.register_assert_rewrite(
    "tensorstore_hooks.testing._store", "tensorstore_hooks.testing._chunkio"
)

from tensorstore_hooks.testing._chunkio import ChunkIOConformance  # noqa: E402
from tensorstore_hooks.testing._store import (  # noqa: E402
    ALL_DTYPES,
    LAYOUT_DTYPES,
    LAYOUTS,
    UNSUPPORTED_KINDS,
    StoreConformance,
    WrappedStore,
    assert_same_tensor,
    random_tensor,
    unsupported_tensors,
)

__all__ = [
    "ALL_DTYPES",
    "ChunkIOConformance",
    "LAYOUT_DTYPES",
    "LAYOUTS",
    "StoreConformance",
    "UNSUPPORTED_KINDS",
    "WrappedStore",
    "assert_same_tensor",
    "random_tensor",
    "unsupported_tensors",
]
