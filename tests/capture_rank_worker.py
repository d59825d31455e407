"""The rank processes of ``tests/test_capture_ranks.py`` (spawned; no pytest in here).

Each rank joins a gloo group on 127.0.0.1, trains a DDP-wrapped model under
``tsh.capture`` into one shared root, then reads the captured rows back with a
``CaptureDataset`` split over the ranks, and writes what it saw to ``OUT/rank{R}.pt``
(plain tensors, read back with ``weights_only=True``).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import tensorstore_hooks as tsh

__all__ = ["STEPS", "batch", "model", "run_rank"]

STEPS = 3


def model() -> nn.Module:
    torch.manual_seed(0)  # identical weights on every rank
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * rank + step))


def run_rank(rank: int, world: int, port: int, work: str) -> None:
    """Entry point of one rank (``torch.multiprocessing`` passes ``rank`` first)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        out: dict[str, torch.Tensor] = {}
        ddp = DistributedDataParallel(model())
        root = str(Path(work) / "root")
        with tsh.capture(ddp, root, modules="module.1", what=("output", "grad_output")):
            for step in range(STEPS):
                ddp(batch(rank, step)).pow(2).sum().backward()
        out["grad"] = ddp.module[0].weight.grad.clone()
        dist.barrier()  # every rank's arrays are written
        ds = tsh.CaptureDataset(root, "module.1/output", batch_size=4, seed=1)
        out["world"] = torch.tensor([ds.rank, ds.world_size, len(ds.arrays)])
        out["rows"] = torch.cat(list(ds))
        torch.save(out, Path(work) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
