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
    # Set per pipeline; glibc's initial value back after the last of each (the two
    # offload pipelines, then the wrap's).
    assert r["mallopt"] == [1 << 20, 128 << 10] * 3
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
