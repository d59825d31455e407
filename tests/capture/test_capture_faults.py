"""Capture never loses a row (issue 35, findings 1-3 and 8): documents are replaced
atomically and a damaged one is never written over (and can be repaired), one writer
holds an array at a time, and chunks go to the disk with ``O_DIRECT`` where it allows."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks.cli.inspect import inspect_root
from tensorstore_hooks.storage.io import LocalIO, probe_direct_io
from tests._mounts import loop_ext4

WIDTH = 16  # 64 B rows of float32


def _ids(n: int, first: int = 0) -> torch.Tensor:
    """``n`` rows, row ``i`` all ``first + i``."""
    return torch.arange(first, first + n, dtype=torch.float32)[:, None].expand(n, WIDTH).clone()


def _capture(root: Path | str, model: nn.Module, **kw: Any) -> tsh.Capture:
    kw.setdefault("chunk_bytes", "4KiB")
    return tsh.capture(model, str(root), modules="0", what="output", **kw)


def _varying_blocks(model: nn.Module, blocks: int) -> torch.Tensor:
    """Forward ``blocks`` batches of 1, 2, 3, ... rows (one ``blocks`` run each: the
    document grows by a run per batch); returns every row in order."""
    rows, first = [], 0
    with torch.no_grad():
        for i in range(blocks):
            x = _ids(1 + i % 7, first)
            first += len(x)
            model(x)
            rows.append(x)
    return torch.cat(rows)


def repair_array(*args: Any, **kwargs: Any) -> Any:
    from tensorstore_hooks.capture import repair_array as repair

    return repair(*args, **kwargs)


def _files(folder: Path) -> dict[str, str]:
    """sha256 of every chunk file under ``folder``."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "/c/" in str(p)
    }


