"""Rebuilding the ``zarr.json`` of a capture array from what survives of it.

NOTE [ Capture repair ]
A document that cannot be parsed is never written over (NOTE [ Capture documents ]),
and its chunk files are kept. :func:`repair_array` gives the rows back:

1. What the damaged document still says is read from it as text: a torn document is
   a prefix of a whole one, and a capture array's document begins with its shape,
   data type and chunk shape; its attributes (``dtype``, ``module``, ``kind``, ``rank``)
   and the complete ``blocks`` runs come after. The caller may give what is missing
   (``row_shape``, ``dtype``, ``rows``); nothing is guessed (a partial chunk's padding
   cannot be told from rows, so the row count must come from the document or the
   caller).
2. Every chunk the rows need is read and checked (its size, its crc32c) in order; the
   rows stop before the first chunk that fails, and those lost are said.
3. Rows whose steps were lost with the document's tail form one block of step ``-1``
   (``attributes.repaired`` says how many), so ``blocks`` covers every row again.
4. The damaged document is kept beside the new one (``zarr.json.damaged-TIME``), the
   new one is written atomically, and the array's writer lock is held meanwhile (a
   capture writing it at the same time is refused, as is the repair while one runs).
"""

from __future__ import annotations

import logging
import math
import re
import time

import torch

from tensorstore_hooks._codec import DTYPES
from tensorstore_hooks.capture._docs import write_document
from tensorstore_hooks.capture._layout import (
    _MARK,
    CAPTURE_DIR,
    CAPTURE_FORMAT,
    JSON,
    ArrayInfo,
    DamagedDocument,
    array_doc,
    chunk_path,
    encode_doc,
    kind_of,
    read_array,
    stored_dtype_name,
)
from tensorstore_hooks.capture._locks import ArrayLocks, lock_path
from tensorstore_hooks.capture._source import CaptureRoot, CaptureSource, StorageOptions
from tensorstore_hooks.errors import ConfigError
from tensorstore_hooks.storage.io import ChunkIO
from tensorstore_hooks.storage.zarr import crc

__all__ = ["repair_array"]

log = logging.getLogger("tensorstore_hooks")

_INTS = r"\[\s*((?:-?\d+\s*,\s*)*-?\d+)?\s*\]"
_RUN = re.compile(r"\[\s*(-?\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]")


def repair_array(
    root: CaptureRoot,
    name: str,
    *,
    row_shape: tuple[int, ...] | None = None,
    dtype: str | torch.dtype | None = None,
    rows: int | None = None,
    storage_options: StorageOptions | None = None,
) -> ArrayInfo:
    """Rebuild the ``zarr.json`` of the capture array ``name`` (``layers.0/output``,
    ``rank1/...``) under ``root`` (NOTE [ Capture repair ]) and return the array as it
    now is. ``row_shape``, ``dtype`` (the torch dtype of the values) and ``rows``
    (visible rows) fill in what the damaged document no longer says. An array whose
    document is whole is returned as it is. Raises :class:`ConfigError` for what cannot
    be proven (naming the argument to give) and
    :class:`~tensorstore_hooks.StoreUnavailableError` while a capture writes the array.
    """
    io, owned = CaptureSource.of(root, storage_options).open()
    path = f"{CAPTURE_DIR}/{name}"
    group, _, leaf = path.rpartition("/")
    locks = ArrayLocks(io)
    try:
        locks.take([lock_path(*_group_and_module(group), kind_of(leaf))])
        try:
            info = read_array(io, path)
        except DamagedDocument as e:
            if e.foreign:
                raise ConfigError(f"repair_array: {e}") from None
        else:
            if info is None:
                raise ConfigError(f"repair_array: {io.url} has no capture array {name!r}")
            return info  # whole: nothing to repair
        return _rebuild(io, path, name, row_shape, dtype, rows)
    finally:
        locks.release()
        if owned:
            io.close()


def _group_and_module(group: str) -> tuple[str, str]:
    """``capture[/rankR]/MODULE`` -> (``capture[/rankR]``, ``MODULE``)."""
    parent, _, module = group.rpartition("/")
    return parent, module


def _rebuild(
    io: ChunkIO,
    path: str,
    name: str,
    row_shape: tuple[int, ...] | None,
    dtype: str | torch.dtype | None,
    rows: int | None,
) -> ArrayInfo:
    text = bytes(io.read(f"{path}/zarr.json")).decode("utf-8", "replace")
    said = _salvage(text)
    shape = said.get("shape")
    shape_list = shape if isinstance(shape, list) else None
    row = tuple(row_shape) if row_shape is not None else None
    if row is None and shape_list:
        row = tuple(int(d) for d in shape_list[1:] if isinstance(d, int))
    want = rows if rows is not None else None
    if want is None and shape_list and isinstance(shape_list[0], int):
        want = shape_list[0]
    torch_dtype = _dtype(dtype, said)
    if row is None or want is None or torch_dtype is None:
        found = (("row_shape", row), ("rows", want), ("dtype", torch_dtype))
        missing = [n for n, v in found if v is None]
        raise ConfigError(
            f"repair_array: {path}/zarr.json no longer says its {', '.join(missing)}; pass "
            f"{', '.join(f'{m}=...' for m in missing)} (the shape of one row, the rows that "
            "were visible, the torch dtype of the values)"
        )
    row_bytes = math.prod(row) * torch_dtype.itemsize
    chunk_rows = _chunk_rows(io, path, said, row, row_bytes)
    good = _verified_rows(io, path, want, chunk_rows, row_bytes, len(row) + 1)
    doc = array_doc(row, chunk_rows, torch_dtype)
    doc["shape"] = [good, *row]
    doc["attributes"] = _attributes(said, name, torch_dtype, good, want)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    io.write(f"{path}/zarr.json.damaged-{stamp}", [text.encode("utf-8", "surrogateescape")])
    write_document(io, f"{path}/zarr.json", encode_doc(doc))
    log.warning(
        "repair_array: %s/%s rebuilt with %d rows%s",
        io.url,
        path,
        good,
        f" ({want - good} rows lost: a chunk failed its check)" if good < want else "",
    )
    info = read_array(io, path)
    if info is None:  # another process removed it meanwhile
        raise ConfigError(f"repair_array: {io.url}/{path} vanished while it was repaired")
    return info


