"""Views of one storage moved as one span: NOTE [ Span unions ].

q, k and v cut from one fused projection, SwiGLU's halves, a tensor saved under two
shapes: each storage's saved views move once, as the union of what they cover, with
the gaps no view covers left out, on the host, over the fake accelerator, in the
host tier and in the store. Gradients are compared with ``torch.equal``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks._codec import span_of
from tensorstore_hooks.pipeline._iopool import shutdown_pool
from tensorstore_hooks.pipeline._spans import OPEN_PACKS, Pattern, Span, pattern_of
from tensorstore_hooks.testing import WrappedStore
from tests.fake_accelerator import CpuAsAccelerator, on_fake_accelerator

B, L, D, H = 2, 16, 64, 4


def pat(t: torch.Tensor) -> Pattern | None:
    return pattern_of(tuple(t.shape), tuple(t.stride()), t.storage_offset())


def heads(qkv: torch.Tensor) -> list[torch.Tensor]:
    """q, k, v as SDPA takes them: views with gaps of one fused projection."""
    return [t.view(B, L, H, D // H).transpose(1, 2) for t in qkv.split(D, dim=-1)]


# ----------------------------------------------------------------- patterns
def test_patterns() -> None:
    qkv = torch.randn(B, L, 3 * D)
    q, _k, v = heads(qkv)
    assert pat(q) == Pattern(0, B * L, 3 * D, D)
    assert pat(v) == Pattern(2 * D, B * L, 3 * D, D)
    assert pat(qkv) == Pattern(0, 1, B * L * 3 * D, B * L * 3 * D)  # a region
    assert pat(qkv.transpose(0, 1)) == pat(qkv)  # any dense layout
    assert pat(qkv[0].expand(3, L, 3 * D)) == Pattern(0, 1, L * 3 * D, L * 3 * D)
    _gate, up = torch.randn(B, L, 2 * D).chunk(2, dim=-1)
    assert pat(up) == Pattern(D, B * L, 2 * D, D)
    x = torch.randn(8, 8)
    assert pat(x[::2, ::2]) is None  # gaps both ways: no one sequence of rows
    assert pat(x.unfold(0, 4, 1)) is None  # overlapping rows
    assert pat(x[:0]) is None


def test_span_joins_covers_and_rebuilds_every_view() -> None:
    qkv = torch.randn(B, L, 3 * D)
    q, k, v = heads(qkv)
    for order in ([q, v], [v, q, k], [k, q]):
        first = pat(order[0])
        assert first is not None
        span = Span.of(first)
        for t in order[1:]:
            p = pat(t)
            assert p is not None and span.fits(p) and not span.covers(p, 1)
            span.join(p)
        src = span.source(order[0])
        gathered = span.gather(src).clone()  # as the store gives it back
        assert gathered.numel() == sum(t.numel() for t in order) == span.elements
        for t in order:
            view = (tuple(t.shape), tuple(t.stride()), t.storage_offset())
            over_source = span.rebuild(src, view)
            assert torch.equal(over_source, t) and over_source.data_ptr() == t.data_ptr()
            assert torch.equal(span.rebuild(gathered, view), t)
    span = Span.of(pat(q))  # type: ignore[arg-type]
    for t in (k, v):
        span.join(pat(t))  # type: ignore[arg-type]
    assert span.region and span.length == qkv.numel()  # whole: the region itself
    assert span.holds_all_of(pat(qkv))  # type: ignore[arg-type]


# --------------------------------------------------------- models and probes
class SaveAll(torch.autograd.Function):
    """``sum(t * t)`` over its inputs, saving them; backward notes the storages the
    saved tensors come back in (``SEEN``)."""

    SEEN: ClassVar[list[list[tuple[int, int]]]] = []

    @staticmethod
    def forward(ctx: Any, *ts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*ts)
        return torch.stack([(t * t).sum() for t in ts]).sum()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        saved = ctx.saved_tensors
        SaveAll.SEEN.append(
            [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in saved]
        )
        return tuple(2 * t * g for t in saved)


def returned_storage_bytes() -> int:
    """Bytes of the distinct storages the last backward of :class:`SaveAll` got."""
    return sum(dict(SaveAll.SEEN[-1]).values())


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = heads(self.qkv(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, L, D))


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Attention(), SwiGLU(), Attention(), SwiGLU())


def _step(model: nn.Module, hooks: Any, *, flush: bool = True) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = torch.randn(B, L, D, generator=torch.Generator().manual_seed(3), requires_grad=True)
    if hooks is None:
        loss = model(x).pow(2).sum()
    else:
        with hooks:
            loss = model(x).pow(2).sum()
        if flush:
            hooks.flush()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _put_numels(store: WrappedStore) -> list[int]:
    return [n for op, n in store.log if op == "put"]


# ------------------------------------------------------------- on the host
def test_qkv_and_swiglu_halves_move_once_as_one_record() -> None:
    model = _model()
    want = _step(model, None)
    store = LoggingStore()
    hooks = tsh.offload(store, min_bytes=0, max_inflight="16MiB", prefetch="16MiB")
    assert _equal(_step(model, hooks), want)
    stats = hooks.stats
    puts = _put_numels(store)
    # One put per fused projection's output (q, k and v; gate and up), of its elements.
    assert puts.count(B * L * 3 * D) == 2 and puts.count(B * L * 4 * D) == 2
    assert stats.bytes_written == stats.bytes_read == stats.bytes_offloaded  # once each way
    assert stats.reuse_hits >= 2 * 2 + 2 * 1  # k and v, up after gate: no second read
    assert hooks._pipeline.table.inflight == 0
    shutdown_pool(store)


class LoggingStore(WrappedStore):
    """Logs ``("put", numel)`` for every put (``log``)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int]] = []

    def put(self, tensor: torch.Tensor) -> str:
        self.log.append(("put", tensor.numel()))
        return super().put(tensor)


