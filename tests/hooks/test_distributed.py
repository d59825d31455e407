"""Multi-rank training: two gloo ranks on CPU, offloading to one shared root.

One launch of two processes (``torch.multiprocessing``, spawn) runs every check in
``tests/distributed_worker.py``; each check here reads both ranks' verdicts. Ranks
rendezvous on 127.0.0.1 at a free port; the launch is killed if it outlives
``tests._ddp.LAUNCH_TIMEOUT_S``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests import distributed_worker
from tests._ddp import launch_ranks, needs_gloo
from tests.s3_fixtures import *  # noqa: F403 - the fixtures
from tests.s3_fixtures import S3Server

pytestmark = needs_gloo

WORLD = 2


def _launch(work: Path, options: dict[str, Any]) -> dict[str, list[str]]:
    """Run the ranks; return ``{check: [verdict of rank 0, verdict of rank 1]}``."""
    launch_ranks(distributed_worker.run_rank, str(work), options, world=WORLD)
    verdicts: dict[str, list[str]] = {}
    for rank in range(WORLD):
        results = json.loads((work / f"rank{rank}.json").read_text())["results"]
        for name, verdict in results.items():
            verdicts.setdefault(name, []).append(verdict)
    return verdicts


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> dict[str, list[str]]:
    s3_server.create_bucket("tsh-ranks")
    try:
        return _launch(
            tmp_path_factory.mktemp("ranks"),
            {
                "checks": list(distributed_worker.CHECKS),
                "s3_url": "s3://tsh-ranks/acts",
                "storage_options": s3_server.storage_options,
            },
        )
    finally:
        s3_server.remove_bucket("tsh-ranks")


def _expect_ok(verdicts: dict[str, list[str]], name: str) -> None:
    got = verdicts.get(name)
    assert got is not None and len(got) == WORLD, f"check {name!r} did not run on every rank"
    failures = [f"rank {r}:\n{v}" for r, v in enumerate(got) if v != "ok"]
    assert not failures, "\n".join(failures)


def test_ddp_gradients_identical(verdicts: dict[str, list[str]]) -> None:
    """DDP (gloo, 2 ranks): offloading to a shared local root changes no gradient; each
    rank writes under its own ``r{rank}-...`` namespace and removes it at close."""
    _expect_ok(verdicts, "ddp")


def test_fsdp2_gradients_identical(verdicts: dict[str, list[str]]) -> None:
    """FSDP2 ``fully_shard`` on CPU/gloo: the same gradient shards with offloading."""
    _expect_ok(verdicts, "fsdp2")


def test_fsdp2_without_skip_parameters_gradients_identical(
    verdicts: dict[str, list[str]],
) -> None:
    """FSDP2 with ``skip_parameters=False``: stored parameters leave FSDP free to
    ``resize_(0)`` their storage; the same gradient shards over several steps."""
    _expect_ok(verdicts, "fsdp2_parameters")


def test_ddp_with_dataloader_fork_workers_running_a_wrapped_block(
    verdicts: dict[str, list[str]],
) -> None:
    """DDP, ``tsh.wrap(modules=...)``, DataLoader fork workers (persistent) whose Dataset
    runs the wrapped block with and without backward: the same gradients."""
    _expect_ok(verdicts, "ddp_loader_workers")


def test_ddp_ranks_share_an_s3_prefix(verdicts: dict[str, list[str]]) -> None:
    """Both ranks offload under one ``s3://`` prefix without colliding."""
    _expect_ok(verdicts, "ddp_s3")


def test_ddp_capture_writes_a_group_per_rank(verdicts: dict[str, list[str]]) -> None:
    """tsh.capture under DDP: ``capture/rank{R}/`` per rank, exact values, gradients
    unchanged, and a CaptureDataset over the ranks that reads every row once."""
    _expect_ok(verdicts, "ddp_capture")
