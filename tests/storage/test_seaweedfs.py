"""The remote tier against a real, distributed S3-compatible object store: SeaweedFS.

One cluster for the session (``tests/seaweedfs.py``, fixtures in ``tests/s3_fixtures.py``):
``weed server -s3`` (master, filer, S3 gateway) and a ``weed volume`` process on
loopback. What runs against it: the store conformance suite, the ChunkIO conformance
suite, a tier chain whose last tier is on it, gradient equivalence of training steps,
and faults that only a real cluster has: the volume server stopped in the middle of a
step (writes fall back and keep their tensors, reads retry, then fail naming the
URL) and started again (training goes on). moto (``tests/storage/test_s3.py``) stays for
injected throttling and errors.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import re
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import StoreUnavailableError, TensorStore
from tensorstore_hooks.cli import main as cli_main
from tensorstore_hooks.storage.io import ChunkIO, FsspecIO
from tensorstore_hooks.storage.zarr._store import make_io
from tensorstore_hooks.testing import StoreConformance
from tests.config.test_configs_train import CONFIGS, _train
from tests.hooks.test_equivalence import MODELS, check_equivalent
from tests.s3_fixtures import *  # noqa: F403 - the fixtures
from tests.s3_fixtures import SEAWEED_BUCKET
from tests.seaweedfs import SeaweedFS
from tests.storage.test_s3 import _FsspecIOConformance, _Net, _step

_IDS = itertools.count()


# --------------------------------------------------------------- conformance
_CLOSES_ITS_STORE = frozenset(
    {"test_closed_store", "test_context_manager_closes", "test_context_manager_closes_on_error"}
)


@pytest.fixture(scope="class")
def shared_store(seaweedfs: SeaweedFS) -> Iterator[TensorStore]:
    """One SeaweedFS store for a class (opening one costs ~0.3 s of client setup)."""
    prefix = f"shared-{next(_IDS)}"
    store = tsh.open_store(
        f"s3://{SEAWEED_BUCKET}/{prefix}", storage_options=seaweedfs.storage_options
    )
    try:
        yield store
    finally:
        store.close()
        seaweedfs.remove_prefix(SEAWEED_BUCKET, prefix + "/")


class TestSeaweedFSConformance(StoreConformance):
    """The whole store contract on ``s3://`` served by SeaweedFS: one store for the class,
    emptied after each test; a fresh one for the tests that close their store."""

    @pytest.fixture
    def store(
        self,
        request: pytest.FixtureRequest,
        shared_store: TensorStore,
        seaweed_url: str,
        seaweed_options: dict[str, Any],
    ) -> Iterator[TensorStore]:
        if request.node.originalname in _CLOSES_ITS_STORE:
            s = tsh.open_store(seaweed_url, storage_options=seaweed_options)
            yield s
            s.close()
            return
        yield shared_store
        shared_store.delete_many(list(shared_store.keys()))
        assert len(shared_store) == 0


class TestSeaweedFSChunkIO(_FsspecIOConformance):
    """The ChunkIO contract on SeaweedFS: FsspecIO over s3fs."""

    @pytest.fixture
    def io(self, seaweed_url: str, seaweed_options: dict[str, Any]) -> Iterator[ChunkIO]:
        io = make_io(seaweed_url, seaweed_options)
        assert isinstance(io, FsspecIO)
        yield io
        io.remove_tree("")
        io.close()


@pytest.fixture(scope="class")
def remote_tier(seaweedfs: SeaweedFS) -> Iterator[TensorStore]:
    """One SeaweedFS store for a class of chain tests (opening one costs ~0.3 s)."""
    prefix = f"chain-{next(_IDS)}"
    store = tsh.open_store(
        f"s3://{SEAWEED_BUCKET}/{prefix}", storage_options=seaweedfs.storage_options
    )
    try:
        yield store
    finally:
        store.close()
        seaweedfs.remove_prefix(SEAWEED_BUCKET, prefix + "/")


class TestChainToSeaweedFS(StoreConformance):
    """The store contract on a chain: a local directory (16 KiB) -> SeaweedFS. Most
    tensors of the suite are small and stay local; the rest move or go down at once."""

    @pytest.fixture
    def store(self, tmp_path: Path, remote_tier: TensorStore) -> Iterator[TensorStore]:
        s = tsh.TierChain(
            [tsh.open_store(tmp_path / "local"), remote_tier],
            budgets=["16KiB"],
            owned=[True, False],
        )
        yield s
        s.close()


# ----------------------------------------------------------------- training
@pytest.mark.parametrize("flush", [False, True], ids=["tail", "flushed"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_training_is_identical_on_seaweedfs(
    seaweedfs: SeaweedFS, seaweed_url: str, model_name: str, flush: bool
) -> None:
    make_model, make_input, step = MODELS[model_name]
    hooks = tsh.offload(seaweed_url, storage_options=seaweedfs.storage_options, min_bytes=0)
    stats = check_equivalent(make_model, make_input(), step, hooks, flush=flush)
    assert stats.fallbacks == 0
    if flush:
        assert stats.bytes_read > 0  # everything came back over HTTP from the volume server
    assert len(hooks.store) == 0
    hooks.close()
    prefix = seaweed_url.split("/", 3)[3]
    # The store's namespace is removed when it closes; the root stays.
    assert seaweedfs.object_keys(SEAWEED_BUCKET, prefix + "/") == [f"{prefix}/zarr.json"]


@pytest.mark.parametrize("flush", [False, True], ids=["tail", "flushed"])
def test_training_is_identical_through_a_chain_to_seaweedfs(
    tmp_path: Path, seaweedfs: SeaweedFS, seaweed_url: str, flush: bool
) -> None:
    """A local tier smaller than the step: the oldest tensors end up in SeaweedFS,
    backward reads from both tiers, and the gradients are exact."""
    chain = tsh.open_store(
        [str(tmp_path / "local"), seaweed_url],
        budgets=["128KiB"],
        storage_options=[None, seaweedfs.storage_options],
    )
    assert isinstance(chain, tsh.TierChain)
    hooks = tsh.offload(chain, min_bytes=0)
    make_model, make_input, step = MODELS["gpt"]
    stats = check_equivalent(make_model, make_input(), step, hooks, flush=flush)
    assert stats.fallbacks == 0
    cs = chain.stats
    assert cs.moves > 0 and cs.tiers[1].moved_in == cs.moves
    assert cs.tiers[0].peak_bytes <= 128 << 10
    assert len(chain) == 0 and cs.tiers[0].bytes == 0
    hooks.close()
    chain.close()


def test_the_example_chain_config_trains_on_seaweedfs(
    tmp_path: Path, seaweedfs: SeaweedFS, seaweed_url: str
) -> None:
    """configs/chain.yaml with its URLs pointed here (local tier 256 KiB, SeaweedFS
    below): two training steps with bit-identical gradients and parameters."""
    cfg = tsh.load_config(CONFIGS / "chain.yaml")
    local, remote = cfg.store.tiers
    tiers = (
        dataclasses.replace(local, url=str(tmp_path / "nvme"), budget=256 << 10),
        dataclasses.replace(remote, url=seaweed_url, storage_options=seaweedfs.storage_options),
    )
    cfg = dataclasses.replace(
        cfg,
        store=dataclasses.replace(cfg.store, tiers=tiers),
        policy=dataclasses.replace(cfg.policy, min_bytes=0),  # TinyLM's tensors are small
    )
    for stats in _train(cfg, steps=2):
        assert stats.tensors_offloaded > 0 and stats.fallbacks == 0


def test_inspect_lists_both_tiers_of_a_chain(
    tmp_path: Path,
    seaweedfs: SeaweedFS,
    seaweed_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    local = f"file://{tmp_path / 'local'}"
    chain = tsh.open_store(
        [local, seaweed_url], budgets=["32KiB"], storage_options=[None, seaweedfs.storage_options]
    )
    try:
        keys = [chain.put(torch.full((4096,), float(i))) for i in range(5)]  # 16 KiB each
        assert chain.wait_idle(30)
        assert [chain.tier_of(k) for k in keys] == [1, 1, 1, 0, 0]
        chain.flush()  # an object store's index is written on flush/close
        options = json.dumps([None, seaweedfs.storage_options])  # one entry per tier
        code = cli_main(["inspect", "--json", "--storage-options", options, local, seaweed_url])
        listing = json.loads(capsys.readouterr().out)
    finally:
        chain.close()
    assert code == 0
    assert [t["url"] for t in listing["tiers"]] == [local, seaweed_url]
    assert [t["totals"]["tensors"] for t in listing["tiers"]] == [2, 3]
    (ns,) = listing["namespaces"]
    assert ns["tensors"] == [2, 3] and ns["bytes"] == [2 << 14, 3 << 14]


# ------------------------------------------------------------------- faults
def _forward(hooks: tsh.OffloadHooks, model: torch.nn.Module, x: torch.Tensor) -> Any:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    with hooks:
        return model(x)


def test_volume_server_stopped_mid_step_then_restarted(
    seaweed_volume: SeaweedFS, seaweed_url: str
) -> None:
    """The volume server (where the bytes live) stops in the middle of a step: the
    writes after it fall back and keep their tensors (one warning), reads of what it
    held are retried and then fail naming the URL, in bounded time. Started again on
    the same data, the next step trains with exact gradients."""
    server = seaweed_volume
    store = tsh.open_store(
        seaweed_url, storage_options=server.storage_options, retry_deadline_s=0.5
    )
    hooks = tsh.offload(store, min_bytes=0, read_deadline_s="2s", max_inflight=0, prefetch=0)
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    x = torch.randn(32, 64)
    stop_at = model.layers[3]  # half of the saves are written before it runs

    def stop(*_: Any) -> None:
        server.stop_volume()

    handle = stop_at.register_forward_pre_hook(stop)
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = _forward(hooks, model, x)
        hooks.flush()
        handle.remove()
        fallbacks = hooks.stats.fallbacks
        assert fallbacks > 0 and hooks.stats.tensors_offloaded > 0  # some were written before
        with pytest.raises(StoreUnavailableError, match=re.escape(seaweed_url)) as info:
            loss.backward()
    assert isinstance(info.value, ConnectionError)
    assert time.monotonic() - t0 < 30
    assert any(seaweed_url in str(w.message) for w in caught)  # the fallback warning
    del loss, info

    server.start_volume(bucket=SEAWEED_BUCKET)
    # The next steps go on: written to and read back from the restarted volume server.
    for _ in range(2):
        before = hooks.stats.snapshot()
        want = _step(ref, x)
        got = _step(model, x, hooks, flush=True)
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
        delta = hooks.stats - before
        assert delta.fallbacks == 0 and delta.bytes_read > 0
    hooks.close()
    store.close()


def test_chain_keeps_tensors_local_while_the_volume_server_is_down(
    tmp_path: Path, seaweed_volume: SeaweedFS, seaweed_url: str
) -> None:
    """A chain to SeaweedFS whose volume server is down: moves fail and the tensors stay
    in the local tier (nothing lost, every get exact); once it is back, the moves go
    through."""
    server = seaweed_volume
    remote = tsh.open_store(
        seaweed_url, storage_options=server.storage_options, retry_deadline_s=1.0
    )
    chain = tsh.TierChain(
        [tsh.open_store(tmp_path / "local"), remote], budgets=["48KiB"], put_wait_s=0.5
    )
    try:
        server.stop_volume()
        tensors = [torch.full((4096,), float(i)) for i in range(3)]  # 16 KiB each: fit
        keys = [chain.put(t) for t in tensors]
        with pytest.raises(StoreUnavailableError, match=re.escape(seaweed_url)):
            chain.put(torch.ones(4096))  # no room: waits, the move fails, the remote too
        assert chain.stats.move_failures > 0
        assert [chain.tier_of(k) for k in keys] == [0, 0, 0]
        assert len(chain) == 3 and chain.stats.tiers[0].bytes == 3 * 16384
        for k, t in zip(keys, tensors, strict=True):
            assert torch.equal(chain.get(k), t)
        server.start_volume(bucket=SEAWEED_BUCKET)
        keys.append(chain.put(torch.ones(4096)))  # the retried move makes room
        tensors.append(torch.ones(4096))
        assert chain.wait_idle(30)
        assert chain.tier_of(keys[0]) == 1
        for k, t in zip(keys, tensors, strict=True):
            assert torch.equal(chain.get(k), t)
    finally:
        chain.close()


def test_seaweedfs_stops_without_leaving_anything(s3_env: None) -> None:
    """A cluster of its own: stop ends every weed process and removes its directory and
    the gRPC sockets weed puts in /tmp."""
    server = SeaweedFS()
    bucket = f"tsh-own-{next(_IDS)}"
    server.start(bucket=bucket)
    root = server.root
    pids = server.pids
    sockets = [s for s in server._grpc_sockets() if Path(s).exists()]
    assert root is not None and root.exists() and pids
    store = tsh.open_store(f"s3://{bucket}/acts", storage_options=server.storage_options)
    key = store.put(torch.arange(10.0))
    assert torch.equal(store.get(key), torch.arange(10.0))
    store.close()
    t0 = time.monotonic()
    server.stop(timeout_s=2.0)
    assert time.monotonic() - t0 < 20
    assert not root.exists()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid)
    assert not [s for s in sockets if Path(s).exists()]
    server.stop()  # idempotent


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return ""
