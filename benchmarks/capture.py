"""Capturing every block output of the benchmark model, three ways, side by side.

Modes (each run in a fresh subprocess, forward only under ``torch.no_grad()``, as an
activation cache is made)::

    none       the forward alone (the baseline of every ratio)
    tsh        tsh.capture(model, DIR, modules="blocks.*", what="output")
    tutorial   the tutorial's hooks: out.data.cpu().numpy() appended to a list per
               block, then np.save of each block's rows at the end
    tofile     a plain loop writing the same bytes: each hook writes its output with
               numpy.tofile to one open file per block

For each number of batches ``N`` (``--batches 8,32,128``) and each round, every mode
runs once; figures are ratios to ``none`` of the same round and ``N``, then the median
over rounds (the machine is shared and noisy; only side-by-side ratios survive that):

* step time: the median time of one batch (forward plus hooks; batch 0 is warm-up),
  and the end-to-end time (every batch plus what the mode does at the end: tsh's
  flush, the tutorial's np.save, closing the files), as a ratio to ``none``'s;
* throughput: bytes captured per second of end-to-end time;
* peak memory: the process's high-water RSS over the whole run minus the RSS before
  batch 0 (sampled every ~1 ms, checked against ``ru_maxrss``: train_step.py's
  RssSampler), and, where a memory cgroup can be made (cgroup v1 at
  /sys/fs/cgroup/memory, as root), the peak charge of a child group holding only the
  run (RSS plus the page cache its files occupy) minus the charge before batch 0.
  tsh's charge at each N, and the largest over the smallest, is printed last: capture
  writes chunks with O_DIRECT where the disk allows it, so it should be flat in N.

Then the read side: ``CaptureDataset(DIR, "blocks.K/output", shuffle=True,
flatten=True)`` reading every row of one captured array (one dataset, a new epoch
each read, as a training loop reads it), against a raw sequential read of the same
chunk files (``numpy.fromfile`` of each, in order, as store_io.py's raw baseline),
alternating, with a cold page cache (the chunk files evicted with
``posix_fadvise(DONTNEED)`` before each read) and a warm one; wall time and the
process's CPU time of each.

Goals (DESIGN.md, issues 26 and 35): tsh within 1.15x of ``none``'s step time where
the disk keeps up; tsh's container charge flat in ``N`` (RSS bounded by
``max_inflight``, no page cache left by its writes) while the tutorial's grows;
CaptureDataset >= 0.8x of the raw read, cold and warm.

    python benchmarks/capture.py                                   # bench model, N=8,32,128
    python benchmarks/capture.py --size tiny --batches 4,12 --rounds 1    # quick
    python benchmarks/capture.py --modes none,tsh --batches 8,32,128      # the charge in N
    python benchmarks/capture.py --json bench-out/capture.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import RssSampler, ru_maxrss_bytes  # the sibling benchmark's sampler

MODES = ("none", "tsh", "tutorial", "tofile")
CGROUP_V1 = Path("/sys/fs/cgroup/memory")


# --------------------------------------------------------------------------- cgroup
class ChildCgroup:
    """A cgroup v1 memory group under this process's own, holding one worker run."""

    def __init__(self) -> None:
        self.path: Path | None = None
        try:
            own = next(
                line.split(":", 2)[2].strip()
                for line in Path("/proc/self/cgroup").read_text().splitlines()
                if line.split(":", 2)[1] == "memory"
            )
            path = CGROUP_V1 / own.lstrip("/") / f"tsh-bench-{uuid.uuid4().hex[:8]}"
            path.mkdir()
            self.path = path
        except (OSError, StopIteration, IndexError):
            self.path = None

    def remove(self) -> None:
        if self.path is None:
            return
        with contextlib.suppress(OSError):
            (self.path / "memory.force_empty").write_text("0")
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _join_cgroup(path: str | None) -> Path | None:
    if not path:
        return None
    group = Path(path)
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return group


def _charge(group: Path | None, name: str) -> int | None:
    if group is None:
        return None
    return int((group / name).read_text())


