"""Where captured arrays live and what their ``zarr.json`` says: shared by the capture
writer, :class:`~tensorstore_hooks.CaptureDataset` and ``inspect``.

NOTE [ Capture layout ]
Every captured (module, kind) is one plain Zarr v3 array under ``ROOT/capture/``::

    ROOT/zarr.json                                 the store root (as ZarrStore writes it)
    ROOT/capture/zarr.json                         group
    ROOT/capture/[rank{R}/]MODULE/zarr.json        group, one per module
    ROOT/capture/[rank{R}/]MODULE/KIND/zarr.json   array: shape (rows, *row_shape)
    ROOT/capture/[rank{R}/]MODULE/KIND/c/I/0/...   chunk I: chunk_rows rows, then crc32c

Rules:

1. Axis 0 is the row axis (one row per sample: axis 0 of each captured tensor; a 0-d
   tensor is one row). Chunks span whole rows, ``chunk_rows = max(1, chunk_bytes //
   row_bytes)``, so appending writes whole chunk objects one after another.
2. Codecs are ``bytes`` (little endian) then ``crc32c``: plain ``zarr`` reads and
   verifies every chunk. Dtypes numpy lacks (bfloat16, float8, complex32) are stored
   as the same-width unsigned integers; ``attributes.dtype`` names the torch dtype.
3. The shape in ``zarr.json`` only ever covers rows whose chunks are written, and it
   ends at a block boundary (a block is the rows of one hook call): a block whose
   chunks were not all written is never visible, not even in part.
4. ``attributes``: ``module``, ``kind`` (``output``, ``output.0``, ``input.x``, ...),
   ``dtype`` (stored torch dtype), ``source_dtype``, ``rank`` (``None`` outside
   ``torch.distributed``) and ``blocks``: runs ``[step, first_row, rows, count]``, each
   ``count`` blocks of ``rows`` rows from ``first_row`` on, of steps ``step``,
   ``step + 1``, ... (a training loop with a fixed batch size has one run).
5. Under ``torch.distributed`` each rank writes its own group ``capture/rank{R}/``.
6. Every document is replaced atomically, and one that cannot be used is never
   written over (NOTE [ Capture documents ] in ``capture/_docs.py``). Reading one is
   bounded: at most :data:`MAX_DOC_BYTES`, JSON nested as deep as Python reads it, at
   most :data:`MAX_NDIM` axes, sizes below :data:`MAX_SIZE`; anything else is a
   :class:`DamagedDocument` naming the array.
7. A writer holds ``ROOT/.capture-locks/[rank{R}/]MODULE/KIND.lock`` for every module
   and kind it captures (NOTE [ One writer per array ] in ``capture/_locks.py``).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np
import torch
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec

from tensorstore_hooks._codec import DTYPES
from tensorstore_hooks.capture._docs import recovery_hint, write_document
from tensorstore_hooks.errors import IntegrityError
from tensorstore_hooks.storage.io import ChunkIO
from tensorstore_hooks.storage.zarr import FORMAT_VERSION, root_doc, zarr_json_of

__all__ = [
    "CAPTURE_DIR",
    "CAPTURE_FORMAT",
    "JSON",
    "MAX_DOC_BYTES",
    "MAX_NDIM",
    "MAX_SIZE",
    "ArrayInfo",
    "DamagedDocument",
    "GroupDocs",
    "JSONDoc",
    "array_doc",
    "chunk_path",
    "group_doc",
    "kind_of",
    "list_arrays",
    "read_array",
    "row_bytes",
    "scan_arrays",
    "stored_dtype_name",
]

JSON: TypeAlias = str | int | float | bool | list["JSON"] | dict[str, "JSON"] | None
"""A value as ``json.loads`` makes it (a ``zarr.json`` field, an attribute)."""
JSONDoc: TypeAlias = dict[str, JSON]
"""A JSON object: a ``zarr.json`` document, its ``attributes``."""

CAPTURE_DIR = "capture"
"""The folder under the store root that holds every captured array."""
CAPTURE_FORMAT = 1
"""``attributes.tensorstore_hooks_capture`` of every capture node."""
_MARK = "tensorstore_hooks_capture"
MAX_NDIM = 32
"""The most axes a capture array may have (rule 6)."""
MAX_DOC_BYTES = 64 << 20
"""The largest ``zarr.json`` read (rule 6): ``blocks`` grows by a run per change of
batch size, so a real document stays far below this."""
MAX_SIZE = 1 << 50
"""The largest length of an axis (and of a chunk's rows) a document may claim (rule 6)."""
_MAX_DEPTH = 4  # capture/[rankR/]MODULE/KIND


def stored_dtype_name(dtype: torch.dtype) -> str | None:
    """The Zarr ``data_type`` that holds ``dtype``'s bits (``None``: not storable)."""
    name = str(dtype).removeprefix("torch.")
    entry = DTYPES.get(name)
    return None if entry is None else np.dtype(entry[1]).name


@dataclass(frozen=True, slots=True)
class ArrayInfo:
    """One captured array as its ``zarr.json`` describes it (NOTE [ Capture layout ])."""

    path: str
    """Its path under the store root (``capture/layers.0/output``)."""
    rows: int
    """Rows visible (axis 0 of its shape)."""
    row_shape: tuple[int, ...]
    """The shape of one row."""
    chunk_rows: int
    """Rows per chunk object."""
    dtype: str
    """The torch dtype of the values (``bfloat16`` even though Zarr sees ``uint16``)."""
    attributes: JSONDoc
    """Its attributes as stored (``module``, ``kind``, ``blocks``, ...)."""

    @property
    def masked(self) -> bool:
        """Whether its rows are the real tokens of masked batches (NOTE [ Capture masks ])."""
        return isinstance(self.attributes.get("masked"), str)

    @property
    def name(self) -> str:
        """The path under ``capture/`` (``[rankR/]MODULE/KIND``): what the dataset takes."""
        return self.path[len(CAPTURE_DIR) + 1 :]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.row_shape, self.torch_dtype)

    @property
    def chunk_bytes(self) -> int:
        """Payload bytes of one chunk object (without its 4-byte checksum)."""
        return self.chunk_rows * self.row_bytes

    @property
    def chunks(self) -> int:
        """Chunk objects that hold visible rows."""
        return -(-self.rows // self.chunk_rows)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


class DamagedDocument(IntegrityError):
    """A capture document that exists but cannot be used (rule 6): never written over."""

    def __init__(
        self, url: str, path: str, why: str, *, foreign: bool = False, group: bool = False
    ) -> None:
        self.path = path
        """The array's path under the store root (``capture/layers.0/output``)."""
        self.why = why
        """What is wrong with its ``zarr.json``."""
        self.foreign = foreign
        """Whether it is a whole document of another kind (another tool's array): not
        damage to report, but still never written over."""
        name = path[len(CAPTURE_DIR) + 1 :] if path.startswith(CAPTURE_DIR + "/") else path
        if group:
            fix = (
                "it is a group's document, the same for every capture group: remove it "
                "and the next capture writes it again (the arrays below it are listed)"
            )
        elif foreign:
            fix = "capture writes nothing there: move it, or capture into another root"
        else:
            fix = recovery_hint(url, name)
        what = "capture group" if group else "capture array"
        super().__init__(f"{what} {name} under {url}: {path}/zarr.json {why}; {fix}")


@dataclass
class Scan:
    """What :func:`scan_arrays` found: capture arrays, and the documents it skipped."""

    arrays: list[ArrayInfo] = field(default_factory=list)
    damaged: list[DamagedDocument] = field(default_factory=list)


def row_bytes(row_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of one row of ``row_shape`` in ``dtype``."""
    return math.prod(row_shape) * dtype.itemsize


def kind_of(leaf: str) -> str:
    """The capture kind a leaf name belongs to (``grad_output.0@17x8_float32`` and
    ``output~tokens`` -> ``grad_output``, ``output``): what its writer lock covers."""
    return leaf.split("@", 1)[0].split("~", 1)[0].split(".", 1)[0]


def chunk_path(array_path: str, index: int, ndim: int) -> str:
    """The chunk object holding chunk ``index`` along axis 0 (the ``default`` key encoding)."""
    return f"{array_path}/c/{index}" + "/0" * (ndim - 1)


def group_doc() -> bytes:
    """A capture group's ``zarr.json``."""
    attrs = {_MARK: CAPTURE_FORMAT}
    return zarr_json_of(lambda s: zarr.create_group(store=s, zarr_format=3, attributes=attrs))


class GroupDocs:
    """The group documents above capture arrays, each written once (where missing).
    Thread-safe."""

    def __init__(self) -> None:
        self._made: set[str] = set()
        self._lock = threading.Lock()

    def ensure(self, io: ChunkIO, path: str) -> None:
        """The store root's ``zarr.json`` and a group's for each folder above ``path``."""
        parts = path.split("/")[:-1]
        with self._lock:
            if "" not in self._made:
                if not io.exists("zarr.json"):
                    write_document(io, "zarr.json", root_doc(FORMAT_VERSION))
                self._made.add("")
            for i in range(1, len(parts) + 1):
                group = "/".join(parts[:i])
                if group not in self._made:
                    if not io.exists(f"{group}/zarr.json"):
                        write_document(io, f"{group}/zarr.json", group_doc())
                    self._made.add(group)


def array_doc(row_shape: tuple[int, ...], chunk_rows: int, dtype: torch.dtype) -> JSONDoc:
    """An empty capture array's ``zarr.json`` as a dict (zarr's own document, made once);
    the writer sets ``shape`` and ``attributes`` before each write of it."""
    data_type = stored_dtype_name(dtype)
    if data_type is None:
        raise ValueError(f"no Zarr data type holds {dtype}")
    raw = zarr_json_of(
        lambda s: zarr.create_array(
            store=s,
            shape=(0, *row_shape),
            # Zarr wants chunk sides >= 1; a zero-sized side has no chunks anyway.
            chunks=(chunk_rows, *(max(1, d) for d in row_shape)),
            dtype=data_type,
            fill_value=0,
            serializer=BytesCodec(),
            compressors=[Crc32cCodec()],
            filters=None,
            zarr_format=3,
        )
    )
    doc: JSONDoc = json.loads(raw)
    return doc


def encode_doc(doc: JSONDoc) -> bytes:
    return json.dumps(doc, indent=2).encode()


def read_array(io: ChunkIO, path: str) -> ArrayInfo | None:
    """The capture array at ``path``, or ``None`` where there is no document or a group's.

    Raises :class:`DamagedDocument` for a document that cannot be used (rule 6): it
    does not parse, is out of bounds, or is not a capture array (another tool's array
    or a stray file). A caller never writes over such a document."""
    try:
        raw = bytes(io.read(f"{path}/zarr.json"))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    if len(raw) > MAX_DOC_BYTES:
        raise DamagedDocument(io.url, path, f"is {len(raw)} bytes, more than any capture writes")
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise DamagedDocument(io.url, path, "is nested too deeply to be read") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise DamagedDocument(
            io.url, path, f"cannot be parsed ({e}; {len(raw)} bytes: torn by a failed write?)"
        ) from None
    if isinstance(doc, dict) and doc.get("node_type") == "group":
        return None
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or doc.get("node_type") != "array":
        raise DamagedDocument(io.url, path, "is not a Zarr array or group document")
    if not isinstance(attrs, dict) or attrs.get(_MARK) != CAPTURE_FORMAT:
        raise DamagedDocument(
            io.url, path, "is an array that tsh.capture did not write", foreign=True
        )
    return _parse(io.url, path, doc, attrs)


def _parse(url: str, path: str, doc: JSONDoc, attrs: JSONDoc) -> ArrayInfo:
    def bad(why: str) -> DamagedDocument:
        return DamagedDocument(url, path, why)

    grid = doc.get("chunk_grid")
    config = grid.get("configuration") if isinstance(grid, dict) else None
    if not isinstance(config, dict) or "chunk_shape" not in config:
        raise bad("has no regular chunk grid")
    shape_doc, chunks_doc = doc.get("shape"), config["chunk_shape"]
    shape, chunks = _sizes(shape_doc), _sizes(chunks_doc)
    if shape is None or chunks is None or not 1 <= len(shape) == len(chunks) <= MAX_NDIM:
        raise bad(f"has a bad shape {shape_doc!r:.200} or chunk shape {chunks_doc!r:.200}")
    if max(shape + chunks) > MAX_SIZE or math.prod(shape[1:]) > MAX_SIZE:
        raise bad(f"claims sizes out of bounds: shape {shape}, chunk shape {chunks}")
    dtype = attrs.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"names an unknown dtype {dtype!r}")
    if doc.get("data_type") != stored_dtype_name(DTYPES[dtype][0]):
        raise bad(f"stores {doc.get('data_type')!r}, which cannot hold {dtype}")
    codecs_doc = doc.get("codecs", [])
    codecs = (
        [c.get("name") if isinstance(c, dict) else c for c in codecs_doc]
        if isinstance(codecs_doc, list)
        else codecs_doc
    )
    if codecs != ["bytes", "crc32c"]:
        raise bad(f"has codecs {codecs!r}; capture arrays are written as bytes + crc32c")
    if chunks[0] < 1 or list(chunks[1:]) != [max(1, d) for d in shape[1:]]:
        raise bad(f"chunks {chunks!r} do not span whole rows of {shape!r}")
    return ArrayInfo(
        path=path,
        rows=shape[0],
        row_shape=tuple(shape[1:]),
        chunk_rows=chunks[0],
        dtype=dtype,
        attributes=attrs,
    )


def _sizes(value: JSON) -> list[int] | None:
    """``value`` if it is a list of ints >= 0 (an array's shape), else ``None``."""
    if not isinstance(value, list):
        return None
    sizes = [v for v in value if isinstance(v, int) and v >= 0]
    return sizes if len(sizes) == len(value) else None


def list_arrays(io: ChunkIO, under: str = CAPTURE_DIR) -> Iterator[ArrayInfo]:
    """Every capture array under ``under`` (default: all of ``ROOT/capture``), sorted
    by path; documents that cannot be used are skipped (:func:`scan_arrays` says which)."""
    yield from scan_arrays(io, under).arrays


def scan_arrays(io: ChunkIO, under: str = CAPTURE_DIR) -> Scan:
    """Every capture array under ``under``, sorted by path, and every document there
    that cannot be used (rule 6; arrays other tools wrote are not capture's to report)."""
    found = Scan()
    _walk(io, under, 0, found)
    return found


def _walk(io: ChunkIO, path: str, depth: int, found: Scan) -> None:
    try:
        info = read_array(io, path)
    except DamagedDocument as e:
        if e.foreign:
            return  # another tool's array: not capture's to list or report
        if "c" in io.listdir(path):  # an array's folder
            found.damaged.append(e)
            return
        # A group's document: the arrays below it are still listed.
        found.damaged.append(DamagedDocument(io.url, path, e.why, group=True))
        info = None
    if info is not None:
        found.arrays.append(info)
        return
    if depth >= _MAX_DEPTH:
        return
    for name in io.listdir(path):
        if name in ("zarr.json", "c") or name.startswith("."):
            continue
        _walk(io, f"{path}/{name}", depth + 1, found)
