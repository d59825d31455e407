"""The pipeline's units on their own: record lifecycle, router, adapters, I/O pool.

End-to-end behaviour (write-behind, prefetch, fallbacks, CUDA) is in ``test_pipeline.py``.
"""

from __future__ import annotations

import ast
import logging
import pathlib
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import _adapters
from tensorstore_hooks._codec import TensorMeta, decode, encode
from tensorstore_hooks.pipeline._iopool import on_io_thread, pool_for, shutdown_pool
from tensorstore_hooks.pipeline._records import TRANSITIONS, IllegalTransition, Record, State
from tensorstore_hooks.testing import WrappedStore

PACKAGE = pathlib.Path(tsh.__file__).parent


# ------------------------------------------------------------- record lifecycle
def _record_in(state: State) -> Record:
    rec = Record(torch.zeros(4), 16, 0)
    rec.state = state
    return rec


@pytest.mark.parametrize("src", list(State), ids=lambda s: s.name)
def test_record_moves_follow_the_lifecycle_table(src: State) -> None:
    """Every move the NOTE [ Record lifecycle ] forbids raises; every one it allows works."""
    for dst in State:
        rec = _record_in(src)
        if dst in TRANSITIONS[src]:
            rec.move(dst)
            assert rec.state == dst
        else:
            with pytest.raises(IllegalTransition, match=f"{src.name} -> {dst.name}"):
                rec.move(dst)
            assert rec.state == src


def test_lifecycle_table_is_the_documented_one() -> None:
    s = State
    assert {a: set(b) for a, b in TRANSITIONS.items()} == {
        s.QUEUED: {s.WRITING, s.MEMORY, s.DIRTY, s.FREED},
        s.WRITING: {s.STORED, s.MEMORY, s.DIRTY, s.FREED},
        s.STORED: {s.FREED},
        s.MEMORY: {s.FREED},
        s.DIRTY: {s.FREED},
        s.FREED: set(),
        s.HELD: {s.QUEUED, s.DIRTY, s.FREED},
        s.OPEN: {s.QUEUED, s.HELD, s.MEMORY, s.FREED},
    }


def test_illegal_transition_is_an_internal_error_not_a_user_error() -> None:
    assert issubclass(IllegalTransition, RuntimeError)
    assert not issubclass(IllegalTransition, tsh.TensorStoreError)


# ------------------------------------------------------------------- router
def test_router_is_public_and_both_hooks_share_it() -> None:
    hooks = tsh.offload("memory://", min_bytes=0)
    router = hooks.router
    assert isinstance(router, tsh.Router) and hooks.pack_hook == router.pack
    x = torch.randn(1024, requires_grad=True)
    route = router.decide(x * 1, 4096)
    assert (route.action, route.label, route.nbytes) == ("store", "default", 4096)
    assert hooks.stats.per_action == {}  # decide() counts nothing: a planner may override
    assert router.account(route) == "store"
    assert hooks.stats.per_action["store"].tensors == 1
    hooks.close()


def test_router_keeps_after_close() -> None:
    hooks = tsh.offload("memory://", min_bytes=0)
    router = hooks.router
    hooks.close()
    assert router.route(torch.randn(1024), 4096) == "keep"
    assert hooks.stats.tensors_kept == 1


def test_paddle_hooks_do_not_redeclare_the_stand_ins() -> None:
    source = (PACKAGE / "paddle" / "_hooks.py").read_text()
    names = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)}
    assert not names & {"_Kept", "_Host", "Kept", "Host"}


# ------------------------------------------------------------------ imports
def _import_graph() -> dict[str, set[str]]:
    """Module -> library modules it imports anywhere (lazy imports in functions too)."""
    mods: dict[str, tuple[pathlib.Path, bool]] = {}
    for p in PACKAGE.rglob("*.py"):
        parts = list(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    graph: dict[str, set[str]] = {}
    for name, (p, is_pkg) in mods.items():
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                prefix = base[: len(base) - node.level + 1] if node.level else []
                target = ".".join(prefix + ([node.module] if node.module else []))
                cands = [target, *(f"{target}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                cands = [a.name for a in node.names]
            else:
                continue
            deps.update(c for c in cands if c in mods and c != name)
        graph[name] = deps
    return graph


def test_library_has_no_import_cycle() -> None:
    graph = _import_graph()
    assert "tensorstore_hooks._codec" in graph["tensorstore_hooks.paddle._bridge"]  # sanity
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep) :], dep]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep, [*path, dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])