# --------------------------------------------------------------------------- worker
def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One mode, ``args.n`` batches, in this process."""
    import numpy as np
    import torch

    from tensorstore_hooks.cli._demo_model import GPT, config_for, synthetic_batch

    group = _join_cgroup(args.cgroup)
    cfg = config_for(args.size)
    model = GPT(cfg, seed=0)
    batches = [synthetic_batch(cfg, i) for i in range(args.n)]
    out_dir = Path(args.dir)
    blocks = [f"blocks.{i}" for i in range(cfg.blocks)]
    finish: Any = lambda: None  # noqa: E731 - what the mode does after the last batch
    handles: list[Any] = []
    cap: Any = None
    if args.mode == "tsh":
        import tensorstore_hooks as tsh

        cap = tsh.capture(
            model, str(out_dir), modules="blocks.*", what="output", max_inflight=args.max_inflight
        )
        finish = cap.remove
    elif args.mode == "tutorial":
        acts: dict[str, list[Any]] = {b: [] for b in blocks}
        for b in blocks:
            handles.append(
                model.get_submodule(b).register_forward_hook(
                    lambda m, a, out, b=b: acts[b].append(out.data.cpu().numpy())
                )
            )

        def save() -> None:
            for b, rows in acts.items():
                np.save(out_dir / f"{b}.npy", np.concatenate(rows))

        finish = save
    elif args.mode == "tofile":
        files = {b: open(out_dir / f"{b}.bin", "wb") for b in blocks}  # noqa: SIM115
        for b in blocks:
            handles.append(
                model.get_submodule(b).register_forward_hook(
                    lambda m, a, out, b=b: out.detach().numpy().tofile(files[b])
                )
            )

        def close() -> None:
            for f in files.values():
                f.close()

        finish = close

    if group is not None:
        (group / "memory.max_usage_in_bytes").write_text("0")
    charge_base = _charge(group, "memory.usage_in_bytes")
    sampler = RssSampler()
    ru_before = ru_maxrss_bytes()
    base = sampler.start()
    step_s: list[float] = []
    t_all = time.perf_counter()
    with torch.no_grad():
        for tokens, targets in batches:
            t0 = time.perf_counter()
            model(tokens, targets)
            step_s.append(time.perf_counter() - t0)
    t_finish = time.perf_counter()
    finish()
    end_s = time.perf_counter() - t_all
    finish_s = time.perf_counter() - t_finish
    peak = sampler.stop()
    ru_after = ru_maxrss_bytes()
    if ru_after > ru_before:
        peak = max(peak, ru_after)
    charge_peak = _charge(group, "memory.max_usage_in_bytes")
    captured = args.n * cfg.blocks * cfg.batch * cfg.seq * cfg.d_model * 4
    result = {
        "mode": args.mode,
        "n": args.n,
        "round": args.round,
        "step_s": statistics.median(step_s[1:] or step_s),
        "end_to_end_s": end_s,
        "finish_s": finish_s,
        "captured_bytes": captured if args.mode != "none" else 0,
        "rss_peak_bytes": peak - base,
        "cgroup_peak_bytes": (
            None if charge_peak is None or charge_base is None else charge_peak - charge_base
        ),
    }
    if cap is not None:
        s = cap.stats
        result["tsh"] = {
            "peak_inflight_bytes": s.peak_inflight_bytes,
            "stall_s": s.stall_s,
            "bytes_written": s.bytes_written,
            "failed_writes": s.failed_writes,
            "chunks_written": s.chunks_written,
            "chunks_direct": s.chunks_direct,
        }
    for h in handles:
        h.remove()
    return result


def _evict(paths: list[Path]) -> None:
    """Drop ``paths`` from the page cache (their pages are clean: written and synced)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_read(args: argparse.Namespace) -> dict[str, Any]:
    """CaptureDataset against a raw sequential read of the same chunk files, with a cold
    page cache (the files evicted before each read) and a warm one, alternating."""
    import numpy as np

    import tensorstore_hooks as tsh
    from tensorstore_hooks.capture._layout import chunk_path, read_array
    from tensorstore_hooks.storage.io import LocalIO

    io = LocalIO(args.dir)
    name = args.read_array
    info = read_array(io, f"capture/{name}")
    if info is None:
        raise SystemExit(f"no captured array {name} under {args.dir}")
    paths = [
        Path(args.dir) / chunk_path(info.path, c, len(info.row_shape) + 1)
        for c in range(info.chunks)
    ]

    def raw() -> tuple[float, float]:
        """numpy.fromfile of each chunk file in order: the raw sequential read."""
        t0, c0 = time.perf_counter(), time.process_time()
        for p in paths:
            np.fromfile(p, dtype=np.uint8)
        return time.perf_counter() - t0, time.process_time() - c0

    def dataset() -> Any:
        return tsh.CaptureDataset(
            args.dir, name, batch_size=args.read_batch, shuffle=True, seed=0, flatten=True
        )

    def epoch_of(ds: Any, epoch: int) -> tuple[float, float]:
        ds.set_epoch(epoch)
        t0, c0 = time.perf_counter(), time.process_time()
        rows = 0
        for batch in ds:
            rows += len(batch)
        took = time.perf_counter() - t0, time.process_time() - c0
        assert rows == ds.num_rows
        return took

    # Cold: a new dataset for each read (a first epoch; a kept map would hold its pages
    # in the page cache, which DONTNEED leaves). Warm: one dataset over the rounds, a new
    # epoch each, as a training loop reads it (its chunk maps and buffers are kept).
    figures: dict[str, Any] = {"array": name, "bytes": info.nbytes}
    for cache in ("cold", "warm"):
        raws, mine = [], []
        if cache == "warm":
            warm = dataset()
            epoch_of(warm, 0)
            figures["threads"] = warm.threads
        for r in range(args.read_rounds):
            if cache == "cold":
                _evict(paths)
                raws.append(raw())
                fresh = dataset()
                _evict(paths)
                mine.append(epoch_of(fresh, r))
                del fresh
            else:
                raw()  # every file in the page cache
                raws.append(raw())
                mine.append(epoch_of(warm, r + 1))
        raw_s = statistics.median(t for t, _ in raws)
        our_s = statistics.median(t for t, _ in mine)
        figures[cache] = {
            "raw_s": raw_s,
            "dataset_s": our_s,
            "raw_gbps": info.nbytes / raw_s / 1e9,
            "dataset_gbps": info.nbytes / our_s / 1e9,
            "ratio": raw_s / our_s,
            "raw_cpu_s": statistics.median(c for _, c in raws),
            "dataset_cpu_s": statistics.median(c for _, c in mine),
        }
    return figures


