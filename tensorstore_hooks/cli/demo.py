"""``tensorstore-hooks demo``: train a small GPT with and without offloading, side by side.

Two copies of one seeded model train on the same synthetic batches with SGD in
interleaved rounds: each round runs one step of each (the order alternates, so
neither always finds a warmer machine), the reference without hooks and the other
inside ``tsh.offload(STORE)``. After every round the gradients are compared with
``torch.equal`` (so the models stay in lock-step); the table at the end shows the
activation memory (peak RSS during the step minus RSS before it) and step time as
medians over the rounds with their range, the per-round ratio of the two, and a
verdict that says so when the rounds disagree (NOTE [ Demo verdicts ]). Exit status 1
if any gradient differed.

NOTE [ Demo verdicts ]
A shared or busy machine makes single steps vary by more than offloading changes
them, and a median of two steps can say "0.48x" either way. So:

1. The first round pays one-time costs (threads, store layout, kernels) and is left
   out when there is more than one; medians and ranges are over the others.
2. Each round's offload/no-offload ratio is taken within the round (the two steps ran
   back to back), and the verdict reads those ratios: when every round lies on one
   side of 1.0 it says which side and by how much (the range); when they straddle 1.0
   it says the spread is too wide to conclude, and how to get a clearer answer.
3. Fewer than three measured rounds are too few for any verdict; the demo says so.
4. Each run has a process of its own (``--processes``, the default for torch): the
   reference never shares an allocator, a heap or a pipeline with the offloaded run,
   so neither pays for the other (a heap the other run fragmented, its threads, its
   process-wide settings). The parent steps the two processes in lock-step, one step
   each per round in alternating order, and compares the SHA-256 of every gradient
   they send back. ``--same-process`` runs both in this process, as before.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    import torch

    from tensorstore_hooks.cli._demo_model import GPTConfig
    from tensorstore_hooks.hooks import OffloadHooks
    from tensorstore_hooks.pipeline import OffloadStats
    from tensorstore_hooks.storage import TensorStore

__all__ = [
    "DemoHooks",
    "Pair",
    "RssSampler",
    "Spread",
    "TorchPair",
    "register",
    "release_free_memory",
    "run",
    "verdict",
]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    parser = subparsers.add_parser(
        "demo",
        help="train a small GPT with and without offloading and compare",
        description=(
            "Train a small GPT-like model on synthetic tokens, once without hooks and once "
            "with tsh.offload(STORE), from identical weights, in interleaved rounds (one "
            "step of each per round). Prints activation memory (peak RSS during a step "
            "minus RSS before it) and step time as medians with their range, the per-round "
            "ratios and a verdict that says when their spread is too wide to conclude, "
            "tensors and bytes offloaded, prefetch hits, "
            "fallbacks, and whether every gradient was bit-identical (exit status 1 if not). "
            "The library's default budgets (prefetch 256MiB, max_inflight 512MiB) are sized "
            "for real models; a demo step saves only tens of MiB, all of which would fit "
            "in them, so the demo scales them down unless --prefetch/--max-inflight say "
            "otherwise."
        ),
    )
    parser.add_argument(
        "--store",
        metavar="URL",
        default=None,
        help="store URL (file://..., memory://, s3://..., tsh://HOST:PORT); "
        "default: a temporary local directory, removed afterwards",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=5,
        metavar="N",
        help="rounds, each one step with and one without offloading (default 5; the "
        "first is warm-up); more rounds give a firmer verdict on a busy machine",
    )
    parser.add_argument(
        "--size",
        choices=("tiny", "small"),
        default="tiny",
        help="tiny (default, a few seconds) or small (about 4x the work)",
    )
    parser.add_argument(
        "--framework",
        choices=("torch", "paddle"),
        default="torch",
        help="torch (default) or paddle (needs pip install -e '.[paddle]' in this repository); "
        "both train the same model from the same weights",
    )
    parser.add_argument(
        "--prefetch",
        metavar="SIZE",
        help="bytes read ahead in backward (default: scaled to the model, see below)",
    )
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="write a Chrome/Perfetto timeline of the offloaded steps' I/O to FILE "
        "(hooks.trace; open in https://ui.perfetto.dev, or render it with "
        "benchmarks/plot_timeline.py)",
    )
    parser.add_argument(
        "--same-process",
        action="store_true",
        help="run both models in this process (default for torch: each in a process of "
        "its own, so neither pays for the other's heap, threads or settings; paddle "
        "always runs in this process)",
    )
    parser.add_argument(
        "--max-inflight",
        metavar="SIZE",
        help="bytes written behind before forward waits (default: scaled to the model)",
    )
    parser.set_defaults(func=run)


# ------------------------------------------------------------------------- memory
class RssSampler:
    """Tracks the peak resident set size of this process on a background thread.

    ``start()`` returns the RSS at that moment; ``stop()`` the highest RSS seen since,
    sampled every ``period_s`` (reading ``/proc/self/statm`` costs a few microseconds;
    elsewhere psutil is used). With ``record=True`` every sample is kept in
    ``samples`` as ``(seconds since start, rss bytes)``.
    """

    def __init__(self, period_s: float = 0.002) -> None:
        self.period_s = period_s
        self.peak = 0
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._record = False
        self._fd: int | None = None
        self._page = 4096
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
            self._page = os.sysconf("SC_PAGE_SIZE")
        except (OSError, AttributeError, ValueError):
            import psutil

            self._proc = psutil.Process()

    def rss(self) -> int:
        """The resident set size now, in bytes."""
        if self._fd is not None:
            return int(os.pread(self._fd, 128, 0).split()[1]) * self._page
        return int(self._proc.memory_info().rss)

    def start(self, *, record: bool = False) -> int:
        """Start sampling; returns the RSS now (the baseline)."""
        self._stop.clear()
        self._record = record
        self.samples = []
        self._t0 = time.perf_counter()
        base = self.peak = self.rss()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return base

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            r = self.rss()
            if r > self.peak:
                self.peak = r
            if self._record:
                self.samples.append((time.perf_counter() - self._t0, r))

    def stop(self) -> int:
        """Stop sampling; returns the peak RSS seen since ``start()``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.peak = max(self.peak, self.rss())
        return self.peak

    def close(self) -> None:
        self.stop()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def release_free_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc ``malloc_trim``).

    Without it, memory glibc kept from the previous step would make the next step's
    "RSS before" include it, and every step after the first would look free.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# --------------------------------------------------------------------------- demo
