"""Which tensor metadata the daemon stores: what torch can rebuild at a bounded size.

NOTE [ Storable metadata ]
Metadata comes from the client; whatever the daemon stores is later served by GET,
listed by ``inspect`` and replayed at a restart. So a PUT's metadata is checked
before a byte of its payload is read (and a disk-index record's at a restart):

1. :meth:`TensorMeta.from_dict` (the codec's bounds): a known dtype, at most 64
   non-negative sizes and strides, a device name matched in full, and ``nbytes``
   equal to what shape, strides and dtype say the payload holds;
2. every size, stride and the storage offset fit torch's 64-bit integers;
3. the storage a rebuild allocates (storage offset + span elements) is at most
   ``max_tensor`` bytes: a client cannot plant a few bytes whose GET asks for
   petabytes;
4. a torch tensor's device is one torch can name (``torch.device`` parses it).

Rules 1, 2 and 4 answer BAD_REQUEST and 3 TOO_LARGE (a client keeps such a tensor);
the payload is read and discarded and the connection stays usable. At a restart, a
disk-index record breaking them is quarantined (NOTE [ Journal damage ]).
"""

from __future__ import annotations

import functools

import torch

from tensorstore_hooks._codec import TensorMeta, span_of
from tensorstore_hooks.protocol import ErrorCode

__all__ = ["meta_problem"]

_INT64_MAX = (1 << 63) - 1


@functools.lru_cache(maxsize=64)
def _torch_device_ok(name: str) -> bool:
    try:
        torch.device(name)
    except (RuntimeError, ValueError):
        return False
    return True


def meta_problem(meta: TensorMeta, max_tensor_bytes: int) -> tuple[ErrorCode, str] | None:
    """Why the daemon must not store ``meta`` (an error code and a message), or None.

    ``meta`` already passed :meth:`TensorMeta.from_dict` (rule 1 of NOTE [ Storable
    metadata ]); this checks rules 2-4.
    """
    values = (*meta.shape, *meta.stride, meta.storage_offset)
    if any(v > _INT64_MAX for v in values):
        return ErrorCode.BAD_REQUEST, (
            f"tensor metadata: shape {list(meta.shape)}, stride {list(meta.stride)} or "
            f"storage_offset {meta.storage_offset} does not fit torch's 64-bit integers"
        )
    itemsize = meta.torch_dtype.itemsize
    storage = (meta.storage_offset + span_of(meta.shape, meta.stride)) * itemsize
    if storage > max_tensor_bytes:
        return ErrorCode.TOO_LARGE, (
            f"tensor metadata: rebuilding it needs a storage of {storage} bytes (storage_offset "
            f"{meta.storage_offset} + span of shape {list(meta.shape)} with stride "
            f"{list(meta.stride)}), more than max_tensor ({max_tensor_bytes}); the client "
            "keeps the tensor"
        )
    if meta.framework == "torch" and not _torch_device_ok(meta.device):
        return ErrorCode.BAD_REQUEST, f"tensor metadata: torch has no device {meta.device!r}"
    return None
