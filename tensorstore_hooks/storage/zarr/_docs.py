"""The ``zarr.json`` documents of a ZarrStore root: exactly what zarr writes for them.

Made by zarr itself in scratch memory (a ``MemoryStore`` over a dict of our own), so
plain ``zarr`` opens the layout; see docs/layout.md. Written with
:meth:`~tensorstore_hooks.storage.io.ChunkIO.write_atomic` (NOTE [ Atomic documents ] in
``storage/io/_base.py``), and a document that cannot be parsed is never overwritten:
:func:`ensure_doc` reports it instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import zarr
from zarr.abc.codec import BytesBytesCodec
from zarr.abc.store import Store
from zarr.codecs import BytesCodec
from zarr.core.buffer import Buffer

from tensorstore_hooks.storage.io import ChunkIO

__all__ = [
    "JSON",
    "Doc",
    "damaged_doc_advice",
    "ensure_doc",
    "namespace_doc",
    "namespace_format",
    "parse_doc",
    "read_doc",
    "root_doc",
    "segment_doc",
]

JSON: TypeAlias = "str | int | float | bool | list[JSON] | dict[str, JSON] | None"
"""A parsed JSON document (``json.loads``): untrusted, so narrowed before use."""


@dataclass(frozen=True, slots=True)
class Doc:
    """A ``zarr.json`` as found: missing, parsed, or why it cannot be parsed."""

    parsed: dict[str, JSON] | None
    """The document (a JSON object); ``None`` when missing or damaged."""
    error: str | None = None
    """Why it cannot be parsed (``None``: missing, or parsed)."""

    @property
    def missing(self) -> bool:
        return self.parsed is None and self.error is None


def parse_doc(raw: bytes) -> Doc:
    """``raw`` parsed as a ``zarr.json``: a JSON object, or why it is not one."""
    try:
        parsed = json.loads(bytes(raw))
    except ValueError as e:  # also UnicodeDecodeError
        what = "it is empty" if not raw else f"it is not JSON ({e})"
        return Doc(None, what)
    if not isinstance(parsed, dict):
        return Doc(None, f"it is JSON but not an object ({type(parsed).__name__})")
    return Doc(parsed)


def read_doc(io: ChunkIO, path: str) -> Doc:
    """The document at ``path`` (``Doc.missing`` if absent). OS and store errors other
    than a missing file propagate."""
    try:
        raw = io.read(path)
    except FileNotFoundError:
        return Doc(None)
    return parse_doc(raw)


def ensure_doc(io: ChunkIO, path: str, want: bytes, *, replace: bool) -> str | None:
    """Write document ``want`` at ``path`` where it is missing (``replace``: also where
    it differs), atomically (NOTE [ Atomic documents ]). Returns ``None``, or why the
    document there cannot be parsed: it is then left untouched, for the caller to
    report (:func:`damaged_doc_advice`)."""
    found = read_doc(io, path)
    if found.error is not None:
        return found.error
    if found.missing or (replace and found.parsed != json.loads(want)):
        io.write_atomic(path, [want])
    return None


def damaged_doc_advice(io: ChunkIO, path: str) -> str:
    """How to recover from a damaged document at ``path`` (for messages)."""
    where = f"{io.url.rstrip('/')}/{path}"
    return (
        f"it was left as it is (a document that cannot be parsed is never overwritten). "
        f"To recover, move it aside (e.g. rename {where} to {path.rsplit('/', 1)[-1]}.damaged "
        "in its directory): the store then writes a fresh one; the tensors' index and "
        "chunks are apart from it and untouched"
    )


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


def namespace_format(doc: dict[str, JSON]) -> JSON:
    """The ``format`` a parsed namespace ``zarr.json`` declares (``None``: it declares
    none, so the library did not write it)."""
    attrs = doc.get("attributes")
    ours = attrs.get("tensorstore_hooks") if isinstance(attrs, dict) else None
    return ours.get("format") if isinstance(ours, dict) else None


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