# size -> (prefetch, max_inflight): small next to the ~200 MiB (tiny) / ~600 MiB (small)
# a step saves, so offloading has room to lower the peak.
_DEMO_BUDGETS = {"tiny": ("4MiB", "8MiB"), "small": ("16MiB", "32MiB")}


@dataclass(frozen=True, slots=True)
class Spread:
    """Median and range of one figure over the measured rounds."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            return cls(0.0, 0.0, 0.0, 0)
        return cls(statistics.median(values), min(values), max(values), len(values))

    def format(self, fmt: Callable[[float], str]) -> str:
        """``median (low-high)``; the median alone for one value."""
        if self.n <= 1:
            return fmt(self.median)
        low, high = fmt(self.low), fmt(self.high)
        low_num, _, low_unit = low.rpartition(" ")
        high_num, _, high_unit = high.rpartition(" ")
        if low_num and high_num and low_unit == high_unit:  # "145.90-150.86 MiB"
            return f"{fmt(self.median)} ({low_num}-{high})"
        return f"{fmt(self.median)} ({low}-{high})"


def _ratios(off: Sequence[float], ref: Sequence[float]) -> list[float]:
    """Per-round ratios offload / no offload (rule 2 of NOTE [ Demo verdicts ])."""
    return [o / r for o, r in zip(off, ref, strict=True) if r > 0]


def verdict(
    what: str,
    ratios: Spread,
    rounds: int,
    fmt: Callable[[float], str],
    words: tuple[str, str] = ("lower", "higher"),
) -> str:
    """One line on what the rounds show about ``what`` (NOTE [ Demo verdicts ]);
    ``words``: how to say a ratio below and above 1."""
    if rounds < 3 or ratios.n < 3:
        return (
            f"{what}: {rounds} measured round{'s' if rounds != 1 else ''}: too few to "
            "conclude; run --steps 5 or more"
        )
    span = f"{fmt(ratios.low)}-{fmt(ratios.high)} of no offload over {ratios.n} rounds"
    if ratios.high < 1.0:
        return f"{what}: {words[0]} with offloading in every round ({span})"
    if ratios.low > 1.0:
        return f"{what}: {words[1]} with offloading in every round ({span})"
    return (
        f"{what}: the rounds disagree ({span}): the spread is too wide to conclude "
        f"whether it is {words[0]} or {words[1]} with offloading here; rerun with more "
        "--steps, on a quieter machine"
    )


def _fmt_times(*spreads: Spread) -> list[str]:
    """Format durations in one unit (ms below a second, else s) so columns compare."""
    if max(s.high for s in spreads) < 1:
        return [s.format(lambda x: f"{x * 1e3:.0f} ms") for s in spreads]
    return [s.format(lambda x: f"{x:.2f} s") for s in spreads]


class DemoHooks(Protocol):
    """What the demo uses of the hooks a :class:`Pair` makes (torch's or Paddle's
    ``OffloadHooks``): a context manager around the offloaded step's forward."""

    @property
    def stats(self) -> OffloadStats: ...

    @property
    def store(self) -> TensorStore: ...

    def trace(self, path: str) -> AbstractContextManager[object]: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> object: ...

    def __exit__(self, *exc: object) -> None: ...


