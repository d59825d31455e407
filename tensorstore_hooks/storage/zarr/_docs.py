"""The ``zarr.json`` documents of a ZarrStore root: exactly what zarr writes for them.

Made by zarr itself in scratch memory (a ``MemoryStore`` over a dict of our own), so
plain ``zarr`` opens the layout; see docs/layout.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import zarr
from zarr.abc.codec import BytesBytesCodec
from zarr.abc.store import Store
from zarr.codecs import BytesCodec
from zarr.core.buffer import Buffer

__all__ = ["JSON", "namespace_doc", "namespace_format", "root_doc", "segment_doc"]

JSON: TypeAlias = "str | int | float | bool | list[JSON] | dict[str, JSON] | None"
"""A parsed JSON document (``json.loads``): untrusted, so narrowed before use."""


def zarr_json_of(factory: Callable[[Store], object]) -> bytes:
    """The ``zarr.json`` document zarr writes for the node ``factory`` creates."""
    docs: dict[str, Buffer] = {}
    factory(zarr.storage.MemoryStore(store_dict=docs))
    return bytes(docs["zarr.json"].to_bytes())


def root_doc(format_version: int) -> bytes:
    """The root group: ``{"tensorstore_hooks": {"format": N}}``."""
    attrs = {"tensorstore_hooks": {"format": format_version}}
    return zarr_json_of(lambda s: zarr.create_group(store=s, zarr_format=3, attributes=attrs))


def namespace_doc(format_version: int, namespace: str, chunk_bytes: int, codec: str) -> bytes:
    """One writer's group, with what ``inspect`` shows about it."""
    attrs = {
        "tensorstore_hooks": {
            "format": format_version,
            "namespace": namespace,
            "chunk_bytes": chunk_bytes,
            "codec": codec,
            "index": "index/journal + index/snapshot (framed msgpack), see docs/layout.md",
        }
    }
    return zarr_json_of(lambda s: zarr.create_group(store=s, zarr_format=3, attributes=attrs))


def namespace_format(doc: bytes) -> JSON:
    """The ``format`` a namespace's ``zarr.json`` (bytes) declares, or ``"unknown"``
    when it declares none or cannot be parsed."""
    import json

    try:
        parsed = json.loads(bytes(doc))
    except ValueError:  # also UnicodeDecodeError
        return "unknown"
    attrs = parsed.get("attributes") if isinstance(parsed, dict) else None
    ours = attrs.get("tensorstore_hooks") if isinstance(attrs, dict) else None
    fmt = ours.get("format") if isinstance(ours, dict) else None
    return "unknown" if fmt is None else fmt


def segment_doc(chunk: int, chunks: int, compressors: list[BytesBytesCodec]) -> bytes:
    """A 1-D uint8 segment array of ``chunks`` chunks of ``chunk`` bytes (NOTE [ Segment
    layout ] in ``storage/zarr/_store.py``)."""
    return zarr_json_of(
        lambda s: zarr.create_array(
            store=s,
            shape=(chunk * chunks,),
            chunks=(chunk,),
            dtype="uint8",
            fill_value=0,
            serializer=BytesCodec(),
            compressors=compressors or None,
            filters=None,
            zarr_format=3,
            attributes={"tensorstore_hooks": {"segment_chunk_bytes": chunk}},
        )
    )
