"""``CaptureDataset`` epochs (issue 35, findings 4-7): a new order each epoch with
persistent workers, equal batch counts on every rank, metadata checked against the
files before use, and leaves of zero-length rows skipped."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import tensorstore_hooks as tsh

WIDTH = 8


def _ids(t: torch.Tensor) -> list[int]:
    assert torch.equal(t, t[:, :1].expand_as(t)), "a row was torn"
    return t[:, 0].long().tolist()


def _write(root: Path, sizes: list[int], width: int = WIDTH, chunk_bytes: str = "4KiB") -> int:
    """Capture blocks of ``sizes`` rows (row ``i`` is all ``i``); returns the rows."""
    model = nn.Sequential(nn.Identity())
    first = 0
    with (
        torch.no_grad(),
        tsh.capture(model, str(root), modules="0", what="output", chunk_bytes=chunk_bytes),
    ):
        for n in sizes:
            model(torch.arange(first, first + n, dtype=torch.float32)[:, None].expand(n, width))
            first += n
    return first


# ------------------------------------------------------------------ finding 4
def test_set_epoch_reaches_persistent_workers(tmp_path: Path) -> None:
    rows = _write(tmp_path, [50] * 20)  # 1000 rows in chunks of 128
    ds = tsh.CaptureDataset(str(tmp_path), "0/output", batch_size=32, shuffle_bytes="8KiB")
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    orders = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        order = [i for batch in loader for i in _ids(batch)]
        assert sorted(order) == list(range(rows))  # every row once
        orders.append(order)
    assert orders[0] != orders[1] != orders[2] != orders[0]
    ds.set_epoch(1)  # an epoch's order is its own, whatever came before
    assert [i for batch in loader for i in _ids(batch)] == orders[1]
    assert ds.epoch == 1


# ------------------------------------------------------------------ finding 5
def _per_rank(root: Path, world: int, workers: int, **kw: object) -> list[list[list[int]]]:
    """The batches (as row ids) each rank yields in one epoch; ``len(ds)`` and
    ``len(loader)`` must say how many (checked once the counts agree)."""
    out, lengths = [], []
    for rank in range(world):
        ds = tsh.CaptureDataset(str(root), "0/output", rank=rank, world_size=world, **kw)  # type: ignore[arg-type]
        loader = DataLoader(ds, batch_size=None, num_workers=workers)
        out.append([_ids(b) for b in loader])
        lengths.append(lambda ds=ds, loader=loader: (len(ds), len(loader)))
    counts = [len(batches) for batches in out]
    assert len(set(counts)) == 1, f"ranks yield {counts} batches: a DDP loop would hang"
    assert all(length() == (counts[0], counts[0]) for length in lengths)
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_every_rank_gets_the_same_number_of_batches(
    tmp_path: Path, workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    rows = _write(tmp_path, [7, 300, 13, 401, 280])  # 1001 rows; chunks of 128
    with caplog.at_level(logging.INFO, logger="tensorstore_hooks"):
        ranks = _per_rank(tmp_path, 2, workers, batch_size=100, seed=3)
    assert [len(b) for b in ranks] == [6, 6]  # 501 rows and 500 (+ one padded batch)
    assert "even_batches='pad'" in caplog.text and "1 repeated rows" in caplog.text
    seen = Counter(i for batches in ranks for b in batches for i in b)
    assert set(seen) == set(range(rows))  # every row
    assert sum(seen.values()) == rows + 1  # and one repeated: the pad batch's row
    dropped = _per_rank(tmp_path, 2, workers, batch_size=100, even_batches="drop")
    assert [len(b) for b in dropped] == [5, 5]
    flat = [i for batches in dropped for b in batches for i in b]
    assert len(flat) == len(set(flat)) == 1000  # nothing repeated, one row left out
    last = _per_rank(tmp_path, 3, workers, batch_size=64, drop_last=True)
    assert len({len(b) for b in last}) == 1
    assert all(len(b) == 64 for batches in last for b in batches)


def test_opting_out_with_unequal_counts_is_an_error_not_a_hang(tmp_path: Path) -> None:
    _write(tmp_path, [1001])
    with pytest.raises(
        tsh.ConfigError, match=r"CaptureDataset\('0/output'\).*2 ranks would get 5 to 6 batches"
    ):
        tsh.CaptureDataset(
            str(tmp_path), "0/output", batch_size=100, rank=0, world_size=2, even_batches=False
        )
    ds = tsh.CaptureDataset(  # counts that agree need no evening
        str(tmp_path), "0/output", batch_size=91, rank=1, world_size=2, even_batches=False
    )
    assert len(ds) == 6
    with pytest.raises(tsh.ConfigError, match="even_batches must be 'pad', 'drop' or False"):
        tsh.CaptureDataset(str(tmp_path), "0/output", batch_size=4, even_batches=True)


def test_a_rank_reads_the_same_rows_in_as_many_batches_whatever_its_workers(
    tmp_path: Path,
) -> None:
    _write(tmp_path, [333, 444])
    kw = dict(batch_size=50, seed=5, shuffle_bytes="4KiB")
    alone = _per_rank(tmp_path, 2, 0, **kw)
    shared = _per_rank(tmp_path, 2, 2, **kw)
    for a, b in zip(alone, shared, strict=True):
        assert len(a) == len(b)
        assert sorted(i for batch in a for i in batch) == sorted(i for batch in b for i in batch)


# ------------------------------------------------------------------ finding 6
def _doc(root: Path) -> dict[str, object]:
    doc: dict[str, object] = json.loads((root / "capture/0/output/zarr.json").read_text())
    return doc


def _set_doc(root: Path, doc: dict[str, object]) -> None:
    (root / "capture/0/output/zarr.json").write_text(json.dumps(doc))


def test_a_document_claiming_more_rows_than_the_files_hold_is_named(tmp_path: Path) -> None:
    _write(tmp_path, [100])
    doc = _doc(tmp_path)
    doc["shape"] = [10**15, WIDTH]
    _set_doc(tmp_path, doc)
    with pytest.raises(
        tsh.IntegrityError, match=r"capture array 0/output .*claims 1000000000000000 rows in"
    ):
        tsh.CaptureDataset(str(tmp_path), "0/output", batch_size=8)
    doc["shape"] = [10**16, 10**16]
    _set_doc(tmp_path, doc)
    with (
        pytest.warns(UserWarning, match="skipping"),
        pytest.raises(tsh.IntegrityError, match="sizes out of bounds"),
    ):
        tsh.CaptureDataset(str(tmp_path), "0/output", batch_size=8)


def test_a_chunk_larger_than_its_document_says_is_named_before_it_is_read(
    tmp_path: Path,
) -> None:
    _write(tmp_path, [100])  # 128 rows a chunk: one chunk
    doc = _doc(tmp_path)
    doc["shape"] = [100, WIDTH * 4]
    grid = doc["chunk_grid"]
    assert isinstance(grid, dict)
    grid["configuration"]["chunk_shape"] = [128, WIDTH * 4]
    _set_doc(tmp_path, doc)
    ds = tsh.CaptureDataset(str(tmp_path), "0/output", batch_size=8)
    with pytest.raises(tsh.IntegrityError, match=r"chunk capture/0/output/c/0/0 .*has 4100 bytes"):
        list(ds)


def test_a_deeply_nested_document_is_named(tmp_path: Path) -> None:
    _write(tmp_path, [10])
    (tmp_path / "capture/0/output/zarr.json").write_text("[" * 50_000 + "]" * 50_000)
    with (
        pytest.warns(UserWarning, match="skipping"),
        pytest.raises(tsh.IntegrityError, match=r"0/output .*nested too deeply"),
    ):
        tsh.CaptureDataset(str(tmp_path), "0/output", batch_size=8)


# ------------------------------------------------------------------ finding 7
def test_leaves_of_zero_length_rows_are_skipped(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Identity())
    with torch.no_grad(), tsh.capture(model, str(tmp_path), modules="0", what="output") as cap:
        model(torch.ones(4, 3, WIDTH))
        model(torch.ones(4, 0, WIDTH))  # a batch of no tokens: its own, empty-row array
        model(torch.full((2, 5, WIDTH), 2.0))
    assert "0/output@0x8_float32" in cap.arrays
    ds = tsh.CaptureDataset(str(tmp_path), "0/output", batch_size=7, flatten=True)
    got = torch.cat(list(ds))
    assert len(ds.arrays) == 2 and got.shape == (22, WIDTH)
    assert sorted(got[:, 0].tolist()) == [1.0] * 12 + [2.0] * 10
    with pytest.raises(tsh.ConfigError, match="only rows of no elements"):
        tsh.CaptureDataset(str(tmp_path), "0/output@0x8_float32", batch_size=7)


# ------------------------------------------------------------------ finding 8 (reads)
def test_mapped_and_pooled_reads_serve_the_same_batches_and_check_every_epoch(
    tmp_path: Path,
) -> None:
    rows = _write(tmp_path, [300, 411])
    kw = dict(batch_size=64, seed=9, shuffle_bytes="8KiB")
    mapped = tsh.CaptureDataset(str(tmp_path), "0/output", **kw)  # type: ignore[arg-type]
    pooled = tsh.CaptureDataset(str(tmp_path), "0/output", map_bytes=0, **kw)  # type: ignore[arg-type]
    for epoch in range(2):
        mapped.set_epoch(epoch)
        pooled.set_epoch(epoch)
        a = [_ids(b) for b in mapped]
        assert a == [_ids(b) for b in pooled]
        assert sorted(i for b in a for i in b) == list(range(rows))
    assert mapped._maps is not None and pooled._maps is None
    chunk = tmp_path / "capture/0/output/c/2/0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    with open(chunk, "r+b") as f:  # in place: the same file, its map sees the new bytes
        f.write(bytes(data))
    for ds in (mapped, pooled):
        with pytest.raises(tsh.IntegrityError, match=r"c/2/0 .*checksum mismatch"):
            list(ds)


def test_a_map_follows_a_chunk_rewritten_by_a_later_capture(tmp_path: Path) -> None:
    _write(tmp_path, [100])  # one partial chunk of 128 rows
    before = tsh.CaptureDataset(str(tmp_path), "0/output", batch_size=1000, shuffle=False)
    assert _ids(next(iter(before))) == list(range(100))
    model = nn.Sequential(nn.Identity())
    with (
        torch.no_grad(),
        tsh.capture(model, str(tmp_path), modules="0", what="output", chunk_bytes="4KiB"),
    ):
        model(torch.arange(100, 150, dtype=torch.float32)[:, None].expand(50, WIDTH))
    chunk = tmp_path / "capture/0/output/c/0/0"
    assert _ids(next(iter(before))) == list(range(100))  # the rows it saw, from the new file
    assert before._maps is not None
    ((key, data),) = before._maps[1]._maps.values()
    assert key[1] == chunk.stat().st_ino and len(data) == chunk.stat().st_size
    after = tsh.CaptureDataset(str(tmp_path), "0/output", batch_size=1000, shuffle=False)
    assert [_ids(b) for b in after] == [list(range(150))]