class Pair(Protocol):
    """Two identical models trained side by side, ``"ref"`` plain and ``"off"`` under
    hooks: each round calls ``step`` for both, then ``mismatches``, then ``optimizer_step``."""

    framework: str
    """``"torch"`` or ``"paddle"``."""
    n_params: int
    """Parameters whose gradients are compared each round."""

    def offload(self, store: str | None, *, prefetch: str, max_inflight: str) -> DemoHooks:
        """The hooks for the ``"off"`` run (``store``: a URL, ``None``: a temporary one)."""
        ...

    def step(self, which: str, step: int, hooks: AbstractContextManager[object] | None) -> None:
        """Forward (inside ``hooks``, if any) and backward of run ``which`` on batch ``step``."""
        ...

    def mismatches(self, step: int) -> list[str]:
        """One line per parameter whose gradients differ between the runs."""
        ...

    def optimizer_step(self) -> None:
        """One SGD step of both runs; gradients are zeroed."""
        ...


class TorchPair:
    """Two identical torch GPTs trained side by side: ``ref`` plain, ``off`` under hooks."""

    framework = "torch"

    def __init__(self, cfg: GPTConfig) -> None:
        import torch

        from tensorstore_hooks.cli._demo_model import GPT

        self.cfg = cfg
        self.models = {"ref": GPT(cfg, seed=0), "off": GPT(cfg, seed=0)}
        self.opts = {
            which: torch.optim.SGD(m.parameters(), lr=0.05) for which, m in self.models.items()
        }
        self.n_params = sum(1 for _ in self.models["ref"].parameters())

    @staticmethod
    def offload(store: str | None, *, prefetch: str, max_inflight: str) -> OffloadHooks:
        import tensorstore_hooks as tsh

        return tsh.offload(store, prefetch=prefetch, max_inflight=max_inflight)

    def step(self, which: str, step: int, hooks: AbstractContextManager[object] | None) -> None:
        from tensorstore_hooks.cli._demo_model import synthetic_batch

        tokens, targets = synthetic_batch(self.cfg, step)
        with hooks if hooks is not None else contextlib.nullcontext():
            loss = self.models[which](tokens, targets)
        loss.backward()

    def mismatches(self, step: int) -> list[str]:
        import torch

        out = []
        ref, off = self.models["ref"], self.models["off"]
        for (name, p_ref), p_off in zip(ref.named_parameters(), off.parameters(), strict=True):
            g_ref, g_off = p_ref.grad, p_off.grad
            if g_ref is None or g_off is None or not torch.equal(g_ref, g_off):
                out.append(f"step {step}: {name}")
        return out

    def optimizer_step(self) -> None:
        for opt in self.opts.values():
            opt.step()
            opt.zero_grad(set_to_none=False)


