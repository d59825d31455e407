"""One training step of a GPT-like transformer, with and without activation offloading.

Each mode runs in its own subprocess (so every mode starts from a fresh process and
its RSS is its own), modes are interleaved over ``--rounds`` rounds, and every
figure is reported as a ratio to ``none`` measured in the same round, then the
median over rounds: this machine is shared and noisy, and only side-by-side ratios
survive that.

Modes (CPU)::

    none          no hooks
    tutorial      the PyTorch tutorial's disk hooks: torch.save per saved tensor
                  (tensors under 1000 elements stay), torch.load(weights_only=True)
    save_on_cpu   torch.autograd.graph.save_on_cpu() (a no-op copy on CPU: baseline cost)
    tsh-disk      tsh.offload() into a temporary local directory
    tsh-memory    tsh.offload("memory://")

With ``--device cuda`` the modes are ``none``, ``save_on_cpu`` (pin_memory=True),
``tsh-disk`` and ``tsh-memory`` and memory is ``torch.cuda.max_memory_allocated``.

Per process: build the model (seeded) and one SGD optimiser, run one warm-up step,
then ``--steps`` measured steps. Before each step the process collects garbage and
calls glibc's ``malloc_trim(0)``, so the RSS measured before the step is what is
live, not heap that glibc kept from the previous step; a sampler thread reads RSS
every ~1.5 ms during the step. Activation memory = peak RSS during the step minus
RSS before it (gradient buffers already exist: ``zero_grad(set_to_none=False)``).
The first ``none`` process saves every step's gradients; every other process
compares its own with ``torch.equal``, parameter by parameter, step by step.

    python benchmarks/train_step.py                          # the full benchmark
    python benchmarks/train_step.py --blocks 2 --seq 128 --rounds 1 --steps 1   # quick
    python benchmarks/train_step.py --modes none,tsh-disk --tsh-option max_inflight=128MiB
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CPU_MODES = ("none", "tutorial", "save_on_cpu", "tsh-disk", "tsh-memory")
CUDA_MODES = ("none", "save_on_cpu", "tsh-disk", "tsh-memory")
TUTORIAL_THRESHOLD = 1000  # elements; SAVE_ON_DISK_THRESHOLD in the PyTorch tutorial
SAMPLE_PERIOD_S = 0.0015
GiB = float(1 << 30)


# --------------------------------------------------------------------------- memory
class RssSampler:
    """Samples this process's RSS on a background thread while a step runs.

    Reads ``/proc/self/statm`` directly (a few microseconds) rather than through
    psutil, so sampling every 1.5 ms costs the measured step next to nothing.
    """

    def __init__(self, period_s: float = SAMPLE_PERIOD_S) -> None:
        self.period_s = period_s
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak = 0
        self.samples: list[tuple[float, int]] = []
        self._t0 = 0.0

    def rss(self) -> int:
        fields = os.pread(self._fd, 128, 0).split()
        return int(fields[1]) * self._page

    def start(self, record: bool) -> int:
        """Start sampling; returns the RSS now (the step's baseline)."""
        self._stop.clear()
        self.samples = []
        self._t0 = time.perf_counter()
        base = self.peak = self.rss()
        self._thread = threading.Thread(target=self._run, args=(record,), daemon=True)
        self._thread.start()
        return base

    def _run(self, record: bool) -> None:
        while not self._stop.wait(self.period_s):
            r = self.rss()
            if r > self.peak:
                self.peak = r
            if record:
                self.samples.append((time.perf_counter() - self._t0, r))

    def stop(self) -> int:
        """Stop sampling; returns the peak RSS seen (including one last reading)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.rss())
        return self.peak


def _trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc only; elsewhere a no-op)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# --------------------------------------------------------------------------- modes
class _TempFile:
    """The tutorial's ``SelfDeletingTempFile``: removed when autograd drops it."""

    def __init__(self, directory: str) -> None:
        self.name = os.path.join(directory, str(uuid.uuid4()))

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.remove(self.name)


def _tutorial_hooks(directory: str) -> Any:
    """The disk hooks of the PyTorch "Hooks for saved tensors" tutorial, as published."""
    import torch

    def pack_hook(x: torch.Tensor) -> Any:
        if x.numel() < TUTORIAL_THRESHOLD:
            return x
        temp_file = _TempFile(directory)
        torch.save(x, temp_file.name)
        return temp_file

    def unpack_hook(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        return torch.load(packed.name, weights_only=True)

    return torch.autograd.graph.saved_tensors_hooks(pack_hook, unpack_hook)


def _parse_tsh_options(items: list[str]) -> dict[str, Any]:
    """``["max_inflight=128MiB", "writer_threads=3"]`` -> keyword overrides for offload()."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--tsh-option {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value  # sizes such as 128MiB stay strings; the config parses them
    return out


# --------------------------------------------------------------------------- worker
def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Run one mode in this process; returns the per-step figures."""
    import torch

    from tensorstore_hooks._demo_model import GPT, synthetic_batch

    cfg = _model_config(args)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = GPT(cfg, seed=0).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    names = [n for n, _ in model.named_parameters()]
    batches = [synthetic_batch(cfg, i, device=device) for i in range(1 + args.steps)]

    ref: list[dict[str, torch.Tensor]] | None = None
    ref_path = Path(args.ref_grads)
    writes_ref = args.mode == "none" and not ref_path.exists()
    if not writes_ref:
        ref = torch.load(ref_path, weights_only=True, map_location=device)
    mine: list[dict[str, torch.Tensor]] = []

    hooks: Any = None
    scratch = tempfile.mkdtemp(prefix="tsh-bench-tutorial-")
    if args.mode.startswith("tsh-"):
        import tensorstore_hooks as tsh

        url = None if args.mode == "tsh-disk" else "memory://"
        hooks = tsh.offload(url, **_parse_tsh_options(args.tsh_option))

    def context() -> Any:
        if args.mode == "none":
            return contextlib.nullcontext()
        if args.mode == "tutorial":
            return _tutorial_hooks(scratch)
        if args.mode == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=cuda)
        return hooks

    sampler = RssSampler()
    steps: list[dict[str, Any]] = []
    identical = True
    mismatches: list[str] = []
    for i, (tokens, targets) in enumerate(batches):
        record = i == 1
        stats_before = dataclasses.replace(hooks.stats) if hooks is not None else None
        _trim_heap()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            gpu_before = torch.cuda.memory_allocated(device)
        base = sampler.start(record)
        t0 = time.perf_counter()
        with context():
            loss = model(tokens, targets)
        loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
        step_s = time.perf_counter() - t0
        peak = sampler.stop()
        del loss
        entry: dict[str, Any] = {
            "step": i,
            "warmup": i == 0,
            "step_s": step_s,
            "act_bytes": peak - base,
            "rss_before": base,
        }
        if cuda:
            entry["gpu_act_bytes"] = torch.cuda.max_memory_allocated(device) - gpu_before
        if record:
            # Keep ~400 points: enough for a plot, small enough for the JSON.
            every = max(1, len(sampler.samples) // 400)
            entry["rss_trace"] = [(t, r - base) for t, r in sampler.samples[::every]]
        if hooks is not None:
            assert stats_before is not None
            entry["stats"] = _stats_delta(stats_before, hooks.stats)
        steps.append(entry)

        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        if writes_ref:
            mine.append({n: g.detach().clone() for n, g in grads.items()})
        elif ref is not None:
            want = ref[i] if i < len(ref) else {}
            bad = [
                n
                for n in names
                if n not in grads or n not in want or not torch.equal(grads[n], want[n])
            ]
            if bad:
                identical = False
                mismatches.extend(f"step {i}: {n}" for n in bad[:5])
        opt.step()
        opt.zero_grad(set_to_none=False)

    if writes_ref:
        torch.save(mine, ref_path)
    if hooks is not None:
        hooks.close()
    return {
        "mode": args.mode,
        "round": args.round,
        "device": str(device),
        "steps": steps,
        "grads_reference": writes_ref,
        "grads_identical": None if writes_ref else identical,
        "grad_mismatches": mismatches,
    }


def _stats_delta(before: Any, after: Any) -> dict[str, float]:
    fields = (
        "tensors_offloaded",
        "bytes_offloaded",
        "tensors_kept",
        "bytes_kept",
        "fallbacks",
        "bytes_read",
        "prefetch_hits",
        "prefetch_misses",
        "tail_hits",
        "dedup_hits",
        "pack_stall_s",
        "unpack_stall_s",
    )
    return {f: getattr(after, f) - getattr(before, f) for f in fields}


def _model_config(args: argparse.Namespace) -> Any:
    from tensorstore_hooks._demo_model import config_for

    changes = {
        k: v
        for k, v in (
            ("blocks", args.blocks),
            ("d_model", args.d_model),
            ("heads", args.heads),
            ("seq", args.seq),
            ("batch", args.batch),
        )
        if v is not None
    }
    return config_for(args.size, **changes)


# ----------------------------------------------------------------------- orchestrator
def _worker_argv(
    args: argparse.Namespace, mode: int | str, rnd: int, result: Path, ref: Path
) -> list[str]:
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--mode", str(mode),
        "--round", str(rnd),
        "--result", str(result),
        "--ref-grads", str(ref),
        "--steps", str(args.steps),
        "--size", args.size,
        "--device", args.device,
    ]  # fmt: skip
    for name in ("blocks", "d_model", "heads", "seq", "batch"):
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    for opt in args.tsh_option:
        argv += ["--tsh-option", opt]
    return argv


def _worker_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    if args.malloc_mmap_threshold is not None:
        # A fixed threshold also turns off glibc's dynamic one, which otherwise rises to
        # 32 MiB after the first large free and serves activations from a heap that
        # fragments and does not shrink within a step.
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    return env


def _schedule(modes: list[str], rounds: int) -> Iterator[tuple[int, str]]:
    """Interleave modes: each round runs every mode once, rotating the order so no
    mode always follows the same neighbour. Round 0 starts with ``none`` (its process
    writes the reference gradients)."""
    for r in range(rounds):
        k = r % len(modes)
        order = modes[k:] + modes[:k]
        if r == 0 and "none" in order:
            order.remove("none")
            order.insert(0, "none")
        for mode in order:
            yield r, mode


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (round, mode) subprocess and summarise."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "train_step: --device cuda needs a CUDA device, but torch.cuda.is_available() is "
            f"False (torch {torch.__version__}). Run on a GPU machine or drop --device cuda."
        )
    default = CUDA_MODES if args.device == "cuda" else CPU_MODES
    modes = [m.strip() for m in args.modes.split(",")] if args.modes else list(default)
    allowed = (*CUDA_MODES, "tutorial") if args.device == "cuda" else CPU_MODES
    unknown = [m for m in modes if m not in allowed]
    if unknown:
        raise SystemExit(f"train_step: unknown mode(s) {unknown}; choose from {', '.join(allowed)}")
    if "none" not in modes:
        modes.insert(0, "none")  # every figure is a ratio to it
    cfg = _model_config(args)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tsh-bench-") as tmp:
        ref = Path(tmp) / "ref_grads.pt"
        for rnd, mode in _schedule(modes, args.rounds):
            result = Path(tmp) / f"{mode}-{rnd}.json"
            print(f"[round {rnd + 1}/{args.rounds}] {mode} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(
                _worker_argv(args, mode, rnd, result, ref), env=_worker_env(args), check=False
            )
            if proc.returncode != 0:
                raise SystemExit(
                    f"train_step: worker for {mode} (round {rnd}) exited {proc.returncode}"
                )
            run = json.loads(result.read_text())
            runs.append(run)
            med = statistics.median(s["step_s"] for s in run["steps"] if not s["warmup"])
            print(
                f"    {time.perf_counter() - t0:.0f}s, step {med:.2f}s", file=sys.stderr, flush=True
            )
    summary = summarise(runs, modes, gpu=args.device == "cuda")
    return {
        "benchmark": "train_step",
        "date": time.strftime("%Y-%m-%d"),
        "machine": _machine(),
        "command": " ".join(["python", "benchmarks/train_step.py", *sys.argv[1:]]),
        "config": dataclasses.asdict(cfg),
        "device": args.device,
        "rounds": args.rounds,
        "steps": args.steps,
        "tsh_options": _parse_tsh_options(args.tsh_option),
        "malloc_mmap_threshold": args.malloc_mmap_threshold,
        "summary": summary,
        "runs": runs,
    }


