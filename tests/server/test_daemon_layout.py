"""The daemon's code shape: no import cycle in ``server/`` and no import of a library
package the daemon may not use (type-only imports and imports inside functions
included), NOTEs that state rules rather than cite history."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"
LIBRARY_ALLOWED = (
    "tensorstore_hooks.storage",
    "tensorstore_hooks.config",
    "tensorstore_hooks._codec",
    "tensorstore_hooks.protocol",
    "tensorstore_hooks._units",
    "tensorstore_hooks.errors",
)
"""What the daemon may import of the library (and their submodules)."""


def _server_imports(path: Path) -> set[str]:
    """The ``server`` modules ``path`` imports, wherever the import statement is."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level == 1:  # from ._x import y / from . import _x
                if mod:
                    out.add(mod.split(".")[0])
                else:
                    out.update(a.name for a in node.names)
            elif mod.startswith("tensorstore_hooks.server."):
                out.add(mod.split(".")[2])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tensorstore_hooks.server."):
                    out.add(a.name.split(".")[2])
    return out


def _graph() -> dict[str, set[str]]:
    modules = {p.stem: p for p in SERVER.glob("*.py")}
    return {name: _server_imports(path) & set(modules) - {name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (found := visit(m)) is not None:
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)) is not None:
            return found
    return None


def test_server_imports_have_no_cycle() -> None:
    graph = _graph()
    assert len(graph) > 10 and graph["_app"], graph  # the parser sees the imports
    cycle = _cycle(graph)
    assert cycle is None, "import cycle in server/: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_type_only_cycle(tmp_path: Path) -> None:
    # The check would catch the cycles the daemon once had: a TYPE_CHECKING import of
    # the module that imports you, or an import inside a function.
    a = tmp_path / "a.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._b import B\n")
    b = tmp_path / "b.py"
    b.write_text("def f():\n    from ._a import A\n")
    assert _server_imports(a) == {"_b"} and _server_imports(b) == {"_a"}
    assert _cycle({"_a": {"_b"}, "_b": {"_a"}}) == ["_a", "_b", "_a"]


def _library_imports(path: Path) -> set[str]:
    """The ``tensorstore_hooks`` modules outside the daemon that ``path`` imports."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(
            n
            for n in names
            if n.split(".")[0] == "tensorstore_hooks"
            and not n.startswith("tensorstore_hooks.server")
        )
    return out


def test_server_imports_only_the_library_parts_it_may() -> None:
    used = {path.name: _library_imports(path) for path in SERVER.glob("*.py")}
    assert used["_disk.py"], used  # the parser sees the imports
    bad = sorted(
        f"{name}: {mod}"
        for name, mods in used.items()
        for mod in mods
        if not any(mod == a or mod.startswith(a + ".") for a in LIBRARY_ALLOWED)
    )
    assert not bad, bad


def test_library_import_finder_sees_lazy_and_type_only_imports(tmp_path: Path) -> None:
    a = tmp_path / "a.py"
    a.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from tensorstore_hooks.pipeline import Pipeline\n"
        "def f():\n    import tensorstore_hooks.cli.serve\n"
        "from tensorstore_hooks.server._app import serve\nfrom ._wire import Head\n"
    )
    assert _library_imports(a) == {"tensorstore_hooks.pipeline", "tensorstore_hooks.cli.serve"}


def test_notes_state_rules_not_history() -> None:
    history = re.compile(r"\b(issue|finding)s? \d+", re.IGNORECASE)
    hits = [
        f"{path.name}:{i}: {line.strip()}"
        for path in SERVER.glob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if history.search(line)
    ]
    assert not hits, hits
