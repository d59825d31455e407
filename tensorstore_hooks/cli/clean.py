"""``tensorstore-hooks clean [ROOT] [--dry-run]``: remove what dead runs left behind.

A run killed with SIGKILL (or by the OOM killer) cannot close its store: its
namespace under a shared root, or its whole temporary store, stays on disk. This
removes the namespaces of dead processes on this host and their temporary roots
(NOTE [ Stale namespaces ] in ``tensorstore_hooks.storage.zarr._housekeeping``): only what the
library made (its own attributes, its lock, its temporary-root marker); a live
process's namespace, another program's files and symbolic links are never touched.
Each candidate's lock is taken before anything under it is read, measured or
removed, so what a live process holds is not even read.
It prints exactly what it removed, and what it had to leave and why. Stores also
sweep their root when they open.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``clean`` subcommand."""
    parser = subparsers.add_parser(
        "clean",
        help="remove namespaces and temporary stores of dead processes on this host",
        description=(
            "Remove the store namespaces (ROOT/[rN-]HOST-PID-RANDOM, made by "
            "tensorstore-hooks: its attributes in zarr.json and its lock file) of "
            "processes that no longer run on this host, and temporary stores "
            "(ROOT/tensorstore-hooks-*, with the library's marker) holding only such "
            "namespaces. Nothing else is removed, and symbolic links are never followed. "
            "ROOT: a local store root (a path or file:// URL); default: where temporary "
            "stores go ($TSH_TMPDIR, else the system's temporary directory)."
        ),
    )
    parser.add_argument("root", nargs="?", metavar="ROOT", help="local store root")
    parser.add_argument(
        "--dry-run", action="store_true", help="list what would be removed, remove nothing"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """List (and unless ``--dry-run`` remove) stale namespaces; 2 if ROOT is not a
    directory, 1 if something stale could not be removed."""
    from tensorstore_hooks._units import format_bytes
    from tensorstore_hooks.storage.zarr import Stale, find_stale, remove_stale, temp_parent

    root = args.root or temp_parent()
    if root.startswith("file://"):
        root = root[len("file://") :]
    elif "://" in root:
        print(f"clean: ROOT must be a local directory or file:// URL: {root!r}", file=sys.stderr)
        return 2
    if not os.path.isdir(root):
        print(f"clean: {root!r} is not a directory", file=sys.stderr)
        return 2
    found = find_stale(root)  # each measured holding its locks, like its removal
    sizes = {item.path: item.nbytes for item in found}
    if args.dry_run:
        done: list[tuple[Stale, str | None]] = [(item, None) for item in found]
        verb = "would remove"
    else:
        done = [(r.item, r.error) for r in remove_stale(found)]
        verb = "removed"
    removed = [item for item, error in done if error is None]
    for item in removed:
        size = format_bytes(sizes[item.path])
        print(f"{verb} {item.kind} {item.path} (pid {item.pid}, {size})")
    for item, error in done:
        if error is not None:
            print(f"clean: left {item.kind} {item.path}: {error}", file=sys.stderr)
    total = format_bytes(sum(sizes[item.path] for item in removed))
    print(f"{verb} {len(removed)} stale item(s), {total} under {root}")
    return 1 if len(removed) != len(done) else 0

