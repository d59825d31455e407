"""Store I/O: ``ZarrStore`` put+get against writing and reading the same bytes raw.

For each size (float32 tensors of 64 KiB, 1 MiB, 8 MiB, 64 MiB by default) the
benchmark times ``key = store.put(t); store.get(key)`` and, right next to it, the raw
floor for the same bytes at the same place:

* a local directory (default: a fresh temporary one): ``numpy.tofile`` +
  ``numpy.fromfile`` of a file in the store's own directory;
* ``memory://``: a copy out (``tobytes``) and a copy back (``frombuffer().copy()``);
* any other fsspec URL (``s3://bucket/prefix`` with ``--storage-options``): fsspec's
  ``pipe_file`` + ``cat_file`` through the same filesystem.

Ours and raw alternate (who goes first flips every repeat), deletes happen outside
the timed region, and figures are medians. Reported: throughput ratio ours/raw per
size and the fixed cost of one put+get of the smallest size in microseconds.

    python benchmarks/store_io.py
    python benchmarks/store_io.py --url memory:// --repeats 10
    python benchmarks/store_io.py --url s3://bucket/bench --storage-options '{"anon": false}'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tensorstore_hooks import open_store
from tensorstore_hooks._units import format_bytes, parse_bytes
from tensorstore_hooks._zarr_store import split_url

DEFAULT_SIZES = "64KiB,1MiB,8MiB,64MiB"
TARGET_RATIO_SIZE = 8 << 20
TARGET_RATIO = 0.9
TARGET_FIXED_SIZE = 64 << 10
TARGET_FIXED_US = 150.0
SMALL_REPEAT_FACTOR = 10  # sizes <= 1 MiB are cheap and noisier: repeat them more


class RawBaseline:
    """The same bytes written and read without the store, at the store's location."""

    label = ""

    def put_get(self, arr: np.ndarray, i: int) -> tuple[float, float, np.ndarray]:
        """Write then read ``arr``; returns (put seconds, get seconds, what was read)."""
        raise NotImplementedError

    def cleanup(self, i: int) -> None:
        """Remove what ``put_get(..., i)`` wrote (not timed)."""

    def close(self) -> None: ...


class LocalRaw(RawBaseline):
    label = "numpy.tofile + numpy.fromfile"

    def __init__(self, directory: str) -> None:
        self.dir = os.path.join(directory, "raw-baseline")
        os.makedirs(self.dir, exist_ok=True)

    def _path(self, i: int) -> str:
        return os.path.join(self.dir, f"{i}.bin")

    def put_get(self, arr: np.ndarray, i: int) -> tuple[float, float, np.ndarray]:
        path = self._path(i)
        t0 = time.perf_counter()
        arr.tofile(path)
        t1 = time.perf_counter()
        out = np.fromfile(path, dtype=arr.dtype)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, out

    def cleanup(self, i: int) -> None:
        os.remove(self._path(i))

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class MemoryRaw(RawBaseline):
    label = "bytes copy out + copy back"

    def put_get(self, arr: np.ndarray, i: int) -> tuple[float, float, np.ndarray]:
        t0 = time.perf_counter()
        blob = arr.tobytes()
        t1 = time.perf_counter()
        out = np.frombuffer(blob, dtype=arr.dtype).copy()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, out


class FsspecRaw(RawBaseline):
    label = "fsspec pipe_file + cat_file"

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/") + "/raw-baseline"

    def put_get(self, arr: np.ndarray, i: int) -> tuple[float, float, np.ndarray]:
        path = f"{self.root}/{i}.bin"
        t0 = time.perf_counter()
        self.fs.pipe_file(path, arr.tobytes())
        t1 = time.perf_counter()
        out = np.frombuffer(self.fs.cat_file(path), dtype=arr.dtype)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, out

    def cleanup(self, i: int) -> None:
        self.fs.rm_file(f"{self.root}/{i}.bin")

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.root, recursive=True)