# --------------------------------------------------------------------------- parent
def _spawn(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        cmd = [sys.executable, __file__, "--worker", "--json", out, "--size", args.size, *extra]
        subprocess.run(cmd, check=True, timeout=args.timeout)
        return dict(json.loads(Path(out).read_text()))
    finally:
        os.unlink(out)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    ns = [int(n) for n in args.batches.split(",")]
    modes = args.modes.split(",")
    runs: list[dict[str, Any]] = []
    read: dict[str, Any] | None = None
    scratch = Path(tempfile.mkdtemp(prefix="tsh-bench-capture-", dir=args.dir))
    for r in range(args.rounds):
        for n in ns:
            for mode in modes:
                out_dir = scratch / f"{mode}-{n}-{r}"
                out_dir.mkdir(parents=True)
                group = ChildCgroup()
                try:
                    extra = [
                        "--mode",
                        mode,
                        "--n",
                        str(n),
                        "--round",
                        str(r),
                        "--dir",
                        str(out_dir),
                        "--max-inflight",
                        args.max_inflight,
                    ]
                    if group.path is not None:
                        extra += ["--cgroup", str(group.path)]
                    res = _spawn(args, extra)
                finally:
                    group.remove()
                runs.append(res)
                print(_line(res), flush=True)
                last = r == args.rounds - 1 and n == ns[-1]
                if mode == "tsh" and last and args.read_rounds:
                    read = _spawn(
                        args,
                        [
                            "--read",
                            "--dir",
                            str(out_dir),
                            "--read-array",
                            args.read_array,
                            "--read-rounds",
                            str(args.read_rounds),
                            "--read-batch",
                            str(args.read_batch),
                        ],
                    )
                shutil.rmtree(out_dir, ignore_errors=True)
    shutil.rmtree(scratch, ignore_errors=True)
    return {"runs": runs, "summary": summarise(runs, ns, modes), "read": read, "args": vars(args)}


def _line(res: dict[str, Any]) -> str:
    cg = res["cgroup_peak_bytes"]
    return (
        f"  N={res['n']:>3} {res['mode']:<9} step {res['step_s'] * 1e3:8.1f} ms  "
        f"end-to-end {res['end_to_end_s']:7.2f} s  RSS +{res['rss_peak_bytes'] / 2**20:8.1f} MiB"
        + (f"  cgroup +{cg / 2**20:8.1f} MiB" if cg is not None else "")
    )


def summarise(runs: list[dict[str, Any]], ns: list[int], modes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in ns:
        base = {r["round"]: r for r in runs if r["n"] == n and r["mode"] == "none"}
        for mode in modes:
            mine = [r for r in runs if r["n"] == n and r["mode"] == mode and r["round"] in base]
            if not mine:
                continue
            step = [r["step_s"] / base[r["round"]]["step_s"] for r in mine]
            end = [r["end_to_end_s"] / base[r["round"]]["end_to_end_s"] for r in mine]
            cgroup = [r["cgroup_peak_bytes"] for r in mine if r["cgroup_peak_bytes"] is not None]
            out[f"{mode}@{n}"] = {
                "step_ratio": statistics.median(step),
                "end_to_end_ratio": statistics.median(end),
                "throughput_mbps": statistics.median(
                    r["captured_bytes"] / r["end_to_end_s"] / 1e6 for r in mine
                ),
                "rss_peak_mib": statistics.median(r["rss_peak_bytes"] / 2**20 for r in mine),
                "cgroup_peak_mib": statistics.median(cgroup) / 2**20 if cgroup else None,
            }
    return out


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'mode@N':<14}{'step x':>8}{'end x':>8}{'MB/s':>9}{'RSS MiB':>10}{'cgroup MiB':>12}"]
    for key, s in result["summary"].items():
        cg = "-" if s["cgroup_peak_mib"] is None else f"{s['cgroup_peak_mib']:.0f}"
        lines.append(
            f"{key:<14}{s['step_ratio']:>8.3f}{s['end_to_end_ratio']:>8.3f}"
            f"{s['throughput_mbps']:>9.0f}{s['rss_peak_mib']:>10.0f}{cg:>12}"
        )
    read = result["read"]
    if read:
        for cache in ("cold", "warm"):
            r = read[cache]
            lines.append(
                f"read {read['array']} ({read['bytes'] / 2**20:.0f} MiB, shuffled, {cache} page "
                f"cache): CaptureDataset {r['dataset_gbps']:.2f} GB/s, raw sequential "
                f"{r['raw_gbps']:.2f} GB/s: {r['ratio']:.2f}x (CPU {r['dataset_cpu_s']:.2f} s "
                f"against {r['raw_cpu_s']:.2f} s)"
            )
    for extra in (charge_in_n(result["summary"]), direct_share(result["runs"])):
        if extra:
            lines.append(extra)
    return "\n".join(lines)


def charge_in_n(summary: dict[str, Any]) -> str | None:
    """Each mode's container charge at each N side by side, what it adds to ``none``'s
    (the forward's own) at the same N, and the largest over the smallest: tsh's is
    flat in N when its writes leave no page cache behind (NOTE [ Capture writes ]);
    the tutorial's grows with what it holds."""
    by_mode: dict[str, dict[int, float]] = {}
    for key, s in summary.items():
        mode, n = key.split("@")
        if s["cgroup_peak_mib"] is not None:
            by_mode.setdefault(mode, {})[int(n)] = s["cgroup_peak_mib"]
    base = by_mode.get("none", {})
    lines = []
    for mode, charges in by_mode.items():
        if len(charges) < 2:
            continue
        shown = ", ".join(
            f"N={n}: {mib:.0f} MiB"
            + (f" ({mib - base[n]:+.0f} over none)" if mode != "none" and n in base else "")
            for n, mib in sorted(charges.items())
        )
        ratio = max(charges.values()) / max(1.0, min(charges.values()))
        lines.append(f"{mode} container charge by N: {shown} (largest / smallest: {ratio:.2f}x)")
    return "\n".join(lines) or None


def direct_share(runs: list[dict[str, Any]]) -> str | None:
    """How many of tsh's chunks went through O_DIRECT, per N (the charge is flat only
    where they do)."""
    parts = [
        f"N={r['n']}: {r['tsh']['chunks_direct']}/{r['tsh']['chunks_written']}"
        for r in runs
        if "tsh" in r and "chunks_direct" in r["tsh"]
    ]
    return f"tsh chunks written with O_DIRECT: {', '.join(parts)}" if parts else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="bench", help="model size: tiny, small, bench")
    p.add_argument(
        "--batches", default="8,32,128", help="numbers of batches N, comma-separated"
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--max-inflight", default="256MiB", help="tsh's max_inflight")
    p.add_argument("--dir", help="scratch directory on the disk to measure (default: $TMPDIR)")
    p.add_argument("--read-array", default="blocks.3/output")
    p.add_argument(
        "--read-rounds", type=int, default=3, help="rounds per cache state; 0: skip the read"
    )
    p.add_argument("--read-batch", type=int, default=4096, help="CaptureDataset batch_size")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per subprocess")
    p.add_argument("--json", help="write every figure here")
    # worker side
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--read", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--cgroup", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        result = run_read(args) if args.read else run_worker(args)
        Path(args.json).write_text(json.dumps(result))
        return 0
    result = run_benchmark(args)
    print(format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
