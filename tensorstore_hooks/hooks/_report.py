"""``hooks.report()``: what the policy decided per module path, and what each budget keeps.

The router tells a :class:`DecisionLedger` every decision it counts (module path, action, the
rule that decided, payload bytes) and every tensor the rules would move off its
device; :func:`build_report` turns the last finished forward into a :class:`Report`
(a table per module path and the device-budget curve), as text or JSON.

NOTE [ Report ledger ]
1. A forward is what NOTE [ Device budget plan ] rule 1 calls one: the packs between
   two backward passes. The ledger keeps the running forward and the last finished
   one; a report describes the last finished one (or the running one, before any
   forward has finished), so a report taken after many steps shows one step, not
   a sum whose first step (which follows the rules before any budget plan) blurs it.
2. A row is one (module path, action, rule label): the module path is the innermost
   module running when the tensor was saved (``None``: no module of an attached model
   was running, or no model is attached), the action what the tensor got (``keep``,
   ``host``, ``store``) and the label why (``"rules[0] module=*.lm_head"``,
   ``"min_bytes"``, ``"parameter"``, ``"default"``, ``"device_budget"``, ...).
3. The budget curve replays the plan's own rule (``plan_keep``, rule 5 of NOTE
   [ Device budget plan ]) on the tensors the rules moved in that forward, with the
   windows each budget would leave the plan (NOTE [ Windows ] rule 3): the same
   arithmetic the pipeline does, for budgets the user has not tried yet.
4. Cheap on the pack path: one lock and one dict update per saved tensor.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from tensorstore_hooks._units import MemoryShare, format_bytes
from tensorstore_hooks.config import PipelineSettings, Policy
from tensorstore_hooks.pipeline import (
    BUDGET_LABEL,
    DecisionLedger,
    OffloadStats,
    derive_windows,
    plan_keep,
)

__all__ = [
    "BudgetPoint",
    "Report",
    "ReportRow",
    "build_report",
    "report_from_settings",
    "step_figures",
]

_MOVES = frozenset(("store", "host"))
# Budget curve points, shares of what the rules move: past 1 because the windows take
# up to half of a budget (NOTE [ Windows ] rule 3), so 2x keeps everything.
_DEFAULT_SHARES = (0.0, 0.25, 0.5, 1.0, 2.0)


@dataclass(frozen=True, slots=True)
class ReportRow:
    """Saved tensors of one module path that got one action from one rule."""

    module: str | None
    """Dotted module path (``""``: the model itself; ``None``: outside any attached module)."""
    action: str
    """``keep``, ``host`` or ``store``."""
    rule: str
    """Why: the policy rule's label, ``min_bytes``, ``parameter``, ``default``,
    ``device_budget`` (the plan kept it), ..."""
    tensors: int
    bytes: int
    """Payload bytes."""


@dataclass(frozen=True, slots=True)
class BudgetPoint:
    """What a ``device_budget`` would keep of the described forward (NOTE [ Report ledger ] 3)."""

    device_budget: int
    """The budget, bytes."""
    plan_bytes: int
    """What the plan may spend: the budget minus the windows living in the same memory."""
    kept_tensors: int
    kept_bytes: int
    """Device bytes of the newest moved tensors the plan keeps."""
    moved_tensors: int
    moved_bytes: int
    """Payload bytes still moved off the device (to the store or host) per step."""


@dataclass(frozen=True, slots=True)
class Report:
    """What the hooks did in one forward: :meth:`text` for people, :meth:`to_json` for tools."""

    forward: int
    """Which forward this describes (1-based); see NOTE [ Report ledger ] rule 1."""
    finished: bool
    """``False``: the forward was still running (no backward yet)."""
    scoped: bool
    """Whether module paths were tracked (a model attached); else every path is ``None``."""
    rows: tuple[ReportRow, ...]
    moved_tensors: int
    """Tensors the rules would move in this forward (store or host), before any plan."""
    moved_bytes: int
    """Their payload bytes."""
    moved_device_bytes: int
    """What they hold on their device (a view holds its whole storage): what a
    ``device_budget`` is spent in."""
    device_budget: int | None
    """The ``device_budget`` in force (``None``: none)."""
    curve: tuple[BudgetPoint, ...]

    def as_dict(self) -> dict[str, object]:
        """Plain JSON-ready data (``module: null`` outside attached modules)."""
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.as_dict(), indent=indent)

    def text(self) -> str:
        """The table per module path, totals, and the budget curve, as aligned text."""
        state = "" if self.finished else " (still running: no backward yet)"
        lines = [f"forward {self.forward}{state}: what autograd saved, per module path"]
        if not self.scoped:
            lines.append(
                "  (module paths not tracked: pass model= to tsh.offload, or hooks.attach(model))"
            )
        table: list[tuple[str, ...]] = [("module", "saved", "bytes", "action", "rule")]
        previous: str | bool | None = False
        for r in self.rows:
            name = _module_name(r.module, self.scoped) if r.module != previous else ""
            previous = r.module
            table.append((name, str(r.tensors), format_bytes(r.bytes), r.action, r.rule))
        totals: dict[str, list[int]] = {}
        for r in self.rows:
            t = totals.setdefault(r.action, [0, 0])
            t[0] += r.tensors
            t[1] += r.bytes
        for action in ("store", "host", "keep"):
            if action in totals:
                n, b = totals[action]
                table.append((f"total {action}", str(n), format_bytes(b), "", ""))
        lines += _aligned(table, right=(1, 2))
        lines.append("")
        if not self.moved_tensors:
            lines.append("device budget: the rules move nothing here; no budget would change it")
            return "\n".join(lines)
        lines.append("device_budget -> what stays on the device and what moves per step.")
        lines.append(
            f"  The rules move {self.moved_tensors} tensors ({format_bytes(self.moved_bytes)} "
            f"of payload, {format_bytes(self.moved_device_bytes)} held on the device); the plan"
        )
        lines.append(
            "  keeps the newest of them within the budget minus the prefetch and max_inflight "
            "windows:"
        )
        curve: list[tuple[str, ...]] = [
            ("device_budget", "plan spends", "kept", "moved", "moved bytes")
        ]
        for p in self.curve:
            mark = "  <- in force" if p.device_budget == self.device_budget else ""
            curve.append(
                (
                    format_bytes(p.device_budget),
                    format_bytes(p.plan_bytes),
                    f"{p.kept_tensors} ({format_bytes(p.kept_bytes)})",
                    str(p.moved_tensors),
                    format_bytes(p.moved_bytes) + mark,
                )
            )
        lines += _aligned(curve, right=(0, 1, 2, 3))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def _module_name(path: str | None, scoped: bool) -> str:
    if path is None:
        return "(outside the model)" if scoped else "(not tracked)"
    return path or "(model)"


def _aligned(rows: Sequence[tuple[str, ...]], right: Iterable[int]) -> list[str]:
    right_cols = set(right)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [
            c.rjust(widths[i]) if i in right_cols else c.ljust(widths[i]) for i, c in enumerate(r)
        ]
        out.append(("  " + "  ".join(cells)).rstrip())
    return out


def build_report(
    ledger: DecisionLedger,
    *,
    scoped: bool,
    device_budget: int | None,
    max_inflight: int | None,
    prefetch: int | None,
    host_budget: int = 0,
    budgets: Iterable[int] | None = None,
    depth: int | None = None,
) -> Report:
    """The :class:`Report` of ``ledger``'s last finished forward.

    ``depth``: module paths cut to their first ``depth`` parts (``depth=2``:
    ``layers.3.linear1`` counts under ``layers.3``); ``None``: whole paths.

    ``max_inflight``/``prefetch``: the user's windows (``None``: derived);
    ``budgets``: the device budgets of the curve (default: 0, 25, 50, 100 and 200% of
    the bytes the rules move, and ``device_budget`` when set).
    """
    fwd, number, finished = ledger.view()
    merged: dict[tuple[str | None, str, str], list[int]] = {}
    for (path, action, label), (n, b) in fwd.rows.items():
        row = merged.setdefault((_truncate(path, depth), action, label), [0, 0])
        row[0] += n
        row[1] += b
    # Grouped by module path, modules in the order they first saved a tensor.
    order: dict[str | None, int] = {}
    for path, _, _ in merged:
        order.setdefault(path, len(order))
    rows = tuple(
        ReportRow(path, action, label, n, b)
        for (path, action, label), (n, b) in sorted(
            merged.items(), key=lambda item: order[item[0][0]]
        )
    )
    sizes = [d for d, _ in fwd.moves]
    payload = [p for _, p in fwd.moves]
    total = sum(sizes)
    if budgets is None:
        points = {int(total * s) for s in _DEFAULT_SHARES}
        if device_budget is not None:
            points.add(device_budget)
    else:
        points = set(budgets)
    curve = tuple(
        _point(
            b,
            sizes,
            payload,
            max_inflight=max_inflight,
            prefetch=prefetch,
            host_budget=host_budget,
            accelerator=fwd.accelerator,
        )
        for b in sorted(points)
    )
    return Report(
        forward=number,
        finished=finished,
        scoped=scoped,
        rows=rows,
        moved_tensors=len(sizes),
        moved_bytes=sum(payload),
        moved_device_bytes=total,
        device_budget=device_budget,
        curve=curve if sizes else (),
    )


def _truncate(path: str | None, depth: int | None) -> str | None:
    if path is None or depth is None or not path:
        return path
    return ".".join(path.split(".")[:depth])


def _point(
    budget: int,
    sizes: Sequence[int],
    payload: Sequence[int],
    *,
    max_inflight: int | None,
    prefetch: int | None,
    host_budget: int,
    accelerator: bool,
) -> BudgetPoint:
    windows = derive_windows(
        seen_bytes=sum(sizes),
        largest_bytes=max(sizes, default=0),
        max_inflight=max_inflight,
        prefetch=prefetch,
        device_budget=budget,
        host_budget=host_budget,
        accelerator=accelerator,
    )
    plan = windows.plan_budget or 0
    n = plan_keep(sizes, plan)
    split = len(sizes) - n
    return BudgetPoint(
        device_budget=budget,
        plan_bytes=plan,
        kept_tensors=n,
        kept_bytes=sum(sizes[split:]),
        moved_tensors=split,
        moved_bytes=sum(payload[:split]),
    )


def report_from_settings(
    ledger: DecisionLedger,
    *,
    scoped: bool,
    policy: Policy,
    settings: PipelineSettings,
    stats: OffloadStats,
    budgets: Iterable[int] | None = None,
    depth: int | None = None,
) -> Report:
    """:func:`build_report` with the budgets and windows of a pipeline: its policy, its
    ``pipeline:`` settings and, for a budget derived from the memory there is
    (``auto``, a percentage), the effective budget its stats carry."""
    device_budget = stats.effective_device_budget
    if device_budget is None:
        device_budget = _size_or_none(policy.device_budget)
    host_budget = stats.effective_host_budget or _size_or_none(settings.host_budget) or 0
    return build_report(
        ledger,
        scoped=scoped,
        device_budget=device_budget,
        max_inflight=settings.max_inflight,
        prefetch=settings.prefetch,
        host_budget=host_budget,
        budgets=budgets,
        depth=depth,
    )


def _size_or_none(value: int | MemoryShare | None) -> int | None:
    # A share of the memory there is ("auto", "60%") has no size until the pipeline derives it.
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def step_figures(delta: OffloadStats, prefix: str = "tsh/") -> dict[str, float]:
    """The figures a trainer logs for one logging period: ``delta`` is an
    :class:`~tensorstore_hooks.OffloadStats` difference (``stats - snapshot``).

    Counts are what happened in the period; ``peak_held_bytes`` and the effective
    budgets are levels (the value now; the device budget only once there is one).
    """
    kept = delta.per_rule.get(BUDGET_LABEL)
    figures: dict[str, float] = {
        "bytes_offloaded": delta.bytes_offloaded,
        "bytes_read": delta.bytes_read,
        "tensors_offloaded": delta.tensors_offloaded,
        "tensors_kept": delta.tensors_kept,
        "fallbacks": delta.fallbacks,
        "pack_stall_s": delta.pack_stall_s,
        "unpack_stall_s": delta.unpack_stall_s,
        "peak_held_bytes": delta.peak_held_bytes,
        "budget_kept_bytes": kept.bytes if kept is not None else 0,
    }
    if delta.effective_device_budget is not None:
        figures["effective_device_budget"] = delta.effective_device_budget
    figures["effective_host_budget"] = delta.effective_host_budget
    return {prefix + name: value for name, value in figures.items()}
