"""The ``demo`` and ``inspect`` subcommands, run as a user runs them (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import tensorstore_hooks as tsh
from tensorstore_hooks.cli._demo_model import GPT, config_for, synthetic_batch


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tensorstore_hooks.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_demo_tiny_two_steps_gradients_identical(tmp_path: Path) -> None:
    trace = tmp_path / "timeline.json"
    proc = _cli(
        "demo", "--steps", "2", "--store", f"file://{tmp_path / 'store'}", "--trace", str(trace)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical" in proc.stdout
    for row in (
        "activation memory",
        "step time",
        "tensors offloaded",
        "prefetch hits",
        "fallbacks",
    ):
        assert row in proc.stdout
    assert "DIFFER" not in proc.stdout
    # Each run in a process of its own, and the demo says so (issue 38, item 3).
    assert "measured with each run in a process of its own" in proc.stdout
    assert "SHA-256 of each gradient's bytes" in proc.stdout
    # One measured round (round 1 is warm-up): medians, and no verdict from so little.
    assert "step time: 1 measured round: too few to conclude" in proc.stdout
    assert "memory://" not in proc.stdout  # the note is for memory stores only
    # Where the store is, and the full summary (every counter, adding up).
    assert f"store: file://{tmp_path / 'store'}" in proc.stdout
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("hooks (2 steps):"))
    for part in ("saved ", "offloaded ", "dedup ", "tail ", "written ", "read ", "peak held "):
        assert part in summary
    # The timeline of the offloaded steps, and the PNG docs/profiling.md shows, made from it.
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"forward", "backward", "tsh::pack", "tsh::write", "tsh::read"} <= names
    png = tmp_path / "timeline.png"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "plot_timeline.py"
    plot = subprocess.run(
        [sys.executable, str(script), str(trace), str(png)], capture_output=True, text=True
    )
    assert plot.returncode == 0, plot.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_on_memory_says_where_the_bytes_are() -> None:
    proc = _cli("demo", "--steps", "1", "--store", "memory://", "--same-process")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "note: memory:// holds the offloaded bytes in this process's RAM" in proc.stdout
    assert "measured with both runs in this process (--same-process)" in proc.stdout
    assert "identical (1 steps x" in proc.stdout and "torch.equal" in proc.stdout


def test_demo_verdicts_say_when_the_spread_is_too_wide() -> None:
    from tensorstore_hooks.cli.demo import Spread, verdict

    def ratio(r: float) -> str:
        return f"{r:.2f}x"

    words = ("faster", "slower")
    wide = Spread.of([0.48, 1.10, 0.95, 1.30])
    line = verdict("step time", wide, 4, ratio, words)
    assert "the rounds disagree (0.48x-1.30x of no offload over 4 rounds)" in line
    assert "too wide to conclude" in line
    slower = verdict("step time", Spread.of([1.02, 1.08, 1.05]), 3, ratio, words)
    assert slower == (
        "step time: slower with offloading in every round "
        "(1.02x-1.08x of no offload over 3 rounds)"
    )
    assert "faster with offloading in every round" in verdict(
        "step time", Spread.of([0.7, 0.8, 0.9]), 3, ratio, words
    )
    assert "too few to conclude" in verdict("step time", Spread.of([0.5, 0.6]), 2, ratio, words)
    assert Spread.of([3.0, 1.0, 2.0]).format(lambda x: f"{x:.0f} MiB") == "2 MiB (1-3 MiB)"
    assert Spread.of([1.0]).format(lambda x: f"{x:.0f} MiB") == "1 MiB"


def test_inspect_lists_tensors_without_writing(tmp_path: Path) -> None:
    root = tmp_path / "store"
    tensors = {
        "a": torch.zeros(3, 4),
        "b": torch.ones(1000, dtype=torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).view(2, 3).t(),
    }
    store = tsh.open_store(str(root))
    keys = {name: store.put(t) for name, t in tensors.items()}
    store.close()  # a named root keeps a namespace that still holds keys
    before = sorted(p.relative_to(root) for p in root.rglob("*"))

    proc = _cli("inspect", str(root))
    assert proc.returncode == 0, proc.stderr
    assert "float32" in proc.stdout and "(3, 4)" in proc.stdout
    assert "bfloat16" in proc.stdout and "(1000,)" in proc.stdout
    assert "int64" in proc.stdout and "(3, 2)" in proc.stdout
    assert "total: 1 namespace, 3 tensors" in proc.stdout

    listing = json.loads(_cli("inspect", f"file://{root}", "--json").stdout)
    [ns] = listing["namespaces"]
    by_key = {k["key"]: k for k in ns["keys"]}
    for name, t in tensors.items():
        entry = by_key[keys[name]]
        assert entry["dtype"] == str(t.dtype).removeprefix("torch.")
        assert entry["shape"] == list(t.shape)
        assert entry["nbytes"] == t.numel() * t.element_size()
    assert listing["totals"]["tensors"] == 3
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # read-only


def test_inspect_refuses_what_it_cannot_list(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    proc = _cli("inspect", str(missing))
    assert proc.returncode == 1
    assert "not a tensorstore-hooks store" in proc.stderr
    assert not missing.exists()  # inspecting never creates a store
    proc = _cli("inspect", "tsh://127.0.0.1:7077")
    assert proc.returncode == 1
    assert "tensorstore-hooks stats" in proc.stderr


def test_demo_model_is_deterministic() -> None:
    cfg = config_for("tiny", blocks=1, seq=16, batch=2)
    a, b = GPT(cfg, seed=3), GPT(cfg, seed=3)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    x1, y1 = synthetic_batch(cfg, 5)
    x2, y2 = synthetic_batch(cfg, 5)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next tokens
    assert torch.equal(a(x1, y1), b(x1, y1))
