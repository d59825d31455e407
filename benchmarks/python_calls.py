"""Python-level calls per store operation and per saved tensor: the library's host work,
counted rather than timed (the same count on a busy machine as on a quiet one).

Counts every Python function call (``sys.setprofile``, on every thread: the I/O threads
start after the profiler is set) during

* a 64 KiB ``put`` + ``get`` + ``delete`` on a local store, per operation, and
* the whole life of a saved CPU tensor under ``tsh.offload()`` (pack, write on an I/O
  thread, prefetch, unpack, free), per tensor, in a steady-state step,
* the pack hook and the unpack hook alone, on the training thread (what must hide
  under the kernels on a GPU), per tensor: a plain stored CPU tensor, and a tensor
  of the CUDA fake (``tests/fake_accelerator.py``: the real staging code, held in the
  host tier) when the tests are importable,

in total and in the library's own files (per pack and per unpack: the mean, and the
median, the path most tensors take: NOTE [ Pack fast path ]); then, with no profiler
set, the host microseconds each saved tensor adds to a step on the training thread (its
CPU time, less the same step's without hooks, per tensor, median of rounds; a
``memory://`` store; one torch thread, ``--torch-threads``: with more, an intra-op
worker's spin-wait while the I/O threads hold the cores counts as the training
thread's time and swamps the figure on a small machine) under ``tsh.offload()``,
``save_on_cpu`` and torchtune's ``OffloadActivations`` where torchtune is installed (a
noisy figure on a loaded machine: the call counts are the stable one), and where the
library's share of it goes (pack, unpack, and the finalizers that free each record and
delete its key when autograd drops the handle: rule 2 of NOTE [ Record lifecycle ]
keeps that on the thread that drops it), measured under ``cProfile`` with the
thread's CPU clock (inflated by the profiler; compare the shares). Compare two trees
by putting each first on ``PYTHONPATH`` (``git archive REV | tar -x -C /tmp/base``)::

    python benchmarks/python_calls.py
    PYTHONPATH=/tmp/base python benchmarks/python_calls.py
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
from types import FrameType

import torch

import tensorstore_hooks as tsh

ROOT = os.path.dirname(os.path.abspath(tsh.__file__))


HOOKS = {"pack", "unpack"}  # Router.pack / Router.unpack: what the hooks call


class Counter:
    """Counts calls while ``on``; installed on this thread and every thread started later.

    Beside the totals, calls made on the thread that runs a pack or unpack hook, from
    its entry (``Router.pack`` / ``Router.unpack``, called by autograd) to its return,
    are counted per hook in :attr:`hooks` (entries in :attr:`entries`).
    """

    def __init__(self) -> None:
        self.on = False
        self.total = 0
        self.library = 0
        self.hooks = dict.fromkeys(HOOKS, 0)
        self.hooks_library = dict.fromkeys(HOOKS, 0)
        self.entries = dict.fromkeys(HOOKS, 0)
        self.each: dict[str, list[int]] = {h: [] for h in HOOKS}  # calls of each entry
        self._inside: dict[int, tuple[str, FrameType]] = {}  # thread -> (hook, its frame)

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if not self.on:
            return
        me = threading.get_ident()
        inside = self._inside.get(me)
        if event == "return":
            if inside is not None and inside[1] is frame:
                del self._inside[me]
            return
        if event != "call":
            return
        self.total += 1
        code = frame.f_code
        if code.co_filename.startswith(ROOT):
            self.library += 1
            if inside is None and code.co_name in HOOKS and code.co_filename.endswith(_ROUTER):
                self._inside[me] = inside = (code.co_name, frame)
                self.entries[code.co_name] += 1
                self.each[code.co_name].append(0)
        if inside is not None:
            self.hooks[inside[0]] += 1
            self.each[inside[0]][-1] += 1
            if code.co_filename.startswith(ROOT):
                self.hooks_library[inside[0]] += 1

    def per_hook(self) -> dict[str, float]:
        """Calls per pack and per unpack (each hook's own frame included), all and the
        library's own (a fake runtime's calls are not the library's)."""
        out = {}
        for hook in sorted(HOOKS):
            n = self.entries[hook] or 1
            out[f"{hook}_calls"] = self.hooks[hook] / n
            out[f"{hook}_library_calls"] = self.hooks_library[hook] / n
            out[f"{hook}_calls_median"] = statistics.median(self.each[hook] or [0])
        return out

    def measure(self, fn: object, per: int) -> dict[str, float]:
        assert callable(fn)
        self.total = self.library = 0
        self.hooks = dict.fromkeys(HOOKS, 0)
        self.hooks_library = dict.fromkeys(HOOKS, 0)
        self.entries = dict.fromkeys(HOOKS, 0)
        self.each = {h: [] for h in HOOKS}
        self.on = True
        try:
            fn()
        finally:
            self.on = False
        return {
            "calls": self.total / per,
            "library_calls": self.library / per,
            **self.per_hook(),
        }


_ROUTER = os.path.join("pipeline", "_router.py")


def store_ops(root: str, counter: Counter, repeats: int) -> dict[str, float]:
    store = tsh.open_store("file://" + os.path.join(root, "store"))
    t = torch.randn(16384)  # 64 KiB
    for _ in range(5):  # warm: pools, classes, the index
        store.delete(store.put(t))

    def ops() -> None:
        for _ in range(repeats):
            key = store.put(t)
            store.get(key)
            store.delete(key)

    try:
        return counter.measure(ops, repeats)
    finally:
        store.close()


def saved_tensors(
    root: str, counter: Counter, tensors: int, *, fake_cuda: bool = False
) -> dict[str, float]:
    x = torch.randn(64, 1024, requires_grad=True)  # 256 KiB a saved tensor
    # Room for a whole forward in flight on the host path: the profiler slows the I/O
    # threads too, and a pack that must wait for their writes takes the general path
    # (NOTE [ Pack fast path ], rule 2): without it the figure would follow the disk.
    room = "64MiB"
    if fake_cuda:  # held in the host tier through the real staging code, on the fake
        from tests.fake_accelerator import on_fake_accelerator

        hooks = tsh.offload("memory://", min_bytes=0, host_budget="64MiB")  # its copy window
        on_fake_accelerator(hooks)
    else:
        url = "file://" + os.path.join(root, "hooks")
        hooks = tsh.offload(url, min_bytes=0, max_inflight=room)

    def step(n: int) -> None:
        with hooks:
            y = x
            for _ in range(n):
                y = y.sin()  # saves its input: one tensor per op
            loss = y.sum()
        loss.backward()
        del loss, y
        gc.collect()
        hooks.flush()

    try:
        step(8)
        step(8)  # the steady state: plans, pools and threads exist
        return counter.measure(lambda: step(tensors), tensors)
    finally:
        hooks.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50, help="store operations counted")
    parser.add_argument("--tensors", type=int, default=32, help="saved tensors counted")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="torch threads for the host time figure"
    )
    args = parser.parse_args()
    counter = Counter()
    sys.setprofile(counter)
    threading.setprofile(counter)
    try:
        with tempfile.TemporaryDirectory() as root:
            figures: dict[str, object] = {
                "library": ROOT,
                "store_put_get_delete_64KiB": store_ops(root, counter, args.repeats),
                "saved_tensor_life": saved_tensors(root, counter, args.tensors),
            }
            if _tests_importable():
                figures["saved_tensor_life_cuda_fake"] = saved_tensors(
                    root, counter, args.tensors, fake_cuda=True
                )
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.torch_threads)
    try:
        figures["host_us_per_saved_tensor"] = us = host_us_per_tensor(args.tensors)
        figures["host_us_where"] = where = host_us_where(args.tensors)
    finally:
        torch.set_num_threads(threads)
    print(
        f"host microseconds per saved tensor (256 KiB, CPU, {args.torch_threads} torch "
        "thread(s)): "
        + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in us.items())
    )
    print(
        "  tsh's share under cProfile (CPU us per tensor, inflated): "
        + ", ".join(f"{k} {v:.1f}" for k, v in where.items())
    )
    for name in ("store_put_get_delete_64KiB", "saved_tensor_life", "saved_tensor_life_cuda_fake"):
        f = figures.get(name)
        if not isinstance(f, dict):
            continue
        line = f"{name}: {f['calls']:.1f} Python calls ({f['library_calls']:.1f} in the library)"
        if f.get("pack_calls"):
            line += (
                f"; per pack {f['pack_calls']:.1f} ({f['pack_library_calls']:.1f} library, "
                f"median {f['pack_calls_median']:g}), "
                f"per unpack {f['unpack_calls']:.1f} ({f['unpack_library_calls']:.1f} library, "
                f"median {f['unpack_calls_median']:g})"
            )
        print(line)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)


