"""A store closed before its graphs are freed leaves nothing behind once they are.

NOTE [ Closed while in use ] (``storage/zarr/_store.py``): a graph held by a reference
cycle is freed by the collector, after ``hooks.close()`` and ``store.close()``;
its keys must still be deleted, quietly, and the namespace (chunk files, journal,
lock) removed.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import StoreClosedError
from tests.daemon_fixtures import Daemon, shared_daemon  # noqa: F401 - fixture


class _Cycle:
    """Keeps a graph alive until the collector runs (the issue's reference cycle)."""

    def __init__(self) -> None:
        self.me = self
        self.loss: Any = None


def _forward_in_a_cycle(hooks: tsh.OffloadHooks) -> None:
    w = torch.randn(64, 64, requires_grad=True)
    cycle = _Cycle()
    with hooks:
        cycle.loss = (torch.randn(16, 64) @ w).tanh().sin().sum()
    hooks.flush()
    assert len(hooks.store) > 0


def _quiet(capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    assert capfd.readouterr().err == ""
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("owned", [False, True], ids=["store_given", "store_owned"])
def test_a_local_store_closed_before_its_graph_is_freed_leaves_nothing(
    tmp_path: Path,
    owned: bool,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = tmp_path / "root"
    url = f"file://{root}"
    store = None if owned else tsh.open_store(url)
    hooks = tsh.offload(url if owned else store, min_bytes=0)
    store = hooks.store
    _forward_in_a_cycle(hooks)
    hooks.close()
    store.close()
    with pytest.raises(StoreClosedError):
        store.put(torch.ones(2))  # closed for its users at once
    with pytest.raises(StoreClosedError):
        store.get(next(iter(store.keys())))
    assert [p.name for p in root.iterdir()] != ["zarr.json"]  # the graph still lives
    gc.collect()
    assert sorted(p.name for p in root.iterdir()) == ["zarr.json"]  # namespace, lock: gone
    assert len(store) == 0
    _quiet(capfd, caplog)


def test_a_memory_store_closed_before_its_graph_is_freed_is_quiet(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    store = tsh.open_store("memory://")
    hooks = tsh.offload(store, min_bytes=0)
    _forward_in_a_cycle(hooks)
    hooks.close()
    store.close()
    gc.collect()
    assert len(store) == 0
    _quiet(capfd, caplog)


def test_a_daemon_store_closed_before_its_graph_is_freed_is_quiet(
    shared_daemon: Daemon,  # noqa: F811 - the fixture
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = tsh.open_store(shared_daemon.url)
    hooks = tsh.offload(store, min_bytes=0)
    _forward_in_a_cycle(hooks)
    hooks.close()
    store.close()  # BYE: the daemon frees the session's keys at once
    gc.collect()
    _quiet(capfd, caplog)
    with tsh.open_store(shared_daemon.url) as other:
        assert len(other) == 0


def test_keys_put_by_hand_outlive_close_as_before(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'root'}"
    store = tsh.open_store(url, namespace="kept")
    key = store.put(torch.arange(6.0))
    hooks = tsh.offload(store, min_bytes=0)
    _forward_in_a_cycle(hooks)
    hooks.close()
    store.close()
    gc.collect()  # the pipeline's keys go; the hand-put one stays, and the lock is free
    with tsh.open_store(url, namespace="kept") as again:
        assert list(again.keys()) == [key]
        assert torch.equal(again.get(key), torch.arange(6.0))


def test_offload_into_a_closed_store_is_refused(tmp_path: Path) -> None:
    store = tsh.open_store(f"file://{tmp_path / 'root'}")
    store.close()
    with pytest.raises(StoreClosedError, match="is closed"):
        tsh.offload(store)


def test_a_closed_store_finishes_once_its_last_key_is_deleted(tmp_path: Path) -> None:
    # The hooks stay open (their pipeline lives on); freeing the graph is enough.
    root = tmp_path / "root"
    store = tsh.open_store(f"file://{root}")
    hooks = tsh.offload(store, min_bytes=0)
    _forward_in_a_cycle(hooks)
    store.close()
    gc.collect()
    assert sorted(p.name for p in root.iterdir()) == ["zarr.json"]
    hooks.close()
