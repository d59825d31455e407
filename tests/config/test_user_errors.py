"""The last unclear errors a new user met (issue 38, item 4): ``~`` in a path, a scheme in
capitals, ``check-config`` on URLs and missing packages, ``auto`` finding no room, and a
selected module whose forward never runs."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks import ConfigError
from tensorstore_hooks._units import AUTO, format_bytes
from tensorstore_hooks.cli import check_config
from tensorstore_hooks.pipeline._budgets import BudgetControl
from tensorstore_hooks.runtime import MemoryReading
from tensorstore_hooks.storage import split_url

MiB = 1 << 20


# ------------------------------------------------------------------------ URLs
def test_tilde_is_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for url in ("~/acts", "file://~/acts"):
        store = tsh.open_store(url)
        store.put(torch.ones(3))
        assert store.url == f"file://{tmp_path}/acts"
        store.close()
    assert (tmp_path / "acts").is_dir()
    assert not (tmp_path / "~").exists()  # never a directory literally named '~'
    with tsh.offload("~/acts2", min_bytes=0) as hooks:
        torch.ones(4, requires_grad=True).sin().sum().backward()
    assert hooks.store.url == f"file://{tmp_path}/acts2"


def test_tilde_that_cannot_be_expanded_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"cannot expand '~no-such-user-tsh'.*absolute path"):
        split_url("~no-such-user-tsh/acts")


def test_scheme_case_does_not_matter() -> None:
    assert split_url("S3://Bucket/Acts") == ("fsspec", "s3://Bucket/Acts")
    assert split_url("SimpleCache::S3://b/P") == ("fsspec", "simplecache::s3://b/P")
    assert split_url("Memory://x") == ("memory", "memory://x")
    store = tsh.open_store("MEMORY://")
    assert store.url.startswith("memory://")
    store.close()


def test_scheme_without_its_colon_is_refused_with_the_url_meant() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 's3://my-bucket/acts'"):
        tsh.offload("s3//my-bucket/acts")
    # An ordinary relative directory is still one.
    assert split_url("runs//acts") == ("local", "runs//acts")


# ---------------------------------------------------------------- check-config
def _check(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="tensorstore-hooks")
    check_config.register(parser.add_subparsers())
    args = parser.parse_args(["check-config", str(path)])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_check_config_refuses_a_url_without_its_colon(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("store:\n  url: s3//my-bucket/acts\n")
    code, out, err = _check(path, capsys)
    assert code == 1 and out == ""
    assert f"{path}:2: store.url" in err and "'s3://my-bucket/acts'" in err


@pytest.mark.parametrize(
    "yaml_text, field",
    [
        ("store:\n  url: s3://my-bucket/acts\n", "store.url"),
        (
            "store:\n  tiers:\n    - {url: 'memory://', budget: 1MiB}\n"
            "    - {url: 's3://my-bucket/acts'}\n",
            "store.tiers[1].url",
        ),
    ],
)
def test_check_config_names_a_missing_package(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    yaml_text: str,
    field: str,
) -> None:
    # s3fs missing: importing it fails, and fsspec has no class registered for s3.
    monkeypatch.setitem(sys.modules, "s3fs", None)
    registry = importlib.import_module("fsspec.registry")
    monkeypatch.delitem(registry._registry, "s3", raising=False)
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    code, out, err = _check(path, capsys)
    assert code == 1 and out == ""
    assert field in err and "s3fs" in err and "install" in err


def test_check_config_passes_when_the_packages_are_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("s3fs")  # in the test extra: runs in CI
    path = tmp_path / "c.yaml"
    path.write_text("store:\n  url: s3://my-bucket/acts\n")
    code, out, err = _check(path, capsys)
    assert (code, err) == (0, "")
    assert "s3://my-bucket/acts" in out


# ------------------------------------------------------------------ auto budgets
class _NoRoom:
    """4 GiB of memory, and a process that already peaked at 3.9 GiB."""

    def read(self, device: torch.device) -> MemoryReading | None:
        return MemoryReading(4096 * MiB, 4000 * MiB, "fake cgroup")

    def peak(self, device: torch.device) -> int:
        return 4000 * MiB


def test_auto_without_room_says_what_it_read(caplog: pytest.LogCaptureFixture) -> None:
    ctl = BudgetControl(device_budget=AUTO, max_inflight=0, prefetch=0, probe=_NoRoom())
    with pytest.warns(UserWarning) as got:
        for _ in range(5):
            for n in (MiB, MiB):
                ctl.keep("store", n)
            ctl.backward_started()
    messages = [str(w.message) for w in got]
    assert len(messages) == 1, messages  # once, and not the windows warning on top
    (msg,) = messages
    assert "device_budget auto found no room" in msg
    # The limit it read, the headroom and the peak it subtracted, what that left.
    assert f"a limit of {format_bytes(4096 * MiB)} (fake cgroup)" in msg
    assert f"the headroom {format_bytes(4096 * MiB // 10)}" in msg
    assert f"without saved tensors, {format_bytes(4000 * MiB)}: 0 B left" in msg
    assert "memory_headroom" in msg and "as a size" in msg  # the fix


# ---------------------------------------------------------------- wrap: containers
class _Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = layer(x)
        return x


def test_wrap_of_a_module_whose_forward_never_runs_names_its_children() -> None:
    model = _Llama()
    with pytest.raises(ConfigError) as e:
        tsh.wrap(model, modules="model.layers")
    msg = str(e.value)
    assert "'model.layers' is a ModuleList, whose forward never runs" in msg
    assert "modules='model.layers.*'" in msg and "model.layers.0, model.layers.1" in msg
    hooks = tsh.wrap(model, "memory://", modules="model.layers.*", min_bytes=0)
    model(torch.ones(2, 4, requires_grad=True)).sum().backward()
    tsh.unwrap(model)
    assert hooks.stats.tensors_offloaded > 0  # refused before anything was wrapped
