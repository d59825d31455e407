"""Object storage I/O: ``ZarrStore`` on ``s3://`` against raw s3fs on the same bytes.

Starts a local S3-compatible server on 127.0.0.1 — SeaweedFS by default (a real,
distributed object store: ``weed server -s3``, see ``tests/seaweedfs.py``), or moto
(``--server moto``, in a separate process so that it does not share the client's
interpreter lock) — then times, side by side:

* per size (float32 tensors of 64 KiB, 1 MiB, 8 MiB by default), one tensor at a
  time: ours ``key = store.put(t); store.get(key)`` through ``tsh.open_store("s3://...")``
  against raw s3fs ``pipe_file`` + ``cat_file`` of the same bytes;
* in bulk, what a training step does (``--bulk``, default 512 MiB in 32 MiB tensors):
  ours, ``writer_threads`` tensors at once (each one's chunks concurrently), against
  raw s3fs ``pipe``/``cat`` of the same bytes in objects of the same size as our
  chunks (``chunk_bytes``) at the same number of requests in flight. Raw ``cat``
  returns the objects' bytes; a get of ours returns each tensor in a buffer of its
  own (what the pipeline needs), so raw is also timed assembling its objects into
  one new buffer per tensor ("raw+tensor"). Beside the times: the CPU seconds per GB
  moved of the client and, for SeaweedFS, of its processes (``/proc/PID/stat``),
  which say what bounds the transfer here.

Who goes first alternates every repeat, deletes are not timed, and the figures are
medians; the ratio is the median of each repeat's raw/ours pair (>1: ours faster).
A first table gives the object store's fixed cost: put+get of a 1-byte object (the
per-request latency that batching into large objects amortises) and the time to
read the chunks of one 64 MiB tensor split into 8 MiB objects, one by one against
concurrently (what ``FsspecIO.read_many`` does).

    python benchmarks/s3_io.py                                 # SeaweedFS on loopback
    python benchmarks/s3_io.py --repeats 20 --json s3_io.json
    python benchmarks/s3_io.py --server moto
    python benchmarks/s3_io.py --bulk 1GiB --bulk-tensor 32MiB --chunk-bytes 16MiB
    python benchmarks/s3_io.py --url s3://my-bucket/bench     # a real service instead

With ``--url`` the figures are those of that service from this machine (credentials
from the environment or ``--storage-options``); objects go under ``URL/ours`` and
``URL/raw`` and are removed afterwards.

``--hung N`` measures instead what an endpoint that accepts connections and never
answers costs (NOTE [ Outages ] in ``storage/_retry.py``): moto behind a loopback
proxy that, once switched, reads every request and answers none; with
``--deadline`` seconds of ``retry_deadline_s``, ``N`` keys deleted one by one (a
freed graph), ``N`` in one ``delete_many`` and ``N`` reads, against one read timeout
per object (``N x deadline``), and the requests that reached the hung endpoint.

    python benchmarks/s3_io.py --hung 100 --deadline 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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


class SeaweedFSServer:
    """SeaweedFS on 127.0.0.1 (``tests/seaweedfs.py``) with a bucket for the benchmark."""

    def __init__(self) -> None:
        sys.path.insert(0, str(ROOT))
        from tests.seaweedfs import SeaweedFS

        # Large volumes: the benchmark writes gigabytes (deleted bytes are reclaimed only
        # by weed's vacuum), and volume growth mid-run would be timed.
        self.server = SeaweedFS(volume_size_limit_mb=4096)
        self.endpoint_url = ""

    def __enter__(self) -> SeaweedFSServer:
        self.server.start(bucket=BUCKET)
        self.endpoint_url = self.server.endpoint_url
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    @property
    def pids(self) -> list[int]:
        return self.server.pids


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of processes ``pids`` so far (Linux ``/proc``)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def own_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(args: argparse.Namespace) -> dict[str, Any]:
    import s3fs

    import tensorstore_hooks as tsh
    from tensorstore_hooks._units import format_bytes, parse_bytes

    sizes = [parse_bytes(s.strip(), what="--sizes") for s in args.sizes.split(",")]
    chunk = parse_bytes(args.chunk_bytes, what="--chunk-bytes")
    server_pids: list[int] = []
    with contextlib.ExitStack() as stack:
        if args.url:
            base = args.url.rstrip("/")
            options = json.loads(args.storage_options) if args.storage_options else {}
            where = base
        elif args.server == "moto":
            os.environ.update(CREDENTIALS)
            moto = stack.enter_context(ServerProcess())
            base = f"s3://{BUCKET}"
            options = {"endpoint_url": moto.endpoint_url, "key": "testing", "secret": "testing"}
            where = "moto (ThreadedMotoServer) on 127.0.0.1, separate process; HTTP, no TLS"
        else:
            weed = stack.enter_context(SeaweedFSServer())
            server_pids = weed.pids
            base = f"s3://{BUCKET}"
            options = {"endpoint_url": weed.endpoint_url, "key": "testing", "secret": "testing"}
            where = (
                "SeaweedFS (weed server -s3, one process) on 127.0.0.1, same machine; "
                "HTTP, no TLS"
            )
        raw = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        raw_root = base.split("://", 1)[1] + "/raw"
        store = tsh.open_store(f"{base}/ours", storage_options=options, chunk_bytes=chunk)
        try:
            fixed = _fixed_costs(raw, raw_root, args.repeats)
            rows = [_measure(store, raw, raw_root, n, args.repeats, format_bytes) for n in sizes]
            bulk = None
            if args.bulk != "0":
                bulk = _bulk(
                    store,
                    raw,
                    raw_root,
                    total=parse_bytes(args.bulk, what="--bulk"),
                    tensor_bytes=parse_bytes(args.bulk_tensor, what="--bulk-tensor"),
                    chunk_bytes=chunk,
                    threads=args.threads,
                    repeats=max(1, args.repeats // 5),
                    server_pids=server_pids,
                )
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
        "chunk_bytes": chunk,
        "fixed": fixed,
        "results": rows,
        "bulk": bulk,
    }


def _bulk(
    store: Any,
    raw: Any,
    root: str,
    *,
    total: int,
    tensor_bytes: int,
    chunk_bytes: int,
    threads: int,
    repeats: int,
    server_pids: list[int],
) -> dict[str, Any]:
    """A step's worth of bytes both ways: ours (``threads`` tensors at once) against raw
    s3fs (objects of ``chunk_bytes``, as many requests in flight as ours has)."""
    n = max(1, total // tensor_bytes)
    total = n * tensor_bytes
    t = torch.randn(tensor_bytes // 4, generator=torch.Generator().manual_seed(1))
    data = t.numpy().tobytes()
    parts = max(1, tensor_bytes // chunk_bytes)
    objects = [data[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(parts)]
    in_flight = threads * parts
    paths = {f"{root}/bulk/{k}-{i}": objects[i] for k in range(n) for i in range(parts)}
    pool = ThreadPoolExecutor(threads)
    gb = total / 1e9
    sides: dict[str, dict[str, list[float]]] = {
        side: {k: [] for k in ("put_s", "get_s", "put_client", "get_client", "put_server",
                                "get_server")}
        for side in ("ours", "raw", "raw+tensor")
    }  # fmt: skip

    def clocks() -> tuple[float, float, float]:
        return time.perf_counter(), own_cpu_seconds(), cpu_seconds(server_pids)

    def record(side: str, what: str, a: tuple[float, float, float]) -> None:
        b = clocks()
        sides[side][f"{what}_s"].append(b[0] - a[0])
        sides[side][f"{what}_client"].append((b[1] - a[1]) / gb)
        sides[side][f"{what}_server"].append((b[2] - a[2]) / gb)

    try:
        keys = list(pool.map(store.put, [t] * min(n, threads)))  # warm-up
        store.delete_many(keys)
        for r in range(repeats + 1):
            for side in ("ours", "raw") if r % 2 == 0 else ("raw", "ours"):
                if side == "ours":
                    a = clocks()
                    keys = list(pool.map(store.put, [t] * n))
                    record("ours", "put", a)
                    a = clocks()
                    got = list(pool.map(store.get, keys))
                    record("ours", "get", a)
                    if not torch.equal(got[-1], t):
                        raise SystemExit("s3_io: a bulk tensor did not round-trip exactly")
                    del got
                    store.delete_many(keys)
                else:
                    a = clocks()
                    raw.pipe(paths, batch_size=in_flight)
                    record("raw", "put", a)
                    sides["raw+tensor"]["put_s"].append(sides["raw"]["put_s"][-1])
                    a = clocks()
                    blobs = raw.cat(list(paths), batch_size=in_flight)
                    record("raw", "get", a)
                    del blobs
                    a = clocks()
                    blobs = raw.cat(list(paths), batch_size=in_flight)
                    names = list(paths)
                    tensors = []
                    for k in range(n):
                        buf = np.empty(tensor_bytes, dtype=np.uint8)
                        for i in range(parts):
                            lo = i * chunk_bytes
                            buf[lo : lo + chunk_bytes] = np.frombuffer(
                                blobs[names[k * parts + i]], dtype=np.uint8
                            )
                        tensors.append(torch.from_numpy(buf).view(torch.float32))
                    record("raw+tensor", "get", a)
                    del blobs, tensors
                    raw.rm(list(paths))
        for side in sides.values():  # the first round warmed both sides up
            for series in side.values():
                del series[:1]
    finally:
        pool.shutdown()
    ours, rawt = sides["ours"], sides["raw"]
    out: dict[str, Any] = {
        "bytes": total,
        "tensor_bytes": tensor_bytes,
        "chunk_bytes": chunk_bytes,
        "threads": threads,
        "requests_in_flight": in_flight,
        "repeats": repeats,
        "server_cpu_measured": bool(server_pids),
    }
    for name, side in sides.items():
        for k, series in side.items():
            if series:
                out[f"{name}_{k}"] = statistics.median(series)
    assembled = sides["raw+tensor"]
    out["get_ratio_tensor"] = _median_pair(assembled["get_s"], ours["get_s"])
    out["ratio_tensor"] = _median_pair(
        [p + g for p, g in zip(assembled["put_s"], assembled["get_s"], strict=True)],
        [p + g for p, g in zip(ours["put_s"], ours["get_s"], strict=True)],
    )
    out["put_ratio"] = _median_pair(rawt["put_s"], ours["put_s"])
    out["get_ratio"] = _median_pair(rawt["get_s"], ours["get_s"])
    out["ratio"] = _median_pair(
        [p + g for p, g in zip(rawt["put_s"], rawt["get_s"], strict=True)],
        [p + g for p, g in zip(ours["put_s"], ours["get_s"], strict=True)],
    )
    print(
        f"  bulk: ours/raw throughput {out['ratio']:.2f}x (raw+tensor: {out['ratio_tensor']:.2f}x)",
        file=sys.stderr,
    )
    return out


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


class HangingProxy:
    """A loopback TCP proxy in front of ``upstream`` that, after :meth:`hang`, reads
    every request and answers none (a wedged gateway, a black-holed route) until
    :meth:`release` closes its connections. Counts the requests it swallowed."""

    def __init__(self, upstream: str) -> None:
        import socket
        import threading

        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.hung = threading.Event()
        self.released = threading.Event()
        self.swallowed = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self.released.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(self._upstream)
            for a, b in ((client, up), (up, client)):
                threading.Thread(target=self._pump, args=(a, b, a is client), daemon=True).start()

    def _pump(self, src: Any, dst: Any, requests: bool) -> None:
        with contextlib.suppress(OSError):
            while not self.released.is_set():
                data = src.recv(1 << 16)
                if not data:
                    break
                if not self.hung.is_set():
                    dst.sendall(data)
                elif requests and data.split(b" ", 1)[0] in _METHODS:
                    with self._lock:
                        self.swallowed += 1
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.close()

    def hang(self) -> None:
        self.hung.set()

    def release(self) -> None:
        self.released.set()
        self._listener.close()


_METHODS = {b"GET", b"PUT", b"POST", b"DELETE", b"HEAD"}


def hung(args: argparse.Namespace) -> dict[str, Any]:
    """``--hung N``: the cost of an endpoint that never answers (module docstring)."""
    import tensorstore_hooks as tsh
    from tensorstore_hooks import StoreUnavailableError

    n, deadline = args.hung, args.deadline
    os.environ.update(CREDENTIALS)
    with ServerProcess() as moto:
        proxy = HangingProxy(moto.endpoint_url)
        options = {"endpoint_url": proxy.url, "key": "testing", "secret": "testing"}
        store = tsh.open_store(
            f"s3://{BUCKET}/hung", storage_options=options, retry_deadline_s=deadline
        )
        keys = [store.put(torch.full((1024,), float(i))) for i in range(3 * n)]
        proxy.hang()
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        for key in keys[:n]:
            store.delete(key)
        times["delete_one_by_one_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        store.delete_many(keys[n : 2 * n])
        times["delete_many_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for key in keys[2 * n :]:
            with contextlib.suppress(StoreUnavailableError):
                store.get(key)
        times["reads_s"] = time.perf_counter() - t0
        swallowed = proxy.swallowed
        proxy.release()
        t0 = time.perf_counter()
        store.close()
        times["close_s"] = time.perf_counter() - t0
    return {
        "benchmark": "s3_io --hung",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": " ".join(["python", "benchmarks/s3_io.py", *sys.argv[1:]]),
        "objects": n,
        "deadline_s": deadline,
        "one_timeout_per_object_s": n * deadline,
        "requests_to_the_hung_endpoint": swallowed,
        **times,
    }


def format_hung(r: dict[str, Any]) -> str:
    d = r["deadline_s"]
    lines = [
        f"An endpoint that never answers: {r['objects']} objects per operation, "
        f"retry_deadline_s={d:g}; one read timeout per object would be "
        f"{r['one_timeout_per_object_s']:.0f} s each",
        "",
        "| operation | seconds | in deadlines |",
        "|---|---|---|",
    ]
    for what, key in (
        (f"{r['objects']} deletes, one by one", "delete_one_by_one_s"),
        (f"delete_many of {r['objects']} keys", "delete_many_s"),
        (f"{r['objects']} reads", "reads_s"),
        ("close", "close_s"),
    ):
        lines.append(f"| {what} | {r[key]:.2f} | {r[key] / d:.2f} |")
    lines.append(f"\nrequests that reached the hung endpoint: {r['requests_to_the_hung_endpoint']}")
    return "\n".join(lines)


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
    b = result.get("bulk")
    if b:
        gb = b["bytes"] / 1e9
        server = b["server_cpu_measured"]
        lines += [
            "",
            f"Bulk: {format_bytes(b['bytes'])} in {format_bytes(b['tensor_bytes'])} tensors, "
            f"{format_bytes(b['chunk_bytes'])} objects, {b['requests_in_flight']} requests in "
            f"flight (ours: {b['threads']} threads); CPU in seconds per GB moved",
            "",
            "| side | put GB/s | get GB/s | client CPU put / get | server CPU put / get |",
            "|---|---|---|---|---|",
        ]
        for side in ("ours", "raw"):
            srv = (
                f"{b[f'{side}_put_server']:.2f} / {b[f'{side}_get_server']:.2f}"
                if server
                else "-"
            )
            lines.append(
                f"| {side} | {gb / b[f'{side}_put_s']:.3f} | {gb / b[f'{side}_get_s']:.3f} | "
                f"{b[f'{side}_put_client']:.2f} / {b[f'{side}_get_client']:.2f} | {srv} |"
            )
        g = b["raw+tensor_get_s"]
        lines += [
            f"| raw+tensor | - | {gb / g:.3f} | - / {b['raw+tensor_get_client']:.2f} | "
            + (f"- / {b['raw+tensor_get_server']:.2f} |" if server else "- |"),
            f"| ours/raw throughput | {b['put_ratio']:.2f}x | {b['get_ratio']:.2f}x | "
            f"put+get {b['ratio']:.2f}x | |",
            f"| ours/(raw+tensor) throughput | {b['put_ratio']:.2f}x | "
            f"{b['get_ratio_tensor']:.2f}x | put+get {b['ratio_tensor']:.2f}x | |",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--repeats", type=int, default=15, help="timed put+get per size (x4 for <= 1 MiB)"
    )
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"default {DEFAULT_SIZES}")
    p.add_argument(
        "--server",
        choices=("seaweedfs", "moto"),
        default="seaweedfs",
        help="the local S3 server to start (default seaweedfs; ignored with --url)",
    )
    p.add_argument("--url", help="s3://bucket/prefix of a real service instead of a local one")
    p.add_argument(
        "--chunk-bytes", default="8MiB", help="the store's chunk_bytes (default 8MiB)"
    )
    p.add_argument(
        "--bulk", default="512MiB", help="bytes moved by the bulk comparison (0: skip it)"
    )
    p.add_argument("--bulk-tensor", default="32MiB", help="tensor size in the bulk comparison")
    p.add_argument(
        "--threads", type=int, default=2, help="tensors at once in the bulk comparison "
        "(the pipeline's writer_threads; default 2)"
    )
    p.add_argument("--storage-options", metavar="JSON", help="s3fs options as JSON (with --url)")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    p.add_argument(
        "--hung", type=int, metavar="N", default=0,
        help="measure a hung endpoint's cost instead (N objects per operation; moto)",
    )
    p.add_argument("--deadline", type=float, default=2.0, help="retry_deadline_s for --hung")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.hung:
        result = hung(args)
        print(f"\ns3_io --hung: {result['machine']}; {result['date']}\n")
        print(format_hung(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return 0
    result = run(args)
    print(f"\ns3_io: {result['machine']}; {result['date']}; {result['server']}\n")
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
