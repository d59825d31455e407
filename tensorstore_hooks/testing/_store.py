"""The conformance suite for :class:`~tensorstore_hooks.TensorStore`: what ``offload()``
relies on, checked on any store, the library's own and yours.

Subclass :class:`StoreConformance` in a ``test_*.py`` module (a class whose name starts
with ``Test``) and give it a ``store`` fixture that yields an *open*, empty store and
closes it afterwards. Closing twice must be harmless: the tests named in
:data:`CLOSES_THE_STORE` close the store themselves::

    import pytest
    from tensorstore_hooks.testing import StoreConformance

    class TestMyStore(StoreConformance):
        large_nbytes = 1 << 20  # more than one of my store's chunks

        @pytest.fixture
        def store(self):
            s = MyStore()
            yield s
            s.close()

The module also ships the pieces the suite is made of, for a store's own tests:
:func:`random_tensor`, :data:`LAYOUTS`, :func:`assert_same_tensor` (bit-exact
comparison) and :func:`unsupported_tensors`; and :class:`WrappedStore`, a delegating
store that counts calls, for testing code that *uses* a store.

This module is for test code: it imports ``pytest`` and ``hypothesis``, which
``import tensorstore_hooks`` never does.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorstore_hooks import (
    KeyNotFoundError,
    StoreUnavailableError,
    TensorStore,
    TensorStoreError,
    UnsupportedTensorError,
)
from tensorstore_hooks.storage import open_store
from tensorstore_hooks.storage.io import DIRECT_IO_MODES, DirectIOStatus

__all__ = [
    "ALL_DTYPES",
    "CLOSES_THE_STORE",
    "LAYOUT_DTYPES",
    "LAYOUTS",
    "UNSUPPORTED_KINDS",
    "StoreConformance",
    "WrappedStore",
    "assert_same_tensor",
    "random_tensor",
    "unsupported_tensors",
]

# The contract's list (DESIGN.md, "Codec"), written out rather than taken from the
# codec: the suite checks stores against the promise, not against the code under test.
_PROMISED_DTYPES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)

ALL_DTYPES: list[str] = sorted(
    name for name in _PROMISED_DTYPES if isinstance(getattr(torch, name, None), torch.dtype)
)
"""Every dtype a store must round-trip, by torch name (those this torch has)."""

CLOSES_THE_STORE: frozenset[str] = frozenset(
    {"test_closed_store", "test_context_manager_closes", "test_context_manager_closes_on_error"}
)
"""The suite's tests that close the store they are given. A ``store`` fixture that
shares one store between tests (an expensive one) gives these a fresh store of
their own: ``request.node.originalname in CLOSES_THE_STORE``."""


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
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.numel() <= 1:  # may keep a stride of 0, which view() refuses across sizes
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def _span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from a view's first to its last element (0 for an empty view)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))


def assert_same_tensor(
    got: torch.Tensor, want: torch.Tensor, *, device: torch.device | None = None
) -> None:
    """``got`` is ``want`` bit for bit: a plain ``torch.Tensor`` of the same dtype,
    shape, strides, ``requires_grad`` and bits, on ``device`` (default: ``want``'s).

    Its storage is its own span at offset 0, never one the size of ``want``'s base: a
    small view of a huge tensor must not come back as a huge allocation.
    """
    assert type(got) is torch.Tensor, f"a {type(got).__name__}, not a plain torch.Tensor"
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.stride() == want.stride(), (got.stride(), want.stride())
    assert got.storage_offset() == 0
    span = _span(tuple(want.shape), want.stride())
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

LAYOUT_DTYPES: list[torch.dtype] = [
    torch.float32,
    torch.bfloat16,
    torch.bool,
    torch.complex64,
    torch.uint8,
]
"""The dtypes each layout is checked with: one of each kind and width class."""


class _Sub(torch.Tensor):
    pass


UNSUPPORTED_KINDS: list[str] = [
    "sparse_coo",
    "sparse_csr",
    "quantized",
    "nested",
    "meta",
    "subclass",
]
"""The kinds of tensor no store holds, by name (the keys of :func:`unsupported_tensors`)."""


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


@st.composite
def _views(draw: st.DrawFn) -> torch.Tensor:
    """Any strided view of a fresh 1-D tensor: 0 to 3 dimensions, sizes 0 to 5 (empty
    ones too), strides 0 to 7 in any order (broadcast, overlapping, gapped), an offset."""
    dtype = draw(st.sampled_from(LAYOUT_DTYPES))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    stride = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    offset = draw(st.integers(0, 5))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    base = random_tensor((offset + _span(shape, stride),), dtype, gen=gen)
    return base.as_strided(shape, stride, offset)


class _RoundTrips:
    """Round trips, alone and from several threads: what comes back is what went in."""

    large_nbytes: int = 9 << 20
    """A payload larger than the store's chunk size (ZarrStore's default is 8 MiB)."""

    view_examples: int = 30
    """Random views :meth:`test_round_trip_any_view` stores (a remote store may want fewer)."""

    @pytest.mark.parametrize("dtype_name", ALL_DTYPES)
    def test_round_trip_every_dtype(self, store: TensorStore, dtype_name: str) -> None:
        """Every promised dtype comes back bit for bit, under a ``str`` key."""
        dtype = getattr(torch, dtype_name)
        t = random_tensor((7, 3), dtype)
        key = store.put(t)
        assert isinstance(key, str)
        assert_same_tensor(store.get(key), t)

    @pytest.mark.parametrize("dtype", LAYOUT_DTYPES, ids=str)
    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_round_trip_layouts(self, store: TensorStore, layout: str, dtype: torch.dtype) -> None:
        """Each layout of :data:`LAYOUTS` keeps its shape and strides, on a storage of
        its own span."""
        t = LAYOUTS[layout](dtype)
        key = store.put(t)
        assert_same_tensor(store.get(key), t)

    def test_round_trip_any_view(self, store: TensorStore) -> None:
        """Random strided views (broadcast, overlapping, gapped, empty) come back as
        they were: a property test over :attr:`view_examples` deterministic examples."""

        @settings(
            max_examples=self.view_examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(view=_views())
        def check(view: torch.Tensor) -> None:
            key = store.put(view)
            assert_same_tensor(store.get(key), view)
            store.delete(key)

        check()

    def test_channels_last_stays_channels_last(self, store: TensorStore) -> None:
        """A channels_last tensor comes back channels_last (convolutions pick their
        kernels by it)."""
        t = LAYOUTS["channels_last"](torch.float32)
        got = store.get(store.put(t))
        assert got.is_contiguous(memory_format=torch.channels_last)

    def test_large_multi_chunk(self, store: TensorStore) -> None:
        """A tensor of :attr:`large_nbytes` and more, and a large strided view of it."""
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
        """``requires_grad`` comes back; the result is always a leaf (no graph is stored)."""
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
        """``get(key, device=...)`` takes a string or a ``torch.device``."""
        t = LAYOUTS["transposed"](torch.float32)
        got = store.get(store.put(t), device="cpu")
        assert_same_tensor(got, t, device=torch.device("cpu"))
        got = store.get(store.put(t), device=torch.device("cpu"))
        assert got.device.type == "cpu"

    def test_put_copies(self, store: TensorStore) -> None:
        """``put`` keeps what it needs before it returns: the caller may reuse the tensor."""
        t = torch.arange(1000, dtype=torch.float32)
        want = t.clone()
        key = store.put(t)
        t.zero_()  # the caller may reuse the tensor right after put returns
        assert torch.equal(store.get(key), want)

    def test_gets_are_independent(self, store: TensorStore) -> None:
        """Each ``get`` returns a tensor of its own: changing one changes no other."""
        t = torch.arange(100, dtype=torch.int64)
        key = store.put(t)
        a = store.get(key)
        a.fill_(-1)  # mutating one result must not leak into the next
        assert torch.equal(store.get(key), t)

    # ----------------------------------------------------------- concurrency
    def test_concurrent_put_get(self, store: TensorStore) -> None:
        """Four threads put, get and delete at once; every tensor comes back whole."""
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


class _InventoryAndErrors:
    """What the store holds (``keys``, ``in``, ``len``, ``nbytes``) and how it refuses."""

    def test_inventory(self, store: TensorStore) -> None:
        """``keys``, ``in``, ``len`` and ``nbytes`` (payload bytes) follow puts and deletes."""
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
        """Deleting keys does not disturb an iteration over ``keys()`` made before."""
        keys = [store.put(torch.ones(3)) for _ in range(5)]
        it = store.keys()
        for key in keys:
            store.delete(key)  # must not break the iteration already made
        assert sorted(it) == sorted(keys)

    def test_contains_non_keys(self, store: TensorStore) -> None:
        """``in`` answers False for anything that is not a stored key, never raises."""
        assert "no-such-key" not in store
        assert 12345 not in store
        assert None not in store

    # --------------------------------------------------------------- errors
    def test_missing_key(self, store: TensorStore) -> None:
        """``get`` of a missing key raises ``KeyNotFoundError`` (a ``KeyError``) naming it."""
        with pytest.raises(KeyNotFoundError) as info:
            store.get("no-such-key")
        assert isinstance(info.value, KeyError)
        assert isinstance(info.value, TensorStoreError)
        assert "no-such-key" in str(info.value)

    def test_deleted_key_is_missing(self, store: TensorStore) -> None:
        """A deleted key is gone: ``get`` and a second ``delete`` raise."""
        key = store.put(torch.ones(5))
        store.delete(key)
        with pytest.raises(KeyNotFoundError):
            store.get(key)
        with pytest.raises(KeyError):
            store.delete(key)

    def test_delete_missing(self, store: TensorStore) -> None:
        """``delete`` of a missing key raises ``KeyNotFoundError`` naming it."""
        with pytest.raises(KeyNotFoundError, match="no-such-key"):
            store.delete("no-such-key")

    def test_delete_many_ignores_missing(self, store: TensorStore) -> None:
        """``delete_many`` deletes what exists and skips what does not."""
        keys = [store.put(torch.ones(3)) for _ in range(3)]
        store.delete_many([*keys, "no-such-key"])
        assert not any(k in store for k in keys)

    @pytest.mark.parametrize("kind", UNSUPPORTED_KINDS)
    def test_unsupported_tensor(self, store: TensorStore, kind: str) -> None:
        """Sparse, quantized, nested, meta tensors and subclasses are refused with
        ``UnsupportedTensorError`` (a ``TypeError``), and nothing is stored."""
        t = unsupported_tensors()[kind]
        before = len(store)
        with pytest.raises(UnsupportedTensorError) as info:
            store.put(t)
        assert isinstance(info.value, TypeError)
        assert len(store) == before

    def test_not_a_tensor(self, store: TensorStore) -> None:
        """``put`` of something that is not a tensor raises ``UnsupportedTensorError``."""
        with pytest.raises(UnsupportedTensorError):
            store.put([1.0, 2.0])  # type: ignore[arg-type]

    def test_closed_store(self, store: TensorStore) -> None:
        """``close`` is idempotent; a closed store refuses ``put`` and ``get`` with
        ``StoreUnavailableError`` (a ``ConnectionError``)."""
        key = store.put(torch.ones(3))
        store.close()
        store.close()  # idempotent
        with pytest.raises(StoreUnavailableError) as info:
            store.put(torch.ones(3))
        assert isinstance(info.value, ConnectionError)
        with pytest.raises(StoreUnavailableError):
            store.get(key)

    def test_context_manager_closes(self, store: TensorStore) -> None:
        """``with store as s`` gives the store back and closes it at the end."""
        with store as s:
            assert s is store
            key = s.put(torch.ones(2))
            assert torch.equal(s.get(key), torch.ones(2))
        with pytest.raises(StoreUnavailableError):
            store.put(torch.ones(2))

    def test_context_manager_closes_on_error(self, store: TensorStore) -> None:
        """The ``with`` block closes the store on an exception too, and lets it through."""
        with pytest.raises(RuntimeError, match="boom"), store:
            raise RuntimeError("boom")
        with pytest.raises(StoreUnavailableError):
            store.put(torch.ones(2))


class _Capabilities:
    """The optional capabilities: off by default, and kept to their word when declared."""

    def test_temporary_is_a_bool(self, store: TensorStore) -> None:
        """``temporary`` is a bool (default False) and does not change while the store
        is open."""
        first = store.temporary
        assert isinstance(first, bool)
        store.delete(store.put(torch.ones(3)))
        assert store.temporary is first

    def test_direct_io_status(self, store: TensorStore) -> None:
        """``direct_io`` is ``None`` (the default) or a consistent ``DirectIOStatus``:
        a mode of ``DIRECT_IO_MODES``, never on when ``off`` was asked, a reason
        exactly when it is off."""
        status = store.direct_io
        if status is None:
            return
        assert isinstance(status, DirectIOStatus)
        assert status.mode in DIRECT_IO_MODES
        assert isinstance(status.enabled, bool)
        if status.enabled:
            assert status.mode != "off"
            assert status.reason == "" and status.describe() == "on"
        else:
            assert status.reason and status.describe() == f"off ({status.reason})"
        assert store.direct_io == status

    def test_moves_direct_answers_for_a_stored_key(self, store: TensorStore) -> None:
        """``moves_direct(key)`` is ``None`` (the default) or a bool for a stored key,
        never True when ``direct_io`` says off; for a deleted key it answers the same
        way or raises ``KeyNotFoundError``."""
        status = store.direct_io
        keys = [store.put(random_tensor((n,), torch.float32)) for n in (16, 1 << 16, 1 << 18)]
        for key in keys:
            answer = store.moves_direct(key)
            assert answer is None or isinstance(answer, bool), answer
            if status is not None and not status.enabled:
                assert answer is not True, f"{key!r} moves direct, but direct_io is {status}"
        store.delete(keys[0])
        try:
            answer = store.moves_direct(keys[0])
        except KeyNotFoundError:
            pass
        else:
            assert answer is None or isinstance(answer, bool), answer
        store.delete_many(keys[1:])

    def test_buffer_pool_stays_within_its_size(self, store: TensorStore) -> None:
        """``buffer_pool_bytes`` is ``None`` (the default: ``set_buffer_pool_bytes`` then
        does nothing) or an int that stays within what ``set_buffer_pool_bytes`` last
        gave, through puts and gets. The size it had is given back after the test."""
        before = store.buffer_pool_bytes
        if before is None:
            store.set_buffer_pool_bytes(1 << 20)
            assert store.buffer_pool_bytes is None
            return
        assert isinstance(before, int) and before >= 0
        try:
            for limit in (0, 1 << 20):
                store.set_buffer_pool_bytes(limit)
                t = random_tensor((1 << 18,), torch.float32)  # 1 MiB
                key = store.put(t)
                assert_same_tensor(store.get(key), t)
                store.delete(key)
                now = store.buffer_pool_bytes
                assert isinstance(now, int) and 0 <= now <= limit, (now, limit)
        finally:
            store.set_buffer_pool_bytes(before)

    def test_flush_keeps_every_key_readable(self, store: TensorStore) -> None:
        """``flush()`` never raises on an open store (the default does nothing), may be
        called any number of times, and leaves every key as it was."""
        store.flush()
        tensors = [random_tensor((n,), torch.float32) for n in (1, 100, 5000)]
        keys = [store.put(t) for t in tensors]
        store.flush()
        store.flush()  # nothing left to do is not an error
        for key, t in zip(keys, tensors, strict=True):
            assert key in store
            assert_same_tensor(store.get(key), t)
        store.delete(keys[0])
        store.flush()
        assert keys[0] not in store
        with pytest.raises(KeyNotFoundError):
            store.get(keys[0])
        for key, t in zip(keys[1:], tensors[1:], strict=True):
            assert_same_tensor(store.get(key), t)
            store.delete(key)


class StoreConformance(_RoundTrips, _InventoryAndErrors, _Capabilities):
    """The behaviour every :class:`~tensorstore_hooks.TensorStore` promises.

    A subclass provides a ``store`` fixture (see the module's docstring) and may set:

    * :attr:`large_nbytes`: the size of the payload that must span several chunks;
    * :attr:`view_examples`: how many random views the property test tries.

    What it checks, in three groups (the classes it derives from): round trips
    (every dtype, every layout, bit for bit, strides, ``requires_grad``, a fresh
    tensor per ``get``; puts, gets and deletes from several threads); the inventory
    (``keys``, ``in``, ``len``, ``nbytes``) and errors (a missing key is
    ``KeyNotFoundError``, an unsupported tensor ``UnsupportedTensorError``, a closed
    store ``StoreUnavailableError``); and the optional capabilities.

    Capabilities are optional and declared by overriding them (``temporary``,
    ``direct_io``, ``moves_direct``, ``buffer_pool_bytes``/``set_buffer_pool_bytes``,
    ``flush``); a store that overrides none keeps the defaults, which are off, and
    passes. The capability tests hold a store to what it answers: a ``flush`` that
    never raises and loses nothing, a ``moves_direct`` that is ``None`` or a bool, a
    buffer pool that stays within the size it was given.

    A test your store cannot pass, for a reason you accept, is skipped visibly by
    overriding it in the subclass::

        @pytest.mark.skip(reason="MyStore keeps no storage offset")
        def test_round_trip_layouts(self) -> None: ...
    """


class WrappedStore(TensorStore):
    """A user-style TensorStore subclass delegating to ``inner`` (default: a fresh
    ``memory://`` store), for testing code that uses a store; tests override methods
    to inject faults or delays.

    Counts calls (``puts``, ``gets``, ``deletes``), records the keys ``put`` returned
    in ``put_log`` and each ``get`` key, with the name of the thread that asked, in
    ``get_log``. Thread-safe. Declares no capabilities (the defaults).
    """

    def __init__(self, inner: TensorStore | None = None) -> None:
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

    def keys(self) -> Iterator[str]:
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
