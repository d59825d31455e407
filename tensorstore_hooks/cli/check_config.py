"""``tensorstore-hooks check-config FILE``: validate a config and print the effective one."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorstore_hooks.config import EffectiveConfig

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``check-config`` subcommand."""
    parser = subparsers.add_parser(
        "check-config",
        help="validate a YAML config and print the effective config",
        description=(
            "Validate FILE against the config schema (docs/config.md) and print the "
            "effective config as YAML, defaults filled in and secrets in storage_options "
            "masked. Every store URL is checked as open_store would take it, and the "
            "packages its store needs must be importable (s3:// needs s3fs). Exit status "
            "0 if valid; 1 with the error (file:line, field path, what is allowed, what to "
            "install) on stderr otherwise."
        ),
    )
    parser.add_argument("file", metavar="FILE", help="the YAML config file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Validate ``args.file``; print the effective config (exit 0) or the error (exit 1)."""
    from tensorstore_hooks.config import dump_config, load_config
    from tensorstore_hooks.errors import ConfigError

    if _is_daemon_config(args.file):
        return _check_daemon(args.file)
    try:
        config = load_config(args.file)
    except ConfigError as e:
        print(f"check-config: invalid config\n{e}", file=sys.stderr)
        return 1
    missing = _missing_packages(config)
    if missing:
        print(f"check-config: {args.file}: the config is valid, but {missing}", file=sys.stderr)
        return 1
    sys.stdout.write(dump_config(config, redact=True))
    return 0


def _missing_packages(config: EffectiveConfig) -> str | None:
    """What a store URL of ``config`` needs and this Python lacks (``None``: nothing)."""
    from tensorstore_hooks.errors import ConfigError
    from tensorstore_hooks.storage import check_packages

    urls = [("store.url", config.store.url)] + [
        (f"store.tiers[{i}].url", tier.url) for i, tier in enumerate(config.store.tiers)
    ]
    for field, url in urls:
        if url is None:
            continue
        try:
            check_packages(url)
        except ConfigError as e:
            return f"{field} cannot be opened here: {e}"
    return None


def _is_daemon_config(path: str) -> bool:
    """True for a ``tensorstore-hooks serve`` config: daemon keys, no library sections."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False  # the library loader reports it with file and line
    if not isinstance(data, dict) or {"store", "pipeline", "policy"} & set(data):
        return False
    from tensorstore_hooks.server._config import DAEMON_KEYS

    return bool(DAEMON_KEYS & set(data))


def _check_daemon(path: str) -> int:
    from tensorstore_hooks.errors import ConfigError
    from tensorstore_hooks.server import check_config
    from tensorstore_hooks.server import load_config as load_daemon_config

    try:
        config = load_daemon_config(path)
        warnings = check_config(config)
    except ConfigError as e:
        print(f"check-config: invalid daemon config\n{e}", file=sys.stderr)
        return 1
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(
        f"{path}: a daemon config (for `tensorstore-hooks serve --config {path}`); valid, "
        f"would listen on {config.unix or config.listen}"
    )
    return 0
