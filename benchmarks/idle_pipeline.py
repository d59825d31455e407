"""What an idle pipeline costs a plain step (issue 38, item 3): nothing, within noise.

Runs the demo's tiny GPT in fresh processes, alternating: ``plain`` trains plain steps
only; ``idle`` first trains one step under ``tsh.offload()`` and keeps the hooks (an
idle pipeline in the process, as a user who kept ``hooks`` has), then the same plain
steps. Prints, per mode, the median step time and activation memory (peak RSS during
a step minus RSS before it), and the ratio idle / plain (target: within 1.05x).

    OMP_NUM_THREADS=1 python benchmarks/idle_pipeline.py --rounds 3 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _child(mode: str, steps: int) -> None:
    import torch

    import tensorstore_hooks as tsh
    from tensorstore_hooks.cli._demo_model import GPT, config_for, synthetic_batch
    from tensorstore_hooks.cli.demo import RssSampler, release_free_memory

    torch.set_num_threads(1)
    cfg = config_for("tiny")
    model = GPT(cfg, seed=0)
    kept = None
    if mode == "idle":
        with tsh.offload() as kept:
            loss = model(*synthetic_batch(cfg, 0))
        loss.backward()
        del loss
        model.zero_grad(set_to_none=True)
    sampler = RssSampler()
    secs, mem = [], []
    for step in range(steps + 1):  # the first is warm-up
        release_free_memory()
        base = sampler.start()
        t0 = time.perf_counter()
        model(*synthetic_batch(cfg, step)).backward()
        secs.append(time.perf_counter() - t0)
        mem.append(sampler.stop() - base)
        model.zero_grad(set_to_none=True)
    sampler.close()
    print(json.dumps({"secs": secs[1:], "mem": mem[1:], "kept": kept is not None}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--child", choices=("plain", "idle"))
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.steps)
        return
    got: dict[str, dict[str, list[float]]] = {m: {"secs": [], "mem": []} for m in ("plain", "idle")}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for r in range(args.rounds):
        for mode in ("plain", "idle") if r % 2 == 0 else ("idle", "plain"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, "--steps", str(args.steps)],
                capture_output=True, text=True, check=True, env=env,
            )  # fmt: skip
            figures = json.loads(out.stdout.strip().splitlines()[-1])
            for k in ("secs", "mem"):
                got[mode][k] += figures[k]
    med = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in got.items()}
    for mode in ("plain", "idle"):
        print(
            f"{mode:>5}: step {med[mode]['secs'] * 1e3:.1f} ms, "
            f"activation memory {med[mode]['mem'] / 2**20:.1f} MiB"
        )
    print(
        f"idle / plain: time {med['idle']['secs'] / med['plain']['secs']:.3f}x, "
        f"memory {med['idle']['mem'] / med['plain']['mem']:.3f}x"
    )


if __name__ == "__main__":
    main()
