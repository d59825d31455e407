"""What the hooks did, where users look: profiler ranges, a timeline, logs, stats, warnings."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import profile

import tensorstore_hooks as tsh
from tensorstore_hooks import TensorStore


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Tanh())


X = torch.randn(128, 64, generator=torch.Generator().manual_seed(4))


def _step(model: nn.Module, hooks: tsh.OffloadHooks, *, flush: bool = True) -> None:
    with hooks:
        loss = model(X).pow(2).mean()
    if flush:
        hooks.flush()  # everything comes back from the store: reads and waits happen
    loss.backward()


def _names(prof: profile) -> set[str]:
    return {e.name for e in prof.events()}


def test_a_default_profiler_trace_shows_pack_unpack_and_waits() -> None:
    model = _model()
    hooks = tsh.offload("memory://", min_bytes=0, prefetch=0)  # every unpack reads and waits
    with profile() as prof:
        _step(model, hooks)
    names = _names(prof)
    assert {"tsh::pack", "tsh::unpack", "tsh::unpack_wait"} <= names, sorted(names)
    # I/O threads are recorded when the profiler is asked to record every thread.
    with profile(experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        _step(model, hooks)
    assert {"tsh::write", "tsh::read", "tsh::pack", "tsh::unpack"} <= _names(prof)
    hooks.close()


def test_trace_writes_a_chrome_timeline_of_io_against_forward_and_backward(
    tmp_path: Path,
) -> None:
    model = _model()
    hooks = tsh.offload("memory://", min_bytes=0)
    path = tmp_path / "trace.json"
    with hooks.trace(path):
        for _ in range(2):
            _step(model, hooks)
    _step(model, hooks)  # after the block: not traced
    doc = json.loads(path.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    by_name: dict[str, list[dict]] = {}
    for e in spans:
        by_name.setdefault(e["name"], []).append(e)
    assert len(by_name["forward"]) == 2 and len(by_name["backward"]) == 2
    n = hooks.stats.tensors_offloaded // 3  # per step
    assert len(by_name["tsh::pack"]) >= 2 * n
    assert len(by_name["tsh::write"]) == 2 * n  # one write per stored tensor
    assert len(by_name["tsh::read"]) >= 2 * n  # a dedup'd tensor is read once per unpack
    threads = {
        e["tid"]: e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert all(threads[e["tid"]].startswith("tsh-") for e in by_name["tsh::write"])
    fwd, bwd = by_name["forward"][0], by_name["backward"][0]
    assert fwd["ts"] + fwd["dur"] <= bwd["ts"]
    assert all(e["dur"] >= 0 for e in spans)
    hooks.close()


def test_stats_time_bytes_and_peak_held(tmp_path: Path) -> None:
    model = _model()
    hooks = tsh.offload(f"file://{tmp_path}", min_bytes=0, max_inflight="64KiB")
    _step(model, hooks)
    s = hooks.stats
    assert s.bytes_written == s.bytes_offloaded > 0  # flushed: every write happened
    assert s.bytes_read >= s.bytes_offloaded  # a dedup'd tensor is read once per unpack
    assert s.write_s > 0 and s.read_s > 0
    assert s.peak_held_bytes > 0
    assert s.held_bytes == 0  # backward consumed everything
    summary = s.summary()
    assert f"written {s.bytes_written}" not in summary  # sizes are formatted ...
    assert "written 0 B" not in summary and "peak held 0 B" not in summary  # ... and real
    hooks.close()


def test_pipeline_open_is_logged_at_info_and_each_tensor_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _model()
    with caplog.at_level(logging.INFO, logger="tensorstore_hooks"):
        hooks = tsh.offload("memory://", min_bytes="1KiB", prefetch="8MiB")
    opened = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(
        "memory://" in m and "min_bytes=1KiB" in m and "prefetch=8MiB" in m for m in opened
    ), opened
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="tensorstore_hooks"):
        _step(model, hooks)
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    stored = [m for m in debug if m.startswith("pack: store") and "dedup" not in m]
    assert len(stored) == hooks.stats.tensors_offloaded > 0
    hooks.close()


class _Refusing(TensorStore):
    """A store whose writes all fail (to see the fallback warning)."""

    def put(self, tensor: torch.Tensor) -> str:
        raise OSError("disk on fire")

    def get(self, key: str, *, device: torch.device | str | None = None) -> torch.Tensor:
        raise KeyError(key)

    def delete(self, key: str) -> None:
        pass

    def keys(self) -> Iterator[str]:
        return iter(())

    def __contains__(self, key: object) -> bool:
        return False

    def __len__(self) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


def test_fallback_warning_points_at_the_users_line() -> None:
    model = _model()
    hooks = tsh.offload(_Refusing(), min_bytes=0)
    with pytest.warns(UserWarning, match="could not take a saved tensor") as w:
        for _ in range(2):
            _step(model, hooks)
        hooks.close()
    assert [r.filename for r in w.list] == [__file__]
    assert hooks.stats.fallbacks > 0