def _machine() -> str:
    import platform

    import torch

    cores = os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()}, {cores} cores, {gpu}, torch {torch.__version__}"


def summarise(runs: list[dict[str, Any]], modes: list[str], *, gpu: bool) -> dict[str, Any]:
    """Per mode: medians, and ratios to ``none`` taken per round then medianed."""
    mem_key = "gpu_act_bytes" if gpu else "act_bytes"

    def measured(run: dict[str, Any]) -> list[dict[str, Any]]:
        return [s for s in run["steps"] if not s["warmup"]]

    per_round: dict[tuple[str, int], dict[str, float]] = {}
    for run in runs:
        steps = measured(run)
        per_round[(run["mode"], run["round"])] = {
            "step_s": statistics.median(s["step_s"] for s in steps),
            "mem": statistics.median(s[mem_key] for s in steps),
        }
    out: dict[str, Any] = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        rounds = sorted(r["round"] for r in mine)
        time_ratio = [
            per_round[(mode, k)]["step_s"] / per_round[("none", k)]["step_s"]
            for k in rounds
            if ("none", k) in per_round
        ]
        mem_ratio = [
            per_round[(mode, k)]["mem"] / per_round[("none", k)]["mem"]
            for k in rounds
            if ("none", k) in per_round and per_round[("none", k)]["mem"] > 0
        ]
        steps = [s for r in mine for s in measured(r)]
        stats = [s["stats"] for s in steps if "stats" in s]
        verdicts = [r["grads_identical"] for r in mine if r["grads_identical"] is not None]
        entry: dict[str, Any] = {
            "step_s": statistics.median(s["step_s"] for s in steps),
            "act_bytes": statistics.median(s[mem_key] for s in steps),
            "time_ratio": statistics.median(time_ratio) if time_ratio else None,
            "mem_ratio": statistics.median(mem_ratio) if mem_ratio else None,
            "time_ratios": time_ratio,
            "mem_ratios": mem_ratio,
            "grads_identical": all(verdicts) if verdicts else None,
            "grads_reference": any(r["grads_reference"] for r in mine),
        }
        if stats:
            entry["stats"] = {k: statistics.median(s[k] for s in stats) for k in stats[0]}
        out[mode] = entry
    return out


