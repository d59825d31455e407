"""The code's shape, checked (docs/architecture.md): layers whose imports point down
only, a daemon that imports only what the design lets it, functions a reader can hold
in their head, types the project owns named rather than ``Any``, and docs that name the
modules a saved tensor really runs through."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tensorstore_hooks

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(tensorstore_hooks.__file__).resolve().parent


def _server_dir() -> Path:
    spec = importlib.util.find_spec("tensorstore_hooks.server")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).resolve().parent


def _sources(*roots: Path) -> list[Path]:
    # A set: installed without the source tree, server/ lies inside the package.
    return sorted({p for root in roots for p in root.rglob("*.py")})


# ------------------------------------------------------------------ the layers
_LINT = (
    "import sys; from importlinter.cli import lint_imports; "
    "sys.exit(lint_imports(no_cache=True))"
)


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter over the package found first on ``root`` (its pyproject's contracts)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", _LINT],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_layers_contract_is_kept() -> None:
    done = _lint_imports(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 2 kept, 0 broken." in done.stdout, done.stdout


_UPWARD = {
    "module level": "from tensorstore_hooks.hooks import offload\n",
    "inside a function": "def _late():\n    from tensorstore_hooks.pipeline import Router\n",
    "type checking only": (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from tensorstore_hooks.config import Policy\n"
    ),
}


@pytest.mark.parametrize("how", sorted(_UPWARD))
def test_an_import_that_points_up_breaks_the_contract(tmp_path: Path, how: str) -> None:
    """The contract is not vacuous: the same check over a copy of the package with
    one upward import in ``storage/_urls.py`` fails and names it, however the import
    is written."""
    shutil.copytree(PACKAGE, tmp_path / "tensorstore_hooks", ignore=_no_bytecode)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    urls = tmp_path / "tensorstore_hooks" / "storage" / "_urls.py"
    urls.write_text(urls.read_text() + "\n" + _UPWARD[how])
    done = _lint_imports(tmp_path)
    assert done.returncode != 0, done.stdout
    assert "Layers: an import never points up BROKEN" in done.stdout, done.stdout
    assert "tensorstore_hooks.storage._urls -> tensorstore_hooks." in done.stdout, done.stdout


def test_storage_keeps_its_own_layers(tmp_path: Path) -> None:
    """Inside storage: the store API never reaches up into a backend."""
    shutil.copytree(PACKAGE, tmp_path / "tensorstore_hooks", ignore=_no_bytecode)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    store = tmp_path / "tensorstore_hooks" / "storage" / "_store.py"
    store.write_text(store.read_text() + "\ndef _late():\n    from . import zarr\n")
    done = _lint_imports(tmp_path)
    assert done.returncode != 0, done.stdout
    assert "Storage: the registry above the backends" in done.stdout
    assert "BROKEN" in done.stdout and "tensorstore_hooks.storage._store" in done.stdout


def _no_bytecode(_dir: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__"]


def _imports(path: Path, package: str) -> list[tuple[int, str, bool]]:
    """(line, absolute module, lazy) of every ``tensorstore_hooks`` import in ``path``,
    wherever the statement is; lazy: it does not run when ``path`` is imported (inside a
    function body, or under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    deferred = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        or (isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"))
    ]
    lazy_lines = {
        node.lineno
        for block in deferred
        for node in ast.walk(block)
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    is_pkg = path.name == "__init__.py"
    base = package.split(".") if is_pkg else package.split(".")[:-1]
    found: list[tuple[int, str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[: len(base) - node.level + 1]
                target = ".".join(prefix + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [
            (node.lineno, n, node.lineno in lazy_lines)
            for n in names
            if n == "tensorstore_hooks" or n.startswith("tensorstore_hooks.")
        ]
    return found


# The daemon imports the stores, the config loader, the codec, the wire format, units
# and errors (DESIGN.md, "Layers"), and itself.
_SERVER_MAY_IMPORT = (
    "tensorstore_hooks.server",
    "tensorstore_hooks.storage",
    "tensorstore_hooks.config",
    "tensorstore_hooks._codec",
    "tensorstore_hooks.protocol",
    "tensorstore_hooks._units",
    "tensorstore_hooks.errors",
)


def test_the_daemon_imports_only_what_the_design_allows() -> None:
    """Every module of the daemon, lazy and type-only imports included. Its
    ``__main__.py`` is exempt: a script for ``python -m tensorstore_hooks.server`` that
    runs the CLI's ``serve`` command; nothing imports it."""
    server = _server_dir()
    bad = []
    for path in _sources(server):
        if path.name == "__main__.py":
            continue
        module = "tensorstore_hooks.server." + path.relative_to(server).with_suffix("").as_posix()
        for line, target, _lazy in _imports(path, module.replace("/", ".")):
            if not any(target == m or target.startswith(m + ".") for m in _SERVER_MAY_IMPORT):
                bad.append(f"{path.name}:{line}: {target}")
    assert not bad, bad


def test_the_library_imports_the_daemon_only_lazily_from_the_cli() -> None:
    """``tensorstore-hooks serve`` imports the daemon when it runs (or for the type
    checker); nothing else does."""
    bad = []
    for path in _sources(PACKAGE):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "server":  # installed without the source tree
            continue
        module = "tensorstore_hooks." + rel.with_suffix("").as_posix().replace("/", ".")
        for line, target, lazy in _imports(path, module):
            if target.startswith("tensorstore_hooks.server") and not (
                rel.parts[0] == "cli" and lazy
            ):
                bad.append(f"{rel}:{line}: {target}{'' if lazy else ' (at import)'}")
    assert not bad, bad


def test_at_most_ten_modules_beside_the_subpackages() -> None:
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 10, modules


def test_the_module_map_names_every_subpackage() -> None:
    doc = tensorstore_hooks.__doc__ or ""
    packages = sorted(
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file() and p.name != "server"
    )
    assert len(packages) >= 10, packages
    missing = [name for name in packages if f"``{name}/``" not in doc]
    assert not missing, f"tensorstore_hooks/__init__.py's module map omits {missing}"


# ------------------------------------------------------------ functions and types
MAX_FUNCTION_LINES = 80
# Functions allowed past MAX_FUNCTION_LINES, each with why it reads better whole.
_LONG_FUNCTIONS: dict[str, str] = {}


def test_no_function_is_over_80_lines() -> None:
    long = []
    for path in _sources(PACKAGE, _server_dir()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                name = f"{path.relative_to(path.parents[1]).as_posix()}:{node.name}"
                if lines > MAX_FUNCTION_LINES and name not in _LONG_FUNCTIONS:
                    long.append(f"{name} ({lines} lines)")
    assert not long, long


MAX_EXPLICIT_ANY = 150


def _explicit_any(path: Path) -> int:
    tree = ast.parse(path.read_text())
    return sum(
        1
        for node in ast.walk(tree)
        if (isinstance(node, ast.Name) and node.id == "Any")
        or (isinstance(node, ast.Attribute) and node.attr == "Any")
    )


def test_explicit_any_stays_within_its_budget() -> None:
    """The project's own types are named (STYLE.md): ``Any`` is for what is truly
    foreign or untyped. Imports of ``Any`` count too."""
    counts = {p: _explicit_any(p) for p in _sources(PACKAGE, _server_dir())}
    total = sum(counts.values())
    worst = sorted(((n, str(p)) for p, n in counts.items() if n), reverse=True)[:8]
    assert total <= MAX_EXPLICIT_ANY, f"{total} explicit Any; most in {worst}"


# ------------------------------------------------------ the life of a saved tensor
_TRACE = textwrap.dedent(
    """
    import gc, json, os, sys, threading
    import torch
    import tensorstore_hooks as tsh

    root = os.path.dirname(os.path.abspath(tsh.__file__))
    seen = set()

    def prof(frame, event, arg):
        if event == "call":
            name = os.path.abspath(frame.f_code.co_filename)
            if name.startswith(root + os.sep):
                seen.add(os.path.relpath(name, root))

    # Profile every thread, the I/O threads included (they start with the first step).
    sys.setprofile(prof)
    threading.setprofile(prof)
    x = torch.randn(256, 1024, requires_grad=True)  # 1 MiB, offloaded
    hooks = tsh.offload(sys.argv[1], min_bytes=0)
    for step in range(2):
        seen.clear()  # the second step: the steady state, nothing first-time
        with hooks:
            y = x.sin().sum()
        hooks.flush()
        y.backward()
        del y
        gc.collect()
        hooks.flush()
    sys.setprofile(None)
    threading.setprofile(None)
    stats = hooks.stats
    hooks.close()
    print(json.dumps({"files": sorted(seen), "read": stats.bytes_read}))
    """
)


def _documented_modules(doc: str) -> tuple[list[str], list[str]]:
    """The files of the guide's "The path" table, and of its "Every module" list."""
    path_part = doc.split("## The path", 1)[1].split("\n## ", 1)[0]
    every_part = doc.split("## Every module", 1)[1].split("\n## ", 1)[0]
    pattern = re.compile(r"`((?:[a-z]+/)*_?[a-z_]+\.py)`")

    def files(part: str) -> list[str]:
        return sorted({f for f in pattern.findall(part) if not f.startswith("tests/")})

    return files(path_part), files(every_part)


def test_life_of_a_saved_tensor_names_every_module_it_runs(tmp_path: Path) -> None:
    """docs/life-of-a-saved-tensor.md reads in at most 12 files, and its list of every
    module names exactly those a stored CPU tensor runs through in a steady-state step
    (pack, write, prefetch, unpack, free), by package."""
    done = subprocess.run(
        [sys.executable, "-c", _TRACE, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    assert result["read"] > 0, "the tensor was not read back from the store"
    ran = sorted(f for f in result["files"] if not f.startswith("server"))
    doc = (REPO / "docs" / "life-of-a-saved-tensor.md").read_text()
    path, every = _documented_modules(doc)
    assert 0 < len(path) <= 12, path
    assert set(path) <= set(every), sorted(set(path) - set(every))
    assert every == ran, (
        f"documented but not run: {sorted(set(every) - set(ran))}; "
        f"run but not documented: {sorted(set(ran) - set(every))}"
    )
