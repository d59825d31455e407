"""A benchmark before and after a change, alternating, in one run.

Exports the tree of ``--base`` (a git revision: ``main``, a commit) into a temporary
directory and runs the same benchmark script of both trees in turn, ``--pairs``
times: base, this checkout, base, this checkout, ... Both run in this interpreter
(the same environment), each tree first on ``PYTHONPATH`` so its own
``tensorstore_hooks`` is the one imported (so not for benchmarks that start the
daemon: ``tensorstore_hooks.server`` comes from the installed package). Each run
writes its JSON under ``--out``; the summary prints each run's headline figures
side by side (train step: every mode's time and memory ratio to ``none``; store
I/O: ours/raw per size and the smallest size's put+get). Arguments after ``--`` go
to the benchmark script unchanged; ``--this-args`` adds arguments for this checkout's
runs only (a switch the base's script does not know, e.g. to compare like with like).

    python benchmarks/before_after.py --base main train_step -- --modes none,tsh-disk
    python benchmarks/before_after.py --base 64f0bc4 \
        --this-args="--tsh-store-option direct_io=off" train_step -- --modes none,tsh-disk
    python benchmarks/before_after.py --base main --pairs 5 store_io
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def export_tree(rev: str, into: Path) -> None:
    """The files of ``rev`` (``git archive``) under ``into``; nothing in the repo changes."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def run_one(tree: Path, script: str, extra: list[str], out: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    argv = [sys.executable, str(tree / "benchmarks" / f"{script}.py"), *extra, "--json", str(out)]
    log = out.with_suffix(".txt")
    with log.open("w") as f:
        subprocess.run(argv, env=env, cwd=tempfile.gettempdir(), stdout=f, stderr=f, check=True)
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def headline(script: str, data: dict[str, Any]) -> str:
    if script == "train_step":
        parts = []
        for mode, s in data["summary"].items():
            if mode != "none":
                grads = "" if s.get("grads_identical", True) else " GRADS DIFFER"
                parts.append(f"{mode} {s['time_ratio']:.2f}x time {s['mem_ratio']:.0%} mem{grads}")
        return f"none step {data['summary']['none']['step_s']:.2f}s; " + "; ".join(parts)
    if script == "store_io":
        rows = [_ours(r) for r in data["results"]]
        small = min(rows, key=lambda r: r[0])
        ratios = " ".join(f"{n >> 10}KiB {ratio:.2f}x" for n, ratio, _ in rows)
        return f"ours/raw {ratios}; {small[0] >> 10} KiB put+get {small[2] * 1e6:.0f} us"
    return json.dumps(data)[:200]


def _ours(result: dict[str, Any]) -> tuple[int, float, float]:
    """(bytes, ours/raw numpy, our put+get seconds) of one size of store_io's JSON: the
    first "ours" row where the result has rows (one per side), else the older flat form."""
    if "rows" not in result:
        return result["bytes"], result["throughput_ratio"], result["ours_put_get_s"]
    row = next(r for r in result["rows"] if r["side"].startswith("ours"))
    return result["bytes"], row["ratio_to_raw"], row["put_get_s"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="main", help="git revision to compare against (default main)")
    p.add_argument("--pairs", type=int, default=3, help="base/this runs, alternating (default 3)")
    p.add_argument("--out", default="bench-out/before-after", help="where the JSON files go")
    p.add_argument("script", help="benchmark: train_step, store_io, daemon_io, ...")
    p.add_argument("extra", nargs="*", help="arguments for the script (after --)")
    p.add_argument(
        "--this-args",
        default="",
        help="more arguments for this checkout's runs only (one string, split on spaces)",
    )
    args = p.parse_args(argv)
    if not (HERE / f"{args.script}.py").exists():
        p.error(f"no benchmark benchmarks/{args.script}.py")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    with tempfile.TemporaryDirectory(prefix="tsh-base-") as tmp:
        base = Path(tmp)
        export_tree(args.base, base)
        for i in range(1, args.pairs + 1):
            for name, tree in (("base", base), ("this", ROOT)):
                path = out / f"{args.script}-{name}-{i}.json"
                extra = args.extra + (args.this_args.split() if name == "this" else [])
                data = run_one(tree, args.script, extra, path)
                lines.append(f"{name:4} {i}: {headline(args.script, data)}")
                print(lines[-1], flush=True)
    print(f"\n{args.script}, base {args.base} vs this checkout, alternating:")
    print("\n".join(sorted(lines, key=lambda s: s[:4])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
