"""Paddle tensors through the torch codec and pipeline, without copying their bytes.

NOTE [ Paddle bridge ]
A Paddle tensor crosses into torch through DLPack: ``torch.from_dlpack`` gives a
zero-copy alias with the same dtype (bfloat16 and float8 included), shape, strides
and bytes, so the codec, the stores and the offload pipeline handle it like any torch
tensor. The way back is ``paddle.from_dlpack`` (zero-copy too), then a move to the
original place. What the alias cannot carry travels beside it:

* the **place** (``cpu``, ``gpu:1``, ...): an accelerator tensor is first copied to
  host by Paddle (synchronously: Paddle's streams are not torch's, so the torch
  staging of CUDA tensors does not apply) and moved back on the way out;
* ``stop_gradient``: restored on the way out;
* the **in-place version**: the alias has a counter of its own, so in-place checks
  read Paddle's ``inplace_version`` through :class:`PaddleVersion`.

This module imports ``paddle`` only when a Paddle tensor is actually seen; the codec
reaches it through the adapter registry (``_adapters.py``: :data:`ADAPTER`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, TypeGuard

import numpy as np
import torch
from torch.utils.dlpack import to_dlpack

from tensorstore_hooks._codec import Buffer, TensorMeta, decode, encode
from tensorstore_hooks.errors import UnsupportedTensorError

if TYPE_CHECKING:  # paddle is imported when a paddle tensor is seen (see the NOTE)
    import paddle

__all__ = [
    "ADAPTER",
    "PaddleVersion",
    "decode_paddle",
    "encode_paddle",
    "from_torch",
    "is_paddle_tensor",
    "paddle_unsupported_reason",
    "place_name",
    "place_of",
    "to_place",
    "to_torch",
]

_PLACE_RE = re.compile(r"^Place\((?P<kind>[a-z][a-z0-9_]{0,15})(?::(?P<index>\d{1,4}))?\)$")
_HOST_KINDS = frozenset({"cpu", "gpu_pinned", "xpu_pinned"})


def is_paddle_tensor(obj: object) -> TypeGuard[paddle.Tensor]:
    """True for a ``paddle.Tensor`` (checked without importing paddle)."""
    return type(obj).__module__.split(".", 1)[0] == "paddle" and type(obj).__name__ == "Tensor"


def place_name(place: object) -> str:
    """A paddle place as a device string: ``"cpu"``, ``"gpu:0"``, ``"xpu:1"``, ...

    Pinned host places are ``"cpu"`` (their bytes are host memory). Parsed from
    ``str(place)`` (``Place(gpu:0)``), the one form every place class shares, so any
    object is taken; one that is not a place raises :class:`UnsupportedTensorError`.
    """
    m = _PLACE_RE.match(str(place))
    if m is None:
        raise UnsupportedTensorError(f"paddle bridge: cannot tell the device of place {place}")
    if m["kind"] in _HOST_KINDS:
        return "cpu"
    return f"{m['kind']}:{m['index'] or 0}"


def place_of(t: paddle.Tensor) -> str:
    """The device string of paddle tensor ``t`` (see :func:`place_name`)."""
    return place_name(t.place)


def to_place(t: paddle.Tensor, device: object) -> paddle.Tensor:
    """Move paddle tensor ``t`` to ``device``: a device string (``"cpu"``, ``"gpu:1"``)
    or any paddle place (read through :func:`place_name`)."""
    import paddle

    name = device if isinstance(device, str) else place_name(device)
    if name == "cpu":
        return t if t.place.is_cpu_place() else t.cpu()
    kind, _, index = name.partition(":")
    place: paddle.CUDAPlace | paddle.XPUPlace | paddle.CustomPlace
    if kind == "gpu":
        place = paddle.CUDAPlace(int(index or 0))
    elif kind == "xpu":
        place = paddle.XPUPlace(int(index or 0))
    else:
        place = paddle.CustomPlace(kind, int(index or 0))
    return t._copy_to(place, True)


def paddle_unsupported_reason(t: paddle.Tensor) -> str | None:
    """Why paddle tensor ``t`` cannot be stored, or ``None``."""
    if not t.is_dense():
        return "sparse or distributed paddle tensor"
    if not t._is_initialized():
        return "uninitialised paddle tensor"
    return None


def to_torch(t: paddle.Tensor) -> torch.Tensor:
    """A torch tensor over the same host bytes as paddle tensor ``t`` (see NOTE [ Paddle bridge ]).

    Zero-copy for host tensors; a device tensor is copied to host first.
    Raises :class:`UnsupportedTensorError` for what DLPack cannot describe.
    """
    reason = paddle_unsupported_reason(t)
    if reason is not None:
        raise UnsupportedTensorError(f"paddle bridge: cannot store a {reason}")
    if not (t.place.is_cpu_place() or t.place.is_cuda_pinned_place()):
        t = t.cpu()
    try:
        return torch.from_dlpack(t.detach())
    except (RuntimeError, TypeError, ValueError, BufferError) as e:
        raise UnsupportedTensorError(
            f"paddle bridge: cannot view a paddle {t.dtype} tensor of shape {list(t.shape)} "
            f"through DLPack: {e}"
        ) from e


def from_torch(
    t: torch.Tensor, device: object = "cpu", *, stop_gradient: bool = True
) -> paddle.Tensor:
    """A paddle tensor over the bytes of host tensor ``t``, moved to ``device`` (as
    :func:`to_place` takes it)."""
    import paddle

    # A capsule: the same zero-copy view paddle makes from the tensor itself, which
    # paddle's stub does not accept (torch's ``__dlpack_device__`` is typed apart).
    out = paddle.from_dlpack(to_dlpack(t.detach()))
    out = to_place(out, device)
    out.stop_gradient = stop_gradient
    return out


class PaddleVersion:
    """Exposes a paddle tensor's ``inplace_version`` as ``_version`` (the pipeline's guard).

    Holds a detached alias, which shares the original's version counter.
    """

    __slots__ = ("_t",)

    def __init__(self, t: paddle.Tensor) -> None:
        self._t = t.detach()

    @property
    def _version(self) -> int:
        return int(self._t.inplace_version)


def encode_paddle(t: paddle.Tensor) -> tuple[TensorMeta, np.ndarray]:
    """:func:`~tensorstore_hooks._codec.encode` for a paddle tensor (metadata says paddle)."""
    meta, payload = encode(to_torch(t))
    meta = dataclasses.replace(
        meta, device=place_of(t), requires_grad=not t.stop_gradient, framework="paddle"
    )
    return meta, payload


def decode_paddle(
    meta: TensorMeta,
    payload: Buffer | torch.Tensor,
    *,
    device: object = None,
    requires_grad: bool | None = None,
) -> paddle.Tensor:
    """Rebuild a paddle tensor stored by :func:`encode_paddle` (on ``device``, as
    :func:`to_place` takes it, or its own place). ``payload``: any buffer the codec's
    ``decode`` takes."""
    host = dataclasses.replace(meta, device="cpu", framework="torch")
    t = decode(host, payload, device="cpu", requires_grad=False)
    want_grad = meta.requires_grad if requires_grad is None else requires_grad
    return from_torch(t, meta.device if device is None else device, stop_gradient=not want_grad)


class _PaddleAdapter:
    """Paddle's :class:`~tensorstore_hooks._codec.FrameworkAdapter`."""

    name = "paddle"
    is_tensor = staticmethod(is_paddle_tensor)
    encode = staticmethod(encode_paddle)
    decode = staticmethod(decode_paddle)


ADAPTER = _PaddleAdapter()
"""The paddle entry of the framework adapter registry (``_adapters.py``)."""
