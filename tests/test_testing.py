"""``tensorstore_hooks.testing``: the conformance suites shipped for users' stores.

A user's own store (a dict, written here the way a user would write it) passes the
store suite; stores with one deliberate bug each fail it, in the tests that name
the bug (run by pytest in a subprocess, as a user's test module). The package stays
out of ``import tensorstore_hooks`` and reaches the library only through its
public, package-level API.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tensorstore_hooks
from tensorstore_hooks import (
    KeyNotFoundError,
    StoreClosedError,
    TensorStore,
    UnsupportedTensorError,
)
from tensorstore_hooks._codec import DTYPES
from tensorstore_hooks.testing import CLOSES_THE_STORE, StoreConformance
from tensorstore_hooks.testing import __all__ as testing_all

# torch's own warn-once on allocating a complex32 tensor (DictStore's copies do).
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")

REPO = Path(__file__).resolve().parents[1]
TESTING = Path(tensorstore_hooks.__file__).parent / "testing"


# ---------------------------------------------------------------- a user's store
class DictStore(TensorStore):
    """A user's minimal store: each tensor's storage span, copied into a dict.

    Declares no capability: every one keeps the ABC's default.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, tuple[torch.Tensor, torch.Size, tuple[int, ...], bool]] = {}
        self._next = 0
        self.closed = False

    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosedError("DictStore is closed; make a new one")

    def put(self, tensor: torch.Tensor) -> str:
        if (
            type(tensor) is not torch.Tensor
            or tensor.layout is not torch.strided
            or tensor.is_quantized
            or tensor.is_nested
            or tensor.is_meta
        ):
            raise UnsupportedTensorError(f"DictStore: cannot store a {type(tensor).__name__}")
        t = tensor.detach()
        # The storage the view covers, first element to last: strides survive the copy.
        reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        span = 0 if t.numel() == 0 else 1 + reach
        copy = t.as_strided((span,), (1,), t.storage_offset()).clone()
        with self._lock:
            self._check_open()
            key = f"k{self._next}"
            self._next += 1
            self._data[key] = (copy, t.shape, t.stride(), tensor.requires_grad)
        return key

    def get(self, key: str, *, device: torch.device | str | None = None) -> torch.Tensor:
        with self._lock:
            self._check_open()
            if key not in self._data:
                raise KeyNotFoundError(f"DictStore: no key {key!r}")
            copy, shape, stride, requires_grad = self._data[key]
        out = copy.clone().as_strided(shape, stride, 0)
        if device is not None:
            out = out.to(device)
        return out.requires_grad_(requires_grad)

    def delete(self, key: str) -> None:
        with self._lock:
            if self._data.pop(key, None) is None:
                raise KeyNotFoundError(f"DictStore: no key {key!r}")

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._data))

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(copy.nbytes for copy, *_ in self._data.values())

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._data.clear()


class TestDictStore(StoreConformance):
    """The shipped suite on the user's store; the fixture also checks that exactly the
    tests named in ``CLOSES_THE_STORE`` close it."""

    large_nbytes = 1 << 20

    @pytest.fixture
    def store(self, request: pytest.FixtureRequest) -> Iterator[TensorStore]:
        s = DictStore()
        yield s
        assert s.closed == (request.node.originalname in CLOSES_THE_STORE)
        s.close()


def test_capabilities_are_off_for_a_minimal_subclass() -> None:
    s = DictStore()
    key = s.put(torch.ones(3))
    assert s.temporary is False
    assert s.direct_io is None
    assert s.moves_direct(key) is None
    assert s.buffer_pool_bytes is None
    s.set_buffer_pool_bytes(1 << 20)
    assert s.buffer_pool_bytes is None
    s.flush()
    assert torch.equal(s.get(key), torch.ones(3))
    s.close()


# ------------------------------------------------------- broken stores, as a user
_USER_MODULE = '''
"""A user's test module: the shipped suite on a good store and on broken ones."""
import pytest
import torch

from tensorstore_hooks import KeyNotFoundError
from tensorstore_hooks.storage.io import DirectIOStatus
from tensorstore_hooks.testing import StoreConformance
from tests.test_testing import DictStore


class UpcastsBfloat16(DictStore):
    def get(self, key, *, device=None):
        t = super().get(key, device=device)
        return t.float() if t.dtype == torch.bfloat16 else t


class DeleteKeepsTheKey(DictStore):
    def delete(self, key):
        if key not in self:
            raise KeyNotFoundError(key)


class FlushRaises(DictStore):
    def flush(self):
        raise OSError("flush: the medium is gone")


class MovesDirectSaysYes(DictStore):
    def moves_direct(self, key):
        return "yes"


class PoolIgnoresItsSize(DictStore):
    @property
    def buffer_pool_bytes(self):
        return 1 << 30


class OffWithoutAReason(DictStore):
    @property
    def direct_io(self):
        return DirectIOStatus(False, "auto", "")


def _fixture(cls):
    @pytest.fixture
    def store(self):
        s = cls()
        yield s
        s.close()

    return store


class TestGood(StoreConformance):
    store = _fixture(DictStore)


class TestUpcastsBfloat16(StoreConformance):
    store = _fixture(UpcastsBfloat16)


class TestDeleteKeepsTheKey(StoreConformance):
    store = _fixture(DeleteKeepsTheKey)


class TestFlushRaises(StoreConformance):
    store = _fixture(FlushRaises)


class TestMovesDirectSaysYes(StoreConformance):
    store = _fixture(MovesDirectSaysYes)


class TestPoolIgnoresItsSize(StoreConformance):
    store = _fixture(PoolIgnoresItsSize)


class TestOffWithoutAReason(StoreConformance):
    store = _fixture(OffWithoutAReason)
'''

