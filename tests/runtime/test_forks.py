"""Forked children leave their parent's stores alone (NOTE [ Fork safety ], ``runtime/_forks.py``).

A child that exits normally (atexit handlers and finalizers run), frees its copy of
the graph or closes its copy of the hooks must not delete, overwrite or unlock
anything of the parent's; hooks that run in a child keep its tensors in memory; a
child may still open stores of its own. The ``os.fork`` children run in a script of
their own (``sys.exit`` in a child forked from pytest would unwind into pytest).
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks import StoreUnavailableError
from tests.daemon_fixtures import Daemon, shared_daemon  # noqa: F401 - fixture

pytestmark = [
    # Python 3.12+ warns about fork() in a process with threads (the I/O pool's):
    # exactly the situation these tests make on purpose.
    pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
]

_CHILD_SCRIPT = textwrap.dedent(
    """
    import gc, json, os, sys
    import torch
    import tensorstore_hooks as tsh

    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)

    def forward():
        return (x @ w).tanh().sin().pow(2).sum()

    forward().backward()
    want = w.grad.clone()
    results = []
    for where, variant in json.loads(sys.argv[1]):
        w.grad = None
        hooks = tsh.offload(None if where == "temp" else where, min_bytes=0)
        with hooks:
            loss = forward()
        hooks.flush()
        pid = os.fork()
        if pid == 0:
            if variant in ("free", "free_close"):
                del loss
                gc.collect()
            if variant in ("close", "free_close"):
                hooks.close()
            if variant == "own_store":
                mine = tsh.open_store(None if where == "temp" else where)
                key = mine.put(torch.arange(10.0))
                assert torch.equal(mine.get(key), torch.arange(10.0))
                mine.close()
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        loss.backward()
        results.append({
            "variant": [where, variant],
            "child_status": status,
            "equal": bool(torch.equal(w.grad, want)),
            "keys_left": len(hooks.store),
            "fallbacks": hooks.stats.fallbacks,
        })
        del loss
        hooks.close()
    print(json.dumps(results))
    """
)

VARIANTS = ["exit", "free", "close", "free_close", "own_store"]


def test_forked_child_exiting_normally_leaves_the_parents_store(tmp_path: Path) -> None:
    """The issue's 6 of 6: a child that ``sys.exit``-s (doing nothing, after freeing
    its copy of the graph, after closing the hooks, both, or after using a store of
    its own) deleted the parent's chunks, or its temporary store, or its lock."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD_SCRIPT)
    cases = [[f"file://{tmp_path / v}", v] for v in VARIANTS] + [["temp", v] for v in VARIANTS]
    run = subprocess.run(
        [sys.executable, str(script), json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TSH_TMPDIR": str(tmp_path / "tmp")},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # Nothing on stderr: no "could not delete", no "Exception ignored".
    assert run.stderr == "", run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert [r["variant"] for r in results] == cases
    for r in results:
        assert (r["child_status"], r["equal"], r["keys_left"], r["fallbacks"]) == (0, True, 0, 0), r
    assert list((tmp_path / "tmp").iterdir()) == []  # every temporary root removed, once


def test_forked_child_keeps_the_parents_namespace_lock(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'root'}"
    store = tsh.open_store(url)
    key = store.put(torch.arange(5.0))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            store.close()  # its copy: nothing on disk, the lock stays the parent's
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    with pytest.raises(StoreUnavailableError, match="is open in another store object"):
        tsh.open_store(url, namespace=store.namespace)  # type: ignore[attr-defined]
    assert torch.equal(store.get(key), torch.arange(5.0))
    store.close()


def _child_writes(store: Any, conn: Any) -> None:
    try:
        store.put(torch.ones(3))
        conn.send("wrote")
    except StoreUnavailableError as e:
        conn.send(str(e))
    try:
        store.delete(next(iter(store.keys())))
        conn.send("deleted")
    except StoreUnavailableError as e:
        conn.send(str(e))


@pytest.mark.parametrize("kind", ["file", "daemon", "chain"])
def test_forked_child_cannot_write_or_delete_the_parents_store(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    if kind == "daemon":
        daemon: Daemon = request.getfixturevalue("shared_daemon")
        store = tsh.open_store(daemon.url)
    elif kind == "chain":
        store = tsh.open_store(["memory://", f"file://{tmp_path / 'root'}"], budgets=["1MiB"])
    else:
        store = tsh.open_store(f"file://{tmp_path / 'root'}")
    key = store.put(torch.arange(4.0))
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_writes, args=(store, child))
    proc.start()
    said = [parent.recv(), parent.recv()]
    proc.join(30)
    assert proc.exitcode == 0
    for text in said:
        assert "is a fork of" in text and "tsh.open_store" in text, said
    assert list(store.keys()) == [key]
    assert torch.equal(store.get(key), torch.arange(4.0))
    if kind == "daemon":
        # The child's exit said no BYE for the parent's session: still readable, writable.
        store.delete(store.put(torch.zeros(2)))
    store.close()


def _child_frees_and_closes(hooks: Any, loss: Any) -> None:
    del loss
    hooks.close()


def test_multiprocessing_fork_child_freeing_the_graph_deletes_nothing(tmp_path: Path) -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    hooks = tsh.offload(f"file://{tmp_path / 'root'}", min_bytes=0)
    with hooks:
        loss = (x @ w).tanh().sum()
    hooks.flush()
    stored = len(hooks.store)
    proc = multiprocessing.get_context("fork").Process(
        target=_child_frees_and_closes, args=(hooks, loss)
    )
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    assert len(hooks.store) == stored > 0
    loss.backward()
    assert w.grad is not None and hooks.stats.fallbacks == 0
    del loss
    hooks.close()


# -------------------------------------------------------- DataLoader workers
class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Block(), _Block())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).pow(2).mean()


class _RunsABlock(torch.utils.data.Dataset[torch.Tensor]):
    """A Dataset whose ``__getitem__`` runs a (wrapped) block in grad mode: a
    forgotten ``no_grad``, or with a backward too."""

    def __init__(self, block: nn.Module, backward: bool) -> None:
        self.block = block
        self.backward = backward

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i))
        y = self.block(x)
        if self.backward:
            y.sum().backward()
        return x + 0.0 * y.detach()


def _train(model: _Net, loader: Any) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    for x in loader:
        opt.zero_grad(set_to_none=True)
        model(x).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        opt.step()
    return grads


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
def test_dataloader_fork_workers_running_a_wrapped_block_leave_the_parent_intact(
    tmp_path: Path, backward: bool
) -> None:
    def loader(block: nn.Module) -> Any:
        return torch.utils.data.DataLoader(
            _RunsABlock(block, backward),
            batch_size=4,
            num_workers=2,
            multiprocessing_context="fork",
            persistent_workers=True,
        )

    torch.manual_seed(0)
    ref = _Net()
    off = _Net()
    off.load_state_dict(ref.state_dict())
    want: list[torch.Tensor] = []
    ref_data = loader(copy.deepcopy(ref.blocks[0]))
    for _ in range(2):  # two epochs: persistent workers fork once
        want += _train(ref, ref_data)
    hooks = tsh.wrap(off, f"file://{tmp_path / 'root'}", modules="blocks.*", min_bytes=0)
    got: list[torch.Tensor] = []
    data = loader(off.blocks[0])
    for _ in range(2):
        got += _train(off, data)
    assert len(got) == len(want) == 8
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step} differs"
    assert hooks.stats.tensors_offloaded > 0 and hooks.stats.fallbacks == 0
    assert hooks.live_records == 0 and len(hooks.store) == 0
    hooks.remove()
