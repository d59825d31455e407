"""The rank processes of ``tests/hooks/test_distributed.py`` (spawned; no pytest in here).

Each rank joins a gloo process group on 127.0.0.1, runs every check in
:data:`CHECKS` in order, and writes ``{check: "ok" | traceback}`` to
``OUT/rank{R}.json``; the parent turns each entry into a test result. A check that
fails on one rank must not leave the other blocked in a collective: every check
ends with the same collectives on both ranks whatever happened, and the process
group has a short timeout as a last resort.
"""

from __future__ import annotations

import copy
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import tensorstore_hooks as tsh
from tests._ddp import process_group

__all__ = ["CHECKS", "run_rank"]


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _model() -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank
    return nn.Sequential(nn.Linear(16, 32), _Block(32), _Block(32), nn.Linear(32, 4))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(8, 12, 16, generator=torch.Generator().manual_seed(100 + rank))


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 gradients are DTensors sharded over ranks; compare this rank's shard.
    to_local = getattr(t, "to_local", None)
    return (to_local() if to_local is not None else t).detach().clone()


def _step(
    model: nn.Module, x: torch.Tensor, hooks: tsh.OffloadHooks | None, on_forward: Any = None
) -> dict[str, torch.Tensor]:
    if hooks is None:
        loss = model(x).pow(2).mean()
    else:
        with hooks:
            loss = model(x).pow(2).mean()
        if on_forward is not None:
            on_forward(hooks)
    loss.backward()
    return {n: _local(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want, (sorted(got), sorted(want))
    for name in want:
        assert torch.equal(got[name], want[name]), f"gradient of {name} differs"


def _namespaces_while_live(
    root: Path, rank: int, problems: list[str]
) -> Callable[[tsh.OffloadHooks], None]:
    """After forward: every rank's namespace is under the shared root, all different.

    Problems are collected, not raised: raising here would skip this rank's backward
    and leave the other rank waiting in DDP's all-reduce.
    """

    def check(hooks: tsh.OffloadHooks) -> None:
        hooks.flush()
        ns = hooks.store.namespace  # type: ignore[attr-defined]
        names: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(names, ns)
        dist.barrier()  # every rank has written its namespace
        present = {p.name for p in root.iterdir() if p.is_dir()}
        if not ns.startswith(f"r{rank}-"):
            problems.append(f"namespace {ns!r} does not start with r{rank}-")
        if len(set(names)) != len(names):
            problems.append(f"ranks share a namespace: {names}")
        if not set(names) <= present:
            problems.append(f"namespaces {names} not all under the root: {sorted(present)}")

    return check


def check_ddp(rank: int, work: Path, options: dict[str, Any]) -> None:
    """DDP: the same gradients with and without offloading to a shared local root."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    root = work / "ddp-root"
    base = _model()
    x = _batch(rank)
    want = _step(DDP(copy.deepcopy(base)), x, None)
    hooks = tsh.offload(f"file://{root}", min_bytes=0)
    problems: list[str] = []
    got = _step(DDP(copy.deepcopy(base)), x, hooks, _namespaces_while_live(root, rank, problems))
    stats = hooks.stats
    hooks.close()
    dist.barrier()  # both ranks have closed their stores (the last collective here)
    leftovers = sorted(p.name for p in root.iterdir())
    assert stats.tensors_offloaded > 0 and stats.fallbacks == 0, stats
    assert not problems, problems
    _assert_same(got, want)
    assert leftovers == ["zarr.json"], leftovers  # each rank removed its namespace


def check_fsdp2(rank: int, work: Path, options: dict[str, Any]) -> None:
    """FSDP2 (``fully_shard``) on CPU/gloo: the same gradient shards with offloading."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def sharded() -> nn.Module:
        model = _model()
        for module in model.children():
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    root = work / "fsdp-root"
    x = _batch(rank)
    want = _step(sharded(), x, None)
    hooks = tsh.offload(f"file://{root}", min_bytes=0)
    problems: list[str] = []
    got = _step(sharded(), x, hooks, _namespaces_while_live(root, rank, problems))
    stats = hooks.stats
    hooks.close()
    assert not problems, problems
    _assert_same(got, want)
    # Unsharded parameters stay put (skip_parameters): FSDP frees and regathers them.
    assert stats.tensors_offloaded > 0 and stats.fallbacks == 0, stats


def check_fsdp2_parameters(rank: int, work: Path, options: dict[str, Any]) -> None:
    """FSDP2 with ``skip_parameters=False``: FSDP frees each unsharded parameter with
    ``storage.resize_(0)`` after forward; packing must leave that storage resizable
    and the write must not race the free (NOTE [ Parameters are copied at pack ])."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def train(hooks: tsh.OffloadHooks | None) -> list[dict[str, torch.Tensor]]:
        model = _model()
        for module in model.children():
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        for step in range(3):
            opt.zero_grad()
            grads.append(_step(model, _batch(rank + 10 * step), hooks))
            opt.step()
        return grads

    want = train(None)
    hooks = tsh.offload(f"file://{work / 'fsdp-params'}", min_bytes=0, skip_parameters=False)
    got = train(hooks)
    stats = hooks.stats
    hooks.close()
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    assert stats.per_rule.get("parameter") is None, stats.per_rule  # parameters stored
    assert stats.tensors_offloaded > 0 and stats.fallbacks == 0, stats


class _RunsABlock(torch.utils.data.Dataset[torch.Tensor]):
    """A Dataset whose ``__getitem__`` runs a wrapped block in grad mode (a forgotten
    ``no_grad``), and with ``backward`` a backward through it too."""

    def __init__(self, block: nn.Module, backward: bool, rank: int) -> None:
        self.block, self.backward, self.rank = block, backward, rank

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.randn(12, 16, generator=torch.Generator().manual_seed(1000 * self.rank + i))
        y = self.block[0](x)  # the first Linear, then the wrapped block
        out = self.block[1](y)
        if self.backward:
            out.pow(2).sum().backward()
        return x + 0.0 * out.detach().sum()


def check_ddp_loader_workers(rank: int, work: Path, options: dict[str, Any]) -> None:
    """DDP with ``tsh.wrap(modules=...)`` and DataLoader fork workers (persistent) whose
    Dataset runs the wrapped block: the workers' hooks must neither write into this
    rank's namespace nor delete from it (NOTE [ Fork safety ])."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def train(wrap: bool, backward: bool) -> list[dict[str, torch.Tensor]]:
        base = _model()
        hooks = None
        if wrap:
            root = f"file://{work / 'loader-root'}"
            hooks = tsh.wrap(base, root, modules=["1", "2"], min_bytes=0)
        ddp = DDP(base)
        loader = torch.utils.data.DataLoader(
            _RunsABlock(base, backward, rank),
            batch_size=4,
            num_workers=2,
            multiprocessing_context="fork",
            persistent_workers=True,
        )
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        grads = []
        for _ in range(2):  # two epochs: the persistent workers fork once
            for x in loader:
                opt.zero_grad()
                grads.append(_step(ddp, x, None))
                opt.step()
        if hooks is not None:
            stats = hooks.stats
            hooks.remove()
            assert stats.tensors_offloaded > 0 and stats.fallbacks == 0, stats
            assert hooks.live_records == 0
        return grads

    for backward in (False, True):
        want = train(False, backward)
        got = train(True, backward)
        assert len(got) == len(want) == 8
        for g, w in zip(got, want, strict=True):
            _assert_same(g, w)


def check_ddp_s3(rank: int, work: Path, options: dict[str, Any]) -> None:
    """DDP with both ranks offloading under one S3 prefix (the parent's moto server)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    url = options["s3_url"]
    base = _model()
    x = _batch(rank)
    want = _step(DDP(copy.deepcopy(base)), x, None)
    hooks = tsh.offload(url, storage_options=options["storage_options"], min_bytes=0)
    namespaces: list[Any] = [None] * dist.get_world_size()

    def gather(h: tsh.OffloadHooks) -> None:
        h.flush()
        dist.all_gather_object(namespaces, h.store.namespace)  # type: ignore[attr-defined]

    got = _step(DDP(copy.deepcopy(base)), x, hooks, gather)
    assert hooks.stats.tensors_offloaded > 0 and hooks.stats.fallbacks == 0
    hooks.close()
    _assert_same(got, want)
    assert [n.split("-", 1)[0] for n in namespaces] == [f"r{r}" for r in range(len(namespaces))]


def check_ddp_capture(rank: int, work: Path, options: dict[str, Any]) -> None:
    """DDP under tsh.capture into one shared root: each rank writes its own group, the
    values are those of hand-written hooks, the gradients those of no capture, and a
    CaptureDataset split over the ranks reads every rank's rows once."""
    import zarr
    from torch.nn.parallel import DistributedDataParallel as DDP

    root = work / "capture-root"
    base = _model()
    x = _batch(rank)
    want = _step(DDP(copy.deepcopy(base)), x, None)
    ref: list[torch.Tensor] = []  # the tutorial's hooks on an undistributed copy

    def hook(m: nn.Module, a: Any, out: torch.Tensor) -> None:
        ref.append(out.detach().clone())
        out.register_hook(lambda g: ref.append(g.clone()))

    plain = copy.deepcopy(base)
    plain[1].register_forward_hook(hook)
    _step(plain, x, None)
    ddp = DDP(copy.deepcopy(base))
    with tsh.capture(ddp, str(root), modules="module.1", what=("output", "grad_output")):
        got = _step(ddp, x, None)
    _assert_same(got, want)
    dist.barrier()  # every rank's arrays are written
    group = zarr.open_group(str(root / "capture" / f"rank{rank}"), mode="r")
    assert group["module.1/output"].attrs["rank"] == rank
    assert torch.equal(torch.from_numpy(group["module.1/output"][:]), ref[0])
    assert torch.equal(torch.from_numpy(group["module.1/grad_output"][:]), ref[1])
    ds = tsh.CaptureDataset(str(root), "module.1/output", batch_size=3, seed=1)
    assert (ds.rank, ds.world_size, len(ds.arrays)) == (rank, dist.get_world_size(), 2)
    mine = [tuple(r.flatten().tolist()) for r in torch.cat(list(ds))]
    seen: list[Any] = [None] * dist.get_world_size()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    dist.all_gather_object(every, [tuple(r.flatten().tolist()) for r in ref[0]])
    assert sorted(r for rows in seen for r in rows) == sorted(r for rows in every for r in rows)


CHECKS: dict[str, Callable[[int, Path, dict[str, Any]], None]] = {
    "ddp": check_ddp,
    "fsdp2": check_fsdp2,
    "fsdp2_parameters": check_fsdp2_parameters,
    "ddp_loader_workers": check_ddp_loader_workers,
    "ddp_s3": check_ddp_s3,
    "ddp_capture": check_ddp_capture,
}


def run_rank(rank: int, world: int, port: int, work: str, options: dict[str, Any]) -> None:
    """Entry point of one rank (``torch.multiprocessing`` passes ``rank`` first)."""
    results: dict[str, str] = {}
    with process_group(rank, world, port, timeout_s=30):
        try:
            for name, check in CHECKS.items():
                if name not in options["checks"]:
                    continue
                try:
                    check(rank, Path(work), options)
                    results[name] = "ok"
                except Exception:
                    results[name] = traceback.format_exc()
                # Line the ranks up again before the next check, whatever happened.
                dist.barrier()
        finally:
            out = Path(work) / f"rank{rank}.json"
            out.write_text(json.dumps({"pid": os.getpid(), "results": results}))
