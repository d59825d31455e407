"""Budgets and tiers: ``device_budget`` / ``host_budget`` config, and the pipeline under
them (DESIGN.md "Budgets and tiers")."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import ConfigError, Policy
from tensorstore_hooks._units import AUTO, MemoryShare
from tensorstore_hooks.config._settings import (
    config_from_dict,
    dump_config,
    load_config,
    resolve_config,
)
from tensorstore_hooks.pipeline._budgets import BudgetControl, Windows
from tensorstore_hooks.testing import WrappedStore

MiB = 1 << 20


# ------------------------------------------------------------------------- config
def test_budgets_from_yaml_and_back(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("pipeline:\n  host_budget: 256MiB\npolicy:\n  device_budget: 1GiB\n")
    cfg = load_config(path)
    assert cfg.policy.device_budget == 1 << 30
    assert cfg.pipeline.host_budget == 256 * MiB
    again = config_from_dict(cfg.to_dict())
    assert again.policy.device_budget == 1 << 30 and again.pipeline.host_budget == 256 * MiB


def test_auto_and_shares_from_yaml_and_back(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "pipeline:\n  host_budget: 60%\n  memory_headroom: 2GiB\npolicy:\n  device_budget: auto\n"
    )
    cfg = load_config(path)
    assert cfg.policy.device_budget == AUTO
    assert cfg.pipeline.host_budget == MemoryShare(60)
    assert cfg.pipeline.memory_headroom == 2 << 30
    data = cfg.to_dict()
    assert data["policy"]["device_budget"] == "auto"
    assert data["pipeline"]["host_budget"] == "60%"
    assert data["pipeline"]["memory_headroom"] == "2GiB"
    assert config_from_dict(data) == replace(cfg, source=None)
    text = dump_config(cfg)
    assert "device_budget: auto" in text and "host_budget: 60%" in text
    assert load_config(_write(tmp_path / "again.yaml", text)).policy.device_budget == AUTO


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_auto_and_shares_as_keywords() -> None:
    cfg = resolve_config(
        None, {"device_budget": "auto", "host_budget": "12.5%", "memory_headroom": "5%"}
    )
    assert cfg.policy.device_budget == AUTO
    assert cfg.pipeline.host_budget == MemoryShare(12.5)
    assert cfg.pipeline.memory_headroom == MemoryShare(5)
    assert resolve_config(None, {}).pipeline.memory_headroom == MemoryShare(10)  # default
    assert resolve_config(None, {"device_budget": "100%"}).policy.device_budget == AUTO


def test_budget_defaults() -> None:
    cfg = resolve_config(None, {})
    assert cfg.policy.device_budget is None  # no plan
    assert cfg.pipeline.host_budget == 0  # no host tier
    assert cfg.pipeline.prefetch is None and cfg.pipeline.max_inflight is None  # derived


def test_budgets_as_keywords() -> None:
    cfg = resolve_config(None, {"device_budget": "64MiB", "host_budget": 1 << 30})
    assert cfg.policy.device_budget == 64 * MiB
    assert cfg.pipeline.host_budget == 1 << 30
    cfg = resolve_config(None, {"device_budget": None, "prefetch": "8MiB"})
    assert cfg.policy.device_budget is None and cfg.pipeline.prefetch == 8 * MiB


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"device_budget": -1}, "offload(device_budget=...): device_budget:"),
        ({"device_budget": "lots"}, "offload(device_budget=...): device_budget: expected"),
        ({"device_budget": True}, "offload(device_budget=...): device_budget:"),
        ({"host_budget": None}, "offload(host_budget=...): host_budget:"),
        ({"host_budget": "-1MiB"}, "offload(host_budget=...): host_budget:"),
        ({"prefetch": "soon"}, "offload(prefetch=...): prefetch: expected"),
        ({"device_budget": "101%"}, "device_budget: expected a size (a non-negative int"),
        ({"device_budget": "101%"}, "a share of the memory there is cannot be over 100%"),
        ({"device_budget": "automatic"}, '"auto" (the memory there is)'),
        ({"host_budget": "-5%"}, "offload(host_budget=...): host_budget: expected"),
        ({"memory_headroom": "auto"}, "offload(memory_headroom=...): memory_headroom: expected"),
        ({"memory_headroom": -1}, "memory_headroom: expected a size"),
    ],
)
def test_bad_budgets_name_the_keyword(overrides: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config(None, overrides)
    assert fragment in str(info.value)


def test_bad_budget_in_yaml_names_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("policy:\n  min_bytes: 1MiB\n  device_budget: 12 parsecs\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3: policy\.device_budget: expected"):
        load_config(path)


def test_bad_share_in_yaml_names_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("pipeline:\n  writer_threads: 2\n  memory_headroom: auto\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3: pipeline\.memory_headroom: expected"):
        load_config(path)
    path.write_text("policy:\n  device_budget: 150%\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:2: policy\.device_budget: .*over 100%"):
        load_config(path)


def test_policy_object_checks_its_budget() -> None:
    assert Policy(device_budget=5).device_budget == 5
    assert Policy(device_budget=AUTO).device_budget == AUTO
    with pytest.raises(ConfigError, match="device_budget"):
        Policy(device_budget=-5)
    with pytest.raises(ConfigError, match=r'MemoryShare \(tsh.offload\(device_budget="auto"\)'):
        Policy(device_budget="auto")  # type: ignore[arg-type]


# ----------------------------------------------------------------- control (no torch)
def _control(**kw: object) -> tuple[BudgetControl, list[Windows]]:
    applied: list[Windows] = []
    args: dict[str, object] = {
        "device_budget": None,
        "host_budget": 0,
        "max_inflight": None,
        "prefetch": None,
        "apply": applied.append,
    }
    args.update(kw)
    return BudgetControl(**args), applied  # type: ignore[arg-type]


def test_control_keeps_nothing_without_a_budget_but_derives_windows() -> None:
    ctl, applied = _control()
    assert applied[-1].max_inflight == 0  # nothing seen yet
    for _ in range(8):
        assert ctl.keep("store", 16 * MiB) is False
    assert applied[-1].max_inflight == 32 * MiB  # 2 x largest while the first forward runs
    assert ctl.backward_started() is True
    assert ctl.backward_started() is False  # the same backward
    assert ctl.windows.max_inflight == ctl.windows.prefetch == 32 * MiB
    for _ in range(8):
        assert ctl.keep("store", 16 * MiB) is False
    assert ctl.windows.plan_budget is None


def test_control_user_windows_win_and_count_against_the_budget() -> None:
    ctl, applied = _control(device_budget=100 * MiB, max_inflight=20 * MiB, prefetch=30 * MiB)
    assert all(w.max_inflight == 20 * MiB and w.prefetch == 30 * MiB for w in applied)
    saves = [10 * MiB] * 10
    assert [ctl.keep("store", n) for n in saves] == [False] * 10
    ctl.backward_started()
    assert ctl.windows.plan_budget == 50 * MiB
    assert [ctl.keep("store", n) for n in saves] == [False] * 5 + [True] * 5


def test_control_counts_only_moved_tensors() -> None:
    ctl, _ = _control(device_budget=64 * MiB, max_inflight=0, prefetch=0)
    for _ in range(2):
        out = [
            ctl.keep("keep", 1 << 30),
            ctl.keep("store", 32 * MiB),
            ctl.keep("host", 32 * MiB),
            ctl.keep("store", 32 * MiB),
        ]
        ctl.backward_started()
    assert out == [False, False, True, True]


# ----------------------------------------------------------------- the pipeline
KiB = 1 << 10


class GatedStore(WrappedStore):
    """A memory store whose puts wait for ``gate`` (to watch write-behind back up)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.put_sizes: list[int] = []

    def put(self, tensor: torch.Tensor) -> str:
        self.gate.wait(30)
        self.put_sizes.append(tensor.numel() * tensor.element_size())
        return super().put(tensor)


