"""Process-wide effects only while a pipeline lives, each said once, each with a switch.

NOTE [ Process-wide effects ] (``runtime/_effects.py``). Every check runs in a fresh
interpreter: whether "the last pipeline" has ended depends on every pipeline the
process ever made, which a shared pytest process cannot promise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

_SCRIPT = textwrap.dedent(
    """
    import gc, json, logging, signal, sys
    import torch
    from torch.nn.modules import module as nn_module
    import tensorstore_hooks as tsh
    from tensorstore_hooks.runtime import _effects
    from tensorstore_hooks.pipeline import _iopool
    from tensorstore_hooks.runtime import _signals

    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda r: records.append(r.getMessage())
    log = logging.getLogger("tensorstore_hooks")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)

    mallopt = []
    real = _effects.set_mmap_threshold
    def record(n):
        mallopt.append(n)
        return real(n)
    _effects.set_mmap_threshold = record
    real_release = _effects.release_mmap_threshold
    def record_release():
        mallopt.append("release")
        return real_release()
    _effects.release_mmap_threshold = record_release

    out = {"at_import": {
        "exit_handler": _iopool.at_exit_registered(),
        "sigint_wrapped": isinstance(signal.getsignal(signal.SIGINT), _signals._DeferringHandler),
        "module_hooks": bool(nn_module._has_any_global_hook()),
    }}
    before = signal.getsignal(signal.SIGINT)
    options = json.loads(sys.argv[1])

    def step(hooks):
        w = torch.randn(256, 256, requires_grad=True)
        with hooks:
            loss = (torch.randn(64, 256) @ w).tanh().sum()
        during = {
            "sigint_wrapped": isinstance(
                signal.getsignal(signal.SIGINT), _signals._DeferringHandler
            ),
            "exit_handler": _iopool.at_exit_registered(),
            "live_pipelines": _effects.live_pipelines(),
        }
        # Every write done before backward frees the records: on a busy machine a write
        # not yet started when its record is freed is skipped (nothing moved, no release).
        hooks.flush()
        loss.backward()
        return during

    for i in range(2):
        hooks = tsh.offload(None, min_bytes=0, **options)
        out[f"during_{i}"] = step(hooks)
        hooks.close()
        gc.collect()
        out[f"after_{i}"] = {
            "sigint_restored": signal.getsignal(signal.SIGINT) is before,
            "exit_handler": _iopool.at_exit_registered(),
            "live_pipelines": _effects.live_pipelines(),
            "heap_releases": hooks.stats.heap_releases,
        }
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    wrapped = tsh.wrap(model, "memory://", **options)
    out["wrapped_module_hooks"] = bool(nn_module._has_any_global_hook())
    tsh.unwrap(model)
    out["unwrapped_module_hooks"] = bool(nn_module._has_any_global_hook())
    out["mallopt"] = mallopt
    out["debug"] = records
    print(json.dumps(out))
    """
)


def _run(options: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def _said(result: dict[str, Any], text: str) -> int:
    return sum(text in line for line in result["debug"])


def test_effects_live_only_while_a_pipeline_does_and_each_is_said_once() -> None:
    r = _run({"mmap_threshold": "1MiB", "release_heap_every": "64KiB"})
    assert not any(r["at_import"].values()), r["at_import"]  # nothing at import
    for i in range(2):
        during = r[f"during_{i}"]
        assert during == {"sigint_wrapped": True, "exit_handler": True, "live_pipelines": 1}
        after = r[f"after_{i}"]
        assert after["sigint_restored"] and not after["exit_handler"]
        assert after["live_pipelines"] == 0 and after["heap_releases"] > 0
    # Set while each offload pipeline moves bytes, glibc's dynamic ceiling back when it
    # stops (its close); the wrap's pipeline never moved a byte: never set.
    assert r["mallopt"] == [1 << 20, "release"] * 2
    assert r["wrapped_module_hooks"] and not r["unwrapped_module_hooks"]
    for text in (
        "SIGINT/SIGTERM handlers wrapped",
        "glibc mmap threshold set to",
        "glibc mmap threshold back at",
        "malloc_trim(0) after every",
        "global module forward hooks registered",
    ):
        assert _said(r, text) == 1, (text, r["debug"])


def test_each_effect_has_a_switch() -> None:
    r = _run({"mmap_threshold": None, "release_heap_every": 0}, env={"TSH_SIGNAL_SHIELD": "0"})
    for i in range(2):
        assert not r[f"during_{i}"]["sigint_wrapped"]
        assert r[f"after_{i}"]["heap_releases"] == 0
    assert r["mallopt"] == []
    for text in ("SIGINT/SIGTERM", "mmap threshold", "malloc_trim"):
        assert _said(r, text) == 0, (text, r["debug"])


# ------------------------------------------ nothing moved, nothing paid (issue 39)
_IDLE_SCRIPT = textwrap.dedent(
    """
    import json, sys, threading
    import torch
    import tensorstore_hooks as tsh
    from tensorstore_hooks.runtime import _effects

    torch.manual_seed(0)
    mallopt = []
    _effects.set_mmap_threshold = lambda n: mallopt.append(n) or True
    _effects.release_mmap_threshold = lambda: mallopt.append("release") or True
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    x = torch.randn(64, 256)
    hooks = tsh.offload(min_bytes=0, **json.loads(sys.argv[1]))
    steps = []
    for _ in range(3):
        before = hooks.stats.snapshot()
        with hooks:
            loss = model(x).tanh().sum()
        loss.backward()
        d = hooks.stats - before
        steps.append({
            "offloaded": d.tensors_offloaded,
            "kept": d.tensors_kept,
            "mallopt": list(mallopt),
            "io_threads": sum(t.name.startswith("tsh-io") for t in threading.enumerate()),
        })
    hooks.close()
    print(json.dumps({"steps": steps, "mallopt": mallopt}))
    """
)


def _idle_run(options: dict[str, Any]) -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, "-c", _IDLE_SCRIPT, json.dumps(options)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def test_auto_with_room_leaves_the_process_as_without_offloading() -> None:
    """``device_budget: auto`` where everything fits: from the first forward on every
    tensor is kept, no byte moves, no I/O thread starts, glibc is never touched."""
    r = _idle_run({"device_budget": "auto"})
    for step in r["steps"]:
        assert step["offloaded"] == 0 and step["kept"] > 0, step
        assert step["io_threads"] == 0 and step["mallopt"] == [], step
    assert r["mallopt"] == []


def test_a_budget_that_keeps_everything_gives_the_threshold_back() -> None:
    """A budget in bytes: the first forward stores (rule 3 of NOTE [ Device budget
    plan ]), the next keep everything; the threshold lasts only while bytes move."""
    r = _idle_run({"device_budget": "1GiB", "mmap_threshold": "1MiB"})
    first, second, third = r["steps"]
    # Given back as soon as the first step's block has exited and its graph is freed
    # (the hooks are idle: NOTE [ Idle hooks ]), not at close; never set again by the
    # steps that move nothing.
    assert first["offloaded"] > 0 and first["mallopt"] == [1 << 20, "release"]
    assert second["offloaded"] == third["offloaded"] == 0
    assert third["mallopt"] == [1 << 20, "release"] == r["mallopt"]


_AFTER_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    import tensorstore_hooks as tsh

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    if sys.argv[1] == "offloaded":
        hooks = tsh.offload("memory://", min_bytes=0)
        w = torch.randn(1 << 16, requires_grad=True)
        with hooks:
            loss = w.sin().sum()  # bytes move: the threshold is set
        loss.backward()
        hooks.close()  # and given back: nothing moves any more
    x = torch.ones(4 << 20)  # 16 MiB: glibc mmaps it; its free raises the dynamic threshold
    del x
    a = torch.ones(2 << 20)  # 8 MiB: from the heap, as glibc's dynamic threshold does
    pin = torch.ones(1024)  # a live block above it
    before = rss()
    del a
    print((before - rss()) >> 20)
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_after_the_last_move_glibc_serves_big_buffers_as_it_did_without_us() -> None:
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")

    def freed_mib(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _AFTER_SCRIPT, mode],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        return int(out.stdout.strip().splitlines()[-1])

    # Without the library the freed 8 MiB stays in glibc's heap (its dynamic threshold
    # rose past it); after a pipeline moved bytes and stopped, the same.
    assert freed_mib("plain") <= 1
    assert freed_mib("offloaded") <= 1
