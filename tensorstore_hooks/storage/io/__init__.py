"""Moving whole objects under one root: one module per backend.

* ``_base.py`` - :class:`ChunkIO`, the interface every backend implements.
* ``_local.py`` - :class:`LocalIO`: a local directory, with ``O_DIRECT`` where the
  filesystem allows it (NOTE [ Direct I/O ]); ``_aligned.py``: the aligned, pooled
  buffers direct I/O needs (NOTE [ Aligned buffers ]).
* ``_memory.py`` - :class:`MemoryIO`: a private in-process dict.
* ``_fsspec.py`` - :class:`FsspecIO`: any fsspec filesystem (S3, GCS, ...), batched.
"""

from __future__ import annotations

from tensorstore_hooks.storage.io._aligned import (
    BLOCK_BYTES,
    BufferPool,
    PoolStats,
    address_of,
    aligned_empty,
    round_up,
)
from tensorstore_hooks.storage.io._base import (
    DIRECT_IO_MODES,
    Buffer,
    ChunkIO,
    DirectIOStatus,
)
from tensorstore_hooks.storage.io._fsspec import FsspecIO
from tensorstore_hooks.storage.io._local import LocalIO, direct_io_readonly_check, probe_direct_io
from tensorstore_hooks.storage.io._memory import MemoryIO

__all__ = [
    "BLOCK_BYTES",
    "Buffer",
    "BufferPool",
    "ChunkIO",
    "DIRECT_IO_MODES",
    "DirectIOStatus",
    "FsspecIO",
    "LocalIO",
    "MemoryIO",
    "PoolStats",
    "address_of",
    "aligned_empty",
    "direct_io_readonly_check",
    "probe_direct_io",
    "round_up",
]
