"""``tsh.CaptureDataset``: every row once per epoch over ranks and workers, seeded
shuffling, flattening, read-ahead threads, and the errors a misuse gets."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import tensorstore_hooks as tsh

ROWS = 1000
WIDTH = 64  # 256 B rows: 16 rows a 4 KiB chunk, 63 chunks


def _ids(t: torch.Tensor) -> list[int]:
    """Row ids: every value of a row is its id."""
    assert torch.equal(t, t[:, :1].expand_as(t)), "a row was torn"
    return t[:, 0].long().tolist()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A capture of ROWS rows (row i is all i) in blocks of 7, and a second leaf of
    tokens: rows of (3, WIDTH) and (5, WIDTH)."""
    path = tmp_path_factory.mktemp("cap")
    model = nn.Sequential(nn.Identity(), nn.Identity())
    ids = torch.arange(ROWS, dtype=torch.float32)[:, None].expand(ROWS, WIDTH)
    with (
        torch.no_grad(),
        tsh.capture(model, str(path), modules="0", what="output", chunk_bytes="4KiB"),
    ):
        for block in ids.split(7):
            model(block)
    tokens = nn.Sequential(nn.Identity())
    with torch.no_grad(), tsh.capture(tokens, str(path), modules="0", what="input"):
        for i in range(10):
            seq = 3 if i % 2 else 5
            base = 10_000 + 100 * i
            tokens(
                torch.arange(base, base + 4 * seq, dtype=torch.float32)
                .view(4, seq, 1)
                .expand(4, seq, WIDTH)
            )
    return str(path)


def test_one_process_reads_every_row_once_in_a_seeded_order(root: str) -> None:
    ds = tsh.CaptureDataset(
        root, "0/output", batch_size=32, shuffle=True, seed=3, shuffle_bytes="16KiB"
    )
    assert ds.num_rows == ROWS and ds.row_shape == (WIDTH,) and ds.dtype == torch.float32
    batches = list(ds)
    assert [len(b) for b in batches[:-1]] == [32] * (len(batches) - 1)
    order = [i for b in batches for i in _ids(b)]
    assert sorted(order) == list(range(ROWS))
    assert order != list(range(ROWS))  # shuffled
    again = [i for b in ds for i in _ids(b)]
    assert again == order  # same seed, same epoch: same order
    ds.set_epoch(1)
    assert [i for b in ds for i in _ids(b)] != order
    plain = tsh.CaptureDataset(root, "0/output", batch_size=100, shuffle=False)
    assert [i for b in plain for i in _ids(b)] == list(range(ROWS))


@pytest.mark.parametrize(("world", "workers"), [(1, 2), (3, 2), (2, 0)])
def test_ranks_and_workers_cover_every_row_once(root: str, world: int, workers: int) -> None:
    seen: list[int] = []
    for rank in range(world):
        ds = tsh.CaptureDataset(
            root,
            "0/output",
            batch_size=16,
            seed=7,
            rank=rank,
            world_size=world,
            shuffle_bytes="8KiB",
        )
        loader = DataLoader(ds, batch_size=None, num_workers=workers)
        seen += [i for b in loader for i in _ids(b)]
    assert sorted(seen) == list(range(ROWS))  # every row once, none twice