def _make_pair(framework: str, cfg: GPTConfig) -> Pair:
    if framework == "paddle":
        try:
            from tensorstore_hooks.cli._paddle_demo import PaddlePair
        except ImportError as e:
            raise SystemExit(
                f"demo: --framework paddle needs PaddlePaddle ({e}); "
                "pip install -e '.[paddle]' in this repository"
            ) from e
        return PaddlePair(cfg)
    return TorchPair(cfg)


@dataclass(frozen=True, slots=True)
class _Setup:
    """What one demo runs with: the command line, the defaults, and the store it got."""

    framework: str
    size: str
    cfg: GPTConfig
    steps: int
    """Rounds, each one step of each run."""
    store_url: str
    temporary: bool
    """The store is removed when the hooks close."""
    prefetch: str
    max_inflight: str
    trace: str | None
    """Where the timeline goes (``--trace``), or ``None``."""
    n_params: int
    processes: bool
    """Each run in a process of its own (rule 4 of NOTE [ Demo verdicts ])."""


def _per_run() -> dict[str, list[float]]:
    return {"ref": [], "off": []}


@dataclass(slots=True)
class _Rounds:
    """What the rounds measured, per run (``"ref"``, ``"off"``) in round order."""

    mem: dict[str, list[float]] = field(default_factory=_per_run)
    """Activation memory: peak RSS during the step minus RSS before it, bytes."""
    secs: dict[str, list[float]] = field(default_factory=_per_run)
    """Step time, seconds."""
    offloaded: list[tuple[int, int]] = field(default_factory=list)
    """Tensors and bytes each step of the ``"off"`` run offloaded."""
    mismatched: list[str] = field(default_factory=list)
    """Gradients that differed, one line each."""
    compared: int = 0
    """Gradients compared."""


@dataclass(frozen=True, slots=True)
class _Summary:
    """The measured rounds reduced as NOTE [ Demo verdicts ] says."""

    skip: int
    """Warm-up rounds left out (rule 1)."""
    measured: int
    mem: dict[str, Spread]
    time: dict[str, Spread]
    mem_ratio: Spread
    """Per-round ratios offload / no offload (rule 2)."""
    time_ratio: Spread
    tensors: float
    """Median tensors offloaded per step."""
    nbytes: float
    """Median bytes offloaded per step."""

    @classmethod
    def of(cls, rounds: _Rounds, steps: int) -> _Summary:
        skip = 1 if steps > 1 else 0  # rule 1: the first round is warm-up
        offloaded = rounds.offloaded[skip:]
        return cls(
            skip=skip,
            measured=steps - skip,
            mem={k: Spread.of(v[skip:]) for k, v in rounds.mem.items()},
            time={k: Spread.of(v[skip:]) for k, v in rounds.secs.items()},
            mem_ratio=Spread.of(_ratios(rounds.mem["off"][skip:], rounds.mem["ref"][skip:])),
            time_ratio=Spread.of(_ratios(rounds.secs["off"][skip:], rounds.secs["ref"][skip:])),
            tensors=statistics.median([n for n, _ in offloaded]),
            nbytes=statistics.median([b for _, b in offloaded]),
        )


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 if every gradient matched, 1 otherwise."""
    from tensorstore_hooks.cli._demo_model import config_for

    if args.steps < 1:
        print("demo: --steps must be >= 1", file=sys.stderr)
        return 2
    cfg = config_for(args.size)
    # See the description: budgets about a tenth of the step's saved bytes.
    budgets = _DEMO_BUDGETS[args.size]
    prefetch = args.prefetch or budgets[0]
    max_inflight = args.max_inflight or budgets[1]
    if args.framework == "torch" and not getattr(args, "same_process", False):
        return _run_in_processes(args, cfg, prefetch, max_inflight)
    pair = _make_pair(args.framework, cfg)
    hooks = pair.offload(args.store, prefetch=prefetch, max_inflight=max_inflight)
    setup = _Setup(
        framework=pair.framework,
        size=args.size,
        cfg=cfg,
        steps=args.steps,
        store_url=hooks.store.url,
        temporary=hooks.store.temporary,
        prefetch=prefetch,
        max_inflight=max_inflight,
        trace=args.trace,
        n_params=pair.n_params,
        processes=False,
    )
    rounds, stats = _train(pair, hooks, setup)
    return _print_report(setup, rounds, stats)


# ------------------------------------------------------------- a process per run
@dataclass(frozen=True, slots=True)
class _StepResult:
    """What a run's process sends back for one step (rule 4 of NOTE [ Demo verdicts ])."""

    secs: float
    mem: float
    offloaded: tuple[int, int]
    digests: list[tuple[str, str]]
    """``(parameter name, SHA-256 of its gradient's bytes)``, in parameter order."""


