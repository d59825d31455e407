"""Launching gloo ranks on CPU for a test: ``launch_ranks(fn, *args)`` runs
``fn(rank, world, port, *args)`` in ``world`` spawned processes that rendezvous on
127.0.0.1 at a free port, and fails the test if they outlive ``timeout_s``.

``fn`` must be importable by a fresh interpreter (a module-level function of a module
under ``tests/``, as ``tests/distributed_worker.py``): each rank is a fresh interpreter
(the spawn start method), not a fork of the test process. A rank joins the group with
:func:`process_group` and reports back through files the caller names in ``args``; a
rank that raises fails the launch with its traceback
(``torch.multiprocessing.ProcessRaisedException``). Every rank still alive at the end,
on success or failure, is killed and reaped.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.daemon_fixtures import free_port

__all__ = ["LAUNCH_TIMEOUT_S", "launch_ranks", "needs_gloo", "process_group"]

LAUNCH_TIMEOUT_S = 150.0
"""How long a launch may run before the test fails (two ranks on a loaded 2-core CPU)."""

needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="needs torch.distributed with the gloo backend",
)
"""The mark of a module whose tests launch ranks (``pytestmark = needs_gloo``)."""


def launch_ranks(
    fn: Callable[..., None],
    *args: object,
    world: int = 2,
    timeout_s: float = LAUNCH_TIMEOUT_S,
    what: str = "the ranks",
) -> None:
    """Run ``fn(rank, world, port, *args)`` for each rank and wait for all of them;
    ``pytest.fail`` naming ``what`` if they have not ended within ``timeout_s``."""
    ctx = mp.start_processes(
        fn,
        args=(world, free_port(), *args),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"{what} did not end within {timeout_s:.0f}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
            p.close()


@contextlib.contextmanager
def process_group(rank: int, world: int, port: int, *, timeout_s: float = 30.0) -> Iterator[None]:
    """Inside a rank: join the gloo group of :func:`launch_ranks` (``timeout_s``: how
    long a collective waits for the other ranks) and leave it at the end. Each rank
    runs torch on one thread: the ranks share a small machine's cores."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
