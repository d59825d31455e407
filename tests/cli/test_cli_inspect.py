"""``tensorstore-hooks inspect`` on roots it cannot list and on damaged indexes:
exit 1 with one line per problem, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import ZarrStore
from tensorstore_hooks.cli import main as cli_main
from tests.s3_fixtures import *  # noqa: F403 - the fixtures


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tensorstore_hooks.cli", "inspect", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _one_line_failure(proc: subprocess.CompletedProcess[str], *expect: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for text in expect:
        assert text in lines[0], lines[0]


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    with ZarrStore(root, namespace="ns") as store:
        store.put(torch.ones(10))
        store.put(torch.zeros(20))
    return root


def test_a_file_instead_of_a_directory(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("hello")
    _one_line_failure(_cli(str(f)), "is a file, not a directory")


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe\x00", "not JSON"),
        (b"[1, 2, 3]", "no attributes.tensorstore_hooks.format"),
        (b'{"attributes": 5}', "no attributes.tensorstore_hooks.format"),
        (b'{"attributes": {"tensorstore_hooks": "x"}}', "no attributes.tensorstore_hooks"),
        (b'{"zarr_format": 3, "node_type": "group"}', "no attributes.tensorstore_hooks"),
    ],
)
def test_a_bad_zarr_json(tmp_path: Path, doc: bytes, why: str) -> None:
    root = _root(tmp_path)
    (root / "zarr.json").write_bytes(doc)
    _one_line_failure(_cli(str(root)), why)


def test_zarr_json_as_a_directory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "zarr.json").mkdir(parents=True)
    _one_line_failure(_cli(str(root)), "zarr.json is a directory")


def test_index_as_a_file(tmp_path: Path) -> None:
    root = _root(tmp_path)
    index = root / "ns" / "index"
    for p in index.iterdir():
        p.unlink()
    index.rmdir()
    index.write_bytes(b"oops")
    _one_line_failure(_cli(str(root)), "namespace ns", "is not a directory")


def test_journal_as_a_directory(tmp_path: Path) -> None:
    root = _root(tmp_path)
    journal = root / "ns" / "index" / "journal"
    journal.unlink()
    journal.mkdir()
    _one_line_failure(_cli(str(root)), "namespace ns", "journal is a directory")


def test_a_damaged_index_record_is_named_and_exits_1(tmp_path: Path) -> None:
    root = _root(tmp_path)
    journal = root / "ns" / "index" / "journal"
    raw = bytearray(journal.read_bytes())
    raw[-3] ^= 0x01  # the second (last) record
    journal.write_bytes(bytes(raw))
    proc = _cli(str(root))
    _one_line_failure(proc, "damaged", "ns/index/journal: record 2 at byte", "checksum mismatch")
    assert "1 tensor" in proc.stdout  # the undamaged record is still listed
    assert "DAMAGED index" in proc.stdout


def test_a_healthy_root_exits_0(tmp_path: Path) -> None:
    proc = _cli(str(_root(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "2 tensors" in proc.stdout


def test_a_damaged_namespace_document_is_named_with_the_way_back(tmp_path: Path) -> None:
    """A namespace zarr.json that cannot be parsed (never overwritten by the store) is
    named, with how to recover; its tensors are still listed from the index."""
    root = _root(tmp_path)
    doc = root / "ns" / "zarr.json"
    doc.write_bytes(b'{"zarr_format": 3, "node_')
    proc = _cli(str(root))
    _one_line_failure(proc, "namespace ns", "ns/zarr.json cannot be parsed", "zarr.json.damaged")
    assert "DAMAGED document" in proc.stdout and "2 tensors" in proc.stdout
    assert doc.read_bytes() == b'{"zarr_format": 3, "node_'


# ------------------------------------------------------------------- chains
def test_a_chain_whose_first_tier_never_stored_shows_the_others(
    tmp_path: Path,
    s3_url: str,
    s3_options: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 36, finding 13: every tensor was larger than the first tier's budget, so
    the S3 tier holds them all and the first tier has no zarr.json: ``inspect`` of the
    chain lists the S3 tier's tensors (exit 0) instead of "not a store root"."""
    local = f"file://{tmp_path / 'nvme'}"
    chain = tsh.open_store([local, s3_url], budgets=["16KiB"], storage_options=[{}, s3_options])
    try:
        keys = [chain.put(torch.full((16384,), float(i))) for i in range(3)]  # 64 KiB each
        assert [chain.tier_of(k) for k in keys] == [1, 1, 1]  # type: ignore[attr-defined]
        chain.flush()  # an object store's index is written on flush/close
        options = json.dumps([{}, s3_options])
        code = cli_main(["inspect", "--storage-options", options, local, s3_url])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert f"tier 0: {local}: 0 tensors, 0 B (nothing stored there yet)" in out
        assert f"tier 1: {s3_url}: 3 tensors, 192.00 KiB" in out
        assert "nothing stored yet: no zarr.json" in out and err == ""
        assert cli_main(["inspect", "--json", "--storage-options", options, local, s3_url]) == 0
        listing = json.loads(capsys.readouterr().out)
        assert [t["totals"]["tensors"] for t in listing["tiers"]] == [0, 3]
        assert listing["tiers"][0]["format"] is None and listing["problems"] == []
    finally:
        chain.close()


def test_a_chain_tier_that_cannot_be_listed_is_named_beside_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    upper, lower = tmp_path / "upper", tmp_path / "lower"
    with ZarrStore(lower, namespace="ns") as store:
        store.put(torch.ones(10))
    upper.write_text("not a directory")  # a tier URL that points at a file
    assert cli_main(["inspect", str(upper), str(lower)]) == 1
    out, err = capsys.readouterr()
    assert f"tier 1: {lower}: 1 tensor, 40 B" in out and "tier 0" in out
    (line,) = err.strip().splitlines()
    assert "tier 0" in line and "not listed" in line and "is a file" in line
    # No tier a store root at all: an error, not an empty listing.
    assert cli_main(["inspect", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "none of the chain's tiers is a tensorstore-hooks store root" in capsys.readouterr().err