def _run_in_processes(
    args: argparse.Namespace, cfg: GPTConfig, prefetch: str, max_inflight: str
) -> int:
    """Rule 4 of NOTE [ Demo verdicts ]: each run in a process of its own, in lock-step."""
    import multiprocessing

    # fork where there is one (a second torch import costs seconds): nothing has run a
    # torch operation or started a thread of ours in this process yet.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    options = (args.size, args.store, prefetch, max_inflight, args.trace)
    procs, conns = {}, {}
    for which in ("ref", "off"):
        parent, child = ctx.Pipe()
        procs[which] = ctx.Process(  # type: ignore[attr-defined]  # typeshed: BaseContext
            target=_run_process, args=(child, which, options), daemon=True
        )
        procs[which].start()
        conns[which] = parent
    try:
        hello = {which: conns[which].recv() for which in ("ref", "off")}
        store_url, temporary, n_params = hello["off"]
        setup = _Setup(
            framework="torch", size=args.size, cfg=cfg, steps=args.steps,
            store_url=store_url, temporary=temporary, prefetch=prefetch,
            max_inflight=max_inflight, trace=args.trace, n_params=n_params, processes=True,
        )  # fmt: skip
        rounds = _lockstep(conns, setup)
        conns["off"].send(("close",))
        stats: OffloadStats = conns["off"].recv()
        conns["ref"].send(("close",))
        conns["ref"].recv()
    finally:
        for proc in procs.values():
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return _print_report(setup, rounds, stats)


def _lockstep(conns: dict[str, Connection], setup: _Setup) -> _Rounds:
    """The rounds: one step of each process, alternating which goes first; the
    gradients compared by digest after each round."""
    from tqdm import tqdm

    rounds = _Rounds()
    bar = tqdm(total=2 * setup.steps, desc="demo", unit="step", file=sys.stderr, leave=False)
    for step in range(setup.steps):
        order = ("ref", "off") if step % 2 == 0 else ("off", "ref")
        got: dict[str, _StepResult] = {}
        for which in order:  # one at a time: the other process waits, idle
            conns[which].send(("step", step))
            got[which] = result = conns[which].recv()
            rounds.secs[which].append(result.secs)
            rounds.mem[which].append(result.mem)
            bar.update(1)
        rounds.offloaded.append(got["off"].offloaded)
        rounds.compared += setup.n_params
        rounds.mismatched += [
            f"step {step}: {name}"
            for (name, a), (_, b) in zip(got["ref"].digests, got["off"].digests, strict=True)
            if a != b
        ]
        bar.set_postfix(grads="identical" if not rounds.mismatched else "DIFFER")
    bar.close()
    return rounds


_Options = tuple[str, str | None, str, str, str | None]
"""What a run's process is made with: size, store, prefetch, max_inflight, trace."""