def _ours(store: Any, t: torch.Tensor) -> tuple[float, float, torch.Tensor, str]:
    t0 = time.perf_counter()
    key = store.put(t)
    t1 = time.perf_counter()
    out = store.get(key)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, out, key


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every size; returns the figures (see ``--json``)."""
    storage_options = json.loads(args.storage_options) if args.storage_options else {}
    sizes = [parse_bytes(s.strip(), what="--sizes") for s in args.sizes.split(",")]
    tmp: str | None = None
    url = args.url
    if url is None:
        tmp = url = tempfile.mkdtemp(prefix="tsh-store-io-")
    kind, location = split_url(url)
    raw: RawBaseline
    if kind == "local":
        raw = LocalRaw(location)
    elif kind == "memory":
        raw = MemoryRaw()
    else:
        raw = FsspecRaw(url, storage_options)
    opts: dict[str, Any] = {"codec": args.codec}
    if args.chunk_bytes:
        opts["chunk_bytes"] = args.chunk_bytes
    if storage_options:
        opts["storage_options"] = storage_options
    store = open_store(url, **opts)
    gen = torch.Generator().manual_seed(0)
    results: list[dict[str, Any]] = []
    try:
        for nbytes in sizes:
            t = torch.randn(nbytes // 4, generator=gen)
            arr = t.numpy()
            repeats = args.repeats * (SMALL_REPEAT_FACTOR if nbytes <= 1 << 20 else 1)
            # Warm-up: first-use costs (segment creation, thread start, page-cache growth).
            for _ in range(2):
                *_, got, key = _ours(store, t)
                if not torch.equal(got, t):
                    raise SystemExit(f"store_io: {format_bytes(nbytes)} did not round-trip exactly")
                store.delete(key)
                raw.put_get(arr, 0)
                raw.cleanup(0)
            ours_put, ours_get, raw_put, raw_get = [], [], [], []
            for i in range(repeats):
                # Alternate who goes first so neither side always finds a warmer cache.
                for side in ("ours", "raw") if i % 2 == 0 else ("raw", "ours"):
                    if side == "ours":
                        p, g, got, key = _ours(store, t)
                        ours_put.append(p)
                        ours_get.append(g)
                        del got
                        store.delete(key)
                    else:
                        p, g, _ = raw.put_get(arr, i)
                        raw_put.append(p)
                        raw_get.append(g)
                        raw.cleanup(i)
            ours_pg = [p + g for p, g in zip(ours_put, ours_get, strict=True)]
            raw_pg = [p + g for p, g in zip(raw_put, raw_get, strict=True)]
            # Ratio of medians of each repeat's side-by-side pair, robust to drift.
            pair_ratio = statistics.median(r / o for o, r in zip(ours_pg, raw_pg, strict=True))
            results.append(
                {
                    "bytes": nbytes,
                    "repeats": repeats,
                    "ours_put_s": statistics.median(ours_put),
                    "ours_get_s": statistics.median(ours_get),
                    "ours_put_get_s": statistics.median(ours_pg),
                    "raw_put_s": statistics.median(raw_put),
                    "raw_get_s": statistics.median(raw_get),
                    "raw_put_get_s": statistics.median(raw_pg),
                    "throughput_ratio": pair_ratio,
                }
            )
            print(f"  {format_bytes(nbytes)}: {pair_ratio:.2f}x raw", file=sys.stderr, flush=True)
    finally:
        store.close()
        raw.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    targets = _targets(results)
    return {
        "benchmark": "store_io",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU use",
        "command": " ".join(["python", "benchmarks/store_io.py", *sys.argv[1:]]),
        "url": args.url or "a temporary local directory",
        "baseline": raw.label,
        "codec": args.codec,
        "results": results,
        "targets": targets,
    }


def _targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in results:
        if r["bytes"] == TARGET_RATIO_SIZE:
            out["ratio_8MiB"] = {
                "value": r["throughput_ratio"],
                "target": f">= {TARGET_RATIO}",
                "holds": r["throughput_ratio"] >= TARGET_RATIO,
            }
        if r["bytes"] == TARGET_FIXED_SIZE:
            us = r["ours_put_get_s"] * 1e6
            out["fixed_us_64KiB"] = {
                "value": us,
                "target": f"<= {TARGET_FIXED_US:.0f}",
                "holds": us <= TARGET_FIXED_US,
            }
    return out


def format_table(result: dict[str, Any]) -> str:
    """The figures as a Markdown table plus the target lines."""
    lines = [
        "| size | ours put | ours get | ours put+get | raw put | raw get | raw put+get "
        "| ours GB/s | raw GB/s | ours/raw |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def us(s: float) -> str:
        return f"{s * 1e6:.0f} us" if s < 1e-2 else f"{s * 1e3:.1f} ms"

    for r in result["results"]:
        gb = 2 * r["bytes"] / 1e9  # written once and read once
        lines.append(
            f"| {format_bytes(r['bytes'])} | {us(r['ours_put_s'])} | {us(r['ours_get_s'])} | "
            f"{us(r['ours_put_get_s'])} | {us(r['raw_put_s'])} | {us(r['raw_get_s'])} | "
            f"{us(r['raw_put_get_s'])} | {gb / r['ours_put_get_s']:.2f} | "
            f"{gb / r['raw_put_get_s']:.2f} | {r['throughput_ratio']:.2f}x |"
        )
    t = result["targets"]
    lines.append("")
    if "ratio_8MiB" in t:
        v = t["ratio_8MiB"]
        lines.append(
            f"8 MiB put+get throughput, ours/raw: {v['value']:.2f}x (target {v['target']}): "
            f"{'holds' if v['holds'] else 'MISSED'}"
        )
    if "fixed_us_64KiB" in t:
        v = t["fixed_us_64KiB"]
        lines.append(
            f"64 KiB put+get: {v['value']:.0f} us (target {v['target']} us): "
            f"{'holds' if v['holds'] else 'MISSED'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="store URL (default: a fresh temporary local directory)")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec storage options as JSON")
    p.add_argument(
        "--repeats",
        type=int,
        default=30,
        help=f"timed put+get per size (x{SMALL_REPEAT_FACTOR} for sizes <= 1 MiB); default 30",
    )
    p.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"comma-separated sizes (default {DEFAULT_SIZES})"
    )
    p.add_argument("--codec", default="none", help="store codec: none (default), lz4, zstd[:LEVEL]")
    p.add_argument("--chunk-bytes", help="store chunk size (default: the store's, 8MiB)")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    result = run(args)
    print(
        f"\nstore_io: {result['machine']}; {result['date']}; store {result['url']}; "
        f"raw baseline: {result['baseline']}; codec {result['codec']}\n"
    )
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
