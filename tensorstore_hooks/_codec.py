"""Tensor <-> (metadata, bytes): the exact, pickle-free serialisation of one tensor.

A tensor is stored as the raw bytes of the part of its storage it covers, plus a
:class:`TensorMeta`. Two payload forms exist:

* **span** (``compact=False``): the bytes of ``storage[offset : offset + span]`` where
  ``span`` is the distance from the first to the last element the view touches. Used
  whenever ``span <= numel``: dense layouts of any stride order (contiguous,
  transposed, channels_last) and overlapping views such as an ``expand``-ed tensor,
  whose stride-0 dimensions are therefore never materialised.
* **compact** (``compact=True``): the elements in row-major order, used for views with
  gaps (``x[:, ::2]``, one chunk of a split) where ``span > numel``.

Either way the stored byte count is ``min(numel, span) * itemsize`` and ``decode``
rebuilds the same shape and strides on a storage of the view's span, never more: a
small view of a huge storage comes back with a storage of its own (its storage
offset is then 0), not a new storage the size of the one it was cut from (on CPU
that was address space; on an accelerator it would be real memory). Keeping strides
matters beyond aesthetics: a transposed operand sends a matmul down a different BLAS
path, and a different summation order would break bit-identical gradients.

Dtypes numpy lacks (bfloat16, float8 variants, complex32) are described by their
torch name plus a same-width unsigned ``storage_dtype`` so a plain numpy/zarr reader
can still get at the bits.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

import numpy as np
import torch

from tensorstore_hooks._adapters import ForeignTensor, adapter_named, framework_of, frameworks
from tensorstore_hooks.errors import IntegrityError, UnsupportedTensorError

__all__ = [
    "DTYPES",
    "Buffer",
    "FrameworkAdapter",
    "MetaDict",
    "TensorMeta",
    "as_memoryview",
    "check_supported",
    "decode",
    "encode",
    "is_dense",
    "span_of",
    "unsupported_reason",
]


Buffer: TypeAlias = bytes | bytearray | memoryview | np.ndarray
"""Raw bytes as the stores, the wire and the codec pass them: anything ``memoryview()``
takes here (a numpy array counts by its bytes, whatever its dtype)."""


def as_memoryview(buf: Buffer) -> memoryview:
    """``memoryview(buf)``. A numpy array goes by its ``.data`` (the same view): numpy
    declares the buffer protocol to type checkers only from Python 3.12 on."""
    return buf.data if isinstance(buf, np.ndarray) else memoryview(buf)


MetaDict: TypeAlias = dict[str, str | int | bool | list[int]]
""":meth:`TensorMeta.to_dict`: the metadata as a msgpack/JSON map."""


def _build_dtype_table() -> dict[str, tuple[torch.dtype, str]]:
    """torch dtype name -> (dtype, numpy storage dtype string) for every savable dtype."""
    table: dict[str, tuple[torch.dtype, str]] = {}
    native = {
        "bool": "|b1",
        "uint8": "|u1",
        "int8": "|i1",
        "int16": "<i2",
        "int32": "<i4",
        "int64": "<i8",
        "uint16": "<u2",
        "uint32": "<u4",
        "uint64": "<u8",
        "float16": "<f2",
        "float32": "<f4",
        "float64": "<f8",
        "complex64": "<c8",
        "complex128": "<c16",
    }
    # No numpy equivalent: stored as same-width unsigned ints.
    foreign = {
        "bfloat16": "<u2",
        "complex32": "<u4",
        "float8_e4m3fn": "|u1",
        "float8_e4m3fnuz": "|u1",
        "float8_e5m2": "|u1",
        "float8_e5m2fnuz": "|u1",
        "float8_e8m0fnu": "|u1",
    }
    for name, np_dtype in {**native, **foreign}.items():
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            table[name] = (dtype, np_dtype)
    return table


DTYPES: dict[str, tuple[torch.dtype, str]] = _build_dtype_table()
_NAME_OF: dict[torch.dtype, str] = {dtype: name for name, (dtype, _) in DTYPES.items()}

# Bounds applied to metadata read back from a store or the wire.
_MAX_NDIM = 64
_MAX_NBYTES = 1 << 48
_DEVICE_RE = re.compile(r"[a-z][a-z0-9_]{0,15}(:\d{1,4})?")  # fullmatch: "$" allows "\n"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Everything needed to rebuild a tensor from its payload bytes."""

    dtype: str
    """torch dtype name, e.g. ``"bfloat16"``."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    """Strides in elements, as the original tensor had them."""
    storage_offset: int
    """Storage offset in elements, as the original tensor had it (recorded only: a view
    comes back at offset 0, on a storage of its own span)."""
    compact: bool
    """True: payload is the elements in row-major order; False: the storage span."""
    device: str
    """Original device, e.g. ``"cpu"`` or ``"cuda:1"``."""
    requires_grad: bool
    """For paddle tensors: ``not stop_gradient``."""
    nbytes: int
    """Payload length in bytes."""
    framework: str = "torch"
    """Whose tensor ``get`` rebuilds: ``"torch"`` or a registered framework adapter's
    name (``"paddle"``: devices then read ``"cpu"``, ``"gpu:0"``; see ``_adapters.py``)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def storage_dtype(self) -> str:
        """numpy dtype string of the payload's elements (same width as the torch dtype)."""
        return DTYPES[self.dtype][1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def span(self) -> int:
        """Elements between the first and last element the view touches, inclusive."""
        return span_of(self.shape, self.stride)

    def to_dict(self) -> MetaDict:
        """A msgpack/JSON-safe dict (also readable by people inspecting a store)."""
        return {
            "dtype": self.dtype,
            "storage_dtype": self.storage_dtype,
            "shape": list(self.shape),
            "stride": list(self.stride),
            "storage_offset": self.storage_offset,
            "compact": self.compact,
            "device": self.device,
            "requires_grad": self.requires_grad,
            "nbytes": self.nbytes,
            **({} if self.framework == "torch" else {"framework": self.framework}),
        }

    @classmethod
    def from_dict(cls, d: object) -> TensorMeta:
        """Validate untrusted metadata (from disk or the wire) and build a TensorMeta.

        Raises :class:`IntegrityError` naming the bad field.
        """
        if not isinstance(d, dict):
            raise IntegrityError(f"tensor metadata: expected a map, got {type(d).__name__}")
        try:
            dtype = d["dtype"]
            shape = d["shape"]
            stride = d["stride"]
            offset = d["storage_offset"]
            compact = d["compact"]
            device = d["device"]
            requires_grad = d["requires_grad"]
            nbytes = d["nbytes"]
        except KeyError as e:
            raise IntegrityError(f"tensor metadata: missing field {e.args[0]!r}") from e
        framework = d.get("framework", "torch")
        if framework not in frameworks():
            raise IntegrityError(f"tensor metadata: unknown framework {framework!r}")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise IntegrityError(f"tensor metadata: unknown dtype {dtype!r}")
        for name, seq in (("shape", shape), ("stride", stride)):
            if (
                not isinstance(seq, list | tuple)
                or len(seq) > _MAX_NDIM
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in seq)
            ):
                raise IntegrityError(f"tensor metadata: bad {name} {seq!r}")
        if len(shape) != len(stride):
            raise IntegrityError(
                f"tensor metadata: shape {shape} and stride {stride} differ in rank"
            )
        for name, val in (("storage_offset", offset), ("nbytes", nbytes)):
            if not isinstance(val, int) or isinstance(val, bool) or not 0 <= val <= _MAX_NBYTES:
                raise IntegrityError(f"tensor metadata: bad {name} {val!r}")
        if not isinstance(compact, bool) or not isinstance(requires_grad, bool):
            raise IntegrityError("tensor metadata: compact/requires_grad must be booleans")
        if not isinstance(device, str) or not _DEVICE_RE.fullmatch(device):
            raise IntegrityError(f"tensor metadata: bad device {device!r}")
        meta = cls(
            dtype=dtype,
            shape=tuple(shape),
            stride=tuple(stride),
            storage_offset=offset,
            compact=compact,
            device=device,
            requires_grad=requires_grad,
            nbytes=nbytes,
            framework=framework,
        )
        itemsize = meta.torch_dtype.itemsize
        numel = math.prod(meta.shape)
        if numel * itemsize > _MAX_NBYTES:
            raise IntegrityError(f"tensor metadata: shape {shape} is too large")
        expected = (numel if compact else min(numel, meta.span) if numel else 0) * itemsize
        if expected != nbytes:
            raise IntegrityError(
                f"tensor metadata: nbytes {nbytes} does not match shape {shape}, "
                f"stride {stride} and dtype {dtype} (expected {expected})"
            )
        return meta


