"""``device_budget: auto``, ``host_budget: auto`` and percentages, with the memory
injected (NOTE [ Auto budgets ] in ``tensorstore_hooks/pipeline/_budgets.py``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks._units import AUTO, MemoryShare
from tensorstore_hooks.pipeline import _budgets
from tensorstore_hooks.pipeline._budgets import BudgetControl, PeakTrack, auto_budget, track_peak
from tensorstore_hooks.runtime._memory import MemoryReading
from tests.fake_accelerator import on_fake_accelerator
from tests.pipeline.test_pipeline import sin_chain

MiB = 1 << 20
CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it


class FakeMemory:
    """A ``MemoryProbe`` whose figures the test sets (per device type)."""

    def __init__(self, limit: int, peak: int) -> None:
        self.limit = {"cpu": limit, "cuda": limit}
        self.peak_bytes = {"cpu": peak, "cuda": peak}
        self.reads = 0

    def read(self, device: torch.device) -> MemoryReading | None:
        if device.type not in self.limit:
            return None
        self.reads += 1
        return MemoryReading(
            self.limit[device.type], self.peak_bytes[device.type], f"fake {device.type}"
        )

    def peak(self, device: torch.device) -> int:
        return self.peak_bytes[device.type]


class FakeTier:
    def __init__(self, cap: int) -> None:
        self.cap_bytes = cap
        self.used_bytes = 0


class Sink:
    max_inflight = 0
    window_bytes = 0


def control(probe: FakeMemory, **kw: Any) -> BudgetControl:
    kw.setdefault("device_budget", AUTO)
    kw.setdefault("max_inflight", 0)
    kw.setdefault("prefetch", 0)
    return BudgetControl(probe=probe, **kw)


def forward(ctl: BudgetControl, sizes: list[int], device: torch.device = CPU) -> list[bool]:
    out = [ctl.keep("store", n, device=device) for n in sizes]
    ctl.backward_started()
    return out


def kept(sizes: list[int], decisions: list[bool]) -> int:
    return sum(n for n, k in zip(sizes, decisions, strict=True) if k)


# ------------------------------------------------------------------ pure figures
def test_auto_budget_is_the_room_less_headroom() -> None:
    reading = MemoryReading(1000 * MiB, 0, "x")
    assert auto_budget(AUTO, reading, 400 * MiB, MemoryShare(10)) == 500 * MiB
    assert auto_budget(MemoryShare(60), reading, 400 * MiB, MemoryShare(10)) == 300 * MiB
    assert auto_budget(AUTO, reading, 400 * MiB, 0) == 600 * MiB
    assert auto_budget(AUTO, reading, 400 * MiB, 200 * MiB) == 400 * MiB  # bytes
    assert auto_budget(AUTO, reading, 990 * MiB, MemoryShare(10)) == 0  # never below 0


def test_the_baseline_rises_only_with_the_peak_and_less_what_was_held() -> None:
    track = track_peak(None, 400, 0)
    assert track == PeakTrack(400, 400)
    assert track_peak(track, 400, 300) == track  # the mark did not rise: nothing learnt
    assert track_peak(track, 700, 300) == PeakTrack(700, 400)  # the rise was what was held
    assert track_peak(track, 750, 300) == PeakTrack(750, 450)  # the step needed 50 more
    assert track_peak(PeakTrack(750, 450), 800, 500) == PeakTrack(800, 450)  # never falls


# --------------------------------------------------------------- device_budget
def test_device_auto_keeps_what_fits_from_the_first_step() -> None:
    probe = FakeMemory(limit=1000 * MiB, peak=400 * MiB)
    ctl = control(probe)
    sizes = [100 * MiB] * 8
    # The first forward: half of 1000 MiB less 10% headroom less the peak so far (400
    # MiB), 250 MiB, spent on its oldest tensors (rule 5; the step's peak is not known).
    assert forward(ctl, sizes) == [True] * 2 + [False] * 6
    assert ctl.device_budget == 250 * MiB
    got = forward(ctl, sizes)
    # 1000 MiB less 10% headroom less the first step's peak (400 MiB): 500 MiB.
    assert ctl.device_budget == 500 * MiB
    assert kept(sizes, got) == 500 * MiB and got[-5:] == [True] * 5


def test_a_percentage_is_a_share_of_the_room() -> None:
    ctl = control(FakeMemory(1000 * MiB, 400 * MiB), device_budget=MemoryShare(50))
    forward(ctl, [10 * MiB] * 4)
    forward(ctl, [10 * MiB] * 4)
    assert ctl.device_budget == 250 * MiB


def test_headroom_in_bytes() -> None:
    ctl = control(FakeMemory(1000 * MiB, 400 * MiB), memory_headroom=50 * MiB)
    forward(ctl, [MiB])
    forward(ctl, [MiB])
    assert ctl.device_budget == 550 * MiB


def test_rederived_when_the_plan_is_redone_not_on_a_steady_step() -> None:
    probe = FakeMemory(1000 * MiB, 400 * MiB)
    ctl = control(probe)
    forward(ctl, [10 * MiB] * 4)
    forward(ctl, [10 * MiB] * 4)
    assert ctl.device_budget == 500 * MiB
    reads = probe.reads
    probe.limit["cpu"] = 1200 * MiB  # e.g. another process let memory go
    forward(ctl, [10 * MiB] * 4)
    assert ctl.device_budget == 500 * MiB and probe.reads == reads  # same sizes
    forward(ctl, [12 * MiB] * 4)  # new sizes: a replan ...
    forward(ctl, [12 * MiB] * 4)  # ... and the next forward derives again
    assert ctl.device_budget == 680 * MiB and probe.reads == reads + 1  # 1200 - 120 - 400


def test_a_step_that_needs_more_memory_lowers_the_budget() -> None:
    probe = FakeMemory(1000 * MiB, 400 * MiB)
    ctl = control(probe)
    sizes = [100 * MiB] * 8
    forward(ctl, sizes)
    assert kept(sizes, forward(ctl, sizes)) == 500 * MiB
    probe.peak_bytes["cpu"] = 900 * MiB  # the kept 500 MiB on top of the same 400: no news
    forward(ctl, sizes)
    assert ctl.device_budget == 500 * MiB
    probe.peak_bytes["cpu"] = 950 * MiB  # 50 MiB more than kept + baseline: the step grew
    got = forward(ctl, sizes)
    assert ctl.device_budget == 450 * MiB  # 1000 - 100 - (950 - 500)
    assert kept(sizes, got) <= 450 * MiB


def test_auto_fits_wherever_offloading_everything_fits() -> None:
    # A process whose steps need `base` besides saved tensors, under a limit: the peak
    # with what auto keeps stays within the limit less the headroom whenever the step
    # needs no more than an earlier one did.
    limit = 2000 * MiB
    probe = FakeMemory(limit, 0)
    ctl = control(probe)
    sizes = [50 * MiB] * 40  # more than the limit: the budget decides
    highest = 0
    for step, base in enumerate([600, 700, 650, 700, 900, 800, 900, 900]):
        base *= MiB
        got = forward(ctl, sizes)
        peak = base + kept(sizes, got)
        if step:
            assert kept(sizes, got) > 0
        if base <= highest:
            assert peak <= limit - limit // 10, step
        highest = max(highest, base)
        probe.peak_bytes["cpu"] = max(probe.peak_bytes["cpu"], peak)
        assert ctl.device_budget is None or ctl.device_budget <= limit - limit // 10


def test_logged_at_info_when_it_moves(caplog: pytest.LogCaptureFixture) -> None:
    probe = FakeMemory(1000 * MiB, 400 * MiB)
    ctl = control(probe)
    with caplog.at_level(logging.DEBUG, logger="tensorstore_hooks"):
        forward(ctl, [MiB] * 2)
        forward(ctl, [MiB] * 2)
        forward(ctl, [MiB] * 3)  # a replan: derived again at the next forward, unchanged
        forward(ctl, [MiB] * 3)
    derived = [r for r in caplog.records if r.getMessage().startswith("device_budget auto:")]
    # Derived at the first forward (it moved: INFO), again at the second (its peak is
    # known now; unchanged: DEBUG) and after the replan (unchanged: DEBUG).
    assert [r.levelno for r in derived] == [logging.INFO, logging.DEBUG, logging.DEBUG]
    first = [r for r in caplog.records if "for the first forward" in r.getMessage()]
    assert len(first) == 1 and "250.00 MiB (half of 500.00 MiB" in first[0].getMessage()
    message = derived[0].getMessage()
    assert "500.00 MiB" in message and "1000.00 MiB from fake cpu" in message
    assert "headroom 100.00 MiB" in message and "saved tensors 400.00 MiB" in message


def test_cuda_tensors_read_the_device_and_keep_the_write_window_on_the_host() -> None:
    probe = FakeMemory(1000 * MiB, 400 * MiB)
    probe.limit["cuda"], probe.peak_bytes["cuda"] = 8000 * MiB, 1000 * MiB
    ctl = control(probe, max_inflight=None, prefetch=None, host_budget=64 * MiB)
    forward(ctl, [100 * MiB] * 8, CUDA)
    forward(ctl, [100 * MiB] * 8, CUDA)
    assert ctl.device_budget == 8000 * MiB - 800 * MiB - 1000 * MiB
    assert ctl.windows.max_inflight <= 16 * MiB  # a quarter of the host budget
    assert ctl.windows.plan_budget == ctl.device_budget - ctl.windows.prefetch


def test_a_device_that_cannot_be_read_gets_no_plan_and_one_warning() -> None:
    ctl = control(FakeMemory(1000 * MiB, 0))
    meta = torch.device("meta")
    with pytest.warns(UserWarning, match="cannot read the memory of meta"):
        assert forward(ctl, [MiB] * 2, meta) == [False, False]  # at the first forward
    assert forward(ctl, [MiB] * 2, meta) == [False, False]
    assert forward(ctl, [MiB] * 3, meta) == [False] * 3  # once
    forward(ctl, [MiB] * 3, meta)
    assert ctl.device_budget is None


# ----------------------------------------------------------------- host_budget
def test_host_auto_is_derived_at_once_and_again_after_a_replan() -> None:
    probe = FakeMemory(1000 * MiB, 300 * MiB)
    ctl = control(probe, device_budget=None, host_budget=AUTO)
    assert ctl.host_budget == 600 * MiB  # from the peak so far, when the pipeline is made
    tier = FakeTier(ctl.host_budget)
    ctl.connect(Sink(), Sink(), tier)
    tier.used_bytes = 200 * MiB  # the first step holds this much in the tier ...
    forward(ctl, [MiB] * 4, CUDA)
    probe.peak_bytes["cpu"] = 500 * MiB  # ... and that is all its peak rose by
    forward(ctl, [MiB] * 4, CUDA)
    assert ctl.host_budget == 600 * MiB and tier.cap_bytes == 600 * MiB
    probe.limit["cpu"] = 800 * MiB  # a smaller container
    forward(ctl, [2 * MiB] * 4, CUDA)  # new sizes: a replan
    forward(ctl, [2 * MiB] * 4, CUDA)
    assert ctl.host_budget == 420 * MiB and tier.cap_bytes == 420 * MiB  # 800 - 80 - 300


# ----------------------------------------------------------- through the hooks
@pytest.fixture
def fake_memory(monkeypatch: pytest.MonkeyPatch) -> FakeMemory:
    probe = FakeMemory(limit=1000 * MiB, peak=400 * MiB)
    monkeypatch.setattr(_budgets, "SystemMemory", lambda: probe)
    return probe


def test_offload_with_auto_fills_stats_and_keeps_within_it(fake_memory: FakeMemory) -> None:
    fake_memory.limit["cpu"] = 400 * MiB + 1 * MiB  # room: 1 MiB less 10% of the limit
    fake_memory.peak_bytes["cpu"] = 360 * MiB
    hooks = tsh.offload("memory://", min_bytes="1KiB", device_budget="auto")
    x = torch.randn(16 << 10, requires_grad=True)  # 64 KiB per saved tensor
    for step in range(3):
        before = hooks.stats.snapshot()
        with hooks:
            loss = sin_chain(x, 20)
        loss.backward()
        d = hooks.stats - before
        planned = d.per_rule.get("device_budget")
        if step == 0:  # half the room the peak so far leaves, on the oldest (rule 5)
            room = 401 * MiB - (401 * MiB) // 10 - 360 * MiB
            assert hooks.stats.effective_device_budget == room // 2
            assert planned is not None and 0 < planned.bytes <= room // 2
        else:
            effective = hooks.stats.effective_device_budget
            assert effective == 401 * MiB - (401 * MiB) // 10 - 360 * MiB
            assert planned is not None and 0 < planned.bytes <= effective
    hooks.close()


def test_offload_host_budget_auto_sets_the_tier_cap(fake_memory: FakeMemory) -> None:
    fake_memory.limit["cpu"], fake_memory.peak_bytes["cpu"] = 500 * MiB, 420 * MiB
    hooks = tsh.offload("memory://", min_bytes=0, host_budget="auto")
    on_fake_accelerator(hooks)
    tier = hooks._pipeline.stager.tier
    assert tier is not None and tier.cap_bytes == 30 * MiB  # 500 - 50 - 420
    assert hooks.stats.effective_host_budget == 30 * MiB
    x = torch.randn(4096, requires_grad=True)
    for n in (4, 4, 6, 6):
        with hooks:
            loss = sin_chain(x, n)
        loss.backward()
        fake_memory.limit["cpu"] = 490 * MiB
    # Re-derived after the replan (6 saves, not 4): 490 - 49 - 420. Each step's graph is
    # freed, so the hooks closed and reopened (NOTE [ Idle hooks ]): the tier in force is
    # the last pipeline's.
    tier = hooks._pipeline.stager.tier
    assert tier is not None and tier.cap_bytes == hooks.stats.effective_host_budget == 21 * MiB
    hooks.close()


def test_the_pipeline_line_names_a_share() -> None:
    hooks = tsh.offload("memory://", device_budget="60%", memory_headroom="1GiB")
    line = hooks._pipeline.describe()
    assert "device_budget=60%" in line and "memory_headroom=1GiB" in line
    hooks.close()


def test_the_example_config_trains_with_auto_budgets(fake_memory: FakeMemory) -> None:
    config = Path(__file__).resolve().parents[2] / "configs" / "auto-budgets.yaml"
    cfg = tsh.load_config(config)
    assert cfg.policy.device_budget == AUTO and cfg.pipeline.host_budget == AUTO
    assert cfg.pipeline.memory_headroom == MemoryShare(10)
    x = torch.randn(1 << 15, requires_grad=True)  # 128 KiB per saved tensor
    hooks = tsh.offload("memory://", config=config)
    grads = []
    for _ in range(3):
        with hooks:
            loss = sin_chain(x, 8)
        loss.backward()
        grads.append(x.grad.clone())
        x.grad = None
    ref = torch.autograd.grad(sin_chain(x, 8), x)[0]
    assert all(torch.equal(g, ref) for g in grads)
    assert hooks.stats.effective_device_budget == 1000 * MiB - 100 * MiB - 400 * MiB
    assert hooks.stats.effective_host_budget == 500 * MiB
    assert hooks.stats.per_rule["device_budget"].tensors > 0
    hooks.close()
