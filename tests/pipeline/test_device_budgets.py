"""Budgets per device (issue 34, finding L; NOTE [ Budgets per device ] in
``pipeline/_budgets.py``): a model on ``cuda:0`` and ``cuda:1`` in one process, over the
fake's several devices (``tests/fake_cuda.py``), whose saved tensors interleave in one
forward."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks._units import MemoryShare
from tensorstore_hooks.pipeline._budgets import BudgetControl, Windows
from tensorstore_hooks.runtime import MemoryReading
from tests.fake_accelerator import CpuAsAccelerator
from tests.fake_cuda import FakeCuda, Timing, devices_accepted, on_device, torch_function_on
from tests.pipeline.test_cuda_path import fake_hooks as one_device_hooks

KiB = 1 << 10
T_BYTES = 16 * KiB  # each saved tensor
PER_DEVICE = 8  # saves per device per forward
BUDGET = 4 * T_BYTES
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.fixture(autouse=True)
def _devices() -> Iterator[None]:
    with devices_accepted():
        yield


def fake_hooks(ops: CpuAsAccelerator, **kw: object) -> tuple[tsh.OffloadHooks, CpuAsAccelerator]:
    """Hooks over the fake whose pack keeps seeing which device a tensor is on."""
    hooks, ops = one_device_hooks(ops=ops, **kw)
    hooks.pack_hook = torch_function_on(hooks.pack_hook)
    return hooks, ops


def two_device_chain(x: torch.Tensor) -> torch.Tensor:
    """``PER_DEVICE`` saves on each device, alternating cuda:0, cuda:1 in one forward."""
    a, b = on_device(x, 0) * 1, on_device(x, 1) * 1  # each device's own memory
    for _ in range(PER_DEVICE):
        a, b = a.sin(), b.sin()
    return a.sum() + b.sum()


def reference_grad(x: torch.Tensor) -> torch.Tensor:
    ref = x.detach().clone().requires_grad_()
    two_device_chain(ref).backward()
    assert ref.grad is not None
    return ref.grad


def kept_per_device(hooks: tsh.OffloadHooks) -> dict[str, int]:
    """Bytes each device kept in the forward just run: its saves less its records."""
    stored = Counter(str(r.device) for r in hooks._pipeline.table.records())
    return {d: (PER_DEVICE - stored[d]) * T_BYTES for d in ("cuda:0", "cuda:1")}


def test_L_each_device_keeps_its_own_budget() -> None:
    """Figures (8 saves of 16 KiB per device, device_budget 64 KiB): from the second
    step each device keeps 64 KiB of its own (4 tensors), 128 KiB in all. Before, one
    plan spent one budget over both devices' interleaved tensors: 32 KiB each."""
    fake = FakeCuda(devices=2)
    hooks, _ = fake_hooks(
        ops=CpuAsAccelerator(fake=fake), device_budget=BUDGET, max_inflight=BUDGET, prefetch=0
    )
    x = torch.randn(T_BYTES // 4, requires_grad=True)
    for step in range(3):
        x.grad = None
        with hooks:
            loss = two_device_chain(x)
        kept = kept_per_device(hooks)
        if step:  # the first forward with a byte budget follows the rules (and learns)
            assert kept == {"cuda:0": BUDGET, "cuda:1": BUDGET}, (step, kept)
            assert hooks._pipeline.budget.kept_bytes() == {CUDA0: BUDGET, CUDA1: BUDGET}
        loss.backward()
        assert torch.equal(x.grad, reference_grad(x))
    assert hooks._pipeline.budget.device_budgets() == {CUDA0: BUDGET, CUDA1: BUDGET}
    hooks.close()


class TwoGpus:
    """A memory probe: cuda:0 has 8 GiB of room, cuda:1 128 KiB (the host 64 GiB)."""

    GiB: ClassVar[int] = 1 << 30
    LIMITS: ClassVar[dict[str, int]] = {"cuda:0": 8 * GiB, "cuda:1": 128 * KiB, "cpu": 64 * GiB}

    def read(self, device: torch.device) -> MemoryReading | None:
        return MemoryReading(self.LIMITS[str(device)], 0, f"fake {device}")

    def peak(self, device: torch.device) -> int:
        return 0


def test_L_auto_reads_each_devices_own_memory() -> None:
    """``device_budget: auto`` on two devices: each derives its figure from its own
    memory (first forward: half of 50% of the room, no headroom): cuda:0 2 GiB, cuda:1
    32 KiB (24 after its prefetch window), which keeps one of its two tensors. Before,
    the figure came from the device of the first tensor (cuda:0's 2 GiB) for both, and
    cuda:1 kept both."""
    budget = BudgetControl(
        device_budget=MemoryShare(50),
        max_inflight=None,
        prefetch=None,
        memory_headroom=0,
        probe=TwoGpus(),
    )
    kept = [budget.keep("store", T_BYTES, device=d) for d in (CUDA0, CUDA1, CUDA0, CUDA1)]
    assert kept == [True, True, True, False]
    assert budget.device_budgets() == {CUDA0: 2 * TwoGpus.GiB, CUDA1: 32 * KiB}
    assert budget.kept_bytes() == {CUDA0: 2 * T_BYTES, CUDA1: T_BYTES}


def test_L_a_device_plan_starts_and_ends_its_forwards_with_the_others() -> None:
    """Every unpack ends every device's forward (rule 2): the second device's trace is
    its own four sizes, not the eight interleaved ones."""
    budget = BudgetControl(device_budget=BUDGET, max_inflight=0, prefetch=0)
    for size in (1, 2, 3, 4):
        budget.keep("store", size * KiB, device=CUDA0)
        budget.keep("store", 10 * size * KiB, device=CUDA1)
    assert budget.backward_started()
    assert [t.sizes for t in budget.traces] == [(1 * KiB, 2 * KiB, 3 * KiB, 4 * KiB)]
    other = budget._plan_of(CUDA1)
    assert [t.sizes for t in other.traces] == [(10 * KiB, 20 * KiB, 30 * KiB, 40 * KiB)]
    assert not budget.backward_started()  # the same backward: nothing more ended


def test_L_the_windows_in_force_are_the_smallest_any_device_derived() -> None:
    """cuda:0 saves 1 MiB tensors, cuda:1 16 KiB ones: cuda:1's plan subtracted a
    32 KiB read-ahead window from its budget, so the one window in force is 32 KiB (its
    own), not the 2 MiB the interleaved trace gave both before."""
    applied: list[Windows] = []
    budget = BudgetControl(
        device_budget=1 << 30, max_inflight=None, prefetch=None, apply=applied.append
    )
    for _ in range(4):
        budget.keep("store", 1 << 20, device=CUDA0)
        budget.keep("store", T_BYTES, device=CUDA1)
    budget.backward_started()
    assert (applied[-1].prefetch, applied[-1].max_inflight) == (2 * T_BYTES, 2 * T_BYTES)
    assert budget.windows.prefetch == 2 << 20  # cuda:0's own
    assert budget._plan_of(CUDA1).windows.prefetch == 2 * T_BYTES


@pytest.mark.parametrize("lag", [1, 16])
def test_L_device_bytes_held_per_device_under_copy_lag(lag: int) -> None:
    """Figures (8 saves of 16 KiB per device through the host tier, window 64 KiB,
    copies 16x slower than a kernel): at the end of forward each device holds at most
    the window (64 KiB) of copies still running, against 128 KiB per device without
    offloading; each device's peak stays under no offloading's."""
    fake = FakeCuda(devices=2, timing=Timing.lagging(lag, T_BYTES))
    hooks, _ = fake_hooks(
        ops=CpuAsAccelerator(fake=fake), host_budget="1MiB", max_inflight=BUDGET, prefetch=0
    )
    x = torch.randn(T_BYTES // 4, requires_grad=True)
    with hooks:
        loss = two_device_chain(x)
    held = {d: fake.live_bytes(d) for d in (0, 1)}
    loss.backward()
    assert torch.equal(x.grad, reference_grad(x))
    no_offloading = PER_DEVICE * T_BYTES
    for d in (0, 1):
        assert held[d] <= BUDGET, held
        assert fake.peak_by_device[d] <= no_offloading, fake.peak_by_device
    hooks.close()


def test_L_a_capture_on_one_device_keeps_only_that_devices_tensors() -> None:
    """A graph captured on cuda:1 while cuda:0's tensors are saved too: cuda:1's are
    kept in place (copying them would be recorded into the user's graph), cuda:0's
    leave their device; no call invalidates the capture; gradients exact."""
    fake = FakeCuda(devices=2, polls=3)
    hooks, _ = fake_hooks(ops=CpuAsAccelerator(fake=fake), host_budget="1MiB")
    x = torch.randn(T_BYTES // 4, requires_grad=True)
    with fake.capture(device=1) as graph, hooks:
        loss = two_device_chain(x)
    assert graph.invalidated is None
    stored = Counter(str(r.device) for r in hooks._pipeline.table.records())
    assert stored == {"cuda:0": PER_DEVICE}, stored
    loss.backward()
    assert torch.equal(x.grad, reference_grad(x))
    hooks.close()


# --------------------------------------------------------------- on real GPUs
@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_cuda_L_two_gpus_each_keep_their_own_budget() -> None:
    """The same interleaved forward on cuda:0 and cuda:1: from the second step each GPU
    keeps its own 64 KiB; gradients bit-identical."""
    hooks = tsh.offload("memory://", min_bytes=0, device_budget=BUDGET, prefetch=0)
    x = torch.randn(T_BYTES // 4, requires_grad=True)

    def chain(x: torch.Tensor) -> torch.Tensor:
        a, b = x.to("cuda:0") * 1, x.to("cuda:1") * 1
        for _ in range(PER_DEVICE):
            a, b = a.sin(), b.sin()
        return a.sum().cpu() + b.sum().cpu()

    ref = x.detach().clone().requires_grad_()
    chain(ref).backward()
    for step in range(3):
        x.grad = None
        with hooks:
            loss = chain(x)
        if step:
            assert kept_per_device(hooks) == {"cuda:0": BUDGET, "cuda:1": BUDGET}
        loss.backward()
        assert torch.equal(x.grad, ref.grad)
    hooks.close()
