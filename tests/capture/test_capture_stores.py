"""Capture on every kind of root: S3 (a real S3-compatible server on loopback), a
ZarrStore that offloads at the same time, ``inspect``, and the README's demo."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks.cli.inspect import inspect_root
from tests.s3_fixtures import *  # noqa: F403 - the fixtures
from tests.s3_fixtures import FaultPlan

README = Path(__file__).resolve().parents[2] / "README.md"


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))


def _reference(model: nn.Module, name: str, data: list[torch.Tensor]) -> torch.Tensor:
    got: list[torch.Tensor] = []
    h = dict(model.named_modules())[name].register_forward_hook(
        lambda m, a, o: got.append(o.detach().clone())
    )
    with torch.no_grad():
        for x in data:
            model(x)
    h.remove()
    return torch.cat(got)


def _capture_to_s3(url: str, options: dict[str, Any]) -> tuple[tsh.Capture, torch.Tensor]:
    """Four batches of layer 0's output into ``url``; the capture and the reference."""
    data = [torch.randn(50, 8) for _ in range(4)]
    ref = _reference(_mlp(), "0", data)
    model = _mlp()
    cap = tsh.capture(
        model, url, modules="0", what="output", storage_options=options, chunk_bytes="4KiB"
    )
    with torch.no_grad(), cap:
        for x in data:
            model(x)
    return cap, ref


def test_capture_to_s3_and_read_back(s3_url: str, s3_options: dict[str, Any]) -> None:
    cap, ref = _capture_to_s3(s3_url, s3_options)
    assert cap.stats.chunks_written == 7 and cap.stats.failed_writes == 0
    arr = cap.arrays["0/output"]  # plain zarr over fsspec
    assert torch.equal(torch.from_numpy(arr[:]), ref)
    ds = tsh.CaptureDataset(s3_url, "0/output", batch_size=64, storage_options=s3_options)
    got = torch.cat(list(ds))
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, ref.tolist()))


def test_s3_throttling_is_retried(
    s3_url: str, s3_options: dict[str, Any], s3_faults: FaultPlan
) -> None:
    s3_faults.configure(slow_down=0.3, max_faults=6)
    cap, ref = _capture_to_s3(s3_url, s3_options)
    assert s3_faults.total > 0 and cap.stats.failed_writes == 0
    assert torch.equal(torch.from_numpy(cap.arrays["0/output"][:]), ref)


def test_a_zarr_store_captures_and_offloads_at_once(tmp_path: Path) -> None:
    data = [torch.randn(16, 8) for _ in range(3)]
    ref = _reference(_mlp(), "2", data)
    model = _mlp()
    store = tsh.open_store(str(tmp_path))
    with tsh.capture(model, store, modules="2", what="output") as cap:
        for x in data:
            with tsh.offload(store, min_bytes=0) as hooks:
                loss = model(x).sum()
            loss.backward()
            assert hooks.stats.tensors_offloaded > 0
    assert len(store) == 0  # offloaded tensors are gone; the captured arrays stay
    store.close()
    assert torch.equal(torch.from_numpy(cap.arrays["2/output"][:]), ref)


def test_inspect_lists_captured_arrays(tmp_path: Path) -> None:
    model = _mlp()
    with (
        torch.no_grad(),
        tsh.capture(model, str(tmp_path), modules=["0", "2"], what="output", dtype="bfloat16"),
    ):
        model(torch.randn(5, 8))
    listing = inspect_root(str(tmp_path))
    assert listing["capture"] == [
        {
            "name": "0/output",
            "shape": [5, 32],
            "dtype": "bfloat16",
            "chunk_rows": 131072,
            "bytes": 320,
        },
        {
            "name": "2/output",
            "shape": [5, 8],
            "dtype": "bfloat16",
            "chunk_rows": 524288,
            "bytes": 80,
        },
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "tensorstore_hooks.cli", "inspect", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    text = proc.stdout
    assert "0/output  bfloat16  (5, 32)" in text


def test_the_readme_capture_demo_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = README.read_text()
    section = text.split("## Capture", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "the README's Capture section has no python block"
    code = blocks[0].replace("/scratch/acts", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {}
    exec(compile(code, str(README), "exec"), scope)  # our own README
    assert scope["sae_loss"] < scope["first_loss"]  # the autoencoder trained
    assert (tmp_path / "capture").is_dir()
