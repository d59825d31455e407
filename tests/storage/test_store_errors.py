"""Errors say what happened: a vanished root, and the CLI's one-line messages."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import IntegrityError, StoreUnavailableError
from tensorstore_hooks.cli import error_line
from tensorstore_hooks.cli import main as cli_main


# ------------------------------------------------------------- vanished root
def test_a_root_renamed_between_forward_and_backward_is_unavailable_not_damaged(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    hooks = tsh.offload(f"file://{root}", min_bytes=0)
    w = torch.randn(64, 64, requires_grad=True)
    with hooks:
        loss = (torch.randn(8, 64) @ w).tanh().sum()
    hooks.flush()
    root.rename(tmp_path / "moved")
    with pytest.raises(StoreUnavailableError, match=rf"root file://{re.escape(str(root))} is gone"):
        loss.backward()
    del loss
    hooks.close()
    assert not root.exists()  # freeing the graph made nothing there again


def test_a_vanished_root_is_named_by_get_and_put_and_not_made_again(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = tsh.open_store(f"file://{root}")
    key = store.put(torch.arange(8.0))
    root.rename(tmp_path / "moved")
    with pytest.raises(StoreUnavailableError, match="is gone") as got:
        store.get(key)
    assert not isinstance(got.value, IntegrityError) and str(root) in str(got.value)
    with pytest.raises(StoreUnavailableError, match=r"is gone.*not stored"):
        store.put(torch.ones(3))
    assert not root.exists()
    store.close()


def test_a_missing_chunk_under_a_live_root_is_still_an_integrity_error(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = tsh.open_store(f"file://{root}")
    key = store.put(torch.arange(8.0))
    (chunk,) = [p for p in root.rglob("c/*") if p.is_file()]
    chunk.unlink()
    with pytest.raises(IntegrityError, match="is missing"):
        store.get(key)
    store.close()


# ------------------------------------------------------------------- the CLI
_DOUBLED = re.compile(r"(?:^|\s)([\w-]+): (?:tensorstore-hooks )?\1:")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_errors_carry_their_prefix_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_a_root = tmp_path / "plain"
    not_a_root.mkdir()
    (not_a_root / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    runs = {
        "inspect": ["inspect", str(not_a_root)],
        "stats": ["stats", f"tsh://127.0.0.1:{_closed_port()}", "--timeout", "2"],
        "clean": ["clean", str(tmp_path / "missing")],
    }
    for name, argv in runs.items():
        assert cli_main(argv) != 0, name
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert lines, name
        for line in lines:
            assert not _DOUBLED.search(line), f"{name}: {line}"
        assert name in lines[0]


def test_error_line_strips_the_prefixes_a_message_already_has() -> None:
    assert error_line("inspect", "inspect: x is not a root") == "inspect: x is not a root"
    assert error_line("tensorstore-hooks stats", "stats: cannot reach") == (
        "tensorstore-hooks stats: cannot reach"
    )
    assert error_line("tensorstore-hooks serve", "tensorstore-hooks: bad\n  config") == (
        "tensorstore-hooks serve: bad config"
    )
    assert os.sep not in error_line("clean", "clean: ")  # nothing left is fine too