def _run_process(conn: Connection, which: str, options: _Options) -> None:
    """One run's process: build the model, then step when the parent says so."""
    from tensorstore_hooks.cli._demo_model import config_for

    size, store, prefetch, max_inflight, trace = options
    pair = TorchPair(config_for(size))
    hooks = None
    if which == "off":
        hooks = pair.offload(store, prefetch=prefetch, max_inflight=max_inflight)
    sampler = RssSampler()
    with contextlib.ExitStack() as stack:
        if hooks is not None:
            stack.callback(hooks.close)
            if trace:
                stack.enter_context(hooks.trace(trace))
            conn.send((hooks.store.url, hooks.store.temporary, pair.n_params))
        else:
            conn.send(None)
        while True:
            command = conn.recv()
            if command[0] == "close":
                break
            conn.send(_process_step(pair, hooks, which, command[1], sampler))
        if hooks is not None:
            stack.close()  # the timeline is written, every write has landed
    sampler.close()
    conn.send(hooks.stats if hooks is not None else None)


def _process_step(
    pair: TorchPair, hooks: DemoHooks | None, which: str, step: int, sampler: RssSampler
) -> _StepResult:
    import hashlib

    rounds = _Rounds()
    _measure_step(pair, hooks, which, step, sampler, rounds)
    digests = [
        (name, hashlib.sha256(_grad_bytes(p.grad)).hexdigest())
        for name, p in pair.models[which].named_parameters()
    ]
    pair.optimizer_step()
    offloaded = rounds.offloaded[0] if rounds.offloaded else (0, 0)
    return _StepResult(rounds.secs[which][0], rounds.mem[which][0], offloaded, digests)


