"""``hooks.report()`` and ``tensorstore-hooks plan``: what the policy decided, per module.

The rows are checked against what the hooks counted (``stats.per_rule``) and the
budget curve against what the pipeline's own plan kept in a real step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks import ConfigError

ROOT = Path(__file__).resolve().parents[2]
KIB = 1024


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64))


def _step(hooks: tsh.OffloadHooks, model: nn.Module, x: torch.Tensor) -> None:
    with hooks:
        loss = model(x).pow(2).mean()
    loss.backward()


def test_report_table_names_module_action_and_rule() -> None:
    model, x = _mlp(), torch.randn(128, 64)
    rules = [{"module": "3", "action": "keep", "name": "norm"}]
    hooks = tsh.offload("memory://", model=model, min_bytes="32KiB", rules=rules)
    _step(hooks, model, x)
    report = hooks.report()
    rows = {(r.module, r.action, r.rule): (r.tensors, r.bytes) for r in report.rows}
    # Linear(64->256) saves its 128x64 input (32 KiB): stored by the default rule.
    assert rows[("0", "store", "default")] == (1, 128 * 64 * 4)
    # GELU saves its 128x256 input (128 KiB); Linear(256->64) its 128x256 input.
    assert rows[("1", "store", "default")] == (1, 128 * 256 * 4)
    assert rows[("2", "store", "default")] == (1, 128 * 256 * 4)
    # The LayerNorm's tensors are kept by the named rule, whatever their size.
    assert ("3", "keep", "rules[0] norm") in rows
    # The loss (outside the model) saves a 128x64 output: stored, module None.
    assert rows[(None, "store", "default")][0] >= 1
    # Rows add up to what the hooks counted, rule by rule.
    per_rule: dict[str, list[int]] = {}
    for r in report.rows:
        t = per_rule.setdefault(r.rule, [0, 0])
        t[0] += r.tensors
        t[1] += r.bytes
    assert per_rule == {k: [v.tensors, v.bytes] for k, v in hooks.stats.per_rule.items()}
    text = report.text()
    assert "rules[0] norm" in text and "(outside the model)" in text
    assert json.loads(report.to_json())["rows"][0]["module"] == "0"
    hooks.close()


def test_report_describes_the_last_forward_not_a_sum() -> None:
    model, x = _mlp(), torch.randn(128, 64)
    hooks = tsh.offload("memory://", model=model, min_bytes=0)
    _step(hooks, model, x)
    one = hooks.report()
    _step(hooks, model, x)
    _step(hooks, model, x)
    three = hooks.report()
    assert (one.forward, three.forward) == (1, 3) and three.finished
    assert [(r.module, r.tensors, r.bytes) for r in one.rows] == [
        (r.module, r.tensors, r.bytes) for r in three.rows
    ]
    with hooks:  # a forward still running: described as such
        loss = model(x).sum()
    assert hooks.report().forward == 3  # the last finished one, until backward
    loss.backward()
    assert hooks.report().forward == 4
    hooks.close()


@pytest.mark.parametrize("budget", [200 * KIB, 512 * KIB, 1 << 20])
def test_budget_curve_with_derived_windows_matches_the_pipeline(budget: int) -> None:
    model, x = _mlp(), torch.randn(128, 64)
    hooks = tsh.offload("memory://", model=model, min_bytes=0, device_budget=budget)
    for _ in range(3):
        before = hooks.stats.snapshot()
        _step(hooks, model, x)
    step = hooks.stats - before
    [point] = hooks.report([budget]).curve
    kept = step.per_rule.get("device_budget", tsh.RouteStats())
    assert (point.kept_tensors, point.kept_bytes) == (kept.tensors, kept.bytes)
    assert point.moved_bytes == step.bytes_offloaded
    assert point.plan_bytes < budget  # the derived windows take their share
    hooks.close()


def test_budget_curve_matches_what_the_plan_kept() -> None:
    model, x = _mlp(), torch.randn(128, 64)
    budget = 512 * KIB
    hooks = tsh.offload(
        "memory://", model=model, min_bytes=0, device_budget=budget, prefetch=0, max_inflight=0
    )
    _step(hooks, model, x)  # the first forward follows the rules and records
    before = hooks.stats.snapshot()
    _step(hooks, model, x)  # the plan acts
    step = hooks.stats - before
    report = hooks.report(["0", budget, "1GiB"])
    assert [p.device_budget for p in report.curve] == [0, budget, 1 << 30]
    nothing, in_force, everything = report.curve
    kept = step.per_rule["device_budget"]
    assert (in_force.kept_tensors, in_force.kept_bytes) == (kept.tensors, kept.bytes)
    assert in_force.moved_bytes == step.bytes_offloaded
    assert 0 < in_force.kept_bytes <= in_force.plan_bytes == budget  # windows given as 0
    assert nothing.kept_tensors == 0 and nothing.moved_tensors == report.moved_tensors
    assert everything.moved_tensors == 0
    assert "<- in force" in report.text()
    hooks.close()


def test_wrap_reports_module_paths() -> None:
    model, x = _mlp(), torch.randn(128, 64)
    hooks = tsh.wrap(model, "memory://", min_bytes=0)
    model(x).sum().backward()
    report = hooks.report(depth=1)
    assert report.scoped
    assert {r.module for r in report.rows} == {"0", "1", "2", "3"}
    hooks.remove()


def test_report_refuses_bad_arguments() -> None:
    hooks = tsh.offload("memory://")
    with pytest.raises(ConfigError, match=r"OffloadHooks\.report: budgets"):
        hooks.report(["lots"])
    with pytest.raises(ConfigError, match=r"OffloadHooks\.report: depth"):
        hooks.report(depth=0)
    assert "module paths not tracked" in hooks.report().text()
    hooks.close()


def test_step_figures_for_trainer_logs() -> None:
    from tensorstore_hooks.hooks._report import step_figures

    stats = tsh.OffloadStats(bytes_offloaded=10, bytes_read=7, fallbacks=1, pack_stall_s=0.5)
    stats.per_rule["device_budget"] = tsh.RouteStats(2, 300)
    figures = step_figures(stats, "offload/")
    assert figures["offload/bytes_offloaded"] == 10 and figures["offload/fallbacks"] == 1
    assert figures["offload/budget_kept_bytes"] == 300
    assert figures["offload/pack_stall_s"] == 0.5
    assert "offload/effective_device_budget" not in figures

    # stats that carry a budget derived from the memory there is
    derived = tsh.OffloadStats(bytes_offloaded=1, effective_device_budget=4096)
    assert step_figures(derived)["tsh/effective_device_budget"] == 4096


# ----------------------------------------------------------------------- the CLI
def _plan(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tensorstore_hooks.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=cwd,
    )


ENTRY = """
import torch
from torch import nn