def test_views_with_gaps_come_back_without_the_gaps() -> None:
    """q and k saved, v not: what comes back holds their elements, not the storage's
    span (3x), and one storage serves both."""
    qkv = torch.randn(B, L, 3 * D, requires_grad=True)
    hooks = tsh.offload("memory://", min_bytes=0, max_inflight="16MiB")
    with hooks:
        q, k, _v = heads(qkv * 1)
        loss = SaveAll.apply(q, k)
    hooks.flush()
    loss.backward()
    assert returned_storage_bytes() == 2 * q.numel() * 4  # q and k, no v, no gap
    assert len(SaveAll.SEEN[-1]) == 2 and len(dict(SaveAll.SEEN[-1])) == 1  # one storage
    assert hooks.stats.bytes_written == hooks.stats.bytes_read == 2 * q.numel() * 4
    ref = qkv.detach().clone().requires_grad_()
    q2, k2, _ = heads(ref * 1)
    ((q2 * q2).sum() + (k2 * k2).sum()).backward()
    assert torch.equal(qkv.grad, ref.grad)


def test_a_lone_view_with_gaps_comes_back_at_its_elements() -> None:
    x = torch.randn(64, 128, requires_grad=True)
    hooks = tsh.offload("memory://", min_bytes=0)
    with hooks:
        half = (x * 1)[:, ::2]
        loss = SaveAll.apply(half)
    hooks.flush()
    loss.backward()
    assert returned_storage_bytes() == half.numel() * 4 < span_of((64, 64), (128, 2)) * 4
    ref = x.detach().clone().requires_grad_()
    ((ref * 1)[:, ::2].pow(2)).sum().backward()
    assert torch.equal(x.grad, ref.grad)


def test_one_tensor_saved_under_two_shapes_moves_once() -> None:
    x = torch.randn(B * L, D, requires_grad=True)
    store = LoggingStore()
    hooks = tsh.offload(store, min_bytes=0)
    with hooks:
        h = x * 2
        loss = SaveAll.apply(h, h.view(B, L, D), h.t())
    hooks.flush()
    assert _put_numels(store) == [h.numel()] and hooks.stats.dedup_hits == 2
    loss.backward()
    assert hooks.stats.bytes_read == h.numel() * 4
    assert len(dict(SaveAll.SEEN[-1])) == 1  # the three views over one storage
    shutdown_pool(store)


