"""The Zarr store: namespaces, the key index and its journal, the chunk allocator,
the chunk codec with checksums, and the housekeeping of stale namespaces.
"""

from __future__ import annotations

from tensorstore_hooks.storage.zarr._checksum import crc
from tensorstore_hooks.storage.zarr._docs import (
    Doc,
    damaged_doc_advice,
    parse_doc,
    read_doc,
    root_doc,
    zarr_json_of,
)
from tensorstore_hooks.storage.zarr._housekeeping import (
    Stale,
    find_stale,
    remove_stale,
    temp_parent,
)
from tensorstore_hooks.storage.zarr._index import (
    MAGIC,
    Damage,
    IndexEntry,
    IndexLog,
    frame_record,
    scan_journal,
)
from tensorstore_hooks.storage.zarr._namespace import Entry
from tensorstore_hooks.storage.zarr._options import (
    DEFAULT_CHUNK_BYTES,
    check_chunk_bytes,
    parse_codec,
    parse_direct_io,
)
from tensorstore_hooks.storage.zarr._store import (
    FORMAT_VERSION,
    ZarrStore,
    default_namespace,
    distributed_rank,
    make_io,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Damage",
    "Doc",
    "Entry",
    "FORMAT_VERSION",
    "IndexEntry",
    "IndexLog",
    "MAGIC",
    "Stale",
    "ZarrStore",
    "check_chunk_bytes",
    "crc",
    "damaged_doc_advice",
    "default_namespace",
    "distributed_rank",
    "find_stale",
    "frame_record",
    "make_io",
    "parse_codec",
    "parse_direct_io",
    "parse_doc",
    "read_doc",
    "remove_stale",
    "root_doc",
    "scan_journal",
    "temp_parent",
    "zarr_json_of",
]
