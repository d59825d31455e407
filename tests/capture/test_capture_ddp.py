"""A sparse autoencoder trained from a capture under two-rank DDP (gloo, CPU) with
persistent DataLoader workers (issue 35's figure): two epochs, every row exactly once
per epoch, a different order each epoch, and the loop ends. Bounded: the launch is
killed after ``tests._ddp.LAUNCH_TIMEOUT_S``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import tensorstore_hooks as tsh
from tests._ddp import launch_ranks, needs_gloo
from tests.capture import ddp_sae

pytestmark = needs_gloo

WORLD = 2
EPOCHS = 2
ROWS = {0: 900, 1: 101}  # rows each training rank captured: chunks of unequal sizes


def _capture(root: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """Rows ``[id, 7 features]`` captured as two ranks of a training run would."""
    model = nn.Sequential(nn.Identity())
    first = 0
    g = torch.Generator().manual_seed(0)
    for rank, n in ROWS.items():
        monkeypatch.setenv("RANK", str(rank))
        with (
            torch.no_grad(),
            tsh.capture(model, str(root), modules="0", what="output", chunk_bytes="4KiB"),
        ):
            for lo in range(0, n, 50):
                k = min(50, n - lo)
                ids = torch.arange(first + lo, first + lo + k, dtype=torch.float32)[:, None]
                model(torch.cat([ids, torch.randn(k, 7, generator=g)], dim=1))
        first += n
    monkeypatch.delenv("RANK")
    return first


def test_a_sae_trains_two_epochs_under_ddp_with_persistent_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = _capture(tmp_path / "root", monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    launch_ranks(
        ddp_sae.run_rank, str(tmp_path / "root"), str(out), EPOCHS, world=WORLD, what="the DDP loop"
    )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    lengths = {r["len"] for r in ranks}
    assert len(lengths) == 1  # len(ds) agrees on every rank
    orders = []
    for epoch in range(EPOCHS):
        counts = [len(r["epochs"][epoch]) for r in ranks]
        assert counts == [ranks[0]["len"]] * WORLD  # the same steps on every rank
        ids = [i for r in ranks for batch in r["epochs"][epoch] for i in batch]
        assert sorted(ids) == list(range(rows))  # every row exactly once
        orders.append(ids)
    assert orders[0] != orders[1]  # a new order in the second epoch
    assert all(r["losses"][-1] < r["losses"][0] for r in ranks)  # it trained
