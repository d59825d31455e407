"""Python calls per pack and per unpack on the training thread (issue 34, finding F).

NOTE [ Pack fast path ] in ``pipeline/_router.py``: a plain stored tensor costs at most
:data:`PACK_CALLS` Python-level calls at pack and :data:`UNPACK_CALLS` at unpack, every
call counted (the library's, torch's Python, the standard library's), from the hook's
entry to its return. Counted with ``sys.setprofile``, not timed: the same count on a
busy machine as on a quiet one. ``benchmarks/python_calls.py`` reports the means and
the host microseconds beside ``save_on_cpu``'s.
"""

from __future__ import annotations

import gc
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks.pipeline import _router

PACK_CALLS = 60
UNPACK_CALLS = 40

_ROUTER = _router.__file__


class _HookCalls:
    """Calls made on this thread inside each ``Router.pack`` / ``Router.unpack``."""

    def __init__(self) -> None:
        self.per_hook: dict[str, list[int]] = {"pack": [], "unpack": []}
        self.names: dict[str, dict[str, int]] = {"pack": {}, "unpack": {}}
        self._inside: tuple[str, FrameType] | None = None
        self._thread = threading.get_ident()

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if threading.get_ident() != self._thread:
            return
        inside = self._inside
        if event == "return":
            if inside is not None and inside[1] is frame:
                self._inside = None
            return
        if event != "call":
            return
        code = frame.f_code
        if inside is None:
            if code.co_name not in self.per_hook or code.co_filename != _ROUTER:
                return
            self._inside = inside = (code.co_name, frame)
            self.per_hook[code.co_name].append(0)
        hook = inside[0]
        self.per_hook[hook][-1] += 1
        names = self.names[hook]
        where = f"{Path(code.co_filename).name}:{code.co_name}"
        names[where] = names.get(where, 0) + 1

    def typical(self, hook: str) -> int:
        """The median count: the path most tensors take (the first pack of a step
        starts I/O threads; an unpack whose read is not back yet waits)."""
        counts = self.per_hook[hook]
        assert counts, f"no {hook} ran"
        return int(statistics.median(counts))

    def report(self, hook: str) -> str:
        n = len(self.per_hook[hook])
        rows = sorted(self.names[hook].items(), key=lambda kv: -kv[1])
        return "\n".join(f"{count / n:6.2f} {name}" for name, count in rows)


def _pause(grad: torch.Tensor) -> None:
    time.sleep(0.005)


def _count(hooks: tsh.OffloadHooks, tensors: int) -> _HookCalls:
    x = torch.randn(64, 1024, requires_grad=True)  # 256 KiB a saved tensor

    def step() -> None:
        with hooks:
            y = x
            for _ in range(tensors):
                y = y.sin()  # saves its input: one plain tensor per op
                # Backward pauses before each unpack, so the read ahead is back by then
                # on a loaded machine too: the count is of the path, not of a race.
                y.register_hook(_pause)
            loss = y.sum()
        loss.backward()
        del loss, y
        gc.collect()
        hooks.flush()

    step()
    step()  # the steady state: plans, pools and threads exist
    calls = _HookCalls()
    sys.setprofile(calls)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def measure(url: str, tmp: str) -> None:
    """The count itself (run in a fresh process by the test below)."""
    # Room for the whole forward in flight: a pack that must wait for writes (slow disk,
    # loaded machine) takes the general path by design (rule 2 of NOTE [ Pack fast path ]).
    where = url if url != "file" else f"file://{Path(tmp) / 's'}"
    hooks = tsh.offload(where, min_bytes=0, max_inflight="64MiB")
    try:
        calls = _count(hooks, tensors=16)
        assert hooks.stats.tensors_offloaded >= 16
    finally:
        hooks.close()
    assert len(calls.per_hook["pack"]) == 16 and len(calls.per_hook["unpack"]) == 16
    pack, unpack = calls.typical("pack"), calls.typical("unpack")
    assert pack <= PACK_CALLS, f"{pack} calls per pack:\n{calls.report('pack')}"
    assert unpack <= UNPACK_CALLS, f"{unpack} calls per unpack:\n{calls.report('unpack')}"


@pytest.mark.parametrize("url", ["memory://", "file"])
def test_a_plain_stored_tensor_costs_few_python_calls(url: str, tmp_path: Path) -> None:
    # In a fresh process: the count is of the path a training process's tensors take,
    # not of state other tests left in a shared xdist worker.
    args = f"{url!r}, {str(tmp_path)!r}"
    code = f"from tests.pipeline.test_call_counts import measure; measure({args})"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
