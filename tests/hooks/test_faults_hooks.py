"""The hooks under faults (issue 14 items 5-9, 13; issue 16 item 9).

Each test drives the public API the way a hostile user would: tensors modified in
place after their write finished, a real SIGINT delivered during backward in a
subprocess, stores whose reads fail in ways that heal and ways that cannot, a model
argument that is not a model, one hooks object entered twice, a store that refuses
every write. Every wait is bounded so a regression fails instead of hanging.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks import (
    ConfigError,
    IntegrityError,
    QuotaExceededError,
    StoreUnavailableError,
    TensorStoreError,
)
from tensorstore_hooks.testing import WrappedStore
from tests.daemon_fixtures import DaemonLauncher, daemons  # noqa: F401 - fixture


def _backward_with_timeout(loss: torch.Tensor, timeout_s: float) -> BaseException | None:
    """Run ``loss.backward()`` on a helper thread; return what it raised (None if nothing)."""
    out: dict[str, BaseException] = {}

    def target() -> None:
        try:
            loss.backward()
        except BaseException as e:  # handed back to the test thread
            out["error"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout_s)
    assert not th.is_alive(), f"backward still running after {timeout_s}s"
    return out.get("error")


# ------------------------------------------------- item 5: in place after the write
@pytest.mark.parametrize("saved", ["input", "output"])
@pytest.mark.parametrize("url", ["memory://", "file"])
def test_inplace_after_write_finished_raises(saved: str, url: str, tmp_path: Path) -> None:
    """Whether the write had finished or not, backward raises torch's in-place error."""
    for trial in range(5):
        store_url = url if url != "file" else f"file://{tmp_path / f'store{trial}'}"
        hooks = tsh.offload(store_url, min_bytes=0)
        x = torch.randn(64, 64, requires_grad=True)
        with hooks:
            a = x * 2
            # sin saves its input (a); exp saves its output (y).
            y = a.sin() if saved == "input" else a.exp()
            loss = y.sum()
        hooks.flush()  # the saved tensor's bytes are in the store, the write is done
        assert hooks.stats.tensors_offloaded >= 1
        assert len(hooks.store) >= 1
        with torch.no_grad():
            (a if saved == "input" else y).add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        del loss, y, a
        assert len(hooks.store) == 0
        hooks.close()