@runtime_checkable
class FrameworkAdapter(Protocol):
    """What another framework's adapter provides (a module or any object with these
    attributes), registered by name in ``_adapters.py`` and checked against this
    Protocol when the codec loads it."""

    name: str
    """The ``framework`` written into a stored tensor's metadata."""

    def is_tensor(self, obj: object) -> bool:
        """True for a tensor of this framework (checked without importing it)."""

    def encode(self, t: ForeignTensor) -> tuple[TensorMeta, np.ndarray]:
        """``(TensorMeta, numpy uint8 payload)`` as :func:`encode` returns them."""

    def decode(
        self,
        meta: TensorMeta,
        payload: Buffer | torch.Tensor,
        *,
        device: torch.device | str | None = None,
        requires_grad: bool | None = None,
    ) -> ForeignTensor:
        """The framework's tensor rebuilt from what :meth:`encode` returned."""


def _adapter(name: str) -> FrameworkAdapter:
    """The registered adapter of framework ``name`` (``KeyError`` if none); a target
    that is not a :class:`FrameworkAdapter` is a ``TypeError`` naming it."""
    adapter = adapter_named(name)
    if not isinstance(adapter, FrameworkAdapter):
        raise TypeError(
            f"codec: the adapter registered for framework {name!r} ({adapter!r}) lacks "
            "name/is_tensor/encode/decode (see _codec.FrameworkAdapter)"
        )
    return adapter


