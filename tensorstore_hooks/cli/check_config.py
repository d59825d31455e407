"""``tensorstore-hooks check-config FILE``: validate a config and print the effective one."""

from __future__ import annotations

import argparse
import sys

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``check-config`` subcommand."""
    parser = subparsers.add_parser(
        "check-config",
        help="validate a YAML config and print the effective config",
        description=(
            "Validate FILE against the config schema (docs/config.md) and print the "
            "effective config as YAML, defaults filled in and secrets in storage_options "
            "masked. Exit status 0 if valid; 1 with the error (file:line, field path, "
            "what is allowed) on stderr otherwise."
        ),
    )
    parser.add_argument("file", metavar="FILE", help="the YAML config file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Validate ``args.file``; print the effective config (exit 0) or the error (exit 1)."""
    from .._config import dump_config, load_config
    from ..errors import ConfigError

    try:
        config = load_config(args.file)
    except ConfigError as e:
        print(f"check-config: invalid config\n{e}", file=sys.stderr)
        return 1
    sys.stdout.write(dump_config(config, redact=True))
    return 0