class FailingDocIO(LocalIO):
    """A local root whose ``zarr.json`` writes of one array fail as ``fail()`` says:
    half the bytes are written, then ENOSPC (a disk filling up mid-write)."""

    def __init__(self, root: str, array: str, fail: Callable[[], bool]) -> None:
        super().__init__(root)
        self.array = array
        self.fail = fail
        self.failures = 0

    def _write(self, path: str, parts: Any, trailer: Any) -> None:
        if path.startswith(self.array + "/") and "zarr.json" in path and self.fail():
            self.failures += 1
            data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
            super()._write(path, [data[: len(data) // 2]], None)
            raise OSError(28, "No space left on device", path)
        super()._write(path, parts, trailer)


# ------------------------------------------------------------------ finding 1
def test_a_failed_document_write_leaves_the_old_one_whole(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Identity())
    failing = [False]
    io = FailingDocIO(str(tmp_path), "capture/0/output", lambda: failing[0])
    cap = _capture(tmp_path, model)
    cap._writer.io = io
    with torch.no_grad(), pytest.warns(UserWarning, match=r"zarr.json failed.*No space left"):
        first = _varying_blocks(model, 80)  # 80 runs: the document is over 4 KiB
        cap.flush()
        assert (tmp_path / "capture/0/output/zarr.json").stat().st_size > 4096
        failing[0] = True  # every document write of the array fails from now on
        model(_ids(5, 10_000))
        cap.remove()
    assert io.failures >= 1 and cap.stats.failed_writes >= 1
    arr = zarr.open_array(str(tmp_path / "capture/0/output"), mode="r")  # parses: whole
    assert torch.equal(torch.from_numpy(arr[:]), first)  # every row it showed, exact
    assert not [p for p in (tmp_path / "capture/0/output").iterdir() if ".tmp-" in p.name]


# ------------------------------------------------------------------ findings 1 and 3
@pytest.fixture()
def torn(tmp_path: Path) -> Iterator[tuple[Path, torch.Tensor]]:
    """A root whose array's document was torn after its first 4096 bytes, as an
    in-place rewrite on a full disk left it (finding 1), with the rows it showed."""
    model = nn.Sequential(nn.Identity())
    with _capture(tmp_path, model):
        rows = _varying_blocks(model, 80)
    doc = tmp_path / "capture/0/output/zarr.json"
    whole = doc.read_bytes()
    assert len(whole) > 4096
    doc.write_bytes(whole[:4096])
    yield tmp_path, rows


def test_a_torn_document_is_never_written_over(torn: tuple[Path, torch.Tensor]) -> None:
    root, _ = torn
    doc = root / "capture/0/output/zarr.json"
    before, chunks = doc.read_bytes(), _files(root / "capture/0/output")
    model = nn.Sequential(nn.Identity())
    with pytest.raises(
        tsh.IntegrityError, match=r"capture array 0/output .*cannot be parsed.*repair_array"
    ):
        _capture(root, model)
    assert not model[0]._forward_hooks and not model._forward_pre_hooks  # nothing hooked
    assert doc.read_bytes() == before and _files(root / "capture/0/output") == chunks


def test_a_document_damaged_during_a_capture_is_skipped_and_said(
    tmp_path: Path,
) -> None:
    model = nn.Sequential(nn.Identity())
    with _capture(tmp_path, model):
        rows = _varying_blocks(model, 10)
    doc = tmp_path / "capture/0/output/zarr.json"
    cap = _capture(tmp_path, model)  # capture() checked: the document was whole
    doc.write_bytes(b'{"shape": [')  # now torn
    chunks = _files(tmp_path / "capture/0/output")
    with torch.no_grad(), pytest.warns(UserWarning, match=r"cannot be parsed.*repair_array"):
        model(_ids(4, 500))
        cap.remove()
    assert cap.stats.rows_dropped == 4 and cap.stats.failed_writes == 1
    assert doc.read_bytes() == b'{"shape": [' and _files(tmp_path / "capture/0/output") == chunks
    info = repair_array(
        str(tmp_path), "0/output", row_shape=(WIDTH,), dtype=torch.float32, rows=len(rows)
    )
    assert info.rows == len(rows)


def test_inspect_and_the_dataset_name_a_damaged_array(torn: tuple[Path, torch.Tensor]) -> None:
    root, _ = torn
    listing = inspect_root(str(root))
    assert listing["capture"] == []
    (problem,) = listing["problems"]
    assert "capture array 0/output" in problem and "repair_array('file://" in problem
    proc = subprocess.run(
        [sys.executable, "-m", "tensorstore_hooks.cli", "inspect", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "0/output" in proc.stderr and "repair_array" in proc.stderr
    with (
        pytest.warns(UserWarning, match="skipping"),
        pytest.raises(tsh.IntegrityError, match="cannot be parsed"),
    ):
        tsh.CaptureDataset(str(root), "0/output", batch_size=4)


def test_repair_gives_the_rows_of_a_torn_document_back(torn: tuple[Path, torch.Tensor]) -> None:
    root, rows = torn
    info = repair_array(str(root), "0/output")
    assert info.rows == len(rows) and info.row_shape == (WIDTH,) and info.dtype == "float32"
    arr = zarr.open_array(str(root / "capture/0/output"), mode="r")
    assert torch.equal(torch.from_numpy(arr[:]), rows)  # crc32c checked by zarr too
    blocks = arr.attrs["blocks"]
    assert blocks[0] == [0, 0, 1, 1] and blocks[-1][0] == -1  # steps lost with the tail
    assert sum(r[2] * r[3] for r in blocks) == len(rows)
    assert arr.attrs["repaired"]["rows_lost"] == 0
    assert list((root / "capture/0/output").glob("zarr.json.damaged-*"))
    ds = tsh.CaptureDataset(str(root), "0/output", batch_size=1000, shuffle=False)
    assert torch.equal(torch.cat(list(ds)), rows)
    model = nn.Sequential(nn.Identity())
    with _capture(root, model), torch.no_grad():  # and capture appends to it again
        model(_ids(3, 7000))
    arr = zarr.open_array(str(root / "capture/0/output"), mode="r")
    assert torch.equal(torch.from_numpy(arr[:]), torch.cat([rows, _ids(3, 7000)]))


def test_repair_stops_at_a_damaged_chunk_and_asks_for_what_is_lost(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Identity())
    with _capture(tmp_path, model):
        rows = _varying_blocks(model, 60)  # 64 rows a chunk
    folder = tmp_path / "capture/0/output"
    chunk = folder / "c/2/0"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 1
    chunk.write_bytes(bytes(data))
    (folder / "zarr.json").write_bytes(b"")  # nothing left of it
    with pytest.raises(tsh.ConfigError, match=r"row_shape, rows, dtype.*row_shape=\.\.\."):
        repair_array(str(tmp_path), "0/output")
    info = repair_array(
        str(tmp_path), "0/output", row_shape=(WIDTH,), dtype="float32", rows=len(rows)
    )
    assert info.rows == 2 * 64  # chunks 0 and 1; chunk 2 fails its crc32c
    got = zarr.open_array(str(folder), mode="r")[:]
    assert torch.equal(torch.from_numpy(got), rows[:128])


# ------------------------------------------------------------------ finding 6 (capture)
def test_a_deeply_nested_document_is_an_integrity_error_not_a_recursion_error(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "capture/0/output"
    folder.mkdir(parents=True)
    nested = "[" * 100_000 + "]" * 100_000
    (folder / "zarr.json").write_text(nested)
    with pytest.raises(tsh.IntegrityError, match="nested too deeply"):
        _capture(tmp_path, nn.Sequential(nn.Identity()))
    (folder / "zarr.json").unlink()
    model = nn.Sequential(nn.Identity())
    cap = _capture(tmp_path, model)
    (folder / "zarr.json").write_text(nested)  # after capture() looked
    with torch.no_grad(), pytest.warns(UserWarning, match="nested too deeply"):
        model(_ids(2))  # the hook never raises: training goes on
        cap.remove()
    assert cap.stats.rows_dropped == 2 and (folder / "zarr.json").read_text() == nested


# ------------------------------------------------------------------ finding 2
def test_a_second_capture_of_the_same_arrays_is_refused_naming_the_first(
    tmp_path: Path,
) -> None:
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    cap = tsh.capture(first, str(tmp_path), modules=None, what="output")
    line = sys._getframe().f_lineno - 1
    with pytest.raises(tsh.StoreUnavailableError) as info:
        tsh.capture(second, str(tmp_path), modules=None, what="output")
    message = str(info.value)
    assert "output arrays of capture/root" in message
    assert f"test_capture_faults.py:{line}" in message and f"pid {os.getpid()}" in message
    assert "cap.remove()" in message and "RANK" in message
    assert not second._forward_hooks and not second._forward_pre_hooks  # nothing hooked
    # Another kind of the same module, or another module, is another array: allowed.
    tsh.capture(second, str(tmp_path), modules=None, what="input").remove()
    with torch.no_grad():
        first(torch.ones(3, 4))
    cap.remove()
    with tsh.capture(second, str(tmp_path), modules=None, what="output"), torch.no_grad():
        second(torch.ones(2, 4))  # the first let go: the second appends
    arr = zarr.open_array(str(tmp_path / "capture/root/output"), mode="r")
    assert arr.shape == (5, 4)
    assert torch.equal(torch.from_numpy(arr[:3]), first(torch.ones(3, 4)).detach())


def test_ranks_keep_their_groups_and_object_roots_lock_in_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    caps = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        caps.append(tsh.capture(model, str(tmp_path), modules="0", what="output"))
    with pytest.raises(tsh.StoreUnavailableError, match="capture/rank1/0"):
        tsh.capture(model, str(tmp_path), modules="0", what="output")
    with torch.no_grad():
        model(torch.ones(2, 4))
    for cap in caps:
        cap.remove()
    monkeypatch.delenv("RANK")
    for rank in (0, 1):
        arr = zarr.open_array(str(tmp_path / f"capture/rank{rank}/0/output"), mode="r")
        assert arr.shape == (2, 4)
    store = tsh.open_store("memory://")
    with (
        tsh.capture(model, store, modules="0", what="output"),
        pytest.raises(tsh.StoreUnavailableError, match="another capture"),
    ):
        tsh.capture(model, store, modules="0", what="output")
    tsh.capture(model, store, modules="0", what="output").remove()  # released
    store.close()


HOLDER = """
import sys, torch, tensorstore_hooks as tsh
cap = tsh.capture(torch.nn.Linear(2, 2), sys.argv[1], modules=None, what="output")
print("holding", flush=True)
sys.stdin.read()
cap.remove()
"""


def test_a_capture_in_another_process_is_named(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        with pytest.raises(tsh.StoreUnavailableError, match=rf"<string>:\d+ \(pid {proc.pid} "):
            tsh.capture(nn.Linear(2, 2), str(tmp_path), modules=None, what="output")
    finally:
        proc.communicate("", timeout=60)
    tsh.capture(nn.Linear(2, 2), str(tmp_path), modules=None, what="output").remove()


# ------------------------------------------------------------------ finding 8 (writes)
def _cached(path: Path) -> bool:
    """Whether the page cache holds all of ``path`` (a read that must not wait)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        try:
            return os.preadv(fd, [bytearray(size)], 0, os.RWF_NOWAIT) == size
        except BlockingIOError:
            return False
    finally:
        os.close(fd)


@pytest.fixture()
def direct_root(tmp_path: Path) -> Path:
    ok, why = probe_direct_io(str(tmp_path))
    if not ok:
        pytest.skip(f"{tmp_path} cannot do O_DIRECT here: {why}")
    return tmp_path


@pytest.mark.parametrize("width", [WIDTH, 3])  # 3 floats: chunks of 4092 B, not blocks
def test_chunks_go_to_the_disk_with_o_direct_and_leave_no_page_cache(
    direct_root: Path, width: int
) -> None:
    model = nn.Sequential(nn.Identity())
    data = [torch.randn(n, width) for n in (100, 37, 250, 3)]
    with (
        tsh.capture(model, str(direct_root), modules="0", what="output", chunk_bytes="4KiB") as cap,
        torch.no_grad(),
    ):
        for x in data:
            model(x)
            cap.flush()  # an open tail written in place, then rewritten atomically
    s = cap.stats
    assert s.chunks_direct > 0 and s.failed_writes == 0
    chunks = [p for p in (direct_root / "capture/0/output/c").rglob("0") if p.is_file()]
    full = len(torch.cat(data)) // (4096 // (4 * width))
    assert sum(not _cached(p) for p in chunks) == full  # whole chunks went direct
    arr = zarr.open_array(str(direct_root / "capture/0/output"), mode="r")
    assert torch.equal(torch.from_numpy(arr[:]), torch.cat(data))


def test_direct_io_off_goes_through_the_page_cache(direct_root: Path) -> None:
    model = nn.Sequential(nn.Identity())
    x = torch.randn(256, WIDTH)
    with (
        tsh.capture(
            model, str(direct_root), modules="0", what="output", chunk_bytes="4KiB", direct_io="off"
        ) as cap,
        torch.no_grad(),
    ):
        model(x)
    assert cap.stats.chunks_direct == 0 and cap.stats.chunks_written == 4
    assert torch.equal(torch.from_numpy(cap.arrays["0/output"][:]), x)


@pytest.fixture()
def small_ext4(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB ext4 filesystem mounted on a loop device, no blocks kept for root
    (skips without root)."""
    with loop_ext4(tmp_path / "mnt", tmp_path / "fs.img", 4 << 20, reserved_percent=0) as mnt:
        yield mnt


def test_a_full_disk_under_direct_io_loses_no_visible_row(small_ext4: Path) -> None:
    model = nn.Sequential(nn.Identity())
    data = [torch.randn(1024, 256) for _ in range(8)]  # 1 MiB a batch, 8 MiB in all
    with (
        pytest.warns(UserWarning, match="No space left|failed"),
        tsh.capture(
            model, str(small_ext4), modules="0", what="output", chunk_bytes="256KiB"
        ) as cap,
        torch.no_grad(),
    ):
        for x in data:
            model(x)  # training goes on
    s = cap.stats
    assert s.failed_writes >= 1 and s.chunks_direct >= 1 and s.rows_dropped > 0
    arr = zarr.open_array(str(small_ext4 / "capture/0/output"), mode="r")
    assert 0 < arr.shape[0] < 8 * 1024 and arr.shape[0] % 1024 == 0  # whole blocks only
    assert torch.equal(torch.from_numpy(arr[:]), torch.cat(data)[: arr.shape[0]])
    json.loads((small_ext4 / "capture/0/output/zarr.json").read_text())
    assert np.all(np.isfinite(arr[:]))


def test_a_damaged_group_document_hides_no_array(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Identity())
    with _capture(tmp_path, model), torch.no_grad():
        model(_ids(3))
    (tmp_path / "capture/0/zarr.json").write_bytes(b'{"zarr_format": 3, "node')
    listing = inspect_root(str(tmp_path))
    assert [a["name"] for a in listing["capture"]] == ["0/output"]
    (problem,) = listing["problems"]
    assert "capture group 0 " in problem and "remove it and the next capture writes it" in problem
