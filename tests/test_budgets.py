"""Budgets and tiers: ``device_budget`` / ``host_budget`` config, and the session under
them (DESIGN.md "Budgets and tiers")."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorstore_hooks import ConfigError, Policy
from tensorstore_hooks._budgets import BudgetControl
from tensorstore_hooks._config import config_from_dict, load_config, resolve_config
from tensorstore_hooks._windows import Windows

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


def test_policy_object_checks_its_budget() -> None:
    assert Policy(device_budget=5).device_budget == 5
    with pytest.raises(ConfigError, match="device_budget"):
        Policy(device_budget=-5)


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
        assert ctl.keep("store", 16 * MiB, accelerator=False) is False
    assert applied[-1].max_inflight == 32 * MiB  # 2 x largest while the first forward runs
    assert ctl.backward_started() is True
    assert ctl.backward_started() is False  # the same backward
    assert ctl.windows.max_inflight == ctl.windows.prefetch == 32 * MiB
    for _ in range(8):
        assert ctl.keep("store", 16 * MiB, accelerator=False) is False
    assert ctl.windows.plan_budget is None


def test_control_user_windows_win_and_count_against_the_budget() -> None:
    ctl, applied = _control(device_budget=100 * MiB, max_inflight=20 * MiB, prefetch=30 * MiB)
    assert all(w.max_inflight == 20 * MiB and w.prefetch == 30 * MiB for w in applied)
    saves = [10 * MiB] * 10
    assert [ctl.keep("store", n, accelerator=False) for n in saves] == [False] * 10
    ctl.backward_started()
    assert ctl.windows.plan_budget == 50 * MiB
    assert [ctl.keep("store", n, accelerator=False) for n in saves] == [False] * 5 + [True] * 5


def test_control_counts_only_moved_tensors() -> None:
    ctl, _ = _control(device_budget=64 * MiB, max_inflight=0, prefetch=0)
    for _ in range(2):
        out = [
            ctl.keep("keep", 1 << 30, accelerator=False),
            ctl.keep("store", 32 * MiB, accelerator=False),
            ctl.keep("host", 32 * MiB, accelerator=False),
            ctl.keep("store", 32 * MiB, accelerator=False),
        ]
        ctl.backward_started()
    assert out == [False, False, True, True]