def test_codec_imports_no_framework_bridge() -> None:
    """The codec is torch-only: other frameworks reach it through ``_adapters``."""
    assert "tensorstore_hooks.paddle._bridge" not in _import_graph()["tensorstore_hooks._codec"]
    source = (PACKAGE / "_codec.py").read_text()
    assert "import paddle" not in source and "_paddle_bridge" not in source


# ----------------------------------------------------------------- adapters
class _Fake:
    """A tensor of a pretend framework (module ``tshfake``), holding a torch tensor."""

    __module__ = "tshfake.core"

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _FakeAdapter:
    name = "tshfake"

    @staticmethod
    def is_tensor(obj: object) -> bool:
        return isinstance(obj, _Fake)

    @staticmethod
    def encode(t: _Fake) -> tuple[TensorMeta, np.ndarray]:
        import dataclasses

        meta, payload = encode(t.t)
        return dataclasses.replace(meta, framework="tshfake"), payload

    @staticmethod
    def decode(meta: TensorMeta, payload: object, **kw: object) -> _Fake:
        import dataclasses

        host = dataclasses.replace(meta, framework="torch")
        return _Fake(decode(host, payload, device="cpu"))


FAKE_ADAPTER = _FakeAdapter()


@pytest.fixture
def fake_framework() -> Iterator[None]:
    _adapters.register_adapter("tshfake", f"{__name__}:FAKE_ADAPTER")
    yield
    _adapters._ENTRIES.pop("tshfake", None)
    _adapters._LOADED.pop("tshfake", None)


def test_adapter_registry_routes_another_frameworks_tensors(fake_framework: object) -> None:
    store = tsh.open_store("memory://")
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    key = store.put(_Fake(x))
    back = store.get(key)
    assert isinstance(back, _Fake) and torch.equal(back.t, x) and back.t.stride() == x.stride()
    meta, _ = encode(_Fake(x))
    assert TensorMeta.from_dict(meta.to_dict()).framework == "tshfake"
    store.close()


def test_adapter_registry_refuses_silent_overwrite(fake_framework: object) -> None:
    with pytest.raises(ValueError, match="already registered"):
        _adapters.register_adapter("tshfake", "elsewhere:ADAPTER")
    with pytest.raises(ValueError, match="already registered"):
        _adapters.register_adapter("paddle", "elsewhere:ADAPTER")
    with pytest.raises(ValueError, match="module:attr"):
        _adapters.register_adapter("other", "no_colon")
    _adapters.register_adapter("tshfake", f"{__name__}:FAKE_ADAPTER", clobber=True)


def test_unknown_framework_in_metadata_is_refused() -> None:
    meta, _ = encode(torch.zeros(2))
    d = {**meta.to_dict(), "framework": "tshfake"}
    with pytest.raises(tsh.IntegrityError, match="unknown framework"):
        TensorMeta.from_dict(d)


