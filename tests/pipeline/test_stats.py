"""``hooks.stats``: per-step figures, counts that add up, the full summary."""

from __future__ import annotations

import torch
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks import OffloadStats, RouteStats


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32), nn.Tanh())


def _saves(model: nn.Module, x: torch.Tensor) -> int:
    """How many tensors autograd saves for one forward (a counting hook pair)."""
    n = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal n
        n += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _forward(model, x)
    return n


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = model(x)
    return (h * h).sum()  # saves h twice: a dedup hit


X = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))


def test_counts_add_up_and_summary_shows_every_counter() -> None:
    model = _model()
    hooks = tsh.offload("memory://", min_bytes=4096)
    for _ in range(2):
        with hooks:
            loss = _forward(model, X)
        hooks.flush()  # every unpack reads from the store: no tail hits
        loss.backward()
    stats = hooks.stats
    assert stats.dedup_hits >= 2 and stats.tensors_kept > 0 and stats.tensors_offloaded > 0
    assert stats.tensors_saved == 2 * _saves(model, X)
    unpacks = stats.prefetch_hits + stats.prefetch_misses + stats.tail_hits + stats.reuse_hits
    assert unpacks == stats.tensors_offloaded + stats.dedup_hits
    # h saved twice: one read, the second unpack gets what the first brought back.
    assert stats.reuse_hits >= 2 and stats.bytes_read == stats.bytes_written
    line = stats.summary()
    assert "\n" not in line
    for part in (
        f"saved {stats.tensors_saved} = offloaded {stats.tensors_offloaded}",
        f"kept {stats.tensors_kept}",
        f"host {stats.tensors_host}",
        f"dedup {stats.dedup_hits}",
        f"unpacked {unpacks} = prefetch hits {stats.prefetch_hits}",
        f"tail {stats.tail_hits} + reuse {stats.reuse_hits}",
        f"recomputed {stats.recomputed}",
        "written ",
        "read ",
        "stalls pack",
        "peak held",
        "fallbacks",
    ):
        assert part in line, part
    hooks.close()


def test_snapshot_delta_and_reset_give_per_step_figures() -> None:
    model = _model()
    hooks = tsh.offload("memory://", min_bytes=0)
    per_step = []
    for _ in range(3):
        before = hooks.stats.snapshot()
        with hooks:
            loss = _forward(model, X)
        loss.backward()
        per_step.append(hooks.stats - before)
    total = hooks.stats.snapshot()
    assert per_step[0].tensors_offloaded > 0
    assert all(s.tensors_offloaded == per_step[0].tensors_offloaded for s in per_step)
    assert all(s.bytes_offloaded == per_step[0].bytes_offloaded for s in per_step)
    assert sum(s.tensors_offloaded for s in per_step) == total.tensors_offloaded
    assert per_step[1].per_rule["default"].tensors == per_step[0].per_rule["default"].tensors
    assert per_step[1].per_rule["default"].tensors * 3 == total.per_rule["default"].tensors
    # The snapshot is a copy: later steps did not change it.
    snap = hooks.stats.snapshot()
    with hooks:
        _forward(model, X).backward()
    assert snap.tensors_offloaded == total.tensors_offloaded < hooks.stats.tensors_offloaded

    hooks.stats.reset()
    assert hooks.stats.tensors_offloaded == 0 and hooks.stats.per_rule == {}
    assert hooks.stats == OffloadStats(
        peak_held_bytes=hooks.stats.held_bytes,
        held_bytes=hooks.stats.held_bytes,
        direct_io=hooks.stats.direct_io,  # a level, like held_bytes: what the store does
    )
    with hooks:
        loss = _forward(model, X)
    loss.backward()
    assert hooks.stats.tensors_offloaded == per_step[0].tensors_offloaded  # one step's worth
    hooks.close()


def test_delta_of_route_tables_keeps_only_changes() -> None:
    a = OffloadStats(tensors_kept=3, per_rule={"x": RouteStats(2, 20), "y": RouteStats(1, 5)})
    b = OffloadStats(
        tensors_kept=5,
        per_rule={"x": RouteStats(4, 40), "y": RouteStats(1, 5), "z": RouteStats(1, 1)},
        held_bytes=7,
        peak_held_bytes=9,
    )
    d = b - a
    assert d.tensors_kept == 2
    assert d.per_rule == {"x": RouteStats(2, 20), "z": RouteStats(1, 1)}
    assert (d.held_bytes, d.peak_held_bytes) == (7, 9)  # levels, not counts
