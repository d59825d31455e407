"""One training step of a GPT-like transformer, with and without activation offloading.

Each mode runs in its own subprocess (so every mode starts from a fresh process and
its RSS and ``ru_maxrss`` are its own), modes are interleaved over ``--rounds``
rounds, and every figure is reported as a ratio to ``none`` measured in the same
round, then the median over rounds: this machine is shared and noisy, and only
side-by-side ratios survive that.

Modes (CPU)::

    none          no hooks
    tutorial      the PyTorch tutorial's disk hooks: torch.save per saved tensor
                  (tensors under 1000 elements stay), torch.load(weights_only=True)
    save_on_cpu   torch.autograd.graph.save_on_cpu() (a no-op copy on CPU: baseline cost)
    checkpoint    every block under torch.utils.checkpoint(use_reentrant=False)
    tsh-disk      tsh.offload() into a temporary local directory
    tsh-memory    tsh.offload("memory://")
    tsh-disk@SIZE tsh.offload(device_budget=SIZE), e.g. tsh-disk@512MiB
                  (``--budget-sweep 256MiB,512MiB`` adds one such mode per size);
                  SIZE may be ``auto`` (the memory there is) or a share, ``60%``

With ``--device cuda`` the modes are ``none``, ``save_on_cpu`` (pin_memory=True),
``checkpoint``, ``tsh-disk`` and ``tsh-memory`` and memory is
``torch.cuda.max_memory_allocated``.

Memory is measured as DESIGN.md "Figures that count" defines it, the way a user
meets it: the process's high-water RSS over the whole run (warm-up step included)
minus the RSS before the first step. A thread samples RSS every ~1 ms from before
the warm-up to after the last step; the figure is checked against
``getrusage(RUSAGE_SELF).ru_maxrss`` (the kernel's exact high-water mark): when
``ru_maxrss`` rose during the run, the run's peak is at least that, so the larger
of the two is reported and the sampler's miss is recorded. The harness does
nothing for memory between steps (no ``gc.collect``, no heap trimming): whatever a
mode does for memory it does by itself. Beside it, for comparison with earlier
figures only, the per-step delta (peak during a measured step minus RSS before it)
is shown; it flatters, because the RSS before a step already holds what the last
step left. GPU: ``max_memory_allocated`` over the whole run minus the allocation
before the first step.

Per process: build the model (seeded) and one SGD optimiser, run one warm-up step,
then ``--steps`` measured steps (gradient buffers already exist after the warm-up:
``zero_grad(set_to_none=False)``). The first ``none`` process saves every step's
gradients; every other process compares its own with ``torch.equal``, parameter
by parameter, step by step.

    python benchmarks/train_step.py                          # the full benchmark
    python benchmarks/train_step.py --blocks 2 --seq 128 --rounds 1 --steps 1   # quick
    python benchmarks/train_step.py --modes none,checkpoint,tsh-disk \
        --budget-sweep 256MiB,512MiB,1GiB --json bench-out/x.json --plot bench-out/x.png
    python benchmarks/train_step.py --modes none,tsh-disk --tsh-option max_inflight=128MiB

Budgets (``device_budget``): ``--dynamic`` draws each step's sequence length from a
fixed seeded list within +-30% of ``--seq`` (the model's positions cover the longest),
as dynamic padding does; the "budgets" table then shows what the plan kept per step
against the budget in force. ``--limit-activation 0.5`` (root, a memory cgroup)
runs the modes a second time, each in a child cgroup whose hard limit is its own
charge before the first step plus 0.5x no offloading's activation memory: which
finish, which are OOM-killed, and their step times there::

    python benchmarks/train_step.py --modes none,tsh-disk,tsh-disk@auto --limit-activation 0.5
    python benchmarks/train_step.py --modes none,tsh-disk@512MiB --dynamic
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
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

CPU_MODES = ("none", "tutorial", "save_on_cpu", "checkpoint", "tsh-disk", "tsh-memory")
CUDA_MODES = ("none", "save_on_cpu", "checkpoint", "tsh-disk", "tsh-memory")
BUDGET_SEP = "@"  # tsh-disk@512MiB: tsh-disk with device_budget=512MiB
TUTORIAL_THRESHOLD = 1000  # elements; SAVE_ON_DISK_THRESHOLD in the PyTorch tutorial
SAMPLE_PERIOD_S = 0.001
TRACE_POINTS = 1500  # RSS samples kept per run for the plot
GiB = float(1 << 30)


# --------------------------------------------------------------------------- memory
class RssSampler:
    """Samples this process's RSS on a background thread for the whole run.

    Reads ``/proc/self/statm`` directly (a few microseconds) rather than through
    psutil, so sampling every ~1 ms costs the measured steps next to nothing.
    ``mark(label)`` records an event (forward/backward boundaries) on the same clock.
    """

    def __init__(self, period_s: float = SAMPLE_PERIOD_S) -> None:
        self.period_s = period_s
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak = 0
        self.samples: list[tuple[float, int]] = []
        self.marks: list[tuple[float, str]] = []
        self._t0 = 0.0

    def rss(self) -> int:
        fields = os.pread(self._fd, 128, 0).split()
        return int(fields[1]) * self._page

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def start(self) -> int:
        """Start sampling; returns the RSS now (the run's baseline)."""
        self._t0 = time.perf_counter()
        base = self.peak = self.rss()
        self.samples = [(0.0, base)]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return base

    def _run(self) -> None:
        samples = self.samples
        while not self._stop.wait(self.period_s):
            r = self.rss()
            if r > self.peak:
                self.peak = r
            samples.append((self.now(), r))

    def mark(self, label: str) -> None:
        r = self.rss()
        if r > self.peak:
            self.peak = r
        self.marks.append((self.now(), label))

    def stop(self) -> int:
        """Stop sampling; returns the peak RSS seen (including one last reading)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.rss())
        return self.peak

    def peak_between(self, t0: float, t1: float) -> int:
        """The highest sample in ``[t0, t1]`` (for the per-step delta)."""
        return max((r for t, r in self.samples if t0 <= t <= t1), default=0)

    def trace(self, points: int = TRACE_POINTS) -> list[tuple[float, int]]:
        """The samples thinned to about ``points``, keeping each stretch's maximum."""
        samples = self.samples
        every = max(1, len(samples) // points)
        out = []
        for i in range(0, len(samples), every):
            chunk = samples[i : i + every]
            out.append(max(chunk, key=lambda s: s[1]))
        return out


def ru_maxrss_bytes() -> int:
    """The kernel's high-water RSS of this process so far (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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


def _checkpoint_blocks(model: Any) -> None:
    """Run every block of ``model`` under ``torch.utils.checkpoint`` (non-reentrant)."""
    import torch.utils.checkpoint

    for block in model.blocks:
        forward = block.forward

        def checkpointed(x: Any, _forward: Any = forward) -> Any:
            return torch.utils.checkpoint.checkpoint(_forward, x, use_reentrant=False)

        block.forward = checkpointed


def split_mode(mode: str) -> tuple[str, str | None]:
    """``"tsh-disk@512MiB"`` -> ``("tsh-disk", "512MiB")``; ``"none"`` -> ``("none", None)``."""
    base, sep, budget = mode.partition(BUDGET_SEP)
    return base, (budget if sep else None)


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
    """Run one mode in this process; returns the whole-run and per-step figures."""
    import torch

    from tensorstore_hooks._demo_model import GPT, synthetic_batch

    cfg, lengths = _step_config(args)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    mode, budget = split_mode(args.mode)
    torch.manual_seed(0)
    model = GPT(cfg, seed=0).to(device)
    if mode == "checkpoint":
        _checkpoint_blocks(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    names = [n for n, _ in model.named_parameters()]
    batches = [synthetic_batch(cfg, i, device=device) for i in range(1 + args.steps)]
    if lengths:  # --dynamic: each step's batch cut to its own length
        batches = [(t[:, :n], y[:, :n]) for (t, y), n in zip(batches, lengths, strict=True)]

    ref: list[dict[str, torch.Tensor]] | None = None
    ref_path = Path(args.ref_grads)
    writes_ref = mode == "none" and not ref_path.exists()
    if not writes_ref:
        ref = torch.load(ref_path, weights_only=True, map_location=device)
    mine: list[dict[str, torch.Tensor]] = []

    hooks: Any = None
    scratch = tempfile.mkdtemp(prefix="tsh-bench-tutorial-")
    if mode.startswith("tsh-"):
        import tensorstore_hooks as tsh

        url = None if mode == "tsh-disk" else "memory://"
        options = _parse_tsh_options(args.tsh_option)
        if budget is not None:
            options["device_budget"] = budget
        hooks = tsh.offload(url, **options)

    def context() -> Any:
        if mode in ("none", "checkpoint"):
            return contextlib.nullcontext()
        if mode == "tutorial":
            return _tutorial_hooks(scratch)
        if mode == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=cuda)
        return hooks

    limit = _limit_this_process(args)  # --limit-activation: the cgroup's hard limit
    sampler = RssSampler()
    steps: list[dict[str, Any]] = []
    identical = True
    mismatches: list[str] = []
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        gpu_base = torch.cuda.memory_allocated(device)
    ru_before = ru_maxrss_bytes()
    base = sampler.start()  # the RSS before the first step: the run's baseline
    for i, (tokens, targets) in enumerate(batches):
        stats_before = hooks.stats.snapshot() if hooks is not None else None
        step_rss_before = sampler.rss()
        t_start = sampler.now()
        sampler.mark(f"step {i} forward")
        t0 = time.perf_counter()
        with context():
            loss = model(tokens, targets)
        sampler.mark(f"step {i} backward")
        loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
        step_s = time.perf_counter() - t0
        sampler.mark(f"step {i} end")
        del loss
        entry: dict[str, Any] = {
            "step": i,
            "warmup": i == 0,
            "step_s": step_s,
            # Beside the honest figure only: see the module docstring.
            "step_delta_bytes": sampler.peak_between(t_start, sampler.now()) - step_rss_before,
            "rss_before": step_rss_before - base,
        }
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
    sampled_peak = sampler.stop()
    ru_after = ru_maxrss_bytes()
    # ru_maxrss is the exact high-water mark of the whole process: if it rose during
    # the run, the run reached it, whatever the sampler saw between its readings.
    peak = max(sampled_peak, ru_after) if ru_after > ru_before else sampled_peak
    memory: dict[str, Any] = {
        "act_bytes": peak - base,
        "sampled_peak_bytes": sampled_peak - base,
        "ru_maxrss_peak_bytes": (ru_after - base) if ru_after > ru_before else None,
        "sampler_missed_bytes": max(0, ru_after - sampled_peak) if ru_after > ru_before else 0,
        "samples": len(sampler.samples),
    }
    if cuda:
        memory["gpu_act_bytes"] = torch.cuda.max_memory_allocated(device) - gpu_base

    if writes_ref:
        torch.save(mine, ref_path)
    if hooks is not None:
        hooks.close()
    return {
        "mode": args.mode,
        "round": args.round,
        "device": str(device),
        "memory": memory,
        "steps": steps,
        "rss_trace": [(t, r - base) for t, r in sampler.trace()],
        "marks": sampler.marks,
        "grads_reference": writes_ref,
        "grads_identical": None if writes_ref else identical,
        "grad_mismatches": mismatches,
        "limit_bytes": limit,
        "lengths": [int(t.shape[1]) for t, _ in batches],
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
    out = {f: getattr(after, f) - getattr(before, f) for f in fields}
    out.update(_plan_delta(before, after))
    return out


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


# ------------------------------------------------------------------ budgets (device_budget)
DYNAMIC_SPREAD = 0.3  # --dynamic: lengths within +-30% of --seq
DYNAMIC_SEED = 20


def dynamic_lengths(seq: int, steps: int) -> list[int]:
    """The sequence length of each step (warm-up first) under ``--dynamic``: drawn from
    a fixed seeded list within +-30% of ``seq``, the same for every mode and round."""
    import random

    rng = random.Random(DYNAMIC_SEED)
    low, high = round(seq * (1 - DYNAMIC_SPREAD)), round(seq * (1 + DYNAMIC_SPREAD))
    return [rng.randint(low, high) for _ in range(1 + steps)]


def _step_config(args: argparse.Namespace) -> tuple[Any, list[int] | None]:
    """The model config and, under ``--dynamic``, each step's sequence length (then the
    model's positions cover the longest)."""
    cfg = _model_config(args)
    if not args.dynamic:
        return cfg, None
    lengths = dynamic_lengths(cfg.seq, args.steps)
    return dataclasses.replace(cfg, seq=max(lengths)), lengths


def _plan_delta(before: Any, after: Any) -> dict[str, float]:
    """What the device_budget plan kept in a step, and the budget in force at its end."""
    route_before = before.per_rule.get("device_budget")
    route_after = after.per_rule.get("device_budget")
    kept = (route_after.bytes if route_after else 0) - (route_before.bytes if route_before else 0)
    budget = after.effective_device_budget
    return {"planned_bytes": kept, "device_budget": -1 if budget is None else budget}


def _limit_this_process(args: argparse.Namespace) -> int | None:
    """``--limit-activation``: this worker's cgroup limited to its charge now plus the
    bytes the orchestrator gave (the charge before the first step is the baseline)."""
    if args.limit_bytes is None:
        return None
    from _cgroup import limit_above_charge

    return limit_above_charge(args.limit_bytes)


def format_budgets(result: dict[str, Any]) -> str:
    """Per mode with a device_budget: what the plan kept per measured step (mean, least,
    most) and the budget in force; kept never passes the budget."""
    lines = [
        "| mode | lengths | budget in force | kept per step: mean | least | most "
        "| most <= budget |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in result["summary"]:
        if BUDGET_SEP not in mode:
            continue
        steps = [s for r in result["runs"] if r["mode"] == mode for s in r["steps"]]
        measured = [s["stats"] for s in steps if not s["warmup"] and "stats" in s]
        if not measured:
            continue
        kept = [st["planned_bytes"] for st in measured]
        budgets = [st["device_budget"] for st in measured]
        ok = all(k <= b for k, b in zip(kept, budgets, strict=True) if b >= 0)
        lengths = sorted({n for r in result["runs"] if r["mode"] == mode for n in r["lengths"]})
        span = f"{lengths[0]}..{lengths[-1]}" if len(lengths) > 1 else str(lengths[0])
        lines.append(
            f"| {mode} | {span} | {min(budgets) / GiB:.3f}..{max(budgets) / GiB:.3f} GiB | "
            f"{statistics.mean(kept) / GiB:.3f} GiB | {min(kept) / GiB:.3f} GiB | "
            f"{max(kept) / GiB:.3f} GiB | {'yes' if ok else 'NO'} |"
        )
    return "\n".join(lines)


def run_limited(
    args: argparse.Namespace, modes: list[str], summary: dict[str, Any], ref: Path
) -> Any:
    """``--limit-activation``: every mode again, each worker in a child memory cgroup
    limited to its charge before the first step plus SHARE x none's activation memory.
    Returns the runs (an OOM-killed one is recorded as such), or why it could not run."""
    import _cgroup

    why = _cgroup.unavailable()
    if why is not None:
        return f"skipped: {why} (a hard memory limit needs root and a memory cgroup)"
    extra = int(args.limit_activation * summary["none"]["act_bytes"])
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tsh-bench-limited-") as tmp:
        for rnd, mode in _schedule(modes, args.rounds):
            result = Path(tmp) / f"{mode}-{rnd}.json"
            print(f"[limited, round {rnd + 1}/{args.rounds}] {mode} ...", file=sys.stderr)
            group = _cgroup.ChildGroup()
            try:
                argv = [*_worker_argv(args, mode, rnd, result, ref), "--limit-bytes", str(extra)]
                env = _worker_env(args)  # (the worker imports _cgroup from its folder)
                proc = subprocess.run(group.argv(argv), env=env, check=False)
                killed = group.oom_kills() > 0 or proc.returncode == -9
                entry: dict[str, Any] = {"mode": mode, "round": rnd, "oom_killed": killed}
                entry["peak_charge_bytes"] = group.read(2)
                if proc.returncode == 0 and result.exists():
                    entry.update(json.loads(result.read_text()))
                elif not killed:
                    raise SystemExit(f"train_step: limited {mode} exited {proc.returncode}")
            finally:
                group.remove()
            entry["oom_killed"] = killed
            runs.append(entry)
    return runs


def _plan_cells(runs: list[dict[str, Any]]) -> str:
    """'budget | kept' per measured step of ``runs`` (GiB, medians), or '- | -'."""
    stats = [
        s["stats"] for r in runs for s in r.get("steps", []) if not s["warmup"] and "stats" in s
    ]
    budgets = [st["device_budget"] for st in stats if st["device_budget"] >= 0]
    if not budgets:
        return "- | -"
    kept = statistics.median(st["planned_bytes"] for st in stats)
    return f"{statistics.median(budgets) / GiB:.2f} GiB | {kept / GiB:.2f} GiB"


def format_limited(result: dict[str, Any]) -> str:
    """The limited pass as a table: finished or OOM-killed, step time there as ratios
    to none's unlimited step and to offloading everything (tsh-disk) under the limit."""
    limited = result["limited"]
    if isinstance(limited, str):
        return limited
    unlimited_none = result["summary"]["none"]["step_s"]
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for run in limited:
        by_mode.setdefault(run["mode"], []).append(run)

    def step_s(runs: list[dict[str, Any]]) -> float | None:
        done = [s["step_s"] for r in runs if not r["oom_killed"] for s in r["steps"]
                if not s["warmup"]]  # fmt: skip
        return statistics.median(done) if done else None

    everything = step_s(by_mode.get("tsh-disk", []))
    lines = [
        f"hard limit: each worker's charge before its first step + "
        f"{result['limit_activation']:g}x none's activation memory "
        f"({result['limit_activation'] * result['summary']['none']['act_bytes'] / GiB:.2f} GiB)",
        "",
        "| mode | finished | step time | vs none (unlimited) | vs tsh-disk (limited) "
        "| peak charge | device_budget in force | kept per step | grads |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, runs in by_mode.items():
        t = step_s(runs)
        finished = sum(not r["oom_killed"] for r in runs)
        grads = [r.get("grads_identical") for r in runs if r.get("grads_identical") is not None]
        lines.append(
            f"| {mode} | {finished}/{len(runs)}"
            + ("" if finished == len(runs) else " (OOM-killed)")
            + f" | {f'{t:.2f}s' if t else '-'} | "
            + (f"{t / unlimited_none:.2f}x" if t else "-")
            + " | "
            + (f"{t / everything:.2f}x" if t and everything else "-")
            + f" | {max(r['peak_charge_bytes'] for r in runs) / GiB:.2f} GiB | "
            + _plan_cells(runs)
            + " | "
            + ("identical" if grads and all(grads) else "DIFFER" if grads else "-")
            + " |"
        )
    return "\n".join(lines)


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
    if args.dynamic:
        argv.append("--dynamic")
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


def parse_modes(args: argparse.Namespace) -> list[str]:
    """The modes to run: ``--modes`` (or every mode) plus one per ``--budget-sweep`` size."""
    from tensorstore_hooks._units import check_budget

    default = CUDA_MODES if args.device == "cuda" else CPU_MODES
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else list(default)
    for size in (args.budget_sweep or "").split(","):
        if size.strip():
            modes.append(f"tsh-disk{BUDGET_SEP}{size.strip()}")
    allowed = (*CUDA_MODES, "tutorial") if args.device == "cuda" else CPU_MODES
    for m in modes:
        base, budget = split_mode(m)
        if base not in allowed or (budget is not None and not base.startswith("tsh-")):
            raise SystemExit(
                f"train_step: unknown mode {m!r}; choose from {', '.join(allowed)}, or "
                f"tsh-disk{BUDGET_SEP}SIZE / tsh-memory{BUDGET_SEP}SIZE for a device_budget"
            )
        if budget is not None:
            try:
                check_budget(budget)
            except ValueError as e:
                raise SystemExit(f"train_step: mode {m!r}: device_budget: {e}") from None
    modes = list(dict.fromkeys(modes))
    if "none" not in modes:
        modes.insert(0, "none")  # every figure is a ratio to it
    return modes


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (round, mode) subprocess and summarise."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "train_step: --device cuda needs a CUDA device, but torch.cuda.is_available() is "
            f"False (torch {torch.__version__}). Run on a GPU machine or drop --device cuda."
        )
    modes = parse_modes(args)
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
        # (Under the limit, every mode compares with the unlimited none's gradients.)
        limited = run_limited(args, modes, summary, ref) if args.limit_activation else None
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
        "dynamic": args.dynamic,
        "limit_activation": args.limit_activation,
        "limited": limited,
    }


def _machine() -> str:
    import platform

    import torch

    cores = os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()}, {cores} cores, {gpu}, torch {torch.__version__}"


def summarise(runs: list[dict[str, Any]], modes: list[str], *, gpu: bool) -> dict[str, Any]:
    """Per mode: medians, and ratios to ``none`` taken per round then medianed.

    Memory is the whole run's (``run["memory"]``); the per-step delta is carried
    beside it.
    """
    mem_key = "gpu_act_bytes" if gpu else "act_bytes"

    def measured(run: dict[str, Any]) -> list[dict[str, Any]]:
        return [s for s in run["steps"] if not s["warmup"]]

    per_round: dict[tuple[str, int], dict[str, float]] = {}
    for run in runs:
        per_round[(run["mode"], run["round"])] = {
            "step_s": statistics.median(s["step_s"] for s in measured(run)),
            "mem": run["memory"][mem_key],
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
            "act_bytes": statistics.median(r["memory"][mem_key] for r in mine),
            "step_delta_bytes": statistics.median(s["step_delta_bytes"] for s in steps),
            "sampler_missed_bytes": max(r["memory"]["sampler_missed_bytes"] for r in mine),
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
    mem = "GPU memory (whole run)" if gpu else "memory (whole run)"
    head = (
        f"| mode | step time | vs none | {mem} | vs none | per-step delta | tensors offloaded "
        "| bytes offloaded | bytes kept | prefetch hits | tail hits | fallbacks | pack stall "
        "| unpack stall | grads |"
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
                f"{st['bytes_kept'] / GiB:.2f} GiB",
                hits,
                f"{st['tail_hits']:.0f}",
                f"{st['fallbacks']:.0f}",
                f"{st['pack_stall_s']:.2f}s",
                f"{st['unpack_stall_s']:.2f}s",
            ]
        else:
            cols = ["-"] * 8
        lines.append(
            f"| {mode} | {e['step_s']:.2f}s | {tr} | {e['act_bytes'] / GiB:.2f} GiB | {mr} | "
            f"{e['step_delta_bytes'] / GiB:.2f} GiB | " + " | ".join(cols) + f" | {grads} |"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Two panels: memory against time of every mode (ratios to ``none``; the
    ``device_budget`` sweep joined by a line), and RSS above the baseline over the
    whole run of each mode's last round, with forward/backward boundaries marked.
    Needs matplotlib (``pip install matplotlib``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("train_step: --plot needs matplotlib: pip install matplotlib") from e
    summary = result["summary"]
    fig, (curve, rss) = plt.subplots(1, 2, figsize=(15, 5.5))
    sweep: list[tuple[float, float, str]] = []
    for mode, e in summary.items():
        if e["time_ratio"] is None or e["mem_ratio"] is None:
            continue
        x, y = e["time_ratio"], 100 * e["mem_ratio"]
        if BUDGET_SEP in mode:
            sweep.append((x, y, mode.split(BUDGET_SEP, 1)[1]))
            continue
        curve.scatter([x], [y], s=40, zorder=3)
        curve.annotate(mode, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    if sweep:
        sweep.sort(key=lambda p: p[1])
        curve.plot(
            [p[0] for p in sweep], [p[1] for p in sweep], "o-", color="tab:purple",
            label="tsh-disk, device_budget sweep",
        )  # fmt: skip
        for x, y, label in sweep:
            curve.annotate(label, (x, y), textcoords="offset points", xytext=(5, -10), fontsize=8)
        curve.legend(loc="upper right", fontsize=8)
    curve.axhline(25, color="grey", lw=0.8, ls="--")
    curve.axvline(1.10, color="grey", lw=0.8, ls="--")
    curve.set_xlabel("step time / no offloading")
    curve.set_ylabel("memory (whole-run high-water RSS) / no offloading, %")
    curve.set_title("memory against time, every mode")
    curve.grid(alpha=0.3)

    last: dict[str, dict[str, Any]] = {}
    for run in result["runs"]:
        last[run["mode"]] = run
    for mode, run in last.items():
        trace = run.get("rss_trace") or []
        line = rss.plot([t for t, _ in trace], [r / GiB for _, r in trace], label=mode, lw=1)
        color = line[0].get_color()
        for t, label in run.get("marks", []):
            if label.endswith("backward"):
                rss.axvline(t, color=color, lw=0.6, ls=":")
            elif label.endswith("forward"):
                rss.axvline(t, color=color, lw=0.6, ls="--", alpha=0.5)
    cfg = result["config"]
    rss.set_title(
        f"RSS above baseline, whole run ({cfg['blocks']} blocks, d={cfg['d_model']}, "
        f"{cfg['batch']}x{cfg['seq']} tokens); --: forward starts, ..: backward starts",
        fontsize=9,
    )
    rss.set_xlabel("time since the first step started (s)")
    rss.set_ylabel("RSS - RSS before the first step (GiB)")
    rss.grid(alpha=0.3)
    rss.legend(fontsize=7)
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
        "--budget-sweep",
        metavar="SIZES",
        help="comma-separated device_budget sizes: adds a tsh-disk@SIZE mode for each, "
        "e.g. 256MiB,512MiB,1GiB",
    )
    p.add_argument(
        "--dynamic",
        action="store_true",
        help="each step's sequence length drawn from a fixed seeded list within +-30%% of "
        "--seq (dynamic padding); the budgets table shows what device_budget kept",
    )
    p.add_argument(
        "--limit-activation",
        type=float,
        metavar="SHARE",
        help="root: run the modes again, each in a child memory cgroup limited to its charge "
        "before the first step plus SHARE x none's activation memory (e.g. 0.5)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="write every figure (and the RSS traces) as JSON; its folder is created",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw memory against time of every mode and RSS over the run (needs "
        "matplotlib); its folder is created",
    )
    # Internal: one mode in this process.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--ref-grads", help=argparse.SUPPRESS)
    p.add_argument("--limit-bytes", type=int, help=argparse.SUPPRESS)
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
    if any(BUDGET_SEP in m for m in result["summary"]):
        print("\ndevice_budget: what the plan kept" + (" (--dynamic)" if args.dynamic else ""))
        print(format_budgets(result))
    if result["limited"] is not None:
        print("\nunder a hard memory limit (--limit-activation)")
        print(format_limited(result))
    bad = [m for m, e in result["summary"].items() if e["grads_identical"] is False]
    missed = {m: e["sampler_missed_bytes"] for m, e in result["summary"].items()}
    if any(missed.values()):
        worst = max(missed.values()) / (1 << 20)
        print(f"\nru_maxrss was above the sampled peak by up to {worst:.1f} MiB (reported)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.plot)
    if bad:
        print(f"\ngradients DIFFER from no offloading in: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