# ----------------------------------------------------------- open spans
def test_an_open_span_is_written_by_flush_and_freed_cleanly() -> None:
    qkv = torch.randn(B, L, 3 * D, requires_grad=True)
    store = LoggingStore()
    hooks = tsh.offload(store, min_bytes=0, max_inflight="16MiB")
    table = hooks._pipeline.table
    with hooks:
        q, k, _v = heads(qkv * 1)
        loss = SaveAll.apply(q, k)
    assert table.has_open and _put_numels(store) == []  # v might still come
    hooks.flush()
    written = [2 * q.numel()]
    assert not table.has_open and _put_numels(store) == written
    del loss, q, k, _v
    assert len(store) == 0 and table.inflight == 0 and table.live == 0
    # Freed while still open: nothing written, nothing left in flight.
    with hooks:
        q, k, _v = heads(qkv * 1)
        loss = SaveAll.apply(q, k)
    assert table.has_open
    del loss, q, k, _v
    assert not table.has_open and table.inflight == 0 and table.live == 0
    assert _put_numels(store) == written
    shutdown_pool(store)


def test_an_open_span_nobody_joins_is_written_after_a_few_saves() -> None:
    qkv = torch.randn(B, L, 3 * D, requires_grad=True)
    store = LoggingStore()
    hooks = tsh.offload(store, min_bytes=0, max_inflight="16MiB")
    table = hooks._pipeline.table
    with hooks:
        q, _k, _v = heads(qkv * 1)
        loss = SaveAll.apply(q)
        for _ in range(OPEN_PACKS):
            loss = loss * torch.randn(B, L, D).sum()  # one other tensor saved
            assert table.has_open
        loss = SaveAll.apply(torch.randn(4, 4, requires_grad=True) * 1) + loss
        assert not table.has_open
    hooks.flush()
    loss.backward()
    assert q.numel() in _put_numels(store)
    shutdown_pool(store)


def test_spans_without_a_window_write_through() -> None:
    """``max_inflight=0``: every write done before pack returns, so no span stays open
    (and pack never waits on one): still exact."""
    model = _model()
    want = _step(model, None)
    hooks = tsh.offload("memory://", min_bytes=0, max_inflight=0)
    assert _equal(_step(model, hooks, flush=False), want)
    assert not hooks._pipeline.table.has_open


def test_a_storage_changed_after_its_views_were_saved_raises() -> None:
    qkv = torch.randn(B, L, 3 * D, requires_grad=True)
    hooks = tsh.offload("memory://", min_bytes=0, max_inflight="16MiB")
    with hooks:
        base = qkv * 1
        q, k, v = heads(base)
        loss = SaveAll.apply(q, k, v)
    with torch.no_grad():
        base[..., 0].add_(1)  # q's first elements, after they were saved
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("flush", [True, False])
def test_models_exact_in_any_store(store_url: str, flush: bool) -> None:
    model = _model()
    want = _step(model, None)
    hooks = tsh.offload(store_url, min_bytes=0)
    for _ in range(2):
        assert _equal(_step(model, hooks, flush=flush), want)


# --------------------------------------------------- the fake accelerator
def test_over_the_fake_accelerator_only_the_elements_cross() -> None:
    """Copies to the host and back carry each saved element once: the views' spans
    (3x for q, 2x for a SwiGLU half) never cross."""
    model = _model()
    want = _step(model, None)
    hooks = tsh.offload("memory://", min_bytes=0, max_inflight="16MiB", prefetch="16MiB")
    ops = CpuAsAccelerator(lazy=True)
    on_fake_accelerator(hooks, ops)
    assert _equal(_step(model, hooks), want)
    stats = hooks.stats
    assert stats.bytes_to_host == stats.bytes_offloaded
    assert stats.bytes_to_device == stats.bytes_offloaded


def test_the_host_tier_holds_the_elements_not_the_spans() -> None:
    qkv = torch.randn(B, L, 3 * D, requires_grad=True)
    hooks = tsh.offload("memory://", min_bytes=0, max_inflight="16MiB", host_budget="64MiB")
    on_fake_accelerator(hooks, CpuAsAccelerator(lazy=True))
    with hooks:
        q, k, _v = heads(qkv * 1)
        loss = SaveAll.apply(q, k)
    hooks.flush()
    loss.backward()
    elements = 2 * q.numel() * 4
    tier = hooks._pipeline.stager.tier
    assert tier is not None and tier.peak_tensor_bytes == elements  # one range, no gaps
    assert hooks.stats.bytes_to_host == elements and hooks.stats.bytes_written == 0
    assert returned_storage_bytes() == elements
    ref = qkv.detach().clone().requires_grad_()
    q2, k2, _ = heads(ref * 1)
    ((q2 * q2).sum() + (k2 * k2).sum()).backward()
    assert torch.equal(qkv.grad, ref.grad)
