"""The rank processes of ``tests/capture/test_capture_ddp.py`` (spawned; no pytest in here).

Each rank trains a sparse autoencoder on captured rows for two epochs, under DDP
(gloo, CPU), reading ``CaptureDataset`` through a DataLoader with persistent workers,
and writes the row ids it saw, batch by batch, to ``OUT/rank{R}.json``. The process
group's short timeout bounds a hang (a rank with one step more than the other).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import tensorstore_hooks as tsh
from tests._ddp import process_group

__all__ = ["SAE", "run_rank"]


class SAE(nn.Module):
    """A sparse autoencoder: ReLU code, L1 penalty (what activation caches feed)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.enc = nn.Linear(d, hidden)
        self.dec = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        code = torch.relu(self.enc(x))
        return (self.dec(code) - x).pow(2).sum(-1).mean() + 1e-3 * code.abs().sum(-1).mean()


def run_rank(rank: int, world: int, port: int, root: str, out: str, epochs: int) -> None:
    """Entry point of one rank (``torch.multiprocessing`` passes ``rank`` first)."""
    with process_group(rank, world, port, timeout_s=45):
        ds = tsh.CaptureDataset(root, "0/output", batch_size=64, seed=0, shuffle_bytes="8KiB")
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        torch.manual_seed(0)
        sae = DDP(SAE(ds.row_shape[0] - 1, 32))
        opt = torch.optim.SGD(sae.parameters(), lr=1e-3)
        seen: list[list[list[int]]] = []
        losses: list[float] = []
        for epoch in range(epochs):
            ds.set_epoch(epoch)
            batches = []
            for batch in loader:
                ids, x = batch[:, 0], batch[:, 1:]  # column 0 names the row
                loss = sae(x)
                opt.zero_grad()
                loss.backward()  # an allreduce: both ranks must take every step
                opt.step()
                batches.append(ids.long().tolist())
                losses.append(float(loss))
            seen.append(batches)
        dist.barrier()
        Path(out, f"rank{rank}.json").write_text(
            json.dumps({"epochs": seen, "len": len(ds), "losses": losses})
        )