def test_unmodified_after_write_does_not_raise() -> None:
    """The check reads the saved tensor's version only; untouched tensors pass."""
    hooks = tsh.offload("memory://", min_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with hooks:
        a = x * 2
        y = a.exp()
        loss = (a.sin() + y).sum()
    hooks.flush()
    _ = a + 1  # not in place: versions unchanged
    loss.backward()
    assert x.grad is not None
    want = 2 * (torch.cos(x.detach() * 2) + torch.exp(x.detach() * 2))
    assert torch.allclose(x.grad, want)
    del loss
    assert len(hooks.store) == 0
    hooks.close()


def test_saved_tensor_dies_after_write() -> None:
    """The in-place check holds nothing alive: a saved tensor nobody references is freed."""
    import weakref

    hooks = tsh.offload("memory://", min_bytes=0)
    x = torch.randn(256, 256, requires_grad=True)
    with hooks:
        a = x * 2
        loss = a.sin().sum()
    ref = weakref.ref(a)
    del a
    hooks.flush()
    assert ref() is None, "the saved tensor is kept alive after its bytes were stored"
    loss.backward()
    del loss
    assert len(hooks.store) == 0
    hooks.close()


# ---------------------------------------------------- item 6: Ctrl-C during backward
_SIGINT_CHILD = textwrap.dedent(
    """
    import gc, sys
    import torch
    import tensorstore_hooks as tsh

    torch.manual_seed(0)
    torch.set_num_threads(1)
    trials = int(sys.argv[1])
    net = torch.nn.Sequential(
        *[m for _ in range(24) for m in (torch.nn.Linear(32, 32), torch.nn.Tanh())]
    )
    x = torch.randn(8, 32)
    hooks = tsh.offload("memory://", min_bytes=0)
    print("ready", flush=True)
    caught = 0
    loss = None
    while caught < trials:
        try:
            while True:
                with hooks:
                    loss = net(x).sum()
                loss.backward()
                loss = None
        except KeyboardInterrupt:
            pass
        # Outside the except block, so the traceback's frames (holding graph pieces of
        # an interrupted forward) are gone too.
        caught += 1
        loss = None  # frees whatever graph the interrupt left behind
        gc.collect()
        hooks.flush()
        print(f"caught {len(hooks.store)}", flush=True)
    hooks.close()
    print("done", flush=True)
    """
)


def test_sigint_during_backward_is_delivered_and_leaks_nothing(tmp_path: Path) -> None:
    """A real SIGINT, many times: never swallowed by a finalizer, never a leaked key."""
    trials = 20
    script = tmp_path / "child.py"
    script.write_text(_SIGINT_CHILD)
    err_path = tmp_path / "stderr.txt"
    rng = random.Random(0)
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(trials)],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60  # the child's start (torch import) included

    def line(timeout_s: float) -> str:
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not ready:
            return ""
        return proc.stdout.readline().decode().strip()  # type: ignore[union-attr]

    try:
        assert line(max(1.0, deadline - time.monotonic())) == "ready", err_path.read_text()
        leaks: list[str] = []
        for i in range(trials):
            time.sleep(rng.uniform(0.02, 0.08))
            proc.send_signal(signal.SIGINT)
            got = line(10.0)
            assert got.startswith("caught"), (
                f"SIGINT {i} was not delivered (the child went on training):\n"
                + err_path.read_text()
            )
            if got != "caught 0":
                leaks.append(got)
        assert line(10.0) == "done"
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    stderr = err_path.read_text()
    assert "Exception ignored" not in stderr, stderr
    assert not leaks, f"keys left in the store after an interrupt: {leaks}\n{stderr}"


# ------------------------------------------------------ item 7: one read deadline
class FaultyReads(WrappedStore):
    """Reads of the tensors ``fail_shape`` does not accept raise ``error()``."""

    def __init__(self, inner: Any = None) -> None:
        super().__init__(inner)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.error: Callable[[], BaseException] | None = None
        self.spare_shape: tuple[int, ...] | None = None

    def put(self, tensor: torch.Tensor) -> str:
        key = super().put(tensor)
        with self.lock:
            self.shapes[key] = tuple(tensor.shape)
        return key

    def get(self, key: str, *, device: Any = None) -> torch.Tensor:
        error = self.error
        if error is not None and self.shapes.get(key) != self.spare_shape:
            super().get(key, device=device)  # counted like a real attempt
            raise error()
        return super().get(key, device=device)


def _three_saves(x: torch.Tensor) -> torch.Tensor:
    # Three saved tensors of distinct shapes, unpacked (16, 256) first: a miss that
    # starts the prefetch of the other two.
    h = x.sin()
    h = h.reshape(32, 128).sin()
    h = h.reshape(16, 256).sin()
    return h.sum()


def test_prefetched_read_gets_one_deadline() -> None:
    """A prefetched key that keeps failing fails after one deadline, not two."""
    deadline_s = 2.0
    store = FaultyReads()
    hooks = tsh.offload(store, min_bytes=0, read_deadline_s=deadline_s, prefetch="1MiB")
    x = torch.randn(64, 64, requires_grad=True)
    with hooks:
        loss = _three_saves(x)
    hooks.flush()
    store.spare_shape = (16, 256)  # the first unpack reads fine; the prefetched ones fail
    store.error = lambda: ConnectionResetError("connection reset (injected)")
    t0 = time.monotonic()
    error = _backward_with_timeout(loss, 60)
    elapsed = time.monotonic() - t0
    assert isinstance(error, StoreUnavailableError), repr(error)
    assert hooks.stats.prefetch_hits >= 1
    assert elapsed >= 0.8 * deadline_s, f"gave up after {elapsed:.2f}s: not retried"
    assert elapsed < 1.5 * deadline_s, (
        f"read_deadline_s={deadline_s} but backward failed after {elapsed:.2f}s"
    )
    store.error = None
    del loss, error
    gc.collect()  # the error's traceback holds the helper thread's frame, in a cycle
    assert len(store) == 0
    hooks.close()