def _salvage(text: str) -> dict[str, JSON]:
    """What a (torn) document still says (rule 1)."""
    out: dict[str, JSON] = {}
    for key in ("shape", "chunk_shape"):
        m = re.search(rf'"{key}"\s*:\s*{_INTS}', text)
        if m is not None:
            out[key] = [int(v) for v in (m.group(1) or "").replace(" ", "").split(",") if v]
    for key in ("data_type", "dtype", "source_dtype", "module", "kind", "masked"):
        m = re.search(rf'"{key}"\s*:\s*"([^"]*)"', text)
        if m is not None:
            out[key] = m.group(1)
    m = re.search(r'"rank"\s*:\s*(-?\d+)', text)
    if m is not None:
        out["rank"] = int(m.group(1))
    at = text.find('"blocks"')
    if at >= 0:
        out["blocks"] = [[int(g) for g in r.groups()] for r in _RUN.finditer(text, at)]
    return out


def _dtype(given: str | torch.dtype | None, said: dict[str, JSON]) -> torch.dtype | None:
    name = given if isinstance(given, str) else said.get("dtype")
    if isinstance(given, torch.dtype):
        return given
    if isinstance(name, str) and name.removeprefix("torch.") in DTYPES:
        return DTYPES[name.removeprefix("torch.")][0]
    stored = said.get("data_type")
    # Without attributes.dtype only data types that hold one torch dtype are certain.
    if isinstance(stored, str) and stored in DTYPES and stored not in ("uint8", "uint16"):
        value = DTYPES[stored][0]
        return value if stored_dtype_name(value) == stored else None
    return None


def _chunk_rows(
    io: ChunkIO, path: str, said: dict[str, JSON], row: tuple[int, ...], row_bytes: int
) -> int:
    chunks = said.get("chunk_shape")
    if isinstance(chunks, list) and chunks and isinstance(chunks[0], int) and chunks[0] > 0:
        return chunks[0]
    try:  # a chunk object is chunk_rows rows and a 4-byte checksum
        size = len(bytes(io.read(chunk_path(path, 0, len(row) + 1))))
    except FileNotFoundError:
        raise ConfigError(f"repair_array: {path} has no chunk 0 to size its chunks by") from None
    if row_bytes <= 0 or (size - 4) % row_bytes:
        raise ConfigError(
            f"repair_array: chunk 0 of {path} ({size} bytes) does not hold whole rows of "
            f"{row_bytes} bytes; check row_shape and dtype"
        )
    return (size - 4) // row_bytes


def _verified_rows(
    io: ChunkIO, path: str, rows: int, chunk_rows: int, row_bytes: int, ndim: int
) -> int:
    """Rule 2: the rows before the first chunk that is missing or fails its check."""
    size = chunk_rows * row_bytes + 4
    for c in range(-(-rows // chunk_rows)):
        try:
            blob = memoryview(io.read(chunk_path(path, c, ndim))).cast("B")
        except FileNotFoundError:
            return c * chunk_rows
        if len(blob) != size or crc(blob[:-4]).to_bytes(4, "little") != bytes(blob[-4:]):
            return c * chunk_rows
    return rows


def _attributes(
    said: dict[str, JSON], name: str, dtype: torch.dtype, rows: int, claimed: int
) -> dict[str, JSON]:
    head, _, kind = name.rpartition("/")
    module = re.sub(r"^rank\d+/", "", head)
    runs: list[list[int]] = []
    blocks = said.get("blocks")
    for run in blocks if isinstance(blocks, list) else []:
        if isinstance(run, list) and len(run) == 4 and all(isinstance(v, int) for v in run):
            step, first, n, count = (v for v in run if isinstance(v, int))
            whole = min(count, max(0, rows - first) // n) if n > 0 else 0
            if whole and first == (runs[-1][1] + runs[-1][2] * runs[-1][3] if runs else 0):
                runs.append([step, first, n, whole])
    end = runs[-1][1] + runs[-1][2] * runs[-1][3] if runs else 0
    if end < rows:
        runs.append([-1, end, rows - end, 1])  # rule 3
    attrs: dict[str, JSON] = {
        _MARK: CAPTURE_FORMAT,
        "module": said.get("module", module),
        "kind": said.get("kind", kind),
        "dtype": str(dtype).removeprefix("torch."),
        "source_dtype": said.get("source_dtype", str(dtype).removeprefix("torch.")),
        "rank": said.get("rank"),
        "blocks": [list(r) for r in runs],
        "repaired": {
            "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "rows_without_steps": rows - end,
            "rows_lost": claimed - rows,
        },
    }
    if isinstance(said.get("masked"), str):
        attrs["masked"] = said["masked"]
    return attrs