@pytest.mark.parametrize("shuffle", [True, False])
def test_shards_split_the_chunks_without_overlap(root: str, shuffle: bool) -> None:
    for world in range(1, 5):
        for workers in range(1, 6):
            rows = []  # (array, chunk, row in chunk) of every piece of every shard
            for rank in range(world):
                ds = tsh.CaptureDataset(
                    root, "0/output", batch_size=8, shuffle=shuffle, rank=rank, world_size=world
                )
                for w in range(workers):
                    pieces = ds.shard(w, workers)
                    rows += [(p.array, p.index, r) for p in pieces for r in range(p.lo, p.hi)]
            per = ds.arrays[0].chunk_rows
            assert sorted(rows) == [(0, i // per, i % per) for i in range(ROWS)]


def test_drop_last_keeps_only_whole_batches(root: str) -> None:
    ds = tsh.CaptureDataset(root, "0/output", batch_size=64, drop_last=True)
    sizes = [len(b) for b in ds]
    assert set(sizes) == {64} and len(sizes) == ROWS // 64


def test_flatten_reads_tokens_of_every_shape_as_rows(root: str) -> None:
    ds = tsh.CaptureDataset(root, "0/input", batch_size=10, flatten=True, seed=1)
    assert len(ds.arrays) == 2 and ds.row_shape == (WIDTH,)
    got = sorted(i for b in ds for i in _ids(b))
    want = sorted(10_000 + 100 * i + k for i in range(10) for k in range(4 * (3 if i % 2 else 5)))
    assert got == want
    one = tsh.CaptureDataset(root, "0/input@3x64_float32", batch_size=4)
    assert one.row_shape == (3, WIDTH) and one.num_rows == 20
    base = tsh.CaptureDataset(root, "0/input", batch_size=4)  # the exact name only
    assert base.row_shape == (5, WIDTH) and base.num_rows == 20


def test_rank_groups_are_read_together_or_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = nn.Sequential(nn.Identity())
    for rank, shape in ((0, (6, 2)), (1, (4, 2)), (2, (4, 3))):
        monkeypatch.setenv("RANK", str(rank))  # what a launcher sets; no process group here
        with torch.no_grad(), tsh.capture(model, str(tmp_path), modules="0", what="output"):
            model(torch.full(shape, float(rank)))
    assert sorted(p.name for p in (tmp_path / "capture").iterdir()) == [
        "rank0",
        "rank1",
        "rank2",
        "zarr.json",
    ]
    one = tsh.CaptureDataset(str(tmp_path), "rank1/0/output", batch_size=10)
    assert torch.equal(torch.cat(list(one)), torch.ones(4, 2))
    with pytest.raises(tsh.ConfigError, match=r"rows differ \(rank0/0/output \(2,\) float32.*"):
        tsh.CaptureDataset(str(tmp_path), "0/output", batch_size=4)


def test_reads_ahead_on_background_threads(root: str) -> None:
    ds = tsh.CaptureDataset(
        root, "0/output", batch_size=8, shuffle_bytes="4KiB", read_ahead=2, threads=3
    )
    it = iter(ds)
    next(it)
    names = [t.name for t in threading.enumerate()]
    assert any(n.startswith("tsh-capture-read") for n in names)
    rest = list(it)  # the threads stop with the iteration
    assert 1 + len(rest) == -(-ROWS // 8)
    assert not any(
        t.name.startswith("tsh-capture-read") and t.is_alive() for t in threading.enumerate()
    )


def test_a_capture_object_is_a_source_for_memory_roots() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    x = torch.randn(10, 4)
    with torch.no_grad(), tsh.capture(model, "memory://", modules="0", what="output") as cap:
        model(x)
    ds = tsh.CaptureDataset(cap, "0/output", batch_size=3, shuffle=False)
    assert torch.equal(torch.cat(list(ds)), model(x).detach())
    with pytest.raises(tsh.ConfigError, match="private to the store object"):
        tsh.CaptureDataset("memory://", "0/output", batch_size=3)


def test_misuse_is_a_config_error(root: str, tmp_path: Path) -> None:
    with pytest.raises(tsh.ConfigError, match=r"no captured array 'nope/output'.*0/output"):
        tsh.CaptureDataset(root, "nope/output", batch_size=4)
    with pytest.raises(tsh.ConfigError, match="batch_size"):
        tsh.CaptureDataset(root, "0/output", batch_size=0)
    with pytest.raises(tsh.ConfigError, match="rank 2"):
        tsh.CaptureDataset(root, "0/output", batch_size=4, rank=2, world_size=2)
    with pytest.raises(tsh.ConfigError, match="daemon"):
        tsh.CaptureDataset("tsh://127.0.0.1:7077", "0/output", batch_size=4)


def test_a_damaged_chunk_is_named(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Identity())
    with torch.no_grad(), tsh.capture(model, str(tmp_path), modules="0", what="output"):
        model(torch.ones(5, 4))
    chunk = tmp_path / "capture/0/output/c/0/0"
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0xFF
    chunk.write_bytes(bytes(data))
    ds = tsh.CaptureDataset(str(tmp_path), "0/output", batch_size=2)
    with pytest.raises(
        tsh.IntegrityError, match=r"chunk capture/0/output/c/0/0 of .*checksum mismatch"
    ):
        list(ds)
