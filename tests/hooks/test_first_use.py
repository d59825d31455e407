"""Small frictions a new user meets first: files left behind, error order, error names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks import ConfigError


def test_hooks_that_store_nothing_leave_no_zarr_json(tmp_path: Path) -> None:
    root = tmp_path / "acts"
    with tsh.offload(f"file://{root}") as hooks:
        pass
    hooks.close()
    assert not [p for p in root.rglob("*") if p.is_file()], sorted(root.rglob("*"))
    # The root's document appears with the first put, and the store reads as before.
    store = tsh.open_store(f"file://{root}")
    assert not (root / "zarr.json").exists()
    key = store.put(torch.arange(6.0))
    assert (root / "zarr.json").is_file()
    assert torch.equal(store.get(key), torch.arange(6.0))
    store.close()


def test_yaml_errors_are_listed_in_file_order(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        "policy:\n"
        "  default: banana\n"
        "  rules:\n"
        "    - {action: nope}\n"
        "  min_bytes: -3\n"
        "pipeline:\n"
        "  prefetch: xyz\n"
        "store:\n"
        "  codec: nope\n"
    )
    with pytest.raises(ConfigError) as e:
        tsh.load_config(config)
    lines = str(e.value).splitlines()[1:]
    numbers = [int(line.split(":")[1]) for line in lines]
    assert numbers == [2, 4, 5, 7, 9], lines


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4))


@pytest.mark.parametrize(
    ("call", "prefix"),
    [
        (lambda: tsh.offload(42), "tsh.offload: expected a URL"),
        (lambda: tsh.offload("nosuch://x"), "tsh.offload: "),
        (lambda: tsh.offload(min_bytes=-1), "tsh.offload(min_bytes=...): "),
        (lambda: tsh.offload(model=3), "tsh.offload(model=...): "),
        (lambda: tsh.offload(config={"policy": {"default": "x"}}), "tsh.offload(config={...}): "),
        (lambda: tsh.wrap(_model(), 42), "tsh.wrap: expected a URL"),
        (lambda: tsh.wrap(3), "tsh.wrap: expected a torch.nn.Module"),
        (lambda: tsh.capture(_model(), 42, modules=None, what="output"), "tsh.capture: "),
    ],
)
def test_errors_name_the_function_the_user_called(call: object, prefix: str) -> None:
    with pytest.raises(ConfigError) as e:
        call()  # type: ignore[operator]
    message = str(e.value)
    assert message.startswith(prefix), message
    assert "open_store:" not in message and not message.startswith("offload")