def _chunk_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.parent.name == "c"]


@pytest.mark.parametrize("fault", ["chunk-is-directory", "store-closed", "bit-flip"])
def test_unhealable_read_errors_raise_at_once(fault: str, tmp_path: Path) -> None:
    """EISDIR, a closed store, a checksum mismatch: raised at once, not retried."""
    root = tmp_path / "store"
    store = tsh.open_store(f"file://{root}")
    hooks = tsh.offload(store, min_bytes=0, read_deadline_s=20)
    x = torch.randn(64, 64, requires_grad=True)
    with hooks:
        loss = _three_saves(x)
    hooks.flush()
    chunks = _chunk_files(root)
    assert chunks, "no chunk files found"
    if fault == "chunk-is-directory":
        for p in chunks:
            p.unlink()
            p.mkdir()
    elif fault == "bit-flip":
        for p in chunks:
            data = bytearray(p.read_bytes())
            data[len(data) // 2] ^= 0x10
            p.write_bytes(bytes(data))
    else:
        store.close()
    t0 = time.monotonic()
    error = _backward_with_timeout(loss, 60)
    elapsed = time.monotonic() - t0
    assert isinstance(error, TensorStoreError), repr(error)
    if fault == "bit-flip":
        assert isinstance(error, IntegrityError), repr(error)
    assert elapsed < 5, f"{fault}: retried for {elapsed:.1f}s although it cannot heal"
    del loss, error
    hooks.close()
    store.close()


def test_read_deadline_bounds_the_daemon_reconnects(daemons: DaemonLauncher) -> None:  # noqa: F811
    """One deadline per read: the daemon client's own reconnect loop obeys it."""
    d = daemons.start("--memory-quota", "64MiB")
    # The client would reconnect for 30 s on its own; the read allows 2 s.
    hooks = tsh.offload(d.url, min_bytes=0, read_deadline_s=2.0, prefetch=0)
    x = torch.randn(64, 64, requires_grad=True)
    with hooks:
        loss = _three_saves(x)
    hooks.flush()
    d.kill()
    t0 = time.monotonic()
    error = _backward_with_timeout(loss, 90)
    elapsed = time.monotonic() - t0
    assert isinstance(error, StoreUnavailableError), repr(error)
    assert elapsed < 6, f"read_deadline_s=2 but the read gave up after {elapsed:.1f}s"
    del loss, error
    t0 = time.monotonic()
    hooks.close()
    assert time.monotonic() - t0 < 10


# ----------------------------------------------------- item 8: __enter__ all or nothing
def test_model_argument_validated_at_offload() -> None:
    with pytest.raises(ConfigError, match="model"):
        tsh.offload("memory://", model="notamodule")  # type: ignore[arg-type]
    hooks = tsh.offload("memory://")
    with pytest.raises(ConfigError, match="attach"):
        hooks.attach(42)  # type: ignore[arg-type]
    hooks.close()


class _ExplodingModel(nn.Module):
    """A model whose module walk fails, as a broken user model might at attach time."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sin()

    def named_modules(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            raise RuntimeError("cannot walk the modules (injected)")
        return super().named_modules(*args, **kwargs)


def _hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_always_called)
        for m in model.modules()
    )


def test_failed_enter_installs_nothing() -> None:
    model = _ExplodingModel()
    hooks = tsh.offload("memory://", model=model, min_bytes=0)
    model.armed = True
    with pytest.raises(RuntimeError, match="injected"), hooks:
        pass
    # No saved-tensor hooks left behind: a forward outside any block is not offloaded.
    model.armed = False
    loss = model(torch.randn(4, 16, requires_grad=True)).sum()
    loss.backward()
    assert hooks.stats.tensors_offloaded == 0 and hooks.stats.tensors_kept == 0
    assert _hook_count(model) == 0
    # The same object works afterwards.
    with hooks:
        loss = model(torch.randn(4, 16, requires_grad=True)).sum()
    assert hooks.stats.tensors_offloaded > 0
    assert _hook_count(model) == 0
    loss.backward()
    del loss
    hooks.close()


# ------------------------------------------------------- item 9: nested re-entry
def test_nested_reentry_keeps_module_tracking() -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
    hooks = tsh.offload(
        "memory://",
        model=model,
        min_bytes=0,
        rules=[{"module": "1", "action": "keep", "name": "first-tanh"}],
    )
    x = torch.randn(8, 32, requires_grad=True)
    with hooks:
        with hooks:
            inner = model(x).sum()
        kept_inner = hooks.stats.per_rule["rules[0] first-tanh"].tensors
        assert kept_inner >= 1
        assert _hook_count(model) > 0, "the inner exit removed the outer block's module hooks"
        outer = model(x).sum()  # the outer block still knows which module runs
        assert hooks.stats.per_rule["rules[0] first-tanh"].tensors == 2 * kept_inner
    assert _hook_count(model) == 0
    (inner + outer).backward()
    del inner, outer
    assert len(hooks.store) == 0
    hooks.close()


# ------------------------------------------------- item 13: one warning per hooks
class RefusingStore(WrappedStore):
    def put(self, tensor: torch.Tensor) -> str:
        raise QuotaExceededError("RefusingStore: full (injected)")


def test_fallbacks_warn_once_and_log_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    store = RefusingStore()
    hooks = tsh.offload(store, min_bytes=0)
    caplog.set_level(logging.DEBUG, logger="tensorstore_hooks")
    x = torch.randn(8, 16, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _step in range(3):
            with hooks:
                loss = sum((x * (i + 1)).sin().sum() for i in range(5))
            hooks.flush()
            loss.backward()
            del loss
        hooks.close()
    assert hooks.stats.fallbacks == 15
    ours = [w for w in caught if "tensorstore-hooks" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    loud = [
        r
        for r in caplog.records
        if r.name.startswith("tensorstore_hooks") and r.levelno >= logging.WARNING
    ]
    assert not loud, [r.getMessage() for r in loud]
    quiet = [
        r
        for r in caplog.records
        if r.name.startswith("tensorstore_hooks")
        and r.levelno == logging.DEBUG
        and "kept in memory" in r.getMessage()
    ]
    assert len(quiet) == 15


def test_fallback_logs_nothing_on_stderr(tmp_path: Path) -> None:
    """Without any logging setup, a run of fallbacks prints nothing per tensor."""
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            """
            import warnings
            import torch
            import tensorstore_hooks as tsh
            from tensorstore_hooks import QuotaExceededError, TensorStore

            class Refusing(TensorStore):
                def put(self, t): raise QuotaExceededError("full (injected)")
                def get(self, key, *, device=None): raise KeyError(key)
                def delete(self, key): raise KeyError(key)
                def keys(self): return iter(())
                def __contains__(self, key): return False
                def __len__(self): return 0
                nbytes = 0
                def close(self): pass

            hooks = tsh.offload(Refusing(), min_bytes=0)
            x = torch.randn(8, 16, requires_grad=True)
            with hooks:
                loss = sum((x * (i + 1)).sin().sum() for i in range(15))
            hooks.flush()
            loss.backward()
            hooks.close()
            print(hooks.stats.fallbacks)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, "-W", "default", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "15"
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    # The single UserWarning (message line + source line) and nothing per tensor.
    assert sum("could not take a saved tensor" in ln for ln in lines) == 1, out.stderr
    assert not any("kept in memory" in ln for ln in lines), out.stderr
