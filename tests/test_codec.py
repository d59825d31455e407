"""The codec: tensor <-> (TensorMeta, bytes), exact, compact, pickle-free."""

from __future__ import annotations

import ast
import gc
import math
import pickle
import weakref
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

import tensorstore_hooks
import tensorstore_hooks as tsh
from tensorstore_hooks import IntegrityError, TensorMeta, UnsupportedTensorError
from tensorstore_hooks._codec import DTYPES, decode, encode, span_of
from tensorstore_hooks.testing import (
    ALL_DTYPES,
    LAYOUT_DTYPES,
    LAYOUTS,
    UNSUPPORTED_KINDS,
    assert_same_tensor,
    random_tensor,
    unsupported_tensors,
)

# torch's own warn-once on allocating a complex32 tensor (decode of views does).
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")


def _round_trip(t: torch.Tensor) -> tuple[TensorMeta, np.ndarray, torch.Tensor]:
    meta, payload = encode(t)
    # What a store keeps: the metadata as msgpack and the payload as bytes.
    wire = msgpack.packb(meta.to_dict())
    back = TensorMeta.from_dict(msgpack.unpackb(wire))
    assert back == meta
    return meta, payload, decode(back, bytearray(payload.tobytes()))


def test_dtype_table_covers_torch() -> None:
    for name in (
        "bfloat16",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "float8_e4m3fn",
        "float8_e5m2",
    ):
        assert name in DTYPES, name
    for name in ("uint16", "uint32", "uint64", "complex32", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        if isinstance(getattr(torch, name, None), torch.dtype):
            assert name in DTYPES, name
    for name, (dtype, storage) in DTYPES.items():
        assert np.dtype(storage).itemsize == dtype.itemsize, name


@pytest.mark.parametrize("dtype_name", ALL_DTYPES)
def test_every_dtype(dtype_name: str) -> None:
    dtype = DTYPES[dtype_name][0]
    t = random_tensor((5, 7), dtype)
    meta, payload, back = _round_trip(t)
    assert meta.dtype == dtype_name
    assert np.dtype(meta.storage_dtype).itemsize == dtype.itemsize
    assert payload.dtype == np.uint8 and payload.nbytes == t.numel() * dtype.itemsize
    assert_same_tensor(back, t)


@pytest.mark.parametrize("dtype_name", ALL_DTYPES)
def test_every_dtype_layouts(dtype_name: str) -> None:
    dtype = DTYPES[dtype_name][0]
    for layout in ("scalar", "zero_size", "transposed", "gapped", "expanded"):
        t = LAYOUTS[layout](dtype)
        assert_same_tensor(_round_trip(t)[2], t)


@pytest.mark.parametrize("dtype", LAYOUT_DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout(layout: str, dtype: torch.dtype) -> None:
    t = LAYOUTS[layout](dtype)
    meta, payload, back = _round_trip(t)
    assert_same_tensor(back, t)
    assert meta.shape == tuple(t.shape)
    assert meta.stride == t.stride()
    assert meta.storage_offset == t.storage_offset()
    # Stored bytes never exceed the elements or the storage span the view covers.
    span = span_of(tuple(t.shape), t.stride())
    assert payload.nbytes == meta.nbytes
    assert payload.nbytes <= min(t.numel(), span) * t.element_size()


def test_expanded_not_materialised() -> None:
    row = torch.randn(1, 1000)
    t = row.expand(1000, 1000)
    _, payload, back = _round_trip(t)
    assert payload.nbytes == 1000 * 4  # not 4 MB
    assert back.stride() == (0, 1)
    assert torch.equal(back, t)


def test_gapped_is_compact() -> None:
    base = torch.randn(100, 100)
    t = base[:, ::10]
    meta, payload, back = _round_trip(t)
    assert meta.compact
    assert payload.nbytes == t.numel() * 4  # not the 9901-element span
    assert_same_tensor(back, t)


def test_sliced_costs_only_its_span() -> None:
    base = torch.randn(1000, 100)
    t = base[500:510]
    meta, payload, back = _round_trip(t)
    assert not meta.compact
    assert payload.nbytes == 10 * 100 * 4
    assert back.untyped_storage().nbytes() == 10 * 100 * 4  # not the base's 400 KB
    assert_same_tensor(back, t)


def test_conj_and_neg_views_resolved() -> None:
    z = torch.randn(4, dtype=torch.complex64)
    zc = z.conj()
    assert zc.is_conj()
    back = _round_trip(zc)[2]
    assert torch.equal(back, zc.resolve_conj()) and not back.is_conj()
    n = torch.randn(3, dtype=torch.complex64)._neg_view()
    assert n.is_neg()
    assert torch.equal(_round_trip(n)[2], n.resolve_neg())


def test_payload_of_cpu_tensor_is_zero_copy() -> None:
    t = torch.randn(256)
    _, payload = encode(t)
    assert payload.ctypes.data == t.data_ptr()


def test_decode_devices_and_grad_flag() -> None:
    t = torch.randn(3, 4, requires_grad=True)
    meta, payload = encode(t)
    assert meta.requires_grad and meta.device == "cpu"
    back = decode(meta, payload.copy(), device="cpu", requires_grad=False)
    assert not back.requires_grad
    back = decode(meta, payload.copy())
    assert back.requires_grad and back.is_leaf
    ints = torch.arange(4)
    m2, p2 = encode(ints)
    assert not decode(m2, p2.copy(), requires_grad=True).requires_grad  # ints cannot


@pytest.mark.parametrize(
    "payload_kind", ["bytes", "bytearray", "memoryview", "numpy", "readonly_numpy", "tensor"]
)
def test_decode_accepts_buffers(payload_kind: str) -> None:
    t = torch.randn(5, 6).t()
    meta, payload = encode(t)
    raw = payload.tobytes()
    buf: Any = {
        "bytes": raw,
        "bytearray": bytearray(raw),
        "memoryview": memoryview(bytearray(raw)),
        "numpy": np.frombuffer(bytearray(raw), dtype=np.uint8),
        "readonly_numpy": np.frombuffer(raw, dtype=np.uint8),
        "tensor": torch.frombuffer(bytearray(raw), dtype=torch.uint8),
    }[payload_kind]
    assert_same_tensor(decode(meta, buf), t)


@pytest.mark.parametrize("delta", [-1, 1, -4])
def test_decode_rejects_wrong_length(delta: int) -> None:
    t = torch.randn(8)
    meta, payload = encode(t)
    raw = payload.tobytes()
    bad = raw[:delta] if delta < 0 else raw + b"\0" * delta
    with pytest.raises(IntegrityError, match="bytes"):
        decode(meta, bytearray(bad))


@pytest.mark.parametrize("kind", UNSUPPORTED_KINDS)
def test_encode_rejects_unsupported(kind: str) -> None:
    with pytest.raises(UnsupportedTensorError) as info:
        encode(unsupported_tensors()[kind])
    assert isinstance(info.value, TypeError)


# ----------------------------------------------------------------- metadata
def _good() -> dict[str, Any]:
    meta, _ = encode(torch.randn(3, 4)[:, 1:])
    return meta.to_dict()


def _set(**changes: Any) -> dict[str, Any]:
    d = _good()
    d.update(changes)
    return d


def _without(field: str) -> dict[str, Any]:
    d = _good()
    del d[field]
    return d


MALFORMED: dict[str, Any] = {
    "not_a_map": [1, 2, 3],
    "none": None,
    "missing_dtype": _without("dtype"),
    "missing_shape": _without("shape"),
    "missing_stride": _without("stride"),
    "missing_nbytes": _without("nbytes"),
    "missing_device": _without("device"),
    "unknown_dtype": _set(dtype="float128"),
    "dtype_not_str": _set(dtype=7),
    "shape_negative": _set(shape=[-3, 4]),
    "shape_bool": _set(shape=[True, 3]),
    "shape_float": _set(shape=[3.0, 3]),
    "shape_str": _set(shape="3,3"),
    "shape_too_many_dims": _set(shape=[1] * 65, stride=[1] * 65),
    "rank_mismatch": _set(stride=[4]),
    "stride_negative": _set(stride=[4, -1]),
    "offset_negative": _set(storage_offset=-1),
    "offset_bool": _set(storage_offset=True),
    "offset_huge": _set(storage_offset=1 << 60),
    "nbytes_wrong": _set(nbytes=7),
    "nbytes_str": _set(nbytes="36"),
    "compact_not_bool": _set(compact=1),
    "requires_grad_not_bool": _set(requires_grad="yes"),
    "device_injection": _set(device="cuda:0; rm -rf /"),
    "device_not_str": _set(device=0),
    "shape_too_large": _set(shape=[1 << 30, 1 << 30], stride=[1 << 30, 1], nbytes=0),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_meta_rejects_malformed(case: str) -> None:
    with pytest.raises(IntegrityError):
        TensorMeta.from_dict(MALFORMED[case])


def test_meta_error_names_field() -> None:
    with pytest.raises(IntegrityError, match="dtype"):
        TensorMeta.from_dict(_set(dtype="float128"))
    with pytest.raises(IntegrityError, match="nbytes"):
        TensorMeta.from_dict(_set(nbytes=7))
    with pytest.raises(IntegrityError, match="device"):
        TensorMeta.from_dict(_without("device"))


def test_meta_accepts_good_and_round_trips() -> None:
    d = _good()
    meta = TensorMeta.from_dict(d)
    assert meta.to_dict() == d
    assert meta.numel == 9 and meta.span == 11
    assert TensorMeta.from_dict(_set(device="cuda:1")).device == "cuda:1"


def test_meta_is_frozen() -> None:
    meta = TensorMeta.from_dict(_good())
    with pytest.raises(AttributeError):
        meta.dtype = "float64"  # type: ignore[misc]


# ------------------------------------------------------------------ no pickle
_PACKAGE = Path(tensorstore_hooks.__file__).parent


def test_no_pickle_in_sources() -> None:
    """No module of the library imports pickle or calls torch.save/torch.load."""
    roots = [_PACKAGE, _PACKAGE.parent / "server"]
    offenders = []
    for root in roots:
        for path in root.rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                if any(
                    n.split(".")[0] in ("pickle", "cPickle", "_pickle", "dill", "cloudpickle")
                    for n in names
                ):
                    offenders.append(f"{path}:{node.lineno}")
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in ("save", "load")
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "torch"
                ):
                    offenders.append(f"{path}:{node.lineno} torch.{node.attr}")
                if isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                    offenders.append(f"{path}:{node.lineno} allow_pickle")
    assert not offenders, offenders


def test_no_pickle_at_runtime(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A store round trip and an offloaded training step never call pickle."""

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle was used")

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "save", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    import tensorstore_hooks as tsh

    t = torch.randn(4, 5).t()
    for url in (str(tmp_path / "s"), "memory://"):
        with tsh.open_store(url) as store:
            assert_same_tensor(store.get(store.put(t)), t)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    with tsh.offload(min_bytes=0) as hooks:
        loss = model(torch.randn(4, 8)).sum()
    loss.backward()
    assert hooks.stats.tensors_offloaded > 0


def test_span_of() -> None:
    assert span_of((), ()) == 1
    assert span_of((0, 5), (5, 1)) == 0
    assert span_of((3, 4), (4, 1)) == 12
    assert span_of((3, 4), (1, 3)) == 12
    assert span_of((4, 5), (0, 1)) == 5
    assert span_of((4, 3), (6, 2)) == 3 * 6 + 2 * 2 + 1
    t = torch.randn(6, 7)[1:, ::3]
    assert span_of(tuple(t.shape), t.stride()) == math.prod([1]) + (5 - 1) * 7 + (3 - 1) * 3


def test_a_small_view_of_a_huge_storage_comes_back_with_its_own_span() -> None:
    # The case: 40 bytes at offset 3e8 of a 1.2 GB storage (never touched:
    # torch.empty maps it lazily). Each get allocated a new 1.2 GB storage before.
    offset = 300_000_000
    big = torch.empty(offset + 10)
    view = big[offset:]
    view.copy_(torch.arange(10.0))
    store = tsh.open_store("memory://")
    key = store.put(view)
    del big, view
    for _ in range(2):
        back = store.get(key)
        assert back.untyped_storage().nbytes() == 40 and back.storage_offset() == 0
        assert torch.equal(back, torch.arange(10.0))
    store.close()


def test_unpack_of_a_small_view_comes_back_with_its_own_span() -> None:
    offset = 300_000_000
    big = torch.empty(offset + 10)
    big[offset:] = torch.arange(10.0)
    w = torch.randn(10, requires_grad=True)
    with tsh.offload("memory://", min_bytes=0) as hooks:
        y = w * big[offset:]  # mul saves the view for w's gradient
    hooks.flush()
    assert hooks.stats.tensors_offloaded == 1
    saved = y.grad_fn._saved_other  # type: ignore[union-attr]  # runs the unpack hook
    assert saved.untyped_storage().nbytes() == 40 and torch.equal(saved, torch.arange(10.0))
    y.sum().backward()
    assert torch.equal(w.grad, torch.arange(10.0))
    hooks.close()


def test_packing_leaves_the_callers_tensors_as_they_were() -> None:
    # .numpy() of a storage marks it not resizable for good; FSDP2 then failed to
    # free its unsharded parameters (storage.resize_(0)).
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(64, 64))
    with tsh.offload("memory://", min_bytes=0, skip_parameters=False) as hooks:
        out = (x @ w).tanh()  # mm saves x and w; tanh saves its output
        loss = out.sum()
    hooks.flush()
    assert hooks.stats.tensors_offloaded >= 3
    for t in (x, w):
        assert t.untyped_storage().resizable()
    watch = weakref.ref(out)
    del out
    loss.backward()
    del loss
    gc.collect()
    assert watch() is None  # nothing of ours keeps a saved tensor alive once freed
    for t in (x, w):
        assert t.untyped_storage().resizable()
    w.untyped_storage().resize_(0)  # what FSDP2 does after forward
    hooks.close()
    store = tsh.open_store("memory://")
    t = torch.randn(10)
    store.get(store.put(t))
    assert t.untyped_storage().resizable()
    store.close()
