"""One conformance suite for every :class:`~tensorstore_hooks.TensorStore`.

Subclass :class:`StoreConformance` in a ``test_*.py`` module and provide a ``store``
fixture that yields an *open* store and closes it afterwards (closing twice must be
harmless: some tests close the store themselves)::

    class TestMyStore(StoreConformance):
        @pytest.fixture
        def store(self):
            s = open_store("my://...")
            yield s
            s.close()

Optional class attributes tune the suite: ``large_nbytes`` (a payload larger than the
store's chunk size). The module also holds the tensor factories and the bit-exact
comparison the codec tests share.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tensorstore_hooks import (
    KeyNotFoundError,
    StoreUnavailableError,
    TensorStore,
    TensorStoreError,
    UnsupportedTensorError,
)
from tensorstore_hooks._codec import DTYPES, span_of

__all__ = [
    "ALL_DTYPES",
    "LAYOUTS",
    "UNSUPPORTED_KINDS",
    "StoreConformance",
    "WrappedStore",
    "assert_same_tensor",
    "random_tensor",
    "unsupported_tensors",
]

ALL_DTYPES: list[str] = sorted(DTYPES)
"""Every dtype the codec supports, by torch name."""


def random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, *, gen: torch.Generator | None = None
) -> torch.Tensor:
    """A contiguous tensor of random *bit patterns* (NaN payloads and all).

    Random bits rather than random values: any float conversion on the way through a
    store would change some of them, so bit-exact comparison catches it.
    """
    n = 1
    for s in shape:
        n *= s
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(
    got: torch.Tensor, want: torch.Tensor, *, device: torch.device | None = None
) -> None:
    """``got`` is ``want`` bit for bit: dtype, shape, strides, grad flag, bits; on a
    storage of its own span (offset 0), never one the size of ``want``'s base."""
    assert type(got) is torch.Tensor
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.stride() == want.stride(), (got.stride(), want.stride())
    assert got.storage_offset() == 0
    span = span_of(tuple(want.shape), want.stride())
    assert got.untyped_storage().nbytes() == span * want.element_size()
    assert got.requires_grad == want.requires_grad
    assert got.device == (device if device is not None else want.device)
    assert torch.equal(_bits(got), _bits(want))


def _contiguous(dtype: torch.dtype) -> torch.Tensor:
    return random_tensor((3, 5), dtype)


def _scalar(dtype: torch.dtype) -> torch.Tensor:
    return random_tensor((), dtype)


def _zero_size(dtype: torch.dtype) -> torch.Tensor:
    return random_tensor((0, 4), dtype)


def _zero_size_view(dtype: torch.dtype) -> torch.Tensor:
    return random_tensor((6, 4), dtype)[3:3]  # empty, with a storage offset


def _transposed(dtype: torch.dtype) -> torch.Tensor:
    return random_tensor((4, 6), dtype).t()


def _channels_last(dtype: torch.dtype) -> torch.Tensor:
    t = random_tensor((2, 3, 4, 5), dtype).contiguous(memory_format=torch.channels_last)
    assert t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
    return t


def _offset_rows(dtype: torch.dtype) -> torch.Tensor:
    return random_tensor((10, 8), dtype)[3:7]  # dense, storage offset 24


def _offset_block(dtype: torch.dtype) -> torch.Tensor:
    return random_tensor((10, 8), dtype)[3:7, 2:6]  # storage offset and gaps


def _expanded(dtype: torch.dtype) -> torch.Tensor:
    return random_tensor((1, 5), dtype).expand(4, 5)  # stride (0, 1)


def _gapped(dtype: torch.dtype) -> torch.Tensor:
    return random_tensor((4, 6), dtype)[:, ::2]


def _strided_1d(dtype: torch.dtype) -> torch.Tensor:
    return random_tensor((20,), dtype)[1::3]


def _overlapping(dtype: torch.dtype) -> torch.Tensor:
    return random_tensor((7,), dtype).as_strided((3, 3), (1, 1), 1)  # sliding windows


LAYOUTS: dict[str, Callable[[torch.dtype], torch.Tensor]] = {
    "contiguous": _contiguous,
    "scalar": _scalar,
    "zero_size": _zero_size,
    "zero_size_view": _zero_size_view,
    "transposed": _transposed,
    "channels_last": _channels_last,
    "offset_rows": _offset_rows,
    "offset_block": _offset_block,
    "expanded": _expanded,
    "gapped": _gapped,
    "strided_1d": _strided_1d,
    "overlapping": _overlapping,
}
"""Layout name -> factory(dtype) of a tensor with that layout (random bits)."""

LAYOUT_DTYPES = [torch.float32, torch.bfloat16, torch.bool, torch.complex64, torch.uint8]


class _Sub(torch.Tensor):
    pass


UNSUPPORTED_KINDS = ["sparse_coo", "sparse_csr", "quantized", "nested", "meta", "subclass"]


