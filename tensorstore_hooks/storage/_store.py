"""The store abstraction: :class:`TensorStore` and the byte-level :class:`BlobStore`."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType

import torch

from tensorstore_hooks._codec import Buffer, TensorMeta, decode, encode

__all__ = ["BlobStore", "DirectIOStatus", "TensorStore"]


@dataclass(frozen=True, slots=True)
class DirectIOStatus:
    """Whether a backend does chunk I/O with ``O_DIRECT`` (NOTE [ Direct I/O ])."""

    enabled: bool
    """True: chunk objects are written and read with ``O_DIRECT``."""
    mode: str
    """What was asked: ``auto``, ``on`` or ``off``."""
    reason: str
    """Why it is off (empty when on)."""

    def describe(self) -> str:
        """``"on"`` or ``"off (why)"``, for logs and ``inspect``."""
        return "on" if self.enabled else f"off ({self.reason})"


class TensorStore(ABC):
    """A key-value store of tensors. Subclass it to plug your own storage into ``offload()``.

    Notes for implementers:

    * ``put`` must copy what it needs before returning: the caller may free or
      modify the tensor right after. It returns an opaque ``str`` key.
    * ``get`` returns a new tensor equal to what was put: same dtype, shape,
      strides and values, on the original device unless ``device`` says otherwise.
      A missing key raises :class:`~tensorstore_hooks.KeyNotFoundError`.
    * Every method may be called from several threads at once (the offload
      pipeline writes and prefetches in the background): make them thread-safe.
    * ``put`` may raise :class:`~tensorstore_hooks.QuotaExceededError` to refuse a
      write; the offload hooks then keep the tensor in memory (a fallback).
    * Capabilities are declared here, off by default (``temporary``, ``direct_io``,
      ``moves_direct``, ``buffer_pool_bytes``/``set_buffer_pool_bytes``, ``flush``):
      override the ones your store has; callers ask them, never probe for them.
    """

    @abstractmethod
    def put(self, tensor: torch.Tensor) -> str:
        """Store ``tensor`` and return its key."""

    @abstractmethod
    def get(self, key: str, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Return the tensor stored under ``key`` (on ``device``, default its original one)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` and free its bytes. Raises ``KeyNotFoundError`` if absent."""

    @abstractmethod
    def keys(self) -> Iterator[str]:
        """Iterate over the keys currently stored (a snapshot)."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Payload bytes currently stored (what the tensors occupy, before any codec)."""

    @abstractmethod
    def close(self) -> None:
        """Release resources. Idempotent. A temporary store deletes its data."""

    # ----------------------------------------------------------- capabilities
    # Declared with their defaults (as zarr's ``Store.supports_*``): callers ask
    # these, never ``getattr`` a store for them. A store overrides what it has.
    @property
    def temporary(self) -> bool:
        """True if :meth:`close` removes everything this store holds (a temporary
        root). Default: False."""
        return False

    @property
    def direct_io(self) -> DirectIOStatus | None:
        """How chunk objects move (NOTE [ Direct I/O ]): ``O_DIRECT`` or the page
        cache, and why. Default ``None``: the store has no chunk files to say it of."""
        return None

    def moves_direct(self, key: str) -> bool | None:
        """Whether ``key``'s bytes were written (and are read) with ``O_DIRECT``;
        ``None`` if the store does not say (the default). May raise
        :class:`~tensorstore_hooks.KeyNotFoundError` for a key deleted meanwhile."""
        return None

    @property
    def buffer_pool_bytes(self) -> int | None:
        """Idle aligned buffer bytes the store keeps for reuse now (NOTE [ Aligned
        buffers ]); ``None`` if it keeps no such pool (the default)."""
        return None

    def set_buffer_pool_bytes(self, nbytes: int) -> None:  # noqa: B027 - optional
        """Keep up to ``nbytes`` idle aligned buffer bytes from now on (trimming at
        once if lower). Default: nothing to size (``buffer_pool_bytes`` is ``None``)."""

    def flush(self) -> None:  # noqa: B027 - optional: most stores write through
        """Block until what this store buffers (an index where the backend cannot
        append) has reached its medium. Default: nothing is buffered."""

    # ----------------------------------------------------------- conveniences
    @property
    def url(self) -> str:
        """A human-readable location, used in messages."""
        return f"<{type(self).__name__}>"

    def _use(self) -> Callable[[], None]:
        """Internal: an offload pipeline writes here until it calls the result.

        A store may keep what deleting the pipeline's keys needs after ``close()``
        until then (``ZarrStore``: NOTE [ Closed while in use ]); this default does
        nothing."""
        return _nothing

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete several keys; missing ones are ignored. Stores may batch this."""
        for key in keys:
            with contextlib.suppress(KeyError):
                self.delete(key)

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def _nothing() -> None:
    pass


class BlobStore(TensorStore):
    """A store that keeps (metadata, payload bytes) pairs; tensors go through the codec.

    Subclasses implement the byte level (``put_blob``/``get_blob``/``meta``); this
    class turns tensors into blobs with :func:`~tensorstore_hooks._codec.encode` and
    back with :func:`~tensorstore_hooks._codec.decode`.
    """

    def put(self, tensor: torch.Tensor) -> str:
        meta, payload = encode(tensor)
        return self.put_blob(meta, payload)

    def get(self, key: str, *, device: torch.device | str | None = None) -> torch.Tensor:
        meta, payload = self.get_blob(key)
        return decode(meta, payload, device=device)

    @abstractmethod
    def put_blob(self, meta: TensorMeta, payload: Buffer) -> str:
        """Store ``payload`` (a buffer of ``meta.nbytes`` bytes) and return a new key.

        The payload is fully consumed (copied or written) before this returns.
        """

    @abstractmethod
    def get_blob(self, key: str) -> tuple[TensorMeta, Buffer]:
        """Return the metadata and a *writable* buffer holding the payload bytes."""

    @abstractmethod
    def meta(self, key: str) -> TensorMeta:
        """Return the metadata of ``key`` without reading its bytes."""