def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    return {"model": model, "batch": torch.randn(128, 64), "loss": lambda y: y.pow(2).mean()}

def not_a_pair():
    return 3
"""


def test_plan_cli_from_a_file_entry_and_a_config(tmp_path: Path) -> None:
    (tmp_path / "entry.py").write_text(ENTRY)
    config = tmp_path / "policy.yaml"
    config.write_text("policy:\n  min_bytes: 64KiB\n  rules:\n    - {module: '2', action: keep}\n")
    proc = _plan(f"{tmp_path / 'entry.py'}:make", "--config", str(config), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rows = {(r["module"], r["action"], r["rule"]): r for r in out["report"]["rows"]}
    assert rows[("0", "keep", "min_bytes")]["bytes"] == 128 * 64 * 4  # 32 KiB < 64 KiB
    assert rows[("1", "store", "default")]["bytes"] == 128 * 256 * 4
    assert rows[("2", "keep", "rules[0] module=2")]["tensors"] == 1
    assert out["store"] == "memory://" and out["steps"] == 1
    assert out["report"]["curve"][0]["device_budget"] == 0

    text = _plan(f"{tmp_path / 'entry.py'}:make", "--budget", "128KiB")
    assert text.returncode == 0, text.stderr
    assert "device_budget ->" in text.stdout and "128.00 KiB" in text.stdout


def test_plan_cli_module_entry(tmp_path: Path) -> None:
    (tmp_path / "plan_entry_mod.py").write_text(ENTRY)
    ok = _plan("plan_entry_mod:make", "--device-budget", "256KiB", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "plan: 2 steps of plan_entry_mod:make" in ok.stdout  # the plan acts from step 2
    assert "device_budget" in ok.stdout and "<- in force" in ok.stdout


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("nocolon", "must be module:factory"),
        ("plan_entry_bad:missing", "has no callable 'missing'"),
        ("plan_entry_bad:not_a_pair", "returned a int; return (model, batch)"),
        ("no_such_module_here:make", "cannot import 'no_such_module_here'"),
    ],
)
def test_plan_cli_entry_errors(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    entry: str,
    message: str,
) -> None:
    from tensorstore_hooks.cli import main

    (tmp_path / "plan_entry_bad.py").write_text(ENTRY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "plan_entry_bad", raising=False)
    assert main(["plan", entry]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tensorstore-hooks plan: ") and message in err, err


def test_docs_plan_output_is_a_real_run() -> None:
    """docs/plan.md shows the output of the command it names, as it is today."""
    doc = (ROOT / "docs" / "plan.md").read_text()
    command = (
        "tensorstore-hooks plan examples/plan_transformer.py:build "
        "--config configs/transformer.yaml --depth 2"
    )
    assert f"$ {command}\n" in doc
    shown = doc.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
    proc = _plan(*command.split()[2:])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == shown
    readme = (ROOT / "README.md").read_text()
    for line in shown.splitlines():
        if line.startswith(("  layers.0 ", "  total store", "  device_budget ")):
            assert line in readme, line
