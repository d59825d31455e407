"""Object storage I/O: ``ZarrStore`` on ``s3://`` against raw s3fs on the same bytes.

Starts a local S3-compatible server (moto, in a separate process so that it does not
share the client's interpreter lock) on 127.0.0.1, then for each size (float32
tensors of 64 KiB, 1 MiB, 8 MiB by default) times, side by side:

* ours: ``key = store.put(t); store.get(key)`` through ``tsh.open_store("s3://...")``;
* raw: s3fs ``pipe_file`` + ``cat_file`` of the same bytes, on its own filesystem.

Who goes first alternates every repeat, deletes are not timed, and the figures are
medians; the ratio is the median of each repeat's raw/ours pair (>1: ours faster).
A first table gives the object store's fixed cost: put+get of a 1-byte object (the
per-request latency that batching into large objects amortises) and the time to
read the chunks of one 64 MiB tensor split into 8 MiB objects, one by one against
concurrently (what ``FsspecIO.read_many`` does).

    python benchmarks/s3_io.py
    python benchmarks/s3_io.py --repeats 20 --json s3_io.json
    python benchmarks/s3_io.py --url s3://my-bucket/bench     # a real service instead

With ``--url`` the figures are those of that service from this machine (credentials
from the environment or ``--storage-options``); objects go under ``URL/ours`` and
``URL/raw`` and are removed afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SIZES = "64KiB,1MiB,8MiB"
BUCKET = "tsh-bench"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def _serve(ready: Any, stop: Any) -> None:  # pragma: no cover - runs in the child
    """The server process: moto with the test suite's request handler (one Server header)."""
    sys.path.insert(0, str(ROOT))
    from tests.s3_fixtures import S3Server

    server = S3Server()
    server.start()
    server.create_bucket(BUCKET)
    ready.put(server.endpoint_url)
    stop.wait()
    server.stop()