def _leaves(sizes_bytes: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(n // 4, generator=gen).requires_grad_() for n in sizes_bytes]


def _step(xs: list[torch.Tensor], hooks: Any) -> None:
    """sin() saves its input: one saved tensor per leaf, in order."""
    ctx = hooks if hooks is not None else contextlib.nullcontext()
    with ctx:
        loss = sum(torch.sin(x).sum() for x in xs)
    assert isinstance(loss, torch.Tensor)
    loss.backward()


def _grads(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [x.grad.clone() for x in xs if x.grad is not None]
    for x in xs:
        x.grad = None
    return out


def _opts(**kw: Any) -> dict[str, Any]:
    # Windows given: the plan spends the whole budget (NOTE [ Windows ] rule 3).
    base: dict[str, Any] = {"min_bytes": "1KiB", "max_inflight": 0, "prefetch": 0}
    base.update(kw)
    return base


def _moved_and_planned(hooks: Any, xs: list[torch.Tensor]) -> tuple[int, int, int]:
    """One step: (bytes offloaded, tensors the plan kept, bytes the plan kept)."""

    def planned() -> tuple[int, int, int]:
        route = hooks.stats.per_rule.get("device_budget")
        t, b = (route.tensors, route.bytes) if route is not None else (0, 0)
        return hooks.stats.bytes_offloaded, t, b

    before = planned()
    _step(xs, hooks)
    after = planned()
    return after[0] - before[0], after[1] - before[1], after[2] - before[2]


def test_budget_keeps_the_newest_within_budget() -> None:
    sizes = [4 * KiB, 8 * KiB, 16 * KiB, 2 * KiB, 2 * KiB]
    xs = _leaves(sizes)
    _step(xs, None)
    want = _grads(xs)
    store = GatedStore()
    hooks = tsh.offload(store, **_opts(device_budget="20KiB"))
    # First forward: the rules, recorded.
    assert _moved_and_planned(hooks, xs) == (32 * KiB, 0, 0)
    assert all(torch.equal(g, w) for g, w in zip(_grads(xs), want, strict=True))
    for _ in range(2):
        kept_before = hooks.stats.bytes_kept
        store.put_sizes.clear()
        # Newest first: 2+2+16 = 20 KiB fit; 8 and 4 (the oldest) go to the store.
        # (Oldest-first would have kept 4+8 = 12 KiB.)
        assert _moved_and_planned(hooks, xs) == (12 * KiB, 3, 20 * KiB)
        assert set(store.put_sizes) <= {4 * KiB, 8 * KiB}
        assert hooks.stats.bytes_kept - kept_before == 20 * KiB
        assert all(torch.equal(g, w) for g, w in zip(_grads(xs), want, strict=True))
    assert hooks.stats.replans == 0
    hooks.close()
    assert len(store) == 0


def test_budget_replanned_when_sizes_change() -> None:
    a = _leaves([8 * KiB] * 4)
    b = _leaves([8 * KiB, 8 * KiB, 2 * KiB, 2 * KiB, 4 * KiB])
    hooks = tsh.offload("memory://", **_opts(device_budget="16KiB"))
    assert _moved_and_planned(hooks, a) == (32 * KiB, 0, 0)
    assert _moved_and_planned(hooks, a) == (16 * KiB, 2, 16 * KiB)  # the two newest kept
    # New sizes: predicted from the remembered trace (cautiously: they contradict it),
    # never past the budget; the new trace is remembered (a replan).
    moved, _, kept = _moved_and_planned(hooks, b)
    assert kept <= 16 * KiB and moved + kept == 24 * KiB
    assert hooks.stats.replans == 1
    assert _moved_and_planned(hooks, b) == (8 * KiB, 4, 16 * KiB)  # 4+2+2+8 kept
    assert _moved_and_planned(hooks, a) == (16 * KiB, 2, 16 * KiB)  # remembered: exact
    assert hooks.stats.replans == 1
    hooks.close()


def test_no_budget_keeps_nothing_more() -> None:
    xs = _leaves([8 * KiB] * 4)
    hooks = tsh.offload("memory://", **_opts())
    for _ in range(2):
        assert _moved_and_planned(hooks, xs) == (32 * KiB, 0, 0)
    hooks.close()


def test_budget_with_wrap_style_entries() -> None:
    # The hooks entered once per block (as wrap() does) still give one forward per step.
    xs = _leaves([8 * KiB] * 4)
    hooks = tsh.offload("memory://", **_opts(device_budget="16KiB"))
    for _ in range(2):
        before = hooks.stats.bytes_offloaded
        parts = []
        for x in xs:
            with hooks:
                parts.append(torch.sin(x).sum())
        sum(parts).backward()  # type: ignore[union-attr]
    assert hooks.stats.bytes_offloaded - before == 16 * KiB
    assert hooks.stats.per_rule["device_budget"].bytes == 16 * KiB
    assert hooks.stats.replans == 0
    hooks.close()


def _packed_before_blocking(hooks: Any, store: GatedStore, xs: list[torch.Tensor]) -> int:
    """How many tensors forward saves while the store takes none (write-behind window)."""
    progress: list[int] = []
    store.gate.clear()

    def forward() -> None:
        with hooks:
            ys = []
            for i, x in enumerate(xs):
                ys.append(torch.sin(x))
                progress.append(i)
        sum(y.sum() for y in ys).backward()

    t = threading.Thread(target=forward)
    t.start()
    deadline = time.monotonic() + 10
    last = -1
    while time.monotonic() < deadline:  # until forward stops advancing
        time.sleep(0.3)
        if len(progress) == last:
            break
        last = len(progress)
    n = len(progress)
    store.gate.set()
    t.join(30)
    return n


def test_windows_follow_what_forward_saves_and_the_budget() -> None:
    xs = _leaves([64 * KiB] * 32)
    # Derived, no budget: 2 x the largest (64 KiB) while the first forward runs ->
    # 128 KiB queued, plus the tensor that waits -> 3 saved before pack blocks.
    store = GatedStore()
    hooks = tsh.offload(store, min_bytes="1KiB", writer_threads=1)
    assert _packed_before_blocking(hooks, store, xs) <= 4
    hooks.close()
    # Given: the user's size wins.
    store = GatedStore()
    hooks = tsh.offload(store, min_bytes="1KiB", writer_threads=1, max_inflight="1MiB")
    assert _packed_before_blocking(hooks, store, xs) >= 16
    hooks.close()
    # Derived within a budget: a quarter of 128 KiB = 32 KiB -> one in flight at a time.
    store = GatedStore()
    hooks = tsh.offload(store, min_bytes="1KiB", writer_threads=1, device_budget="128KiB")
    assert _packed_before_blocking(hooks, store, xs) <= 2
    hooks.close()


# ------------------------------------------------------------ mmap threshold
_HEAP_PROBE = r"""
import os, sys, torch
import tensorstore_hooks as tsh

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

threshold = None if sys.argv[1] == "null" else sys.argv[1]
hooks = tsh.offload("memory://", mmap_threshold=threshold, min_bytes=0)
w = torch.randn(16, requires_grad=True)
with hooks:
    loss = w.sin().sum()  # bytes move: the threshold is in force from here on
x = torch.ones(4 << 20)  # 16 MiB: glibc mmaps it; its free raises the dynamic threshold
del x
a = torch.ones(2 << 20)  # 8 MiB: now from the heap unless the threshold was fixed
pin = torch.ones(1024)  # a live block above it
before = rss()
del a
print((before - rss()) >> 20)
hooks.close()
"""


@pytest.mark.skipif(
    not Path("/proc/self/statm").exists() or not hasattr(os, "confstr"),
    reason="needs Linux /proc",
)
def test_mmap_threshold_returns_freed_buffers_at_once() -> None:
    # NOTE [ Mmap threshold ]: a process-wide setting, so each case runs in its own process.
    def freed_mib(threshold: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _HEAP_PROBE, threshold],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        return int(out.stdout.strip().splitlines()[-1])

    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert freed_mib("1MiB") >= 7  # the 8 MiB buffer left RSS when freed
    assert freed_mib("null") <= 1  # glibc's dynamic threshold kept it in the heap