def format_table(result: dict[str, Any]) -> str:
    """The summary as a Markdown table."""
    gpu = result["device"] == "cuda"
    mem = "GPU act. memory" if gpu else "act. memory"
    head = (
        f"| mode | step time | vs none | {mem} | vs none | tensors offloaded | bytes offloaded "
        "| prefetch hits | tail hits | fallbacks | pack stall | unpack stall | grads |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for mode, e in result["summary"].items():
        st = e.get("stats")
        if e["grads_reference"] and e["grads_identical"] is None:
            grads = "reference"
        elif e["grads_identical"] is None:
            grads = "-"
        else:
            grads = "identical" if e["grads_identical"] else "DIFFER"
        tr = f"{e['time_ratio']:.2f}x" if e["time_ratio"] is not None else "-"
        mr = f"{100 * e['mem_ratio']:.0f}%" if e["mem_ratio"] is not None else "-"
        if st:
            hits = f"{st['prefetch_hits']:.0f}/{st['prefetch_hits'] + st['prefetch_misses']:.0f}"
            cols = [
                f"{st['tensors_offloaded']:.0f}",
                f"{st['bytes_offloaded'] / GiB:.2f} GiB",
                hits,
                f"{st['tail_hits']:.0f}",
                f"{st['fallbacks']:.0f}",
                f"{st['pack_stall_s']:.2f}s",
                f"{st['unpack_stall_s']:.2f}s",
            ]
        else:
            cols = ["-"] * 7
        lines.append(
            f"| {mode} | {e['step_s']:.2f}s | {tr} | {e['act_bytes'] / GiB:.2f} GiB | {mr} | "
            + " | ".join(cols)
            + f" | {grads} |"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """RSS above the step's baseline over time, one line per mode (first measured step
    of the last round). Needs matplotlib (``pip install tensorstore-hooks[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("train_step: --plot needs matplotlib: pip install matplotlib") from e
    last: dict[str, dict[str, Any]] = {}
    for run in result["runs"]:
        last[run["mode"]] = run
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, run in last.items():
        trace = next((s["rss_trace"] for s in run["steps"] if "rss_trace" in s), None)
        if trace:
            ax.plot([t for t, _ in trace], [r / GiB for _, r in trace], label=mode)
    cfg = result["config"]
    ax.set_title(
        f"RSS above baseline during one training step ({cfg['blocks']} blocks, d={cfg['d_model']}, "
        f"{cfg['batch']}x{cfg['seq']} tokens)"
    )
    ax.set_xlabel("time in step (s)")
    ax.set_ylabel("RSS - RSS before step (GiB)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train-step benchmark: step time and activation memory with each "
        "offloading mode, as ratios to no offloading.",
    )
    p.add_argument(
        "--modes",
        help=f"comma-separated modes (CPU: {', '.join(CPU_MODES)}; "
        f"CUDA: {', '.join(CUDA_MODES)}); default: all",
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument(
        "--steps",
        type=int,
        default=2,
        help="measured steps per process, after one warm-up (default 2)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--size", default="bench", help="base model size: bench (default), small, tiny")
    p.add_argument("--blocks", type=int, help="override: transformer blocks (bench: 8)")
    p.add_argument("--d-model", type=int, help="override: model width (bench: 512)")
    p.add_argument("--heads", type=int, help="override: attention heads (bench: 8)")
    p.add_argument("--seq", type=int, help="override: tokens per sequence (bench: 512)")
    p.add_argument("--batch", type=int, help="override: sequences per batch (bench: 8)")
    p.add_argument(
        "--tsh-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword for tsh.offload() in the tsh-* modes, e.g. max_inflight=128MiB (repeatable)",
    )
    p.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        metavar="BYTES",
        help="diagnostic: run the workers with glibc's MALLOC_MMAP_THRESHOLD_=BYTES, so "
        "freed buffers of at least that size go back to the OS at once (RSS then tracks "
        "live memory, not the heap glibc keeps)",
    )
    p.add_argument(
        "--json", metavar="FILE", help="write every figure (and per-step samples) as JSON"
    )
    p.add_argument(
        "--plot", metavar="FILE.png", help="draw RSS over time per mode (needs matplotlib)"
    )
    # Internal: one mode in this process.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--ref-grads", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        raise SystemExit("train_step: --steps and --rounds must be >= 1")
    if args.worker:
        Path(args.result).write_text(json.dumps(run_worker(args)))
        return 0
    result = run_benchmark(args)
    print(f"\ntrain_step: {result['machine']}; {result['date']}")
    cfg = result["config"]
    print(
        f"model: {cfg['blocks']} blocks, d={cfg['d_model']}, {cfg['heads']} heads, "
        f"batch {cfg['batch']} x {cfg['seq']} tokens, fp32, {args.device}; "
        f"{args.rounds} rounds x {args.steps} steps (+1 warm-up) per mode"
    )
    if result["tsh_options"]:
        print(f"tsh.offload options: {result['tsh_options']}")
    if args.malloc_mmap_threshold is not None:
        print(f"workers ran with MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold}")
    print()
    print(format_table(result))
    bad = [m for m, e in result["summary"].items() if e["grads_identical"] is False]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    if bad:
        print(f"\ngradients DIFFER from no offloading in: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
