"""``tensorstore-hooks stats tsh://...``: a running daemon's sessions, tiers and rates."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["format_stats", "register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``stats`` subcommand."""
    parser = subparsers.add_parser(
        "stats",
        help="show a running daemon's sessions, tiers, quotas and request rates",
        description=(
            "Ask a daemon for its statistics over an observer connection (no session is "
            "opened) and print them as a table, or as JSON with --json. The token comes "
            "from --token-file or the TSH_TOKEN environment variable."
        ),
    )
    parser.add_argument(
        "url", metavar="URL", help="tsh://HOST:PORT, tsh+tls://HOST:PORT or tsh+unix:///path"
    )
    parser.add_argument("--token-file", metavar="FILE", help="file holding the daemon's token")
    parser.add_argument("--json", action="store_true", help="print the raw statistics as JSON")
    parser.add_argument("--tls-ca", metavar="CA.pem", help="tsh+tls://: CA of the daemon's cert")
    parser.add_argument("--tls-cert", metavar="CERT.pem", help="tsh+tls://: client certificate")
    parser.add_argument("--tls-key", metavar="KEY.pem", help="tsh+tls://: client key")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS")
    parser.set_defaults(func=run)


def _duration(s: float) -> str:
    s = float(s)
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
    return out


def _buffer_lines(snap: dict[str, Any]) -> list[str]:
    """The daemon's named budgets (what it holds for clients beyond the tiers)."""
    from tensorstore_hooks._units import format_bytes as fb

    lines = []
    buffers = snap.get("buffers") or {}
    put, get = buffers.get("put"), buffers.get("get")
    if put and get:
        lines.append(
            f"buffers      put {fb(put['used'])} of {fb(put['limit'])}   "
            f"get {fb(get['used'])} of {fb(get['limit'])} "
            f"({fb(get['session_limit'])} per session, {get['waits']} waits)"
        )
    book, pool = buffers.get("bookkeeping"), buffers.get("store_pool")
    if book and pool:
        answers = snap["tiers"]["ram"].get("answers", 0)
        lines.append(
            f"             disk bookkeeping {fb(book['used'])} of {fb(book['limit'])}   "
            f"read buffers {fb(pool['used'])} (idle {fb(pool['idle'])} of "
            f"{fb(pool['idle_limit'])})   RAM held by answers {fb(answers)}"
        )
    return lines


def format_stats(snap: dict[str, Any]) -> str:
    """Render a STATS snapshot as the human-readable report ``stats`` prints."""
    from tensorstore_hooks._units import format_bytes as fb

    lines = [
        f"daemon {snap.get('url', '?')}  (tensorstore-hooks {snap.get('server', '?')}, "
        f"pid {snap.get('pid', '?')})  up {_duration(snap.get('uptime_s', 0))}  "
        f"lease {snap.get('lease_s', 0):g}s",
        "",
    ]
    tiers = snap["tiers"]
    rows = [["tier", "tensors", "used", "reserved", "quota", "use"]]
    for name in ("ram", "disk"):
        t = tiers[name]
        if name == "disk" and not t.get("enabled"):
            rows.append(["disk", "-", "-", "-", "none", "-"])
            continue
        quota = t["quota"]
        use = f"{100 * (t['used'] + t['reserved']) / quota:.1f}%" if quota else "-"
        rows.append([name, str(t["tensors"]), fb(t["used"]), fb(t["reserved"]), fb(quota), use])
    lines += _table(rows, right={1, 2, 3, 4, 5})
    c = snap["counters"]
    lines += [
        "",
        f"spills {c['spills']} ({fb(c['spill_bytes'])})   quota rejections {c['quota_rejected']}   "
        f"sessions expired {c['sessions_expired']} ({fb(c['expired_bytes'])})   "
        f"errors {c['errors']}",
        f"connections {snap['connections']} of {snap['max_connections']} "
        f"(accepted {c['connections']}, refused {c['refused']})",
    ]
    lines += _buffer_lines(snap)
    disk = tiers["disk"]
    if disk.get("enabled") and "direct_io" in disk:
        how = "on" if disk["direct_io"] else f"off ({disk.get('direct_io_reason', '?')})"
        lines.append(
            f"disk I/O     O_DIRECT {how}: {fb(c.get('disk_direct_bytes', 0))} direct, "
            f"{fb(c.get('disk_buffered_bytes', 0))} buffered"
        )
    if disk.get("enabled") and disk.get("writable") is False:
        lines.append(
            f"disk tier    takes no writes now ({c.get('disk_write_failures', 0)} failed "
            "writes; the daemon's log says why)"
        )
    rates = snap.get("rates") or {}
    ops = ("put", "get", "delete", "list", "ping", "stats")
    lines.append("requests/s   " + "  ".join(f"{op} {rates.get(op, 0.0):.1f}" for op in ops))
    bytes_in, bytes_out = fb(rates.get("bytes_in", 0.0)), fb(rates.get("bytes_out", 0.0))
    lines.append(f"throughput   in {bytes_in}/s  out {bytes_out}/s")
    sessions = snap.get("sessions") or []
    lines += ["", f"sessions ({snap.get('sessions_total', len(sessions))})"]
    if sessions:
        rows = [["id", "tensors", "ram", "disk", "conns", "idle", "lease left", "requests"]]
        for s in sessions:
            rows.append(
                [
                    s["id"],
                    str(s["tensors"]),
                    fb(s["ram_bytes"]),
                    fb(s["disk_bytes"]),
                    str(s["connections"]),
                    _duration(s["idle_s"]),
                    _duration(s["lease_left_s"]),
                    str(s["requests"]),
                ]
            )
        lines += _table(rows, right={1, 2, 3, 4, 5, 6, 7})
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """Fetch and print the statistics; exit 1 with a message if the daemon is unreachable."""
    from tensorstore_hooks.cli import error_line
    from tensorstore_hooks.errors import ConfigError, StoreUnavailableError
    from tensorstore_hooks.storage.daemon import fetch_stats

    token = None
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            print(f"tensorstore-hooks stats: cannot read --token-file: {e}", file=sys.stderr)
            return 2
    try:
        snap = fetch_stats(
            args.url,
            token=token,
            timeout_s=args.timeout,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )
    except (StoreUnavailableError, ConfigError) as e:
        print(error_line("tensorstore-hooks stats", e), file=sys.stderr)
        return 1
    if args.json:
        json.dump(snap, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_stats(snap))
    return 0
