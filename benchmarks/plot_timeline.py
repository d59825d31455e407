"""Render a ``hooks.trace()`` timeline (Chrome trace JSON) as a PNG.

    tensorstore-hooks demo --steps 2 --trace docs/timeline.json
    python benchmarks/plot_timeline.py docs/timeline.json docs/timeline.png

One lane per thread: forward/backward on top, then the training thread (pack,
unpack, unpack waits) and our writer/reader threads (write, read). Needs
matplotlib (``pip install -e '.[plot]'``). The same JSON opens interactively in
https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

COLORS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "tsh::pack": "#55a868",
    "tsh::unpack": "#8172b3",
    "tsh::unpack_wait": "#c44e52",
    "tsh::write": "#64b5cd",
    "tsh::read": "#ccb974",
}


def lanes(trace: dict[str, Any]) -> tuple[list[str], dict[str, list[tuple[str, float, float]]]]:
    """Thread lanes in display order and, per lane, ``(name, start_ms, duration_ms)``."""
    names: dict[int, str] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[e["tid"]] = e["args"]["name"]
    bars: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            lane = names.get(e["tid"], str(e["tid"]))
            bars[lane].append((e["name"], e["ts"] / 1e3, e["dur"] / 1e3))

    def order(lane: str) -> tuple[int, str]:
        if lane == "forward / backward":
            return (0, lane)
        if not lane.startswith("tsh-"):
            return (1, lane)  # the training thread(s)
        return (2, lane)

    return sorted(bars, key=order), bars


def render(trace_path: Path, png_path: Path, title: str | None = None) -> None:
    """Draw the timeline in ``trace_path`` into ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    trace = json.loads(trace_path.read_text())
    order, bars = lanes(trace)
    if not order:
        raise SystemExit(f"plot_timeline: no spans in {trace_path}")
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.45 * len(order)))
    seen: set[str] = set()
    for row, lane in enumerate(order):
        by_name: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for name, start, dur in bars[lane]:
            by_name[name].append((start, max(dur, 0.05)))
        for name, spans in by_name.items():
            height = 0.8 if name != "tsh::unpack_wait" else 0.4
            ax.broken_barh(
                spans,
                (row - height / 2, height),
                facecolors=COLORS.get(name, "#999999"),
                edgecolor="none",
            )
            seen.add(name)
    ax.set_yticks(range(len(order)), order)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the trace began")
    ax.set_title(title or f"tensorstore-hooks timeline: {trace_path.name}")
    fig.legend(
        handles=[Patch(color=COLORS.get(n, "#999999"), label=n) for n in COLORS if n in seen],
        loc="lower center",
        ncol=len(seen),
        fontsize="small",
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="Chrome trace JSON from hooks.trace()")
    parser.add_argument("png", type=Path, help="PNG to write")
    parser.add_argument("--title", help="figure title")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_timeline: needs matplotlib: pip install -e '.[plot]'", file=sys.stderr)
        return 2
    render(args.trace, args.png, args.title)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