def unsupported_tensors() -> dict[str, torch.Tensor]:
    """Tensors no store can hold: sparse, quantized, nested, meta, a subclass."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR and nested tensors warn they are beta
        out = {
            "sparse_coo": torch.eye(3).to_sparse(),
            "sparse_csr": torch.eye(3).to_sparse_csr(),
            "quantized": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8),
            "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            "meta": torch.empty(3, device="meta"),
            "subclass": torch.ones(3).as_subclass(_Sub),
        }
    assert list(out) == UNSUPPORTED_KINDS
    return out


class StoreConformance:
    """The behaviour every TensorStore promises. Subclasses provide a ``store`` fixture."""

    large_nbytes: int = 9 << 20
    """A payload larger than the store's chunk size (ZarrStore's default is 8 MiB)."""

    # ------------------------------------------------------------ round trips
    @pytest.mark.parametrize("dtype_name", ALL_DTYPES)
    def test_round_trip_every_dtype(self, store: TensorStore, dtype_name: str) -> None:
        dtype = DTYPES[dtype_name][0]
        t = random_tensor((7, 3), dtype)
        key = store.put(t)
        assert isinstance(key, str)
        assert_same_tensor(store.get(key), t)

    @pytest.mark.parametrize("dtype", LAYOUT_DTYPES, ids=str)
    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_round_trip_layouts(self, store: TensorStore, layout: str, dtype: torch.dtype) -> None:
        t = LAYOUTS[layout](dtype)
        key = store.put(t)
        assert_same_tensor(store.get(key), t)

    def test_channels_last_stays_channels_last(self, store: TensorStore) -> None:
        t = LAYOUTS["channels_last"](torch.float32)
        got = store.get(store.put(t))
        assert got.is_contiguous(memory_format=torch.channels_last)

    def test_large_multi_chunk(self, store: TensorStore) -> None:
        n = self.large_nbytes // 4 + 12345  # not a multiple of any chunk size
        t = torch.randn(n)
        key = store.put(t)
        assert_same_tensor(store.get(key), t)
        # A large strided view of a large tensor too.
        v = t[7:].view(-1)[: (n - 7) // 2 * 2].view(-1, 2).t()
        assert_same_tensor(store.get(store.put(v)), v)

    @pytest.mark.parametrize(
        "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.complex64], ids=str
    )
    def test_requires_grad_preserved(self, store: TensorStore, dtype: torch.dtype) -> None:
        leaf = torch.randn(4, 3, dtype=dtype, requires_grad=True)
        got = store.get(store.put(leaf))
        assert got.requires_grad and got.is_leaf and got.grad_fn is None
        assert_same_tensor(got, leaf)
        # A non-leaf comes back as a leaf that requires grad; no graph is stored.
        nonleaf = leaf * 2
        got = store.get(store.put(nonleaf))
        assert got.requires_grad and got.is_leaf
        assert torch.equal(got.detach(), nonleaf.detach())
        plain = torch.randn(3)
        assert not store.get(store.put(plain)).requires_grad

    def test_get_to_cpu(self, store: TensorStore) -> None:
        t = LAYOUTS["transposed"](torch.float32)
        got = store.get(store.put(t), device="cpu")
        assert_same_tensor(got, t, device=torch.device("cpu"))
        got = store.get(store.put(t), device=torch.device("cpu"))
        assert got.device.type == "cpu"

    def test_put_copies(self, store: TensorStore) -> None:
        t = torch.arange(1000, dtype=torch.float32)
        want = t.clone()
        key = store.put(t)
        t.zero_()  # the caller may reuse the tensor right after put returns
        assert torch.equal(store.get(key), want)

    def test_gets_are_independent(self, store: TensorStore) -> None:
        t = torch.arange(100, dtype=torch.int64)
        key = store.put(t)
        a = store.get(key)
        a.fill_(-1)  # mutating one result must not leak into the next
        assert torch.equal(store.get(key), t)

    # ------------------------------------------------------------ inventory
    def test_inventory(self, store: TensorStore) -> None:
        base_len, base_bytes = len(store), store.nbytes
        tensors = [torch.full((n,), float(n)) for n in (1, 10, 1000, 5000)]
        keys = [store.put(t) for t in tensors]
        assert len(set(keys)) == len(keys)
        assert len(store) == base_len + 4
        assert store.nbytes == base_bytes + sum(t.numel() * 4 for t in tensors)
        assert set(keys) <= set(store.keys())
        for key in keys:
            assert key in store
        store.delete(keys[1])
        assert keys[1] not in store
        assert keys[1] not in set(store.keys())
        assert len(store) == base_len + 3
        assert store.nbytes == base_bytes + sum(
            t.numel() * 4 for i, t in enumerate(tensors) if i != 1
        )
        for key in (keys[0], keys[2], keys[3]):
            store.delete(key)
        assert len(store) == base_len
        assert store.nbytes == base_bytes
        assert not set(keys) & set(store.keys())

    def test_keys_is_a_snapshot(self, store: TensorStore) -> None:
        keys = [store.put(torch.ones(3)) for _ in range(5)]
        it = store.keys()
        for key in keys:
            store.delete(key)  # must not break the iteration already made
        assert sorted(it) == sorted(keys)

    def test_contains_non_keys(self, store: TensorStore) -> None:
        assert "no-such-key" not in store
        assert 12345 not in store
        assert None not in store

    # --------------------------------------------------------------- errors
    def test_missing_key(self, store: TensorStore) -> None:
        with pytest.raises(KeyNotFoundError) as info:
            store.get("no-such-key")
        assert isinstance(info.value, KeyError)
        assert isinstance(info.value, TensorStoreError)
        assert "no-such-key" in str(info.value)

    def test_deleted_key_is_missing(self, store: TensorStore) -> None:
        key = store.put(torch.ones(5))
        store.delete(key)
        with pytest.raises(KeyNotFoundError):
            store.get(key)
        with pytest.raises(KeyError):
            store.delete(key)

    def test_delete_missing(self, store: TensorStore) -> None:
        with pytest.raises(KeyNotFoundError, match="no-such-key"):
            store.delete("no-such-key")

    def test_delete_many_ignores_missing(self, store: TensorStore) -> None:
        keys = [store.put(torch.ones(3)) for _ in range(3)]
        store.delete_many([*keys, "no-such-key"])
        assert not any(k in store for k in keys)

    @pytest.mark.parametrize("kind", UNSUPPORTED_KINDS)
    def test_unsupported_tensor(self, store: TensorStore, kind: str) -> None:
        t = unsupported_tensors()[kind]
        before = len(store)
        with pytest.raises(UnsupportedTensorError) as info:
            store.put(t)
        assert isinstance(info.value, TypeError)
        assert len(store) == before

    def test_not_a_tensor(self, store: TensorStore) -> None:
        with pytest.raises(UnsupportedTensorError):
            store.put([1.0, 2.0])  # type: ignore[arg-type]

    def test_closed_store(self, store: TensorStore) -> None:
        key = store.put(torch.ones(3))
        store.close()
        store.close()  # idempotent
        with pytest.raises(StoreUnavailableError) as info:
            store.put(torch.ones(3))
        assert isinstance(info.value, ConnectionError)
        with pytest.raises(StoreUnavailableError):
            store.get(key)

    def test_context_manager_closes(self, store: TensorStore) -> None:
        with store as s:
            assert s is store
            key = s.put(torch.ones(2))
            assert torch.equal(s.get(key), torch.ones(2))
        with pytest.raises(StoreUnavailableError):
            store.put(torch.ones(2))

    def test_context_manager_closes_on_error(self, store: TensorStore) -> None:
        with pytest.raises(RuntimeError, match="boom"), store:
            raise RuntimeError("boom")
        with pytest.raises(StoreUnavailableError):
            store.put(torch.ones(2))

    # ----------------------------------------------------------- concurrency
    def test_concurrent_put_get(self, store: TensorStore) -> None:
        errors: list[BaseException] = []
        start = threading.Barrier(4)

        def worker(seed: int) -> None:
            try:
                gen = torch.Generator().manual_seed(seed)
                start.wait(timeout=30)
                mine: dict[str, torch.Tensor] = {}
                for i in range(25):
                    shape = (int(torch.randint(1, 3000, (1,), generator=gen)),)
                    t = random_tensor(shape, torch.float32, gen=gen)
                    if i % 3 == 0:
                        t = t[::2]
                    mine[store.put(t)] = t
                    if i % 4 == 3:  # interleave deletes with other threads' puts
                        key = next(iter(mine))
                        assert_same_tensor(store.get(key), mine.pop(key))
                        store.delete(key)
                for key, t in mine.items():
                    assert_same_tensor(store.get(key), t)
                    store.delete(key)
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        before = len(store)
        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not any(th.is_alive() for th in threads), "a store call hung"
        if errors:
            raise errors[0]
        assert len(store) == before


class WrappedStore(TensorStore):
    """A user-style TensorStore subclass delegating to ``inner``; tests override methods.

    Counts calls (``puts``, ``gets``, ``deletes``) and records the order of ``get``
    keys, with the name of the thread that asked, in ``get_log``. Thread-safe.
    """

    def __init__(self, inner: TensorStore | None = None) -> None:
        from tensorstore_hooks import open_store

        self.inner = inner if inner is not None else open_store("memory://")
        self.lock = threading.Lock()
        self.puts = 0
        self.gets = 0
        self.deletes = 0
        self.put_log: list[str] = []
        self.get_log: list[tuple[str, str]] = []

    def put(self, tensor: torch.Tensor) -> str:
        key = self.inner.put(tensor)
        with self.lock:
            self.puts += 1
            self.put_log.append(key)
        return key

    def get(self, key: str, *, device: torch.device | str | None = None) -> torch.Tensor:
        with self.lock:
            self.gets += 1
            self.get_log.append((key, threading.current_thread().name))
        return self.inner.get(key, device=device)

    def delete(self, key: str) -> None:
        self.inner.delete(key)
        with self.lock:
            self.deletes += 1

    def keys(self) -> Any:
        return self.inner.keys()

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def close(self) -> None:
        self.inner.close()
