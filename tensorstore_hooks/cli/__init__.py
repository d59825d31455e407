"""The ``tensorstore-hooks`` command line.

Each subcommand lives in its own module here, imported only when the CLI starts, and
defines ``register(subparsers)`` (adds its parser, sets ``func=run``) and
``run(args) -> int`` (the exit code). Heavy imports (torch, the daemon) happen inside
``run`` so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

__all__ = ["error_line", "main"]

_SUBCOMMANDS = ("demo", "plan", "inspect", "check_config", "serve", "stats", "clean")


def error_line(prefix: str, message: object) -> str:
    """``PREFIX: message`` on one line, without repeating a prefix the message has.

    Library errors name their component (``inspect: ...``, ``stats: ...``); the CLI
    adds the command's own prefix, which would otherwise read ``inspect: inspect:``.
    """
    text = " ".join(str(message).split())
    command = prefix.removeprefix("tensorstore-hooks").strip()
    known = [f"{prefix}: ", "tensorstore-hooks: "]
    if command:
        known += [f"tensorstore-hooks {command}: ", f"{command}: "]
    stripped = True
    while stripped:
        stripped = False
        for p in known:
            if text.startswith(p):
                text, stripped = text[len(p) :], True
    return f"{prefix}: {text}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tensorstore-hooks",
        description="Offload the tensors PyTorch autograd saves for backward into a Zarr store.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _SUBCOMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from tensorstore_hooks.errors import TensorStoreError

        if isinstance(e, TensorStoreError):
            print(error_line(f"tensorstore-hooks {args.command}", e), file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