def _grad_bytes(grad: torch.Tensor | None) -> bytes:
    import torch

    if grad is None:
        return b"none"
    return bytes(grad.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _train(pair: Pair, hooks: DemoHooks, setup: _Setup) -> tuple[_Rounds, OffloadStats]:
    """Run the interleaved rounds, comparing gradients after each; closes ``hooks``.

    Returns what the rounds measured and the hooks' stats once every write landed.
    """
    from tqdm import tqdm

    sampler = RssSampler()
    rounds = _Rounds()
    tracing = contextlib.ExitStack()
    try:
        if setup.trace:
            tracing.enter_context(hooks.trace(setup.trace))
        bar = tqdm(total=2 * setup.steps, desc="demo", unit="step", file=sys.stderr, leave=False)
        for step in range(setup.steps):
            # Alternate which run goes first so neither always finds a warmer machine.
            order = ("ref", "off") if step % 2 == 0 else ("off", "ref")
            for which in order:
                _measure_step(pair, hooks, which, step, sampler, rounds)
                bar.update(1)
            rounds.compared += pair.n_params
            rounds.mismatched += pair.mismatches(step)
            pair.optimizer_step()
            bar.set_postfix(grads="identical" if not rounds.mismatched else "DIFFER")
        bar.close()
        tracing.close()  # writes the timeline
        hooks.flush()
        stats = hooks.stats
    finally:
        tracing.close()
        hooks.close()
        sampler.close()
    return rounds, stats


def _measure_step(
    pair: Pair, hooks: DemoHooks | None, which: str, step: int, sampler: RssSampler,
    rounds: _Rounds,
) -> None:  # fmt: skip
    """One step of run ``which``: its time and activation memory, and for the offloaded
    run the tensors and bytes it offloaded, appended to ``rounds``."""
    before = (hooks.stats.tensors_offloaded, hooks.stats.bytes_offloaded) if hooks else (0, 0)
    release_free_memory()
    base = sampler.start()
    t0 = time.perf_counter()
    pair.step(which, step, hooks if which == "off" else None)
    rounds.secs[which].append(time.perf_counter() - t0)
    rounds.mem[which].append(sampler.stop() - base)
    if which == "off" and hooks is not None:
        rounds.offloaded.append(
            (
                hooks.stats.tensors_offloaded - before[0],
                hooks.stats.bytes_offloaded - before[1],
            )
        )


def _print_report(setup: _Setup, rounds: _Rounds, stats: OffloadStats) -> int:
    """Print the table, the verdicts and the gradients' outcome; returns the exit status."""
    summary = _Summary.of(rounds, setup.steps)
    cfg = setup.cfg
    print(
        f"tensorstore-hooks demo: {setup.framework} GPT {setup.size} "
        f"({cfg.blocks} blocks, d={cfg.d_model}, "
        f"{cfg.batch}x{cfg.seq} tokens), {setup.steps} rounds, store {setup.store_url}, "
        f"prefetch {setup.prefetch}, max_inflight {setup.max_inflight}"
    )
    where = (
        "each run in a process of its own (neither pays for the other's heap, threads or "
        "settings), stepped in lock-step"
        if setup.processes
        else "both runs in this process (--same-process)"
    )
    print(f"(measured with {where}; activation memory: peak RSS during a step minus RSS before it)")
    if summary.skip:
        print(
            f"(memory and time: median (min-max) over rounds 2..{setup.steps}, each one step "
            "of each run back to back; round 1 pays one-time setup)"
        )
    print()
    _print_table(_table_rows(setup.steps, summary, stats))
    print()
    _print_verdicts(summary, setup.store_url)
    print()
    where = " (a temporary directory, removed at exit)" if setup.temporary else ""
    print(f"store: {setup.store_url}{where}")
    print(f"hooks ({setup.steps} steps): {stats.summary()}")
    if setup.trace:
        print(f"timeline: {setup.trace} (open in https://ui.perfetto.dev)")
    print()
    if rounds.mismatched:
        print(f"gradients: DIFFER in {len(rounds.mismatched)} of {rounds.compared} comparisons:")
        for m in rounds.mismatched[:10]:
            print(f"  {m}")
        return 1
    how = "torch.equal" if setup.framework == "torch" else "numpy.array_equal"
    if setup.processes:
        how = "SHA-256 of each gradient's bytes, from each run's process"
    print(f"gradients: identical ({setup.steps} steps x {setup.n_params} parameters, {how})")
    return 0


def _table_rows(
    steps: int, summary: _Summary, stats: OffloadStats
) -> list[tuple[str, str, str, str]]:
    """The table's rows, the header first: what, no offload, offload, their ratio."""
    from tensorstore_hooks._units import format_bytes

    mem, mem_ratio, time_ratio = summary.mem, summary.mem_ratio, summary.time_ratio
    hits = f"{stats.prefetch_hits}/{stats.prefetch_hits + stats.prefetch_misses}"
    tail = f"+{stats.tail_hits} served before their write finished" if stats.tail_hits else ""
    ref_t, off_t = _fmt_times(summary.time["ref"], summary.time["off"])
    return [
        ("", "no offload", "offload", "offload / no offload (per round)"),
        (
            "activation memory",
            mem["ref"].format(format_bytes),
            mem["off"].format(format_bytes),
            mem_ratio.format(lambda r: f"{100 * r:.0f}%") + " of no offload" if mem_ratio.n else "",
        ),
        (
            "step time",
            ref_t,
            off_t,
            time_ratio.format(lambda r: f"{r:.2f}x") if time_ratio.n else "",
        ),
        ("tensors offloaded / step", "-", f"{summary.tensors:.0f}", ""),
        ("bytes offloaded / step", "-", format_bytes(summary.nbytes), ""),
        (f"prefetch hits ({steps} steps)", "-", hits, tail),
        (f"fallbacks ({steps} steps)", "-", str(stats.fallbacks), ""),
    ]


def _print_table(rows: list[tuple[str, str, str, str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print(f"  {r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip())


def _print_verdicts(summary: _Summary, store_url: str) -> None:
    """Rule 2 of NOTE [ Demo verdicts ], for time and memory; and what memory:// shows."""
    print(
        verdict(
            "step time",
            summary.time_ratio,
            summary.measured,
            lambda r: f"{r:.2f}x",
            ("faster", "slower"),
        )
    )
    print(
        verdict(
            "activation memory", summary.mem_ratio, summary.measured, lambda r: f"{100 * r:.0f}%"
        )
    )
    if store_url.startswith("memory://"):
        print(
            "note: memory:// holds the offloaded bytes in this process's RAM, so the "
            "activation memory does not drop: the bytes move from autograd to the store. "
            "It shows the mechanics; use a file:// store (the default) or the daemon "
            "(tsh://) to take them out of RAM."
        )