# Broken class -> tests that must fail (others may fail too: a lost delete breaks the
# inventory and more) and one that must still pass (the bug is not everywhere).
_EXPECTED = {
    "TestUpcastsBfloat16": (
        {
            "test_round_trip_every_dtype[bfloat16]",
            "test_round_trip_layouts[contiguous-torch.bfloat16]",
            "test_requires_grad_preserved[torch.bfloat16]",
        },
        "test_round_trip_every_dtype[float32]",
    ),
    "TestDeleteKeepsTheKey": (
        {"test_inventory", "test_deleted_key_is_missing", "test_delete_many_ignores_missing"},
        "test_missing_key",
    ),
    "TestFlushRaises": ({"test_flush_keeps_every_key_readable"}, "test_inventory"),
    "TestMovesDirectSaysYes": ({"test_moves_direct_answers_for_a_stored_key"}, "test_inventory"),
    "TestPoolIgnoresItsSize": ({"test_buffer_pool_stays_within_its_size"}, "test_inventory"),
    "TestOffWithoutAReason": ({"test_direct_io_status"}, "test_inventory"),
}


@pytest.fixture(scope="module")
def user_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict[str, str]], str]:
    """Runs ``_USER_MODULE`` with pytest in a fresh process, outside this repository's
    configuration; returns {class: {test: outcome}} and pytest's output."""
    root = tmp_path_factory.mktemp("user")
    (root / "test_user_store.py").write_text(textwrap.dedent(_USER_MODULE))
    (root / "pytest.ini").write_text(
        "[pytest]\nfilterwarnings =\n    ignore:ComplexHalf support is experimental:UserWarning\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(root / "pytest.ini"),
            "--rootdir",
            str(root),
            "--junitxml",
            str(root / "report.xml"),
            "test_user_store.py",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # 1: some tests failed
    outcomes: dict[str, dict[str, str]] = {}
    for case in ET.parse(root / "report.xml").iter("testcase"):
        cls = case.attrib["classname"].rsplit(".", 1)[-1]
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes.setdefault(cls, {})[case.attrib["name"]] = kinds[0] if kinds else "passed"
    return outcomes, proc.stdout


def test_a_users_store_passes_in_a_users_module(
    user_run: tuple[dict[str, dict[str, str]], str],
) -> None:
    outcomes, output = user_run
    good = outcomes["TestGood"]
    assert len(good) > 100
    assert set(good.values()) == {"passed"}, output
    assert set(outcomes) == {"TestGood", *_EXPECTED}
    assert all(len(tests) == len(good) for tests in outcomes.values())


@pytest.mark.parametrize("cls", list(_EXPECTED))
def test_a_broken_store_fails(user_run: tuple[dict[str, dict[str, str]], str], cls: str) -> None:
    outcomes, output = user_run
    must_fail, still_passes = _EXPECTED[cls]
    got = outcomes[cls]
    assert {name for name in must_fail if got[name] != "failure"} == set(), output
    assert got[still_passes] == "passed", output
    assert f"FAILED test_user_store.py::{cls}::" in output


def test_failures_explain_themselves(user_run: tuple[dict[str, dict[str, str]], str]) -> None:
    """The suite's asserts are rewritten by pytest, so a failure shows the values."""
    _, output = user_run
    assert "assert torch.float32 == torch.bfloat16" in output, output


# --------------------------------------------------------------- the package
def test_import_tensorstore_hooks_leaves_testing_out() -> None:
    code = (
        "import sys, tensorstore_hooks\n"
        "print(sorted(m for m in sys.modules if m.startswith('tensorstore_hooks.testing')"
        " or m.split('.')[0] in ('pytest', '_pytest', 'hypothesis')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert out.stdout.strip() == "[]"


def _imported_modules(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: a relative import"
            assert node.module is not None
            yield node.module


@pytest.mark.parametrize("path", sorted(TESTING.glob("*.py")), ids=lambda p: p.name)
def test_testing_imports_only_the_public_api(path: Path) -> None:
    """Below itself, the package reaches ``tensorstore_hooks`` and its packages only
    (never a private module), and never this repository's ``tests``."""
    for module in _imported_modules(path):
        parts = module.split(".")
        assert parts[0] != "tests", f"{path.name} imports {module}"
        if parts[0] != "tensorstore_hooks" or parts[:2] == ["tensorstore_hooks", "testing"]:
            continue
        assert not any(p.startswith("_") for p in parts), f"{path.name} imports {module}"


def test_exports() -> None:
    import tensorstore_hooks.testing as testing

    assert sorted(testing_all) == sorted(set(testing_all))
    for name in testing_all:
        obj = getattr(testing, name)
        assert not callable(obj) or obj.__doc__, f"{name} has no docstring"


def test_the_suite_promises_every_dtype_the_codec_has() -> None:
    """The suite's dtype list is written from the contract; it matches the codec's."""
    from tensorstore_hooks.testing import ALL_DTYPES

    assert sorted(DTYPES) == ALL_DTYPES
