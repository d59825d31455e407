"""Capture under DDP: two gloo ranks on CPU, one shared root, one group per rank, and
a CaptureDataset that splits every rank's rows over the ranks without overlap."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zarr

from . import capture_rank_worker as worker

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="needs torch.distributed with the gloo backend",
)

WORLD = 2
LAUNCH_TIMEOUT_S = 150.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reference(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s block outputs and output gradients, by hand-written hooks."""
    m = worker.model()
    outs: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []

    def hook(mod: torch.nn.Module, a: object, o: torch.Tensor) -> None:
        outs.append(o.detach().clone())
        o.register_hook(lambda g: grads.append(g.clone()))

    m[1].register_forward_hook(hook)
    for step in range(worker.STEPS):
        m(worker.batch(rank, step)).pow(2).sum().backward()
    return torch.cat(outs), torch.cat(grads)


def test_each_rank_writes_its_group_and_the_dataset_splits_them(tmp_path: Path) -> None:
    ctx = mp.start_processes(
        worker.run_rank,
        args=(WORLD, _free_port(), str(tmp_path)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"ranks did not finish within {LAUNCH_TIMEOUT_S:.0f}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
            p.close()
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    root = tmp_path / "root"
    for rank in range(WORLD):
        out, grad = _reference(rank)
        group = zarr.open_group(str(root / "capture" / f"rank{rank}"), mode="r")
        arr = group["module.1/output"]
        assert arr.attrs["rank"] == rank
        assert torch.equal(torch.from_numpy(arr[:]), out)
        # DDP averages parameter gradients, never the activations' own gradients.
        assert torch.equal(torch.from_numpy(group["module.1/grad_output"][:]), grad)
        assert results[rank]["world"].tolist() == [rank, WORLD, WORLD]
    # Both ranks' gradients agree (DDP's all-reduce), with capture on.
    assert torch.equal(results[0]["grad"], results[1]["grad"])
    # Read back over the ranks: every row of every rank once.
    seen = torch.cat([r["rows"] for r in results])
    want = torch.cat([_reference(r)[0] for r in range(WORLD)])
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, want.tolist()))
