"""``tensorstore-hooks clean [ROOT] [--dry-run]``: remove what dead runs left behind.

A run killed with SIGKILL (or by the OOM killer) cannot close its store: its
namespace under a shared root, or its whole temporary store, stays on disk. This
removes the namespaces of dead processes on this host and their temporary roots
(NOTE [ Stale namespaces ] in ``tensorstore_hooks._housekeeping``); a live
process's namespace is never touched. Stores also sweep their root when they open.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``clean`` subcommand."""
    parser = subparsers.add_parser(
        "clean",
        help="remove namespaces and temporary stores of dead processes on this host",
        description=(
            "Remove the store namespaces (ROOT/[rN-]HOST-PID-RANDOM) of processes that no "
            "longer run on this host, and temporary stores (ROOT/tensorstore-hooks-*) "
            "holding only such namespaces. ROOT: a local store root (a path or file:// "
            "URL); default: where temporary stores go ($TSH_TMPDIR, else the system's "
            "temporary directory)."
        ),
    )
    parser.add_argument("root", nargs="?", metavar="ROOT", help="local store root")
    parser.add_argument(
        "--dry-run", action="store_true", help="list what would be removed, remove nothing"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """List (and unless ``--dry-run`` remove) stale namespaces; 2 if ROOT is not a directory."""
    from .._housekeeping import find_stale, remove, temp_parent
    from .._units import format_bytes

    root = args.root or temp_parent()
    if root.startswith("file://"):
        root = root[len("file://") :]
    elif "://" in root:
        print(f"clean: ROOT must be a local directory or file:// URL: {root!r}", file=sys.stderr)
        return 2
    if not os.path.isdir(root):
        print(f"clean: {root!r} is not a directory", file=sys.stderr)
        return 2
    found = find_stale(root)
    sizes = [_tree_bytes(item.path) for item in found]
    if not args.dry_run:
        remove(found)
    verb = "would remove" if args.dry_run else "removed"
    for item, nbytes in zip(found, sizes, strict=True):
        print(f"{verb} {item.kind} {item.path} (pid {item.pid}, {format_bytes(nbytes)})")
    print(f"{verb} {len(found)} stale item(s), {format_bytes(sum(sizes))} under {root}")
    return 0


def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