def test_importing_the_library_imports_no_adapter() -> None:
    import subprocess
    import sys

    code = (
        "import sys, tensorstore_hooks as t; "
        "t.open_store('memory://').put(__import__('torch').zeros(2)); "
        "print('tensorstore_hooks.paddle._bridge' in sys.modules, 'paddle' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# ------------------------------------------------------------------ I/O pool
def test_pool_for_says_when_a_second_size_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    store = WrappedStore()
    pool = pool_for(store, 3)
    with caplog.at_level(logging.WARNING, logger="tensorstore_hooks"):
        assert pool_for(store, 3) is pool
        assert not caplog.records
        assert pool_for(store, 5) is pool
    assert pool.threads == 3
    assert any(
        "3 threads" in r.getMessage() and "asked for 5" in r.getMessage() for r in caplog.records
    )
    shutdown_pool(store)
    assert pool.closed
    assert pool_for(store, 5).threads == 5  # resized after a shutdown
    shutdown_pool(store)


def test_on_io_thread_is_true_on_pool_workers_only() -> None:
    store = WrappedStore()
    pool = pool_for(store, 1)
    assert not on_io_thread()
    assert pool.submit(0, on_io_thread).result(timeout=30) is True
    seen: list[bool] = []  # a thread's name says nothing: only pool workers count
    other = threading.Thread(target=lambda: seen.append(on_io_thread()), name="tsh-io-9")
    other.start()
    other.join()
    assert seen == [False]
    shutdown_pool(store)


# ------------------------------------------------------- the life of a tensor
def test_life_of_a_saved_tensor_names_what_exists() -> None:
    """The newcomer's walk: at most 8 hops, and every module, method and NOTE it
    names is real (so renaming one without the doc fails here)."""
    import re

    from tensorstore_hooks.pipeline import _staging
    from tensorstore_hooks.pipeline._host_tier import SlabTier

    doc = (PACKAGE.parent / "docs" / "life-of-a-saved-tensor.md").read_text()
    hops = re.findall(r"^## (\d+)\. ", doc, re.M)
    assert hops == [str(i) for i in range(1, len(hops) + 1)] and len(hops) <= 8
    for module in set(re.findall(r"`((?:paddle/|server/)?_\w+\.py)`", doc)):
        root = PACKAGE.parent if module.startswith("server/") else PACKAGE
        assert (root / module).exists(), module
    source = "".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    for note in set(re.findall(r"NOTE \[ ([^\]]+?) \]", doc)):
        note = " ".join(note.split())  # a name may wrap across lines in the doc
        assert f"NOTE [ {note} ]\n" in source, note
    hooks = tsh.offload("memory://")
    pipeline = hooks._pipeline
    objects: dict[str, object] = {
        "Pipeline": pipeline,
        "RecordTable": pipeline.table,
        "Router": pipeline.router,
        "WriteBehind": pipeline.writer,
        "Prefetcher": pipeline.prefetcher,
        "DeviceStager": pipeline.stager,
        "SlabTier": SlabTier,
        "TensorStore": tsh.TensorStore,
        "_staging": _staging,
        "copies": pipeline.table.copies,
    }
    for owner_name, attr in re.findall(r"`(\w+)\.(\w+)`", doc):
        if owner_name in objects and attr != "py":
            assert hasattr(objects[owner_name], attr), f"{owner_name}.{attr}"
    intents = ("share", "wait_for_room", "add", "spill", "begin_write", "end_write")
    intents += ("write_finished", "claim_for_unpack", "free")
    for intent in intents:
        assert f"`{intent}`" in doc and callable(getattr(pipeline.table, intent)), intent
    hooks.close()


# "session" means a daemon session only (Glossary, docs/life-of-a-saved-tensor.md);
# what is behind one OffloadHooks is the pipeline. Skipped whole: the daemon's client
# (storage/daemon/) and wire format (protocol.py), and server/ where it is installed
# inside the package, since every session there is a daemon session; so is every
# name that says "daemon". Any other name with "session" in it is listed here, with
# why it is not the pipeline.
_SESSION_NAMES_ALLOWED = {
    ("storage/io/_fsspec.py", "session"): "aiobotocore.session, botocore's HTTP sessions",
    ("storage/io/_fsspec.py", "AioSession"): "the botocore session a process's S3 stores share",
    ("storage/io/_fsspec.py", "_AIO_SESSION"): "the same",
    ("storage/io/_fsspec.py", "_AIO_SESSION_LOCK"): "the same",
    ("storage/io/_fsspec.py", "_shared_aio_session"): "the same",
    ("cli/serve.py", "session_quota"): "the daemon's --session-quota",
    ("cli/stats.py", "sessions"): "the daemon's sessions, as its stats list them",
}


def test_session_means_a_daemon_session_only() -> None:
    import io
    import re
    import tokenize

    names = set()
    for p in sorted(PACKAGE.rglob("*.py")):
        rel = p.relative_to(PACKAGE).as_posix()
        if rel.startswith("server/") or rel == "protocol.py" or rel.startswith("storage/daemon/"):
            continue
        for tok in tokenize.generate_tokens(io.StringIO(p.read_text()).readline):
            word = tok.string.lower()
            if tok.type == tokenize.NAME and "session" in word and "daemon" not in word:
                names.add((rel, tok.string))
    assert names <= _SESSION_NAMES_ALLOWED.keys(), sorted(names - _SESSION_NAMES_ALLOWED.keys())
    # The words of the regression this guards against, in the library and its docs.
    texts = [p for p in PACKAGE.rglob("*.py") if "server" not in p.relative_to(PACKAGE).parts]
    texts += sorted((PACKAGE.parent / "docs").glob("*.md"))
    said = [str(p) for p in texts if re.search(r"offload\s+sessions?\b", p.read_text(), re.I)]
    assert not said, said