class ServerProcess:
    """moto on 127.0.0.1 in a child process; a context manager that always stops it."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._ready: Any = ctx.Queue()
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_serve, args=(self._ready, self._stop), daemon=True)
        self.endpoint_url = ""

    def __enter__(self) -> ServerProcess:
        self._proc.start()
        self.endpoint_url = self._ready.get(timeout=60)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._ready.close()
        self._ready.join_thread()


def _median_pair(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import s3fs

    import tensorstore_hooks as tsh
    from tensorstore_hooks._units import format_bytes, parse_bytes

    sizes = [parse_bytes(s.strip(), what="--sizes") for s in args.sizes.split(",")]
    with contextlib.ExitStack() as stack:
        if args.url:
            base = args.url.rstrip("/")
            options = json.loads(args.storage_options) if args.storage_options else {}
            where = base
        else:
            os.environ.update(CREDENTIALS)
            server = stack.enter_context(ServerProcess())
            base = f"s3://{BUCKET}"
            options = {"endpoint_url": server.endpoint_url, "key": "testing", "secret": "testing"}
            where = "moto (ThreadedMotoServer) on 127.0.0.1, separate process; HTTP, no TLS"
        raw = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        raw_root = base.split("://", 1)[1] + "/raw"
        store = tsh.open_store(f"{base}/ours", storage_options=options)
        try:
            fixed = _fixed_costs(raw, raw_root, args.repeats)
            rows = [_measure(store, raw, raw_root, n, args.repeats, format_bytes) for n in sizes]
        finally:
            store.close()
            with contextlib.suppress(FileNotFoundError):
                raw.rm(raw_root, recursive=True)
            _close_s3fs(raw)
    return {
        "benchmark": "s3_io",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "server": where,
        "command": " ".join(["python", "benchmarks/s3_io.py", *sys.argv[1:]]),
        "fixed": fixed,
        "results": rows,
    }


def _fixed_costs(raw: Any, root: str, repeats: int) -> dict[str, float]:
    """Per-request latency, and sequential vs concurrent reads of 8 x 8 MiB objects."""
    put, get = [], []
    for i in range(repeats * 3):
        path = f"{root}/tiny-{i}"
        t0 = time.perf_counter()
        raw.pipe_file(path, b"x")
        t1 = time.perf_counter()
        raw.cat_file(path)
        put.append(t1 - t0)
        get.append(time.perf_counter() - t1)
    blob = os.urandom(8 << 20)
    paths = [f"{root}/part-{i}" for i in range(8)]
    raw.pipe(dict.fromkeys(paths, blob))
    seq, conc = [], []
    for i in range(max(3, repeats // 3)):
        for side in ("seq", "conc") if i % 2 == 0 else ("conc", "seq"):
            t0 = time.perf_counter()
            if side == "seq":
                for p in paths:
                    raw.cat_file(p)
                seq.append(time.perf_counter() - t0)
            else:
                raw.cat(paths)
                conc.append(time.perf_counter() - t0)
    return {
        "request_put_s": statistics.median(put),
        "request_get_s": statistics.median(get),
        "read_64MiB_sequential_s": statistics.median(seq),
        "read_64MiB_concurrent_s": statistics.median(conc),
    }


def _measure(
    store: Any, raw: Any, root: str, nbytes: int, repeats: int, fmt: Any
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(nbytes)
    t = torch.randn(nbytes // 4, generator=gen)
    data = t.numpy().tobytes()
    reps = repeats * (4 if nbytes <= 1 << 20 else 1)
    for _ in range(2):  # warm-up: segment creation, connection pool
        key = store.put(t)
        if not torch.equal(store.get(key), t):
            raise SystemExit(f"s3_io: {fmt(nbytes)} did not round-trip exactly")
        store.delete(key)
        raw.pipe_file(f"{root}/warm", data)
        raw.cat_file(f"{root}/warm")
    ours_put, ours_get, raw_put, raw_get = [], [], [], []
    for i in range(reps):
        for side in ("ours", "raw") if i % 2 == 0 else ("raw", "ours"):
            if side == "ours":
                t0 = time.perf_counter()
                key = store.put(t)
                t1 = time.perf_counter()
                store.get(key)
                ours_put.append(t1 - t0)
                ours_get.append(time.perf_counter() - t1)
                store.delete(key)
            else:
                path = f"{root}/{nbytes}-{i}"
                t0 = time.perf_counter()
                raw.pipe_file(path, data)
                t1 = time.perf_counter()
                np.frombuffer(raw.cat_file(path), dtype=np.float32)
                raw_put.append(t1 - t0)
                raw_get.append(time.perf_counter() - t1)
                raw.rm_file(path)
    ours = [p + g for p, g in zip(ours_put, ours_get, strict=True)]
    rawpg = [p + g for p, g in zip(raw_put, raw_get, strict=True)]
    row = {
        "bytes": nbytes,
        "repeats": reps,
        "ours_put_s": statistics.median(ours_put),
        "ours_get_s": statistics.median(ours_get),
        "ours_put_get_s": statistics.median(ours),
        "raw_put_s": statistics.median(raw_put),
        "raw_get_s": statistics.median(raw_get),
        "raw_put_get_s": statistics.median(rawpg),
        "ratio": _median_pair(rawpg, ours),
    }
    print(f"  {fmt(nbytes)}: ours/raw throughput {row['ratio']:.2f}x", file=sys.stderr)
    return row


def _close_s3fs(fs: Any) -> None:
    """Close the filesystem's HTTP session now (not at garbage collection)."""
    from fsspec.asyn import sync

    creator = getattr(fs, "_s3creator", None)
    if creator is not None:
        sync(fs.loop, creator.__aexit__, None, None, None, timeout=5)


def format_table(result: dict[str, Any]) -> str:
    from tensorstore_hooks._units import format_bytes

    def ms(s: float) -> str:
        return f"{s * 1e3:.1f} ms"

    f = result["fixed"]
    lines = [
        "| per request (1-byte object) | put | get |",
        "|---|---|---|",
        f"| raw s3fs | {ms(f['request_put_s'])} | {ms(f['request_get_s'])} |",
        "",
        "| 64 MiB as 8 x 8 MiB objects | one by one | concurrently (`cat` of 8 paths) |",
        "|---|---|---|",
        f"| read | {ms(f['read_64MiB_sequential_s'])} | {ms(f['read_64MiB_concurrent_s'])} |",
        "",
        "| size | ours put | ours get | ours put+get | raw put | raw get | raw put+get "
        "| ours MB/s | raw MB/s | ours/raw |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        mb = 2 * r["bytes"] / 1e6
        lines.append(
            f"| {format_bytes(r['bytes'])} | {ms(r['ours_put_s'])} | {ms(r['ours_get_s'])} | "
            f"{ms(r['ours_put_get_s'])} | {ms(r['raw_put_s'])} | {ms(r['raw_get_s'])} | "
            f"{ms(r['raw_put_get_s'])} | {mb / r['ours_put_get_s']:.0f} | "
            f"{mb / r['raw_put_get_s']:.0f} | {r['ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--repeats", type=int, default=15, help="timed put+get per size (x4 for <= 1 MiB)"
    )
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"default {DEFAULT_SIZES}")
    p.add_argument("--url", help="s3://bucket/prefix of a real service (default: local moto)")
    p.add_argument("--storage-options", metavar="JSON", help="s3fs options as JSON (with --url)")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    result = run(args)
    print(f"\ns3_io: {result['machine']}; {result['date']}; {result['server']}\n")
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