def _adapter_for(obj: object) -> FrameworkAdapter | None:
    """The adapter whose framework ``obj`` is a tensor of, or ``None``."""
    name = framework_of(obj)
    if name is None:
        return None
    adapter = _adapter(name)
    return adapter if adapter.is_tensor(obj) else None


def span_of(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from a view's first to its last element (0 for an empty view)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))


def is_dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True if the view's elements exactly fill its storage span (any dimension order)."""
    if any(s == 0 for s in shape):
        return True
    expected = 1
    for size, st in sorted(
        (p for p in zip(shape, stride, strict=True) if p[0] != 1), key=lambda p: p[1]
    ):
        if st != expected:
            return False
        expected *= size
    return True


def unsupported_reason(t: torch.Tensor) -> str | None:
    """Why ``t`` cannot be stored, or ``None`` if it can. Cheap; used on the hook's hot path."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return f"tensor subclass {type(t).__qualname__}"
    if t.layout is not torch.strided:
        return f"layout {t.layout}"
    if t.is_quantized:
        return "quantized tensor"
    if t.is_nested:
        return "nested tensor"
    if t.device.type == "meta":
        return "meta tensor (no data)"
    if t.dtype not in _NAME_OF:
        return f"dtype {t.dtype}"
    return None


def check_supported(t: object) -> torch.Tensor:
    """Return ``t`` if it can be stored, else raise :class:`UnsupportedTensorError`."""
    if not isinstance(t, torch.Tensor):
        raise UnsupportedTensorError(
            f"codec: expected a torch.Tensor or paddle.Tensor, got {type(t).__name__}; "
            "convert it with torch.as_tensor"
        )
    reason = unsupported_reason(t)
    if reason is not None:
        raise UnsupportedTensorError(
            f"codec: cannot store a {reason}; only dense strided tensors of a built-in dtype "
            "are stored (the offload hooks keep such tensors where they are)"
        )
    return t


def encode(t: torch.Tensor | ForeignTensor) -> tuple[TensorMeta, np.ndarray]:
    """Serialise ``t``: returns its metadata and a 1-D uint8 numpy payload.

    For a CPU tensor whose span is no larger than its element count the payload is a
    zero-copy view of the tensor's storage: the caller must finish with it before the
    tensor is modified. Other tensors are copied (gapped views are compacted, device
    tensors come to host). Another framework's tensor (``paddle.Tensor``) is encoded
    by its adapter (``_adapters.py``). Raises :class:`UnsupportedTensorError`.
    """
    if not isinstance(t, torch.Tensor):
        adapter = _adapter_for(t)
        if adapter is not None:
            return adapter.encode(t)
    check_supported(t)
    requires_grad = t.requires_grad  # before detach(), which clears it
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    shape = tuple(t.shape)
    stride = tuple(t.stride())
    offset = int(t.storage_offset())
    numel = t.numel()
    span = span_of(shape, stride)
    compact = span > numel
    region = t.contiguous().view(-1) if compact else t.as_strided((span,), (1,), offset)
    if region.device.type != "cpu":
        region = region.cpu()
    payload = _bytes_of(region.view(torch.uint8))
    meta = TensorMeta(
        dtype=_NAME_OF[t.dtype],
        shape=shape,
        stride=stride,
        storage_offset=offset,
        compact=compact,
        device=str(t.device),
        requires_grad=requires_grad,
        nbytes=payload.nbytes,
    )
    return meta, payload


class _Bytes:
    """A 1-D uint8 CPU tensor's bytes as numpy sees them, the tensor kept alive.

    Not ``tensor.numpy()``: that marks the caller's storage as not resizable, for
    good (FSDP2 frees unsharded parameters with ``storage.resize_(0)``); DLPack
    would do too, at twice this cost.
    """

    __slots__ = ("__array_interface__", "_tensor")

    def __init__(self, t: torch.Tensor) -> None:
        self._tensor = t
        self.__array_interface__ = {
            "shape": (t.numel(),),
            "typestr": "|u1",
            "data": (t.data_ptr(), False),
            "version": 3,
        }


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The bytes of contiguous 1-D uint8 CPU tensor ``t``, zero-copy, writable."""
    if not t.numel():
        return np.empty(0, dtype=np.uint8)
    return np.asarray(_Bytes(t))


def _as_uint8(payload: Buffer | torch.Tensor) -> torch.Tensor:
    if isinstance(payload, torch.Tensor):
        return payload.view(torch.uint8).view(-1)
    if isinstance(payload, np.ndarray):
        if not payload.flags.writeable:
            payload = payload.copy()
        return torch.from_numpy(payload.view(np.uint8).reshape(-1))
    mv = as_memoryview(payload)
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if mv.readonly:
        return torch.frombuffer(bytearray(mv), dtype=torch.uint8)
    return torch.frombuffer(mv, dtype=torch.uint8)


def decode(
    meta: TensorMeta,
    payload: Buffer | torch.Tensor,
    *,
    device: torch.device | str | None = None,
    requires_grad: bool | None = None,
) -> torch.Tensor | ForeignTensor:
    """Rebuild the tensor described by ``meta`` from ``payload``.

    ``payload`` is any buffer (bytearray, numpy array, uint8 tensor) of ``meta.nbytes``
    bytes; writable buffers are used without a copy, so the caller must not reuse
    them. ``device`` defaults to the original device; ``requires_grad`` to the
    original flag. A tensor stored from another framework comes back as that
    framework's tensor, through its adapter (paddle: ``device`` then takes ``"cpu"``,
    ``"gpu:0"`` or a paddle place). Raises :class:`IntegrityError` if the payload
    length is wrong.
    """
    if meta.framework != "torch":
        adapter = _adapter(meta.framework)
        return adapter.decode(meta, payload, device=device, requires_grad=requires_grad)
    raw = _as_uint8(payload)
    if raw.numel() != meta.nbytes:
        raise IntegrityError(
            f"codec: payload has {raw.numel()} bytes but the metadata says {meta.nbytes} "
            "(truncated or corrupted entry)"
        )
    dtype = meta.torch_dtype
    target = torch.device(device if device is not None else meta.device)
    flat = raw.view(dtype) if meta.nbytes else torch.empty(0, dtype=dtype)
    with torch.no_grad():
        # A storage of the view's span (module docstring): the payload itself when it
        # is that span, else a new one the compact elements are spread into.
        if meta.compact:
            base = torch.empty(meta.span, dtype=dtype, device=target)
        else:
            base = flat.to(target)
        out = base.as_strided(meta.shape, meta.stride, 0)
        if meta.compact and meta.numel:
            out.copy_(flat.view(meta.shape))
    want_grad = meta.requires_grad if requires_grad is None else requires_grad
    if want_grad and (dtype.is_floating_point or dtype.is_complex):
        out.requires_grad_(True)
    return out
