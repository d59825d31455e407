"""A stand-in accelerator for CPU-only machines: the device stager's seam, driven on CPU.

:class:`CpuAsAccelerator` implements the five methods of
``tensorstore_hooks._staging.DeviceOps`` but treats *CPU* tensors as if they lived on an
accelerator: "device-to-host" copies a tensor's storage span into a host buffer and
"host-to-device" copies it back into a new tensor. With it, everything the CUDA path
does (staging, the host tier, spills, reads back through the tier, in-place checks,
buffer recycling) runs for real on a machine without a GPU; only the copies are
plain ``copy_`` calls instead of CUDA kernels. The ``cuda``-marked tests run the same
scenarios with real CUDA tensors.

``lazy=True`` makes copies behave like asynchronous ones: a copy runs when its event
is waited for (``synchronize``) or after ``polls`` ``query()`` calls, so code that
uses a host buffer before its copy has completed reads wrong bytes, as it would on a
real device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tensorstore_hooks import OffloadHooks
from tensorstore_hooks._codec import span_of

__all__ = ["CpuAsAccelerator", "FakeEvent", "on_fake_accelerator"]


class FakeEvent:
    """A copy that runs when waited for, or after ``polls`` queries."""

    def __init__(self, copy: Callable[[], None], polls: int) -> None:
        self._copy: Callable[[], None] | None = copy
        self._polls = polls

    def _complete(self) -> None:
        if self._copy is not None:
            copy, self._copy = self._copy, None
            copy()

    def query(self) -> bool:
        self._polls -= 1
        if self._polls <= 0:
            self._complete()
        return self._copy is None

    def synchronize(self) -> None:
        self._complete()


class CpuAsAccelerator:
    """``DeviceOps`` for CPU tensors (see the module docstring); counts what it does."""

    def __init__(self, *, lazy: bool = False, polls: int = 2) -> None:
        self.lazy = lazy
        self.polls = polls
        self.allocations = 0
        self.allocated_bytes = 0
        self.to_host_calls = 0
        self.to_device_calls = 0
        self.buffers: list[torch.Tensor] = []
        """Every buffer allocated (to tell tier buffers from pageable memory)."""

    @staticmethod
    def accelerated(device: torch.device) -> bool:
        return device.type == "cpu"

    def allocate(self, nbytes: int) -> torch.Tensor:
        self.allocations += 1
        self.allocated_bytes += nbytes
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.buffers.append(buf)
        return buf

    def is_buffer(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in one of the buffers this object allocated."""
        ptr = t.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == ptr for b in self.buffers)

    def _event(self, copy: Callable[[], None]) -> Any:
        if not self.lazy:
            copy()
            return None
        return FakeEvent(copy, self.polls)

    def to_host(self, t: torch.Tensor, buf: torch.Tensor) -> tuple[torch.Tensor, Any]:
        self.to_host_calls += 1
        span = span_of(tuple(t.shape), tuple(t.stride()))
        src = t.detach().as_strided((span,), (1,), t.storage_offset())
        dst = buf[: span * t.element_size()].view(t.dtype)
        event = self._event(lambda: dst.copy_(src))
        return dst.as_strided(t.shape, t.stride(), 0), event

    def to_device(
        self, host: torch.Tensor, device: torch.device, offset: int
    ) -> tuple[torch.Tensor, Any]:
        self.to_device_calls += 1
        span = span_of(tuple(host.shape), tuple(host.stride()))
        flat = host.as_strided((span,), (1,), host.storage_offset())
        base = torch.empty(offset + span, dtype=host.dtype, device=device)
        event = self._event(lambda: base[offset:].copy_(flat))
        return base.as_strided(host.shape, host.stride(), offset), event

    @staticmethod
    def finish(t: torch.Tensor, done: Any) -> torch.Tensor:
        done.synchronize()  # a real device orders the stream; here the copy runs now
        return t


def on_fake_accelerator(hooks: OffloadHooks, ops: CpuAsAccelerator | None = None) -> Any:
    """Make ``hooks`` (not used yet) treat CPU tensors as accelerator ones; returns the
    pipeline's stager, whose ``tier`` and ``ops`` tests inspect."""
    stager = hooks._pipeline.stager
    stager.ops = ops if ops is not None else CpuAsAccelerator()
    return stager
