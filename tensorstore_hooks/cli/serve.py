"""``tensorstore-hooks serve``: run the storage daemon until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorstore_hooks.server import ServerConfig

__all__ = ["add_arguments", "register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    parser = subparsers.add_parser(
        "serve", help="run the storage daemon (tsh:// stores)", description=DESCRIPTION
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


DESCRIPTION = (
    "Serve tensors to DaemonStore clients: a RAM tier up to --memory-quota, "
    "spilling the oldest tensors to a Zarr disk tier at --root up to --disk-quota. "
    "Prints one line 'listening on tsh://HOST:PORT' once it accepts connections, "
    "then serves until SIGTERM/SIGINT, drains and exits 0. Flags override --config. "
    "See docs/daemon.md."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The daemon's flags (shared with ``python -m tensorstore_hooks.server``)."""
    parser.add_argument("--config", metavar="FILE", help="YAML settings (configs/server.yaml)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="TCP address (default 127.0.0.1:7077; port 0 picks one)",
    )
    where.add_argument("--unix", metavar="PATH", help="listen on a Unix socket instead")
    parser.add_argument(
        "--root", metavar="URL", help="disk tier: file:///path or a path (default: none)"
    )
    parser.add_argument(
        "--memory-quota", metavar="SIZE", help='RAM tier size, e.g. "4GiB"; 0 = disk only'
    )
    parser.add_argument("--disk-quota", metavar="SIZE", help='disk tier size, e.g. "64GiB"')
    parser.add_argument(
        "--session-quota",
        metavar="SIZE",
        help="most one session may hold, RAM + disk (default: no cap beyond the tiers)",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="clients must present this token (required off loopback)",
    )
    parser.add_argument(
        "--lease",
        metavar="SECONDS",
        help="free a session's tensors after this long without traffic",
    )
    parser.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus text on /metrics")
    parser.add_argument(
        "--tls-cert", metavar="CERT.pem", help="serve TLS (tsh+tls://) with this certificate chain"
    )
    parser.add_argument("--tls-key", metavar="KEY.pem", help="private key of --tls-cert")
    parser.add_argument(
        "--tls-client-ca",
        metavar="CA.pem",
        help="refuse clients without a certificate signed by this CA (mutual TLS)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="validate the settings (and TLS files) and exit: 0 if valid, 2 if not",
    )
    parser.add_argument(
        "--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="daemon log level (INFO)"
    )


def _check(config: ServerConfig) -> int:
    """``serve --check``: what ``serve`` would refuse or warn about, without binding."""
    from tensorstore_hooks.server import check_config

    for warning in check_config(config):
        print(f"warning: {warning}", file=sys.stderr)
    where = config.unix or config.listen
    print(f"daemon config OK: would listen on {where}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Load the settings, start the daemon, print the listening line; exit 0 after a drain."""
    from tensorstore_hooks.cli import error_line
    from tensorstore_hooks.errors import ConfigError
    from tensorstore_hooks.server import load_config, serve

    try:
        config = load_config(
            args.config,
            listen=args.listen,
            unix=args.unix,
            root=args.root,
            memory_quota=args.memory_quota,
            disk_quota=args.disk_quota,
            session_quota=args.session_quota,
            token_file=args.token_file,
            lease=args.lease,
            metrics=args.metrics,
            log_level=args.log_level,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
        )
        if args.check:
            return _check(config)
    except ConfigError as e:
        print(error_line("tensorstore-hooks serve", e), file=sys.stderr)
        return 2
    server_log = logging.getLogger("tensorstore_hooks.server")
    level = logging.getLevelName(config.log_level.upper())
    if isinstance(level, int) and (server_log.getEffectiveLevel() > level or args.log_level):
        server_log.setLevel(level)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def ready(url: str) -> None:
        print(f"listening on {url}", flush=True)

    try:
        return serve(config, on_ready=ready)
    except ConfigError as e:
        print(error_line("tensorstore-hooks serve", e), file=sys.stderr)
        return 2
    except OSError as e:
        where = config.unix or config.listen
        print(f"tensorstore-hooks serve: cannot listen on {where}: {e}", file=sys.stderr)
        return 1