def host_us_per_tensor(tensors: int, rounds: int = 7) -> dict[str, float | str]:
    """Host microseconds a saved tensor adds to a step, per kind of hooks (see above)."""
    import contextlib
    import statistics
    import time

    x = torch.randn(64, 1024, requires_grad=True)
    hooks = tsh.offload("memory://", min_bytes=0)
    kinds: dict[str, object] = {
        "none": contextlib.nullcontext,
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=False),
        "tsh": lambda: hooks,
    }
    out: dict[str, float | str] = {}
    try:
        from torchtune.training import OffloadActivations

        kinds["torchtune"] = lambda: OffloadActivations(use_streams=False)
    except Exception as e:  # not installed, or its dependencies are not
        out["torchtune"] = f"not measured: {type(e).__name__}: {e}"[:160]

    def step(make: object) -> float:
        assert callable(make)
        t0 = time.thread_time()  # the training thread's CPU: not I/O waits, not I/O threads
        with make():
            y = x
            for _ in range(tensors):
                y = y.sin()
            loss = y.sum()
        loss.backward()
        return time.thread_time() - t0

    times: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for _ in range(2):  # warm
            for make in kinds.values():
                step(make)
        hooks.flush()
        for _ in range(rounds):
            for name, make in kinds.items():
                times[name].append(step(make))
    finally:
        hooks.close()
    base = statistics.median(times["none"])
    for name in kinds:
        if name != "none":
            out[name] = (statistics.median(times[name]) - base) / tensors * 1e6
    return out


