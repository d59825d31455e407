"""The offload pipeline: write-behind, prefetch, tail shortcut, dedup,
backpressure, failures, steady state, and CUDA staging.

Slow stores wait on ``threading.Event``s with timeouts, so a bug fails a test rather
than hanging it; the one simulated-latency store sleeps inside ``put`` to be slow, and
no assertion depends on how long that takes.
"""

from __future__ import annotations

import copy
import gc
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import psutil
import pytest
import torch
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks import (
    IntegrityError,
    OffloadHooks,
    Policy,
    StoreUnavailableError,
)
from tensorstore_hooks.config._settings import PipelineSettings
from tensorstore_hooks.pipeline._iopool import pool_for, shutdown_pool
from tensorstore_hooks.pipeline._pipeline import Pipeline
from tensorstore_hooks.runtime._heap import HeapReleaser, malloc_trim
from tensorstore_hooks.testing import WrappedStore

cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def call_with_timeout(fn: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    """Run ``fn`` on a helper thread; fail (instead of hanging) if it does not return."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised on the caller's thread
            out["error"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout_s)
    assert not th.is_alive(), f"{getattr(fn, '__name__', fn)} hung for {timeout_s}s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def pipeline_hooks(store: Any, **options: Any) -> OffloadHooks:
    """Hooks over a Pipeline built directly (pipeline options offload() may not expose)."""
    policy = Policy(min_bytes=0)
    pipeline = Pipeline(store, policy=policy, settings=PipelineSettings(**options))
    return OffloadHooks(pipeline)


def sin_chain(x: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` ops, each saving a distinct tensor (its input)."""
    h = x
    for _ in range(n):
        h = h.sin()
    return h.sum()


def chain_grad(x: torch.Tensor, n: int) -> torch.Tensor:
    x = x.detach().clone().requires_grad_()
    sin_chain(x, n).backward()
    assert x.grad is not None
    return x.grad


class GatedStore(WrappedStore):
    """``put`` blocks until ``gate`` is set; ``entered`` counts puts waiting there."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)

    def put(self, tensor: torch.Tensor) -> str:
        self.entered.release()
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        return super().put(tensor)


# ------------------------------------------------------------------- prefetch
@pytest.mark.parametrize("prefetch", ["1GiB", "4KiB"])
def test_prefetch_reads_newest_first(prefetch: str) -> None:
    store = WrappedStore()
    pool_for(store, 1)  # one I/O thread: reads run in submission order
    n = 12
    x = torch.randn(1024, requires_grad=True)  # 4 KiB per saved tensor
    hooks = tsh.offload(store, min_bytes=0, prefetch=prefetch)
    with hooks:
        loss = sin_chain(x, n)
    hooks.flush()
    assert len(store.put_log) == n
    loss.backward()
    newest_first = list(reversed(store.put_log))
    main = [k for k, th in store.get_log if th == threading.current_thread().name]
    ahead = [k for k, th in store.get_log if th != threading.current_thread().name]
    assert sorted(main + ahead) == sorted(newest_first)  # each read exactly once
    # The first unpack of a backward starts the read-ahead at the newest tensor.
    assert ahead[0] == newest_first[0]
    assert ahead == [k for k in newest_first if k not in main]  # read-ahead: newest first
    stats = hooks.stats
    assert stats.prefetch_hits + stats.prefetch_misses == n
    assert stats.prefetch_misses == len(main)
    if prefetch == "1GiB":
        assert main == [] and stats.prefetch_hits == n
    else:
        assert stats.prefetch_hits > 0
    assert torch.equal(x.grad, chain_grad(x, n))
    shutdown_pool(store)


def test_no_prefetch_reads_on_demand() -> None:
    store = WrappedStore()
    pool_for(store, 1)  # one I/O thread: puts run in pack order
    n = 8
    x = torch.randn(1024, requires_grad=True)
    hooks = tsh.offload(store, min_bytes=0, prefetch=0)
    with hooks:
        loss = sin_chain(x, n)
    hooks.flush()
    loss.backward()
    me = threading.current_thread().name
    assert store.get_log == [(k, me) for k in reversed(store.put_log)]
    assert hooks.stats.prefetch_misses == n and hooks.stats.prefetch_hits == 0
    shutdown_pool(store)


def test_out_of_order_unpack_is_correct() -> None:
    """Two independent branches, backward of the older one first: misses, still exact."""
    store = WrappedStore()
    a = torch.randn(2048, requires_grad=True)
    b = torch.randn(2048, requires_grad=True)
    hooks = tsh.offload(store, min_bytes=0, prefetch="8KiB")
    with hooks:
        la = sin_chain(a, 5)
        lb = sin_chain(b, 5)
    hooks.flush()
    la.backward()  # the oldest records first
    lb.backward()
    assert torch.equal(a.grad, chain_grad(a, 5)) and torch.equal(b.grad, chain_grad(b, 5))
    assert hooks.stats.prefetch_misses >= 2
    assert len(store) == 0
    shutdown_pool(store)


# ------------------------------------------------------------------- tail
def test_tail_shortcut_serves_from_memory() -> None:
    store = GatedStore()
    x = torch.randn(4096, requires_grad=True)
    # A window that holds the whole forward: the writes are stuck (NOTE [ Windows ]).
    hooks = tsh.offload(store, min_bytes=0, max_inflight="1MiB")
    with hooks:
        loss = sin_chain(x, 6)
    assert store.entered.acquire(timeout=30)  # a write is stuck in the store
    loss.backward(retain_graph=True)  # nothing reached the store: all from memory
    assert hooks.stats.tail_hits == 6
    assert hooks.stats.bytes_read == 0
    want = chain_grad(x, 6)
    assert torch.equal(x.grad, want)
    store.gate.set()
    hooks.flush()
    # Writes that were under way finished and were deleted; the rest never started.
    assert len(store) == 0
    assert store.deletes == store.puts <= 6
    x.grad = None
    loss.backward()  # the graph still works, from memory
    assert torch.equal(x.grad, want)
    del loss
    assert len(store) == 0
    shutdown_pool(store)


# ------------------------------------------------------------------- dedup
def test_dedup_one_put_per_tensor() -> None:
    store = WrappedStore()
    x = torch.randn(4096, requires_grad=True)
    hooks = tsh.offload(store, min_bytes=0)
    with hooks:
        y = x.exp()  # exp saves y, sin and cos save y too: one tensor, three saves
        loss = (y.sin() * y.cos()).sum()  # mul saves sin(y) and cos(y)
    hooks.flush()
    assert store.puts == 3
    assert hooks.stats.dedup_hits == 2
    assert hooks.stats.tensors_offloaded == 3
    loss.backward()
    x2 = x.detach().clone().requires_grad_()
    y2 = x2.exp()
    (y2.sin() * y2.cos()).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert len(store) == 0
    shutdown_pool(store)


def test_dedup_survives_address_reuse() -> None:
    """A new tensor at a dead one's address must not be taken for it (no bare data_ptr).

    Every ``t`` is a fresh tensor over one bytearray: the same address, shape, dtype
    and version each time, deterministically (an allocator's reuse is not).
    """
    store = WrappedStore()
    w = torch.randn(4096, requires_grad=True)
    memory = bytearray(4096 * 4)
    hooks = tsh.offload(store, min_bytes=0)
    losses = []
    ptrs = set()
    with hooks:
        for i in range(20):
            t = torch.frombuffer(memory, dtype=torch.float32)
            with torch.no_grad():
                t.copy_(w * float(i + 1))
            ptrs.add(t.data_ptr())
            losses.append((t * w).sum())  # mul saves t
            del t
            hooks.flush()  # t's bytes are stored; the next t reuses its memory
    assert len(ptrs) == 1
    assert hooks.stats.dedup_hits == 0
    torch.stack(losses).sum().backward()
    w2 = w.detach().clone().requires_grad_()
    torch.stack([((w2 * float(i + 1)).detach() * w2).sum() for i in range(20)]).sum().backward()
    assert torch.equal(w.grad, w2.grad)
    shutdown_pool(store)


# -------------------------------------------------------------- backpressure
class SlowStore(WrappedStore):
    """Simulated latency; records the bytes packed but not yet written at each put."""

    def __init__(self) -> None:
        super().__init__()
        self.hooks: OffloadHooks | None = None
        self.written = 0
        self.max_pending = 0

    def put(self, tensor: torch.Tensor) -> str:
        assert self.hooks is not None
        with self.lock:
            pending = self.hooks.stats.bytes_offloaded - self.written
            self.max_pending = max(self.max_pending, pending)
        # Latency of a slow disk, long enough that pack must wait for it even when a
        # loaded machine runs the forward slowly (the test asserts a stall).
        time.sleep(0.1)
        key = super().put(tensor)
        with self.lock:
            self.written += tensor.numel() * tensor.element_size()
        return key


def test_backpressure_bounds_inflight_bytes() -> None:
    store = SlowStore()
    tensor_bytes = 64 << 10
    limit = 2 * tensor_bytes
    hooks = tsh.offload(store, min_bytes=0, max_inflight=limit, writer_threads=2)
    store.hooks = hooks
    x = torch.randn(tensor_bytes // 4, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 10)
    hooks.flush()
    assert store.puts == 10
    assert hooks.stats.pack_stall_s > 0
    assert 0 < store.max_pending <= limit
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, 10))
    shutdown_pool(store)


def test_tensor_larger_than_max_inflight_still_goes() -> None:
    store = WrappedStore()
    hooks = tsh.offload(store, min_bytes=0, max_inflight="4KiB")
    x = torch.randn(64 << 10, requires_grad=True)  # 256 KiB each

    def forward() -> torch.Tensor:
        with hooks:  # saved-tensor hooks are per thread: enter them on the helper
            return sin_chain(x, 4)

    loss = call_with_timeout(forward)
    hooks.flush()
    assert store.puts == 4
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, 4))
    shutdown_pool(store)


# ------------------------------------------------------------------ failures
class BrokenWrites(WrappedStore):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def put(self, tensor: torch.Tensor) -> str:
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        OSError(28, "No space left on device"),
        StoreUnavailableError("gone"),
        RuntimeError("bug in a store"),
        tsh.QuotaExceededError("quota full"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_failed_writes_fall_back_without_hanging(error: BaseException) -> None:
    store = BrokenWrites(error)
    x = torch.randn(4096, requires_grad=True)
    hooks = tsh.offload(store, min_bytes=0)
    with pytest.warns(UserWarning, match="tensorstore-hooks") as record:
        with hooks:
            loss = sin_chain(x, 5)
        call_with_timeout(hooks.flush)
        call_with_timeout(loss.backward)
    assert sum("tensorstore-hooks" in str(w.message) for w in record) == 1
    assert hooks.stats.fallbacks == 5
    assert hooks.stats.tensors_offloaded == 0 and hooks.stats.tensors_kept == 5
    assert torch.equal(x.grad, chain_grad(x, 5))
    shutdown_pool(store)


def test_refusal_after_the_last_hook_call_warns_at_close() -> None:
    # Writes run behind the step: a refusal can land after the last pack and
    # before any unpack. close() must still say so rather than drop the warning.
    release = threading.Event()

    class LateRefusal(BrokenWrites):
        def put(self, tensor: torch.Tensor) -> str:
            release.wait(10)  # refuse only once the forward has finished
            return super().put(tensor)

    store = LateRefusal(tsh.QuotaExceededError("quota full"))
    x = torch.randn(4096, requires_grad=True)
    hooks = tsh.offload(store, min_bytes=0, max_inflight="1MiB")  # forward never waits
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may be issued before close()
        with hooks:
            loss = sin_chain(x, 5)
        release.set()
        deadline = time.monotonic() + 10
        while hooks.stats.fallbacks < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert hooks.stats.fallbacks == 5
    with pytest.warns(UserWarning, match="could not take a saved tensor"):
        hooks.close()
    loss.backward()
    assert torch.equal(x.grad, chain_grad(x, 5))
    shutdown_pool(store)


class BrokenReads(WrappedStore):
    def __init__(self, error: BaseException, failures: int = 1 << 30) -> None:
        super().__init__()
        self.error = error
        self.failures = failures

    def get(self, key: str, *, device: Any = None) -> torch.Tensor:
        with self.lock:
            self.failures -= 1
            fail = self.failures >= 0
        if fail:
            raise self.error
        return super().get(key, device=device)


@pytest.mark.parametrize(
    "error",
    [StoreUnavailableError("connection reset (injected)"), OSError("I/O error (injected)")],
    ids=lambda e: type(e).__name__,
)
def test_persistent_read_failure_names_the_key(error: BaseException) -> None:
    store = BrokenReads(error)
    hooks = pipeline_hooks(store, read_deadline_s=0.5)
    x = torch.randn(4096, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 3)
    hooks.flush()
    keys = list(store.put_log)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        call_with_timeout(loss.backward)
    assert time.monotonic() - t0 < 20  # retried until the deadline, not forever
    msg = str(info.value)
    assert any(repr(k) in msg or k in msg for k in keys), msg
    assert store.url in msg or "WrappedStore" in msg, msg
    del loss
    shutdown_pool(store)


def test_offload_read_deadline_keyword() -> None:
    store = BrokenReads(StoreUnavailableError("connection reset (injected)"))
    hooks = tsh.offload(store, min_bytes=0, read_deadline_s=0.5)
    x = torch.randn(4096, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 2)
    hooks.flush()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError):
        call_with_timeout(loss.backward, 60)
    assert time.monotonic() - t0 < 15, "read_deadline_s=0.5 was not honoured"
    del loss
    shutdown_pool(store)


def test_integrity_error_is_not_retried() -> None:
    store = BrokenReads(IntegrityError("checksum mismatch in chunk c/0 of key 'k' (injected)"))
    hooks = pipeline_hooks(store, read_deadline_s=60)
    x = torch.randn(4096, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 2)
    hooks.flush()
    t0 = time.monotonic()
    with pytest.raises(IntegrityError, match="checksum"):
        call_with_timeout(loss.backward, 120)
    assert time.monotonic() - t0 < 30  # not retried until the 60 s deadline
    del loss
    shutdown_pool(store)


def test_transient_read_failures_are_retried() -> None:
    store = BrokenReads(StoreUnavailableError("blip (injected)"), failures=3)
    hooks = pipeline_hooks(store, read_deadline_s=30)
    x = torch.randn(4096, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 4)
    hooks.flush()
    call_with_timeout(loss.backward)
    assert torch.equal(x.grad, chain_grad(x, 4))
    shutdown_pool(store)


# ------------------------------------------------------------- steady state
class LoopNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 64)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).pow(2).mean()


def _rss() -> int:
    return int(psutil.Process(os.getpid()).memory_info().rss)


def test_fifty_steps_flat_threads_store_and_rss(store_url: str) -> None:
    torch.manual_seed(0)
    model = LoopNet()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    store = tsh.open_store(store_url)
    hooks = tsh.offload(store, min_bytes=0, prefetch="64KiB")
    threads: list[int] = []
    rss: list[int] = []
    for step in range(50):
        x = torch.randn(32, 64)
        for m, o, h in ((model, opt, hooks), (ref, ref_opt, None)):
            o.zero_grad()
            if h is None:
                loss = m(x)
            else:
                with h:
                    loss = m(x)
            loss.backward()
            o.step()
            del loss
        assert len(store) == 0, f"step {step}: keys left behind"
        threads.append(threading.active_count())
        rss.append(_rss())
    hooks.flush()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)  # 50 optimizer steps later, still bit-identical
    assert hooks.stats.tensors_offloaded >= 50 * 4
    assert max(threads[5:]) == threads[5], threads
    assert rss[-1] - rss[10] < 64 << 20, (rss[10], rss[-1])
    assert store.nbytes == 0
    shutdown_pool(store)
    store.close()


def test_fresh_offload_each_step_releases_everything() -> None:
    model = LoopNet()
    threads: list[int] = []
    roots: list[str] = []
    for _ in range(12):
        hooks = tsh.offload(min_bytes=0)  # a temporary store per step
        with hooks:
            loss = model(torch.randn(32, 64))
        loss.backward()
        roots.append(hooks.store.url.removeprefix("file://"))
        del hooks, loss  # plain reference counting closes the pipeline and its store
        threads.append(threading.active_count())
    assert max(threads[3:]) == threads[3], threads
    assert not any(os.path.exists(r) for r in roots)


def test_user_store_threads_released() -> None:
    """Hooks on many short-lived user stores do not accumulate I/O threads."""
    counts = []
    for _ in range(8):
        store = tsh.open_store("memory://")
        with tsh.offload(store, min_bytes=0) as hooks:
            loss = sin_chain(torch.randn(4096, requires_grad=True), 6)
        loss.backward()
        hooks.flush()
        assert len(store) == 0
        store.close()
        del hooks
        del store, loss
        counts.append(threading.active_count())
    # Pools of dropped stores stop asynchronously: allow one store's threads to lag.
    assert max(counts[2:]) <= counts[1] + 4, counts


# -------------------------------------------------------------- memory
def test_saved_tensor_memory_released_once_written() -> None:
    store = GatedStore()
    hooks = tsh.offload(store, min_bytes=0)
    x = torch.randn(1 << 16, requires_grad=True)
    with hooks:
        a = x.exp()
        loss = a.sin().sum()  # exp and sin both save a
    # The storage, not the Python object: the pipeline holds a detached alias of `a`.
    ref = weakref.ref(a.untyped_storage())
    del a
    gc.collect()
    assert ref() is not None  # not written yet: the pipeline must still hold it
    store.gate.set()
    hooks.flush()
    gc.collect()
    assert ref() is None, "the saved tensor stayed in memory after its bytes were stored"
    loss.backward()  # the graph is alive and reads it back
    x2 = x.detach().clone().requires_grad_()
    x2.exp().sin().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    shutdown_pool(store)


@pytest.mark.parametrize("min_bytes", [0, "1GiB"])  # stored / kept
def test_graph_dies_with_del_loss_for_self_saving_ops(min_bytes: int | str) -> None:
    """ReLU saves its own output, whose grad_fn holds our handle: no cycle may form.

    (A pack result that references the saved tensor itself would keep the graph alive
    through C++, where not even ``gc.collect()`` finds it; see NOTE [ Detached aliases ].)
    """
    store = WrappedStore()
    x = torch.randn(1 << 12, requires_grad=True)
    hooks = tsh.offload(store, min_bytes=min_bytes)
    with hooks:
        r = x.relu()
        loss = r.square().sum()
    hooks.flush()
    ref = weakref.ref(r.untyped_storage())
    del r, loss  # no gc.collect(): freeing must not depend on the collector
    assert ref() is None, "the graph outlived `del loss`"
    assert hooks.live_records == 0 and len(store) == 0
    shutdown_pool(store)


def test_graph_dropped_while_writes_are_blocked_frees_everything() -> None:
    store = GatedStore()
    x = torch.randn(1 << 12, requires_grad=True)
    hooks = tsh.offload(store, min_bytes=0)
    with hooks:
        r = x.relu()
        loss = r.exp().sum()
    assert store.entered.acquire(timeout=30)  # a write is stuck inside the store
    ref = weakref.ref(r.untyped_storage())
    opener = threading.Timer(0.2, store.gate.set)  # `del loss` waits for the write
    opener.start()
    del r, loss
    opener.join()
    hooks.flush()
    assert ref() is None
    assert hooks.live_records == 0
    assert len(store) == 0, "a write that finished after the graph died left its key"
    shutdown_pool(store)


def test_flush_waits_for_writes() -> None:
    store = GatedStore()
    hooks = tsh.offload(store, min_bytes=0, max_inflight="1MiB")
    x = torch.randn(4096, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 4)  # returns while the writes are stuck in the store
    assert len(store) == 0
    flusher = threading.Thread(target=hooks.flush, daemon=True)
    flusher.start()
    assert store.entered.acquire(timeout=30)
    flusher.join(0.2)
    assert flusher.is_alive(), "flush returned while writes were still pending"
    store.gate.set()
    flusher.join(30)
    assert not flusher.is_alive()
    assert len(store) == store.puts == 4
    loss.backward()
    assert hooks.stats.tail_hits == 0 and hooks.stats.bytes_read > 0
    shutdown_pool(store)


def test_leaving_with_block_does_not_wait() -> None:
    store = GatedStore()
    hooks = tsh.offload(store, min_bytes=0, max_inflight="1MiB")
    x = torch.randn(4096, requires_grad=True)
    with hooks:
        loss = sin_chain(x, 3)
    # Were __exit__ waiting for writes, the gate (still closed) would have blocked it.
    assert store.puts == 0
    store.gate.set()
    hooks.flush()
    loss.backward()
    shutdown_pool(store)


# ------------------------------------------------------------------ CUDA
class CudaNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(64, 256)
        self.l2 = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.nn.functional.gelu(self.l1(x))).pow(2).mean()


@pytest.mark.parametrize("flush", [False, True], ids=["tail", "flushed"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_equivalence(store_url: str, flush: bool) -> None:
    torch.manual_seed(0)
    model = CudaNet().cuda()
    ref = copy.deepcopy(model)
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    ref(x_ref).backward()
    hooks = tsh.offload(store_url, min_bytes=0)
    with hooks:
        loss = model(x)
    if flush:
        hooks.flush()
    loss.backward()
    torch.cuda.synchronize()
    assert hooks.stats.tensors_offloaded > 0
    assert torch.equal(x.grad, x_ref.grad)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert len(hooks.store) == 0


class _DeviceSpy(torch.autograd.Function):
    seen: ClassVar[list[torch.device]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        _DeviceSpy.seen.append(x.device)
        return g * 2 + 0 * x


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rehydrates_on_same_device_index() -> None:
    index = torch.cuda.device_count() - 1  # the last device: never the default by accident
    device = torch.device("cuda", index)
    x = torch.randn(4096, device=device, requires_grad=True)
    _DeviceSpy.seen.clear()
    hooks = tsh.offload("memory://", min_bytes=0)
    with hooks:
        y = _DeviceSpy.apply(x * 1.0)
    hooks.flush()
    assert hooks.stats.tensors_offloaded > 0
    y.sum().backward()
    assert _DeviceSpy.seen == [device]
    assert x.grad is not None and x.grad.device == device


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pinned_pool_reused_across_steps() -> None:
    torch.manual_seed(0)
    model = CudaNet().cuda()
    hooks = tsh.offload("memory://", min_bytes=0)
    allocations = []
    for _ in range(6):
        with hooks:
            loss = model(torch.randn(64, 64, device="cuda"))
        hooks.flush()
        loss.backward()
        del loss
        allocations.append(hooks.stats.pinned_allocations)
    offloaded_per_step = hooks.stats.tensors_offloaded // 6
    # Pinned buffers come from the pool: after the first step no new cudaHostAlloc,
    # and even the first step allocated fewer buffers than it moved tensors twice.
    assert allocations[-1] == allocations[1], allocations
    assert allocations[0] < 2 * offloaded_per_step


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_no_host_alloc_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Count every pinned allocation the pipeline asks torch for, over several steps."""
    from tensorstore_hooks.pipeline import _staging

    calls = {"n": 0}
    real_take = _staging.PinnedPool.take

    def counting_take(self: Any, n: int) -> torch.Tensor:
        before = self.allocations
        out = real_take(self, n)
        calls["n"] += self.allocations - before
        return out

    monkeypatch.setattr(_staging.PinnedPool, "take", counting_take)
    model = CudaNet().cuda()
    hooks = tsh.offload("memory://", min_bytes=0)
    for _ in range(4):
        with hooks:
            loss = model(torch.randn(64, 64, device="cuda"))
        hooks.flush()
        loss.backward()
        del loss
    assert hooks.stats.tensors_offloaded >= 4 * 3
    assert calls["n"] < hooks.stats.tensors_offloaded // 2


# ---------------------------------------------------------------- heap release
def test_heap_releaser_trims_every_n_bytes() -> None:
    calls: list[int] = []
    rel = HeapReleaser(100, trim=lambda pad: calls.append(pad) or 1)
    for _ in range(7):
        rel.note(40)  # 280 bytes: due at 120 and 240
    assert calls == [0, 0] and rel.releases == 2
    off = HeapReleaser(0, trim=lambda pad: calls.append(pad) or 1)
    off.note(1 << 40)
    assert len(calls) == 2  # 0 disables it
    assert HeapReleaser(100, trim=None).releases == 0


def test_io_threads_release_the_heap_as_configured() -> None:
    hooks = tsh.offload("memory://", min_bytes=0, release_heap_every="64KiB")
    assert hooks.settings.release_heap_every == 64 << 10
    x = torch.randn(1 << 15, requires_grad=True)  # 128 KiB per saved tensor
    with hooks:
        loss = sin_chain(x, 4)
    hooks.flush()
    written = hooks.stats.heap_releases
    loss.backward()
    if malloc_trim is None:  # not glibc: the option is accepted and does nothing
        assert hooks.stats.heap_releases == 0
    else:
        assert written >= 4  # the writers release too: 4 writes of 128 KiB each
        assert hooks.stats.heap_releases >= 8  # and 4 reads of 128 KiB each
    with pytest.raises(tsh.ConfigError, match="release_heap_every"):
        tsh.offload("memory://", release_heap_every="lots")
