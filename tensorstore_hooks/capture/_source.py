"""Where captured arrays are read back from: a store root URL, a capture, or a store.

:class:`CaptureSource` turns what a user hands to ``CaptureDataset`` (or what a
:class:`~tensorstore_hooks.capture._capture.Capture` knows) into a
:class:`~tensorstore_hooks.storage.io.ChunkIO`, opened in the process that reads:
DataLoader workers open their own (an fsspec filesystem or its HTTP sessions must not
cross a ``fork``). A ``memory://`` root lives only in the process that wrote it, so
its I/O object itself is kept (workers made by ``fork`` see a copy of it).
:func:`open_zarr_array` opens one captured array with plain ``zarr``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

import zarr
from zarr.abc.store import Store

from tensorstore_hooks.errors import ConfigError
from tensorstore_hooks.storage import DAEMON_SCHEMES, TensorStore, scheme_of
from tensorstore_hooks.storage.io import ChunkIO, FsspecIO, LocalIO, MemoryIO

if TYPE_CHECKING:
    from tensorstore_hooks.storage.zarr import ZarrStore

__all__ = ["CaptureRoot", "CaptureSource", "HasCaptureSource", "StorageOptions", "open_zarr_array"]

StorageOptions: TypeAlias = dict[str, object]
"""fsspec's ``storage_options``: keyword arguments of the filesystem (``anon``, ``key``...)."""


@runtime_checkable
class HasCaptureSource(Protocol):
    """What knows where its captured arrays are read from: a ``tsh.capture`` object."""

    def capture_source(self, storage_options: StorageOptions | None = None) -> CaptureSource: ...


CaptureRoot: TypeAlias = "str | os.PathLike[str] | HasCaptureSource | ZarrStore | CaptureSource"
"""What captured arrays can be read from: a store root URL or path, the ``tsh.capture``
object that wrote them, the ``ZarrStore`` they were captured into, or a source."""


@dataclass(frozen=True)
class CaptureSource:
    """A store root to read captured arrays from: a URL and its ``storage_options``, or
    an I/O object of this process (``memory://`` roots, store objects on fsspec)."""

    url: str
    storage_options: StorageOptions | None = None
    io: ChunkIO | None = None

    @classmethod
    def of(
        cls, source: CaptureRoot, storage_options: StorageOptions | None = None
    ) -> CaptureSource:
        """``source``: a store root URL or path, a ``Capture`` or a ``ZarrStore``."""
        from tensorstore_hooks.storage.zarr import ZarrStore

        if isinstance(source, CaptureSource):
            return source
        if isinstance(source, HasCaptureSource):
            return source.capture_source(storage_options)
        if isinstance(source, ZarrStore):
            return cls.of_io(source._io, storage_options, source.url)
        if isinstance(source, TensorStore):
            raise ConfigError(
                f"CaptureDataset: a {type(source).__name__} ({source.url}) holds no captured "
                "arrays; pass the store root URL that tsh.capture wrote into"
            )
        if not isinstance(source, str | os.PathLike):
            raise ConfigError(
                "CaptureDataset: expected a store root URL or path, a tsh.capture object or "
                f"a ZarrStore, got {type(source).__name__}"
            )
        url = os.fspath(source)
        if scheme_of(url) in DAEMON_SCHEMES:
            raise ConfigError(
                f"CaptureDataset: {url} is a storage daemon, which holds no captured arrays "
                "(tsh.capture refuses tsh:// URLs); pass the URL the capture wrote into"
            )
        if scheme_of(url) == "memory":
            raise ConfigError(
                f"CaptureDataset: {url} is private to the store object that made it; pass "
                "that object (the tsh.capture result or the ZarrStore) instead of its URL"
            )
        return cls(url, dict(storage_options) if storage_options else None)

    @classmethod
    def of_io(cls, io: ChunkIO, options: StorageOptions | None, url: str) -> CaptureSource:
        """The source of the root ``url`` that ``io`` reaches (``options``: its fsspec
        ``storage_options``, when known)."""
        if isinstance(io, LocalIO):
            return cls(io.url)
        if isinstance(io, FsspecIO) and options is not None:
            return cls(io.url, dict(options))
        return cls(url, options, io)  # memory, or fsspec options unknown: this object

    def open(self) -> tuple[ChunkIO, bool]:
        """``(io, owned)``: the caller closes an owned one."""
        if self.io is not None:
            return self.io, False
        from tensorstore_hooks.storage.zarr import make_io

        return make_io(self.url, self.storage_options), True


def open_zarr_array(
    io: ChunkIO, path: str, storage_options: StorageOptions | None
) -> zarr.Array | None:
    """The array at ``path`` under ``io``'s root opened read-only with plain ``zarr``
    (``None`` if it is not there yet). A ``memory://`` root is read from a snapshot."""
    store: Store
    if isinstance(io, LocalIO):
        store = zarr.storage.LocalStore(io.root, read_only=True)
    elif isinstance(io, MemoryIO):
        from zarr.core.buffer import Buffer, cpu

        objects: dict[str, Buffer] = {
            k: cpu.Buffer.from_bytes(bytes(io.read(k))) for k in _objects(io, path)
        }
        store = zarr.storage.MemoryStore(store_dict=objects)
    elif isinstance(io, FsspecIO):
        options = storage_options if storage_options is not None else _fs_options(io)
        store = zarr.storage.FsspecStore.from_url(io.url, storage_options=options, read_only=True)
    else:  # pragma: no cover - every ChunkIO is one of the three
        raise ConfigError(f"capture: cannot open arrays under {io.url} with zarr")
    try:
        return zarr.open_array(store=store, path=path, mode="r", zarr_format=3)
    except FileNotFoundError:
        return None


def _objects(io: ChunkIO, path: str) -> list[str]:
    """Every object under ``path`` (a folder of a ``memory://`` root)."""
    out = []
    for name in io.listdir(path):
        sub = f"{path}/{name}"
        try:
            io.read(sub)
        except FileNotFoundError:
            out += _objects(io, sub)
        else:
            out.append(sub)
    return out


def _fs_options(io: FsspecIO) -> StorageOptions:
    """The options ``io``'s filesystem was made with, less what cannot be reused."""
    opts = dict(getattr(io.fs, "storage_options", {}) or {})
    opts.pop("session", None)
    opts.pop("asynchronous", None)
    return opts
