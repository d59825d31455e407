"""Python-level calls per store operation and per saved tensor: the library's host work,
counted rather than timed (the same count on a busy machine as on a quiet one).

Counts every Python function call (``sys.setprofile``, on every thread: the I/O threads
start after the profiler is set) during

* a 64 KiB ``put`` + ``get`` + ``delete`` on a local store, per operation, and
* the whole life of a saved CPU tensor under ``tsh.offload()`` (pack, write on an I/O
  thread, prefetch, unpack, free), per tensor, in a steady-state step,

in total and in the library's own files. Compare two trees by putting each first on
``PYTHONPATH`` (``git archive REV | tar -x -C /tmp/base``)::

    python benchmarks/python_calls.py
    PYTHONPATH=/tmp/base python benchmarks/python_calls.py
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
from types import FrameType

import torch

import tensorstore_hooks as tsh

ROOT = os.path.dirname(os.path.abspath(tsh.__file__))


class Counter:
    """Counts calls while ``on``; installed on this thread and every thread started later."""

    def __init__(self) -> None:
        self.on = False
        self.total = 0
        self.library = 0

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and self.on:
            self.total += 1
            if frame.f_code.co_filename.startswith(ROOT):
                self.library += 1

    def measure(self, fn: object, per: int) -> dict[str, float]:
        assert callable(fn)
        self.total = self.library = 0
        self.on = True
        try:
            fn()
        finally:
            self.on = False
        return {"calls": self.total / per, "library_calls": self.library / per}


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


def saved_tensors(root: str, counter: Counter, tensors: int) -> dict[str, float]:
    x = torch.randn(64, 1024, requires_grad=True)  # 256 KiB a saved tensor
    hooks = tsh.offload("file://" + os.path.join(root, "hooks"), min_bytes=0)

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
    args = parser.parse_args()
    counter = Counter()
    sys.setprofile(counter)
    threading.setprofile(counter)
    try:
        with tempfile.TemporaryDirectory() as root:
            figures = {
                "library": ROOT,
                "store_put_get_delete_64KiB": store_ops(root, counter, args.repeats),
                "saved_tensor_life": saved_tensors(root, counter, args.tensors),
            }
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    for name in ("store_put_get_delete_64KiB", "saved_tensor_life"):
        f = figures[name]
        assert isinstance(f, dict)
        print(f"{name}: {f['calls']:.1f} Python calls ({f['library_calls']:.1f} in the library)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)


if __name__ == "__main__":
    main()
