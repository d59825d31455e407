"""KeyWriter: a ZarrStore's puts and the unlinking of freed runs, and the checks a
write makes of its surroundings (a forked child, a vanished root).

The store (``storage/zarr/_store.py``) owns the namespace, the codec and the I/O; this unit
reserves a run, has the codec write it, journals the entry, and undoes a put that
failed (NOTE [ Requests that land late ] in ``storage/zarr/_store.py``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from tensorstore_hooks._codec import TensorMeta
from tensorstore_hooks.errors import (
    QuotaExceededError,
    StoreClosedError,
    StoreUnavailableError,
    TensorStoreError,
)
from tensorstore_hooks.runtime import foreign
from tensorstore_hooks.storage.io import ChunkIO
from tensorstore_hooks.storage.zarr._allocator import Run
from tensorstore_hooks.storage.zarr._chunkcodec import ChunkCodec
from tensorstore_hooks.storage.zarr._index import os_error
from tensorstore_hooks.storage.zarr._namespace import Entry, NamespaceIndex
from tensorstore_hooks.storage.zarr._reads import TransferCounter, store_gone

__all__ = ["KeyWriter", "check_writer"]

Write = Callable[[list[str], int, bool], tuple[bytes, int]]
"""Writes a payload as the chunks ``paths`` of ``chunk`` bytes, with ``O_DIRECT`` or
not (decided once by the caller); returns (crcs, rot)."""


class KeyWriter:
    """Puts keys into one namespace and unlinks freed runs."""

    def __init__(
        self,
        ns: NamespaceIndex,
        codec: ChunkCodec,
        io: ChunkIO,
        url: str,
        pid: int,
        counter: TransferCounter,
    ) -> None:
        self._ns, self._codec, self._io = ns, codec, io
        self._url, self._pid = url, pid
        self._counter = counter

    def put(self, meta: TensorMeta, write: Write) -> str:
        """Reserve a run for ``meta.nbytes``, ``write`` it, journal it; the new key."""
        check_writer(self._pid, self._url, "write")
        self._io.recheck_direct_io()  # a probe a full disk kept from running (NOTE [ Direct I/O ])
        key, run = self._ns.reserve(meta.nbytes)
        chunk, _, count = run
        paths = self._ns.run_paths(run)
        direct = self._codec.moves_direct(self._io, chunk)  # once: what is done is what counts
        try:
            self._ns.ensure_root_doc()
            if count:
                self._ns.ensure_segment(chunk, self._codec.zarr_compressors())
            crcs, rot = write(paths, chunk, direct) if count else (b"", 0)
        except Exception as e:
            self._undo(run, paths)
            raise self._error(key, e) from e
        try:
            self._ns.commit(key, Entry(chunk, run[1], count, crcs, meta, rot))
        except TensorStoreError as e:
            self._undo(run, paths)
            if isinstance(e, StoreClosedError):
                raise
            raise self._error(key, e) from e
        self._counter.add(meta.nbytes, direct=direct, read=False)
        return key

    def _undo(self, run: Run, paths: list[str]) -> None:
        """A put that failed: delete what it wrote (give the space back), free its run
        unless a request on it may still land (NOTE [ Requests that land late ])."""
        with contextlib.suppress(Exception):
            self._io.delete(paths)
        self._ns.cancel(run, uncertain=self._io.take_uncertain(paths))

    def _error(self, key: str, e: BaseException) -> TensorStoreError:
        where = f"ZarrStore({self._url}): writing key {key!r}"
        gone = store_gone(self._io, self._url, self._ns) if _missing(e) else None
        if gone is not None:
            return StoreUnavailableError(f"{where} failed: {gone}; the tensor was not stored")
        err = _write_failure(where, e)
        if isinstance(err, QuotaExceededError):
            self.unlink(self._ns.drain_spares())  # the disk is full: spares are free space
        return type(err)(f"{err}; the tensor was not stored")

    def unlink(self, runs: list[Run]) -> None:
        """Delete the chunk files of freed runs (outside the lock), then free them."""
        if not runs:
            return
        with contextlib.suppress(Exception):
            self._io.delete([p for run in runs for p in self._ns.run_paths(run)])
        # NOTE [ Requests that land late ]: a run with an uncertain request stays out.
        self._ns.release(
            [run for run in runs if not self._io.take_uncertain(self._ns.run_paths(run))]
        )


def check_writer(pid: int, url: str, what: str) -> None:
    """Refuse to change a store opened by another process (NOTE [ Fork safety ])."""
    if foreign(pid):
        raise StoreUnavailableError(
            f"ZarrStore({url}): cannot {what} here: this store was opened by "
            f"process {pid} and this process ({os.getpid()}) is a fork of it, "
            "which must leave the parent's namespace alone (NOTE [ Fork safety ]); "
            "open a store of this process's own with tsh.open_store(...)"
        )


def _missing(e: BaseException) -> bool:
    return isinstance(e, FileNotFoundError)


def _write_failure(where: str, e: BaseException) -> TensorStoreError:
    """The store's error for a write that failed with ``e``."""
    if isinstance(e, OSError):
        return os_error(e, where)
    if isinstance(e, TensorStoreError):
        return type(e)(f"{where} failed: {e}")
    return StoreUnavailableError(f"{where} failed: {e}")
