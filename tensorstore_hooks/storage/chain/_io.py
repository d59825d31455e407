"""The I/O of a tier chain: writing a put into a tier and copying a tensor from one
tier to the next (NOTE [ Tier chain ] in ``storage/chain/_core.py``).

Between two byte-level stores (:class:`BlobStore`) the encoded bytes and metadata go
across unchanged: no decode, no device, no second encode.
"""

from __future__ import annotations

import numpy as np
import torch

from tensorstore_hooks._codec import TensorMeta
from tensorstore_hooks.storage._store import BlobStore, TensorStore

__all__ = ["copy", "write"]


def write(store: TensorStore, tensor: torch.Tensor, meta: TensorMeta, payload: np.ndarray) -> str:
    """Write one put into ``store``; returns the key there. ``meta, payload`` are
    ``encode(tensor)``: a :class:`BlobStore` takes them as they are, any other store
    takes ``tensor``. Raises what the store raises."""
    if isinstance(store, BlobStore):
        return store.put_blob(meta, payload)
    return store.put(tensor)


def copy(src: TensorStore, key: str, dst: TensorStore) -> str:
    """Write ``src``'s ``key`` into ``dst``; returns the key there. ``src`` keeps its
    copy (the caller deletes it once the chain points at the new one). Raises what
    either store raises (``KeyError`` when ``key`` is gone from ``src``)."""
    if isinstance(src, BlobStore) and isinstance(dst, BlobStore):
        meta, payload = src.get_blob(key)
        return dst.put_blob(meta, payload)
    return dst.put(src.get(key))
