"""Conformance suites, shipped so that you can test your own store the way the library
tests its own (as ``zarr.testing.store.StoreTests`` does for zarr stores).

* :class:`StoreConformance` - the behaviour ``offload()`` relies on from any
  :class:`~tensorstore_hooks.TensorStore`. Subclass it in a test module and provide a
  ``store`` fixture; ``docs/testing.md`` shows the whole of it.
* :class:`ChunkIOConformance` - the same for a
  :class:`~tensorstore_hooks.storage.io.ChunkIO` backend (the object I/O under
  ``ZarrStore``): an ``io`` fixture plus ``set_raw``/``get_raw``.
* Helpers for a store's own tests: :func:`random_tensor`, :data:`LAYOUTS`,
  :func:`assert_same_tensor`, :func:`unsupported_tensors`, and :class:`WrappedStore`
  (a delegating store that counts calls).

Test-time only: this package imports ``pytest`` and ``hypothesis``, and
``import tensorstore_hooks`` never imports it.
"""

from __future__ import annotations

try:
    import hypothesis  # noqa: F401 - the store suite's property test
    import pytest
except ImportError as e:
    raise ImportError(
        "tensorstore_hooks.testing needs its test-time dependencies: pip install pytest hypothesis"
    ) from e

# The suites' asserts explain their failures only if pytest rewrites them, and it
# rewrites a module outside the test files only when told before the module is imported.
pytest.register_assert_rewrite(
    "tensorstore_hooks.testing._store", "tensorstore_hooks.testing._chunkio"
)

from tensorstore_hooks.testing._chunkio import ChunkIOConformance  # noqa: E402
from tensorstore_hooks.testing._store import (  # noqa: E402
    ALL_DTYPES,
    CLOSES_THE_STORE,
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
    "CLOSES_THE_STORE",
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