def host_us_where(tensors: int, steps: int = 5) -> dict[str, float]:
    """The training thread's CPU time per saved tensor under ``tsh.offload()``, in the
    library's pack hook, unpack hook and record finalizers (the key's delete), and the
    whole step less a step without hooks, under ``cProfile`` on the thread's CPU clock."""
    import contextlib
    import cProfile
    import pstats
    import time

    x = torch.randn(64, 1024, requires_grad=True)
    hooks = tsh.offload("memory://", min_bytes=0)

    def step(with_hooks: bool) -> None:
        with hooks if with_hooks else contextlib.nullcontext():
            y = x
            for _ in range(tensors):
                y = y.sin()
            loss = y.sum()
        loss.backward()

    out: dict[str, float] = {}
    try:
        for _ in range(2):
            step(True)
        hooks.flush()
        totals = {}
        for with_hooks in (False, True):
            prof = cProfile.Profile(time.thread_time)
            prof.enable()
            for _ in range(steps):
                step(with_hooks)
            prof.disable()
            stats = pstats.Stats(prof)
            totals[with_hooks] = stats.total_tt  # type: ignore[attr-defined]
        per = steps * tensors
        wanted = {
            ("pack", _ROUTER): "pack",
            ("unpack", _ROUTER): "unpack",
            ("_handle_died", "_records.py"): "free",
        }
        for (path, _, name), row in stats.stats.items():  # type: ignore[attr-defined]
            for (fn, where), label in wanted.items():
                if name == fn and path.endswith(where) and path.startswith(ROOT):
                    out[label] = out.get(label, 0.0) + row[3] / per * 1e6  # cumulative
        out["step_over_none"] = (totals[True] - totals[False]) / per * 1e6
    finally:
        hooks.close()
    return out


def _tests_importable() -> bool:
    """Whether ``tests/`` (the CUDA fake) is importable: run from a checkout."""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if checkout not in sys.path:
        sys.path.insert(0, checkout)
    try:
        import tests.fake_accelerator  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
