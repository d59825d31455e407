"""A stand-in accelerator for CPU-only machines: the real CUDA staging code on a fake runtime.

:class:`CpuAsAccelerator` is the library's own ``CudaOps`` (the device stager's
``DeviceOps``) over :class:`~tests.fake_cuda.FakeCuda`, which treats *CPU* tensors as
accelerator tensors. The stager, the host tier and every staging function
(``copy_to_host``, ``copy_to_device``, ``consume``, ...) run unchanged; only the
stream, event, copy and allocation primitives under them are the fake's, which
records their order, checks the rules of NOTE [ Stream ordering ], and poisons what a
broken rule would corrupt on a GPU (``tests/fake_cuda.py``). What the fake cannot see
by itself it is told here, at the seam: a tensor handed to the stager at pack was just
produced on the current stream, and a tensor read from the store is host memory.

``lazy=True`` makes copies land late: an event answers ``query()`` with ``False``
``polls - 1`` times before its copy lands, or lands it when synchronized or waited
for, so code that reads a buffer before its copy completed reads NaN, as it would on
a real device. The ``cuda``-marked tests run the same scenarios with real CUDA tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from tensorstore_hooks import OffloadHooks
from tensorstore_hooks.pipeline._staging import CopyEvent, CudaOps, Loaded
from tests.fake_cuda import FakeCuda, FakeEvent

__all__ = [
    "CpuAsAccelerator",
    "FakeCuda",
    "broken_rules",
    "expect_broken",
    "on_fake_accelerator",
]

_made: list[FakeCuda] = []  # every fake made since the last broken_rules() call


def broken_rules() -> list[str]:
    """The rules broken in every fake made since the last call (then forgotten), once
    every copy still queued on them has landed (on a device it would land after the
    test too): the ``_fresh_fakes`` fixture of ``tests/conftest.py`` fails a test
    that leaves any. A test that breaks a rule on purpose clears what it expected
    (:func:`expect_broken`)."""
    for fake in _made:
        fake.run_all()
    out = [v for fake in _made for v in fake.violations]
    _made.clear()
    return out


def expect_broken(ops: CpuAsAccelerator) -> list[str]:
    """The violations ``ops`` recorded, after its queued copies landed, then cleared: a
    test that breaks the rules on purpose asserts on these, and the conftest fixture
    checks only what comes later."""
    ops.fake.run_all()
    out = list(ops.violations)
    ops.violations.clear()
    return out


class CpuAsAccelerator(CudaOps):
    """``CudaOps`` over a :class:`FakeCuda` (``fake``), counting what the stager asks."""

    def __init__(self, *, lazy: bool = False, polls: int = 2, fake: FakeCuda | None = None) -> None:
        self.fake = fake if fake is not None else FakeCuda(polls=polls if lazy else 0)
        _made.append(self.fake)
        super().__init__(self.fake)
        self.allocations = 0
        self.allocated_bytes = 0
        self.to_host_calls = 0
        self.to_device_calls = 0
        self.buffers: list[torch.Tensor] = []
        """Every buffer allocated (to tell tier buffers from pageable memory)."""

    @property
    def violations(self) -> list[str]:
        return self.fake.violations

    def allocate(self, nbytes: int) -> torch.Tensor:
        self.allocations += 1
        self.allocated_bytes += nbytes
        buf = super().allocate(nbytes)
        self.buffers.append(buf)
        return buf

    def is_buffer(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in one of the buffers this object allocated."""
        ptr = t.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == ptr for b in self.buffers)

    def to_host(self, t: torch.Tensor, buf: torch.Tensor) -> Loaded:
        self.to_host_calls += 1
        self.fake.produced(t)  # pack: the tensor was just made on the current stream
        return super().to_host(t, buf)

    def to_device(
        self, host: torch.Tensor, device: torch.device, after: CopyEvent | None = None
    ) -> Loaded:
        self.to_device_calls += 1
        self.fake.mark_host(host)  # read from the store: ordinary host memory
        return super().to_device(host, device, after)

    def producer_event(self, t: torch.Tensor) -> CopyEvent:
        self.fake.produced(t)  # pack: written from the device later
        return super().producer_event(t)

    def pin(self, t: torch.Tensor) -> Loaded:
        self.fake.produced(t)  # pack: a ``host`` rule's copy
        return super().pin(t)

    def finish(self, t: torch.Tensor, done: CopyEvent) -> torch.Tensor:
        self.fake.kernel()  # backward: the kernel that uses it (timed fakes)
        out = super().finish(t, done)
        assert isinstance(done, FakeEvent)
        self.fake.check_consumed(out, done)
        return out


def on_fake_accelerator(hooks: OffloadHooks, ops: CpuAsAccelerator | None = None) -> Any:
    """Make ``hooks`` (not used yet) treat CPU tensors as accelerator ones; returns the
    pipeline's stager, whose ``tier`` and ``ops`` tests inspect."""
    stager = hooks._pipeline.stager
    stager.ops = ops if ops is not None else CpuAsAccelerator()
    return stager
