"""Budgets: which saved tensors stay where they were made, the windows, and budgets taken
from the memory there is.

The router asks :meth:`BudgetControl.keep` for every tensor the policy has decided
(between its ``decide`` and ``account``) and calls :meth:`BudgetControl.backward_started`
on every unpack. The control sets the write-behind's and the prefetcher's windows and
the host tier's cap through what :meth:`BudgetControl.connect` gave it. The functions
at module level are the rules, pure (sizes in, decisions out: no torch, no I/O, no
clock); :class:`BudgetControl` holds one pipeline's state and applies them.

NOTE [ Device budget plan ]
Rules, numbered so code can cite them:

1. A *forward* is the run of packs between two backward passes: it starts with the
   first pack after an unpack (or the pipeline's first pack) and ends at the next
   unpack. Entering or leaving the hooks does not end one, so ``offload()`` around a
   whole model, ``wrap()`` entering once per block, and several ``with`` blocks per
   step all give the same forwards. Gradient accumulation (forward, backward,
   forward, backward) gives one forward per micro-batch; several forwards before
   one backward (losses summed) are one forward. ``retain_graph`` backward passes
   only unpack, so they never start a forward.
2. Only tensors the rules would move off their device (``store`` or ``host``)
   count. Parameters, tensors below ``min_bytes`` and ``keep`` rules are kept by the
   rules and are not the plan's to spend the budget on.
3. The first forward of a pipeline follows the rules and records, in pack order, the
   sizes of the tensors that count (its *trace*). Under an ``auto`` (or percentage)
   budget it also keeps its oldest counting tensors while they fit the first-forward
   figure (NOTE [ Auto budgets ] rule 5), and moves the rest: where everything fits,
   nothing moves from the first step on.
4. The last ``REMEMBERED_TRACES`` distinct traces are remembered, newest first. A
   forward whose trace is one of them changes nothing; one whose trace is new is
   remembered (the oldest is forgotten) and counts a replan (``stats.replans``).
5. A forward keeps a contiguous run of its counting tensors and moves the rest:
   the newest, newest first, as long as their running total fits the plan's
   budget. Decided online, tensor by tensor: the run starts at the first tensor
   whose *predicted rest* (it and every counting tensor the forward will still
   save, rule 6) fits; from there each tensor is kept while the run's total fits,
   and the first that does not fit ends the run: it and every later tensor of the
   forward are moved. The run never passes the budget, whatever the prediction: a
   prediction too high keeps less, one too low ends the run before the forward
   does. Stopping at the first misfit rather than skipping it for older, smaller
   ones keeps the kept tensors contiguous: backward consumes them while the
   prefetcher reads the stored run behind them in one sweep, with no read stall
   at backward's start.
6. The rest is predicted from a remembered trace, aligned with the running forward
   tensor by tensor. A *kind* is a size of the remembered trace (the same tensor of
   each repeated block has the same size); its ratio is the running forward's size
   over the remembered one at the kind's latest pairing. The rest is this tensor
   plus each remaining remembered tensor times its kind's ratio, so a forward at
   another sequence length is scaled kind by kind (attention's ``L x L`` by r**2,
   the ``L x d`` tensors by r). A kind not paired yet whose tensors sit together
   (the logits, the last norm) scales by the largest ratio seen (or that of all
   bytes so far, if larger): a guess too high keeps less, never more. One not
   paired yet that is spread over the trace (a tensor of every block) leaves the
   rest unknown: no run starts in the first block.
   Alignment: a tensor pairs with the next trace position whose kind fits (its own
   ratio once paired; a new kind: a ratio within the square of those seen). One or
   two trace tensors of kinds never paired may be skipped (a tensor that fell below
   ``min_bytes`` at this length); a tensor that fits none of the next three is one
   the trace lacks. Both, and a kind seen at two ratios, are *contradictions*: a
   trace with any is no longer trusted kind by kind (every remaining byte scales by
   the largest ratio). The trace used is the one with the fewest contradictions,
   then one the forward matches exactly so far (predicted exactly), then the
   newest. Past the trace's end the rest is the tensor alone.
7. Calibration: a forward whose run started from a prediction compares the rest it
   really saved from there with the prediction; the next forwards multiply their
   predictions by the largest such ratio of the last ``CALIBRATION_FORWARDS``
   forwards (at least 1, at most ``MAX_MARGIN``; a forward without a run counts 1).
   A steady sequence predicts exactly (ratio 1), so from the second forward on its
   plan is :func:`plan_keep` of its trace: the newest tail that fits.
8. Deterministic: the decisions depend only on the sequence of sizes and the
   budget, never on timing.
9. A plan that keeps nothing ``KEPT_NOTHING_FORWARDS`` forwards in a row (each
   saving tensors that count) warns once, naming the budget the plan had and the
   newest tensor it could not fit; not when ``device_budget`` was given as 0 (that
   asks for nothing to be kept).

The budget the plan spends is what the pipeline gives it: ``device_budget`` minus the
windows that live in the same memory (NOTE [ Windows ]).

NOTE [ Budgets per device ]
Several devices in one process (a model split over ``cuda:0`` and ``cuda:1``, CPU
layers beside GPU ones) each have their own memory, so each has its own budget:

1. Each device whose tensors count gets a plan of its own: its forwards, traces,
   calibration, kept bytes, ``auto`` figure and high-water mark (read from *its*
   memory), under the rules above, whatever the other devices' tensors do. Tensors
   of the devices interleave in one forward; a device's plan sees only its own.
   ``device_budget`` (bytes or a share) applies to each device.
2. A forward (rule 1 of NOTE [ Device budget plan ]) starts on each device at its
   first pack after an unpack, and every unpack ends every device's forward.
3. The write-behind's and the prefetcher's windows are one per pipeline: the windows
   in force are the smallest any device's plan derived (0 where none has a window
   yet), so every device's plan, having subtracted its own, stays within its budget.
   The copy window (NOTE [ Copy window ] in ``_device.py``) bounds each device's copies
   separately.
4. ``stats.effective_device_budget`` is the first device's figure (the device the
   first counting tensor was on); :meth:`BudgetControl.device_budgets` has all.
   What a plan learnt carries over per device (:class:`PlanMemory`).

NOTE [ Plan carry-over ]
What a plan learnt lives in a :class:`PlanMemory`, not in the pipeline: a pipeline
given one starts from its remembered traces, calibration, peaks and derived
``device_budget``, and leaves what it learns there. ``offload()`` keys one memory per
configuration and step (the hooks layer says which), so a fresh ``with
tsh.offload(device_budget=...)`` block per step plans from the second step on, as one
hooks object reused does. Sharing never lets a forward pass its budget: a remembered
trace that does not match the new forward is a replan (rule 4), and rule 5 holds
whatever the prediction.

NOTE [ Windows ]
A window a user gives (``prefetch=``, ``max_inflight=``, or the YAML field) is used as
given. A window left out (``None``) is derived, again after every forward (rule 1 of
NOTE [ Device budget plan ]):

1. ``seen``: the bytes the last forward saved in tensors the rules move (its
   trace), or while the first forward runs, what it has saved so far. ``largest``:
   the largest such tensor.
2. A derived window is ``seen / 8`` (about one block of a model built of blocks),
   at least ``2 * largest`` (one transfer runs while the next tensor is packed or
   consumed) and at most a fixed cap (``max_inflight`` 512 MiB, ``prefetch``
   256 MiB). Before anything was seen it is 0: the first tensors of a pipeline
   are written through, which costs the warm-up step a little time and no memory.
3. Windows count against the budget of the memory they live in. On a CPU tensor
   both windows hold RAM, the ``device_budget``'s memory; on an accelerator the
   prefetch window holds device memory (``device_budget``) and the write-behind
   window pinned host memory (``host_budget``, when set). A derived window takes
   at most a quarter of its budget; the plan spends what the windows leave
   (``device_budget - windows``). A given window is subtracted in full (a budget
   smaller than the given windows leaves the plan nothing: everything the rules
   move is moved).
4. The pipeline always lets one tensor through an empty window (else a tensor
   larger than the window would wait forever), so the true bound of a window is
   ``max(window, largest)``.

NOTE [ Auto budgets ]
``device_budget`` and ``host_budget`` may be ``auto`` or a percentage (NOTE [ Memory
shares ] in ``_units.py``): a share of the *room*, the memory there is.

1. Each budget reads the memory it lives in (``_memory.MemoryReading``):
   ``device_budget`` the memory of the device its counting tensors are on (CUDA:
   free memory plus what torch's caching allocator has reserved, and the
   allocator's peak; CPU: RAM), ``host_budget`` the host's RAM. RAM is a
   container's limit (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``) less
   what its other processes use, or else the machine's available memory plus what
   this process has (NOTE [ Container limits ] in ``runtime/_memory.py``).
2. ``room = limit - headroom - baseline``, at least 0, where ``headroom`` is
   ``memory_headroom`` (a share of ``limit``, or bytes) and ``baseline`` the
   process's peak without saved tensors (rule 3). The budget is its share of
   ``room``.
3. The baseline: the process's high-water mark of that memory less what the
   budget held when the mark was reached. At the first reading after the first
   step, the mark itself (the first forward keeps nothing: the peak of offloading
   what the rules move). Later, each step that raised the mark raises the baseline
   to at least the new mark less what that step held (the plan's kept bytes; for
   the host, the host tier's bytes at backward's start). A high-water mark never
   falls, so neither does the baseline: a step that needs more memory lowers the
   budget, and a peak that held saved tensors never raises it.
4. When: ``device_budget`` at the first pack of the first forward (rule 5) and again
   at the start of the second forward (the first step's peak is known then),
   ``host_budget`` when the pipeline is made (from the peak so far) and again at the
   second forward; both again at the start of every
   forward after a replan (rule 4 of NOTE [ Device budget plan ]) or after the
   baseline rose. The figure is logged at INFO (when it moves by 1/16 or more;
   DEBUG otherwise) and kept in ``stats.effective_device_budget`` /
   ``stats.effective_host_budget``; the windows follow it (NOTE [ Windows ]).
5. The first forward's figure is half the budget's share of the room the peak so far
   leaves (the step's own peak, which rule 3 subtracts, is not known yet: half is
   left for it), and that forward keeps its oldest tensors within it (rule 3 of NOTE
   [ Device budget plan ]). From the second forward on the figure is rule 2's, in
   full. A device whose memory cannot be read (neither CPU nor CUDA) gets no plan and
   one warning.
6. Why it cannot get a run killed where offloading everything fits: under a limit
   ``L`` offloading everything peaks at the baseline ``B``; the budgets keep at
   most ``L - headroom - B`` (the windows included), so the run peaks near
   ``L - headroom``, the headroom left for what no figure shows (allocator slack,
   heap fragmentation, page tables).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from tensorstore_hooks._units import DEFAULT_HEADROOM, MemoryShare, format_bytes
from tensorstore_hooks._warn import warn_user
from tensorstore_hooks.runtime import MemoryProbe, MemoryReading, SystemMemory

if TYPE_CHECKING:
    from tensorstore_hooks.config import PipelineSettings, Policy
    from tensorstore_hooks.pipeline._stats import OffloadStats

__all__ = [
    "BUDGET_LABEL",
    "CALIBRATION_FORWARDS",
    "DEFAULT_MAX_INFLIGHT",
    "DEFAULT_PREFETCH",
    "KEPT_NOTHING_FORWARDS",
    "MAX_MARGIN",
    "REMEMBERED_TRACES",
    "BudgetControl",
    "PeakTrack",
    "PlanMemory",
    "Trace",
    "Windows",
    "auto_budget",
    "derive_windows",
    "headroom_bytes",
    "kept_nothing_warning",
    "no_room_warning",
    "pinned_idle_cap",
    "plan_keep",
    "scaled_rest",
    "track_peak",
]

log = logging.getLogger("tensorstore_hooks")

BUDGET_LABEL = "device_budget"
"""The stats label (``stats.per_rule``) of tensors the plan kept."""
REMEMBERED_TRACES = 4
"""Distinct traces a plan predicts from (rule 4 of NOTE [ Device budget plan ])."""
CALIBRATION_FORWARDS = 4
"""Forwards whose prediction errors scale the next predictions (rule 7)."""
MAX_MARGIN = 2.0
"""The most a prediction is scaled up by (rule 7)."""
KEPT_NOTHING_FORWARDS = 3
"""Forwards in a row that keep nothing before the warning (rule 9)."""
DEFAULT_MAX_INFLIGHT = 512 << 20
"""Upper bound of a derived ``max_inflight``."""
DEFAULT_PREFETCH = 256 << 20
"""Upper bound of a derived ``prefetch``."""

_MOVES = frozenset(("store", "host"))
_BLOCKS = 8  # NOTE [ Windows ] rule 2: a forward is taken to be about this many blocks
_BUDGET_SHARE = 4  # rule 3: a derived window takes at most 1/4 of its budget
_LOG_STEP = 16  # NOTE [ Auto budgets ] rule 4: INFO when a figure moves by 1/16 or more


# ------------------------------------------------------------------------- the plan
def plan_keep(sizes: Sequence[int], budget_bytes: int) -> int:
    """How many of the newest entries of ``sizes`` (pack order) fit ``budget_bytes``.

    The kept tensors are ``sizes[len(sizes) - n:]``: rule 5 of NOTE [ Device budget plan ]
    on a forward known in advance.
    """
    total = 0
    n = 0
    for size in reversed(sizes):
        if total + size > budget_bytes:
            break
        total += size
        n += 1
    return n


@dataclass(frozen=True, slots=True)
class Trace:
    """A forward's counting sizes in pack order (rule 3), with its kinds (rule 6)."""

    sizes: tuple[int, ...]
    total: int
    """``sum(sizes)``."""
    kinds: tuple[tuple[int, int, bool], ...]
    """``(size, how many, spread)`` for every distinct size; *spread*: its occurrences
    are not all next to each other (a tensor of every block, not the logits)."""

    @classmethod
    def of(cls, sizes: Sequence[int]) -> Trace:
        counts: dict[int, int] = {}
        last: dict[int, int] = {}
        spread: set[int] = set()
        for i, size in enumerate(sizes):
            counts[size] = counts.get(size, 0) + 1
            if last.get(size, i - 1) != i - 1:
                spread.add(size)
            last[size] = i
        return cls(tuple(sizes), sum(sizes), tuple((k, n, k in spread) for k, n in counts.items()))


def scaled_rest(
    kinds: Sequence[tuple[int, int, bool]],
    seen: dict[int, int],
    ratios: dict[int, float],
    cautious_ratio: float,
) -> float:
    """The bytes a remembered trace has left, each kind scaled by its ratio (rule 6).

    ``kinds``: the trace's ``(size, count, spread)``; ``seen``: how many of each size
    the alignment has passed; ``ratios``: each seen kind's latest ratio. A seen kind
    scales by its ratio; one not seen yet by ``cautious_ratio`` (a guess never shrinks
    the rest below the largest ratio seen), unless it is spread over the trace: then
    the rest is unknown (``inf``), nothing says how a tensor of every block scales, and
    there is a lot of it.
    """
    rest = 0.0
    for size, count, spread in kinds:
        passed = seen.get(size, 0)
        if count > passed:
            ratio = ratios.get(size)
            if ratio is None:  # not seen yet (or only skipped over)
                if spread and not passed:
                    return math.inf
                ratio = cautious_ratio
            rest += (count - passed) * size * ratio
    return rest


class _Alignment:
    """How the running forward lines up with one remembered trace (rule 6)."""

    __slots__ = (
        "_hi",
        "_lo",
        "_top",
        "at",
        "contradictions",
        "exact",
        "ratios",
        "ref",
        "ref_bytes",
        "seen",
    )

    def __init__(self, ref: Trace) -> None:
        self.ref = ref
        self.at = 0  # the trace position the next tensor is paired with
        self.seen: dict[int, int] = {}
        self.ratios: dict[int, float] = {}
        self.ref_bytes = 0  # bytes of the trace before ``at``
        self.contradictions = 0
        self.exact = True
        self._top = 0.0  # the largest ratio seen
        self._lo = self._hi = 1.0  # the smallest / largest ratio seen, and 1

    def _fits(self, kind: int, ratio: float) -> bool:
        """Whether ``ratio`` is what ``kind`` scales by: its own ratio once seen, else
        one within the square of the ratios seen (``L x d`` by r, ``L x L`` by r**2)."""
        old = self.ratios.get(kind)
        if old is not None:
            return old == ratio
        if not self.ratios:
            return True
        slack = 1 + 1e-9  # r * r in floats against a ratio of squares
        return self._lo * self._lo / slack <= ratio <= self._hi * self._hi * slack

    def add(self, nbytes: int) -> None:
        """Pair the running forward's next counting tensor (``nbytes``) with the trace.

        Realigns around one or two trace tensors the forward does not save (a tensor
        that fell below ``min_bytes`` at this length): the first of the next three
        trace positions whose kind fits is taken, skipping only kinds never paired yet;
        when none fits the tensor is one the trace does not have, the trace position
        stays and a contradiction is counted.
        """
        sizes = self.ref.sizes
        for skip in range(3):
            j = self.at + skip
            if j >= len(sizes) or (skip and sizes[j - 1] in self.ratios):
                break  # past the end, or skipping a kind the forward has shown it saves
            kind = sizes[j]
            ratio = nbytes / kind if kind else 1.0
            if self._fits(kind, ratio):
                for k in sizes[self.at : j]:  # skipped: the forward does not have them
                    self.seen[k] = self.seen.get(k, 0) + 1
                    self.ref_bytes += k
                self._pair(kind, ratio)
                self.at = j + 1
                if skip or nbytes != kind:
                    self.exact = False
                return
        self.contradictions += 1
        self.exact = False

    def _pair(self, kind: int, ratio: float) -> None:
        self.seen[kind] = self.seen.get(kind, 0) + 1
        self.ref_bytes += kind
        self.ratios[kind] = ratio
        self._top = max(self._top, ratio)
        self._lo = min(self._lo, ratio)
        self._hi = max(self._hi, ratio)

    def rest(self, nbytes: int, forward_bytes: int) -> float:
        """Predicted bytes from the tensor just added (``nbytes``) to the forward's end;
        ``forward_bytes``: what the forward has saved so far, that tensor included."""
        ref = self.ref
        if self.at >= len(ref.sizes):
            return float(nbytes)
        if self.exact:
            return float(nbytes + ref.total - self.ref_bytes)
        # The largest ratio seen, or of all bytes so far: what an untrusted kind scales by.
        cautious = max(forward_bytes / self.ref_bytes if self.ref_bytes else 1.0, self._top)
        if self.contradictions:  # not the same structure: every byte at the cautious ratio
            return nbytes + (ref.total - self.ref_bytes) * cautious
        return nbytes + scaled_rest(ref.kinds, self.seen, self.ratios, cautious)


def _best(aligns: Sequence[_Alignment]) -> _Alignment:
    """The alignment rule 6 predicts from (``aligns`` is newest first)."""
    best = aligns[0]
    for align in aligns[1:]:
        if (align.contradictions, not align.exact) < (best.contradictions, not best.exact):
            best = align
    return best


# ---------------------------------------------------------------------- the windows
@dataclass(frozen=True, slots=True)
class Windows:
    """The windows in force and what the device plan may spend."""

    max_inflight: int
    """Bytes written behind before pack blocks."""
    prefetch: int
    """Bytes read ahead during backward."""
    plan_budget: int | None
    """Bytes the ``device_budget`` plan may keep (``None``: no device budget)."""


def _derived(seen: int, largest: int, cap: int, budget: int | None) -> int:
    size = min(max(seen // _BLOCKS, 2 * largest), cap)  # rule 2
    if budget is not None:
        size = min(size, budget // _BUDGET_SHARE)  # rule 3
    return size


def derive_windows(
    *,
    seen_bytes: int,
    largest_bytes: int,
    max_inflight: int | None,
    prefetch: int | None,
    device_budget: int | None,
    host_budget: int = 0,
    accelerator: bool = False,
) -> Windows:
    """The windows and the plan's budget per NOTE [ Windows ].

    ``max_inflight`` / ``prefetch``: the user's sizes, or ``None`` to derive them.
    ``accelerator``: the saved tensors live on a device other than the host (then
    the write-behind window lives in host memory, rule 3).
    """
    inflight_budget = (host_budget or None) if accelerator else device_budget
    mi = (
        max_inflight
        if max_inflight is not None
        else _derived(seen_bytes, largest_bytes, DEFAULT_MAX_INFLIGHT, inflight_budget)
    )
    pf = (
        prefetch
        if prefetch is not None
        else _derived(seen_bytes, largest_bytes, DEFAULT_PREFETCH, device_budget)
    )
    plan: int | None = None
    if device_budget is not None:
        plan = max(device_budget - pf - (0 if accelerator else mi), 0)
    return Windows(max_inflight=mi, prefetch=pf, plan_budget=plan)


def pinned_idle_cap(settings: PipelineSettings) -> int:
    """Idle pinned staging buffers a pipeline keeps: both windows at their largest."""
    mi = DEFAULT_MAX_INFLIGHT if settings.max_inflight is None else settings.max_inflight
    pf = DEFAULT_PREFETCH if settings.prefetch is None else settings.prefetch
    return int(mi + pf)


# --------------------------------------------------------------------- auto budgets
@dataclass(frozen=True, slots=True)
class PeakTrack:
    """A high-water mark and the baseline taken from it (NOTE [ Auto budgets ] rule 3)."""

    peak_bytes: int
    baseline_bytes: int
    """The process's peak without saved tensors, as far as it is known."""


def track_peak(track: PeakTrack | None, peak_bytes: int, held_bytes: int) -> PeakTrack:
    """``track`` after a step that ended at high-water mark ``peak_bytes`` while the
    budget held ``held_bytes`` (rule 3: the baseline only rises, and only with the mark)."""
    if track is None:
        return PeakTrack(peak_bytes, max(0, peak_bytes - held_bytes))
    if peak_bytes <= track.peak_bytes:
        return track
    return PeakTrack(peak_bytes, max(track.baseline_bytes, peak_bytes - held_bytes))


def headroom_bytes(headroom: int | MemoryShare, limit_bytes: int) -> int:
    """``memory_headroom`` in bytes: given, or its share of ``limit_bytes``."""
    return headroom.of(limit_bytes) if isinstance(headroom, MemoryShare) else headroom


def auto_budget(
    share: MemoryShare, reading: MemoryReading, baseline_bytes: int, headroom: int | MemoryShare
) -> int:
    """``share`` of the room in ``reading`` (NOTE [ Auto budgets ] rule 2)."""
    room = reading.limit_bytes - headroom_bytes(headroom, reading.limit_bytes) - baseline_bytes
    return share.of(max(0, room))


# ---------------------------------------------------------------------- the control
class _WritesBehind(Protocol):
    max_inflight: int


class _ReadsAhead(Protocol):
    window_bytes: int


class _Tier(Protocol):
    """The host tier (``_host_tier.SlabTier``): its cap and what it uses."""

    cap_bytes: int

    @property
    def used_bytes(self) -> int: ...


_IDLE, _KEEPING, _CLOSED = 0, 1, 2  # a forward's run (rule 5): not started, running, ended
_CPU = torch.device("cpu")


@dataclass(slots=True)
class _Forward:
    """The running forward (rule 1): what it has saved, and its run (rule 5)."""

    aligns: list[_Alignment]
    """One per remembered trace, newest first (rule 6)."""
    plan_budget: int | None
    """What the plan could spend when the forward started."""
    sizes: list[int] = field(default_factory=list)
    seen: int = 0
    largest: int = 0
    run: int = _IDLE
    kept: int = 0
    run_start: int = -1
    predicted: float = 0.0
    """The rest predicted where the run started (rule 7)."""
    align: _Alignment | None = None
    """The alignment that prediction came from."""


def kept_nothing_warning(plan_bytes: int, budget_bytes: int, newest_bytes: int) -> str:
    """The rule 9 warning: the plan's budget, the windows, the tensor that did not fit."""
    why = (
        f"less than the newest tensor a forward saves ({format_bytes(newest_bytes)})"
        if plan_bytes < newest_bytes
        else "and each forward's sizes differed too much from the earlier ones to predict "
        "what it would still save"
    )
    windows = budget_bytes - plan_bytes
    return (
        f"tensorstore-hooks: device_budget kept nothing in {KEPT_NOTHING_FORWARDS} forwards "
        f"in a row: the plan may spend {format_bytes(plan_bytes)} (device_budget "
        f"{format_bytes(budget_bytes)} less the prefetch and max_inflight windows, "
        f"{format_bytes(windows)}), {why}. Raise device_budget (to at least "
        f"{format_bytes(newest_bytes + windows)}), give smaller windows (prefetch=, "
        "max_inflight=), or set device_budget to null to offload without a plan."
    )


def no_room_warning(
    which: str, share: MemoryShare, reading: MemoryReading, base: int, headroom: int
) -> str:
    """An ``auto`` (or percentage) budget that found no room: what it read, and the fix."""
    effect = (
        "nothing is kept on the device: everything the rules move is moved"
        if which == "device"
        else "there is no host tier"
    )
    return (
        f"tensorstore-hooks: {which}_budget {share} found no room, so it is 0 B and "
        f"{effect}. It read a limit of {format_bytes(reading.limit_bytes)} ({reading.source}), "
        f"less the headroom {format_bytes(headroom)} (memory_headroom) and the peak this "
        f"process reached without saved tensors, {format_bytes(base)}: "
        f"{format_bytes(max(0, reading.limit_bytes - headroom - base))} left. Free memory "
        f"before the first step, lower memory_headroom, or give {which}_budget as a size."
    )


def _log_auto(
    which: str, share: MemoryShare, reading: MemoryReading, base: int, headroom: int, figure: int,
    *, info: bool,
) -> None:  # fmt: skip
    log.log(
        logging.INFO if info else logging.DEBUG,
        "%s_budget %s: %s (%s of %s from %s, less headroom %s and the peak without saved "
        "tensors %s)",
        which, share, format_bytes(figure), share, format_bytes(reading.limit_bytes),
        reading.source, format_bytes(headroom), format_bytes(base),
    )  # fmt: skip


@dataclass
class PlanMemory:
    """What a plan learnt, carried from one pipeline to the next (NOTE [ Plan carry-over ]).

    Mutated in place by every :class:`BudgetControl` given it (under that control's lock).
    """

    traces: list[Trace] = field(default_factory=list)
    errors: deque[float] = field(default_factory=lambda: deque(maxlen=CALIBRATION_FORWARDS))
    tracks: dict[str, PeakTrack] = field(default_factory=dict)
    device_budget: int | None = None
    """The last ``device_budget`` derived from a share (``auto``), bytes."""
    device: torch.device | None = None
    forwards: int = 0
    derive_due: bool = False
    """An ``auto`` figure is to be derived again at the next forward's start (the first
    forward's half figure, a new trace)."""
    kept_nothing: int = 0
    """Forwards in a row that kept nothing (rule 9 of NOTE [ Device budget plan ])."""
    warned: set[str] = field(default_factory=set)
    """The one-time warnings already given: once over every pipeline of this memory."""
    devices: dict[str, PlanMemory] = field(default_factory=dict)
    """What the plans of the other devices learnt, by device (NOTE [ Budgets per device ])."""


class BudgetControl:
    """One pipeline's budgets: the device plan, the windows and the ``auto`` figures.

    ``device_budget``: bytes, a :class:`~tensorstore_hooks._units.MemoryShare`
    (``auto``, ``"60%"``) or ``None`` (no plan); ``host_budget``: bytes or a share (0:
    no host tier). ``max_inflight`` / ``prefetch``: the user's sizes or ``None``
    (derived). ``apply(windows)`` is called whenever the windows change (on the thread
    that packs or unpacks; keep it cheap). ``probe``: where memory is read (default:
    the system's). ``stats`` (when given) gets ``replans`` and the effective budgets.
    Thread-safe.
    """

    def __init__(
        self,
        *,
        device_budget: int | MemoryShare | None,
        host_budget: int | MemoryShare = 0,
        max_inflight: int | None,
        prefetch: int | None,
        memory_headroom: int | MemoryShare = DEFAULT_HEADROOM,
        apply: Callable[[Windows], None] | None = None,
        stats: OffloadStats | None = None,
        probe: MemoryProbe | None = None,
        memory: PlanMemory | None = None,
    ) -> None:
        self._specs: dict[str, int | MemoryShare | None] = {
            "device": device_budget,
            "host": host_budget,
        }
        self._headroom = memory_headroom
        self._user_inflight = max_inflight
        self._user_prefetch = prefetch
        self._apply = apply
        self._tier: _Tier | None = None
        self._stats = stats
        self._probe: MemoryProbe = probe if probe is not None else SystemMemory()
        self._lock = threading.Lock()
        # Remembered traces, newest first (rule 4), and what predictions learnt (rule 7).
        self._traces: list[Trace] = []
        self._errors: deque[float] = deque(maxlen=CALIBRATION_FORWARDS)
        self._margin = 1.0
        self.forwards = 0
        """Forwards finished (rule 1)."""
        self.replans = 0
        """Forwards whose trace was new (rule 4)."""
        self._memory: PlanMemory | None = None  # NOTE [ Plan carry-over ]
        self._fwd: _Forward | None = None  # None between forwards
        self._fwd_done = _Forward([], None)  # the last finished one
        self._kept_nothing = 0  # forwards in a row (rule 9)
        self._warned: set[str] = set()
        self._warning: str | None = None  # issued by keep() outside the lock
        # Effective budgets (NOTE [ Auto budgets ]).
        self._device: torch.device | None = None
        self._tracks: dict[str, PeakTrack] = {}
        self._tier_used = 0  # the host tier's bytes at the last backward's start
        self._derive_due = False
        self._logged: dict[str, int] = {}
        self._others: dict[torch.device, BudgetControl] = {}  # NOTE [ Budgets per device ]
        self.device_budget: int | None = (
            device_budget if not isinstance(device_budget, MemoryShare) else None
        )
        """The device budget in force, bytes (``None``: none, or ``auto`` not derived yet)."""
        self.host_budget: int = host_budget if isinstance(host_budget, int) else 0
        """The host budget in force, bytes."""
        if memory is not None:
            self._recall(memory)
        if isinstance(host_budget, MemoryShare):
            self.host_budget = self._derive("host", _CPU, 0) or 0
        self._publish()
        self.windows = self._derive_windows()
        self._push()

    def _recall(self, memory: PlanMemory) -> None:
        """Start from what earlier pipelines learnt (NOTE [ Plan carry-over ])."""
        self._memory = memory
        self._traces, self._errors, self._tracks = memory.traces, memory.errors, memory.tracks
        self._kept_nothing, self._warned = memory.kept_nothing, memory.warned
        if memory.device is not None:  # the first device's plan is this one (NOTE [ Budgets
            self._device = memory.device  # per device ] rule 4)
        if self._errors:
            self._margin = min(MAX_MARGIN, max(1.0, *self._errors))
        if isinstance(self._specs["device"], MemoryShare) and memory.device_budget is not None:
            self.device_budget, self._device = memory.device_budget, memory.device
            self.forwards = memory.forwards  # rule 5 of NOTE [ Auto budgets ] is behind us
            self._derive_due = memory.derive_due

    def _remember(self) -> None:
        memory = self._memory
        if memory is not None:
            memory.forwards = self.forwards
            memory.device = self._device
            memory.derive_due, memory.kept_nothing = self._derive_due, self._kept_nothing
            if isinstance(self._specs["device"], MemoryShare):
                memory.device_budget = self.device_budget

    @classmethod
    def for_pipeline(
        cls,
        policy: Policy,
        settings: PipelineSettings,
        stats: OffloadStats,
        memory: PlanMemory | None = None,
    ) -> BudgetControl:
        """The control of a pipeline (then :meth:`connect` its units); ``memory``: start
        from and add to what earlier pipelines learnt (NOTE [ Plan carry-over ])."""
        return cls(
            device_budget=policy.device_budget,
            host_budget=settings.host_budget,
            max_inflight=settings.max_inflight,
            prefetch=settings.prefetch,
            memory_headroom=settings.memory_headroom,
            stats=stats,
            memory=memory,
        )

    def connect(self, writer: _WritesBehind, prefetcher: _ReadsAhead, tier: _Tier | None) -> None:
        """Set ``writer.max_inflight`` and ``prefetcher.window_bytes`` now and whenever the
        windows change, and ``tier.cap_bytes`` whenever ``host_budget`` is derived again."""

        def apply(windows: Windows) -> None:
            writer.max_inflight = windows.max_inflight
            prefetcher.window_bytes = windows.prefetch

        with self._lock:
            self._apply = apply
            self._tier = tier
            self._push()

    @property
    def derives(self) -> bool:
        """Whether any window is derived (not given by the user)."""
        return self._user_inflight is None or self._user_prefetch is None

    @property
    def traces(self) -> tuple[Trace, ...]:
        """The remembered traces, newest first (rule 4)."""
        return tuple(self._traces)

    # ---------------------------------------------------------------- packing
    def keep(self, action: str, nbytes: int, *, device: torch.device = _CPU) -> bool:
        """One saved tensor the policy sent to ``action``; ``True``: the plan keeps it.

        ``device``: where the tensor lives. Only ``store`` and ``host`` tensors count
        (rule 2 of NOTE [ Device budget plan ]); any call starts a forward (rule 1).
        """
        first = self._device
        if first is not None and device != first:  # NOTE [ Budgets per device ]
            return self._plan_of(device).keep(action, nbytes, device=device)
        with self._lock:
            fwd = self._fwd if self._fwd is not None else self._begin_forward(device)
            keep = self._decide(fwd, nbytes, device) if action in _MOVES else False
            warning, self._warning = self._warning, None
        if warning is not None:
            warn_user(warning)  # outside the lock: an error filter may raise it
        return keep

    def _decide(self, fwd: _Forward, nbytes: int, device: torch.device) -> bool:
        self._device = device
        i = len(fwd.sizes)
        fwd.sizes.append(nbytes)
        fwd.seen += nbytes
        if nbytes > fwd.largest:
            fwd.largest = nbytes
            if not self._traces and self.derives:
                # First forward: the windows grow with what it has saved (NOTE [ Windows ]
                # rule 1); two integer assignments when they change.
                self._set_windows(self._derive_windows())
        budget = self.windows.plan_budget
        if budget is None:
            return False
        if not self._traces:
            return self._first_forward(fwd, nbytes, budget)
        for align in fwd.aligns:  # also after the run started: rule 7 checks it
            align.add(nbytes)
        if fwd.run == _KEEPING and fwd.kept + nbytes <= budget:
            fwd.kept += nbytes
            return True
        if fwd.run != _IDLE:
            fwd.run = _CLOSED  # rule 5: the first misfit ends the run
            return False
        if nbytes > budget:
            return False
        best = _best(fwd.aligns)
        rest = best.rest(nbytes, fwd.seen)
        if rest * self._margin > budget:
            return False
        fwd.run, fwd.kept, fwd.run_start, fwd.predicted, fwd.align = _KEEPING, nbytes, i, rest, best
        return True

    def _first_forward(self, fwd: _Forward, nbytes: int, budget: int) -> bool:
        """Rule 3 under an ``auto`` budget: keep the oldest tensors while they fit."""
        if not isinstance(self._specs["device"], MemoryShare) or fwd.run == _CLOSED:
            return False  # a budget given in bytes: the first forward follows the rules
        if fwd.kept + nbytes <= budget:
            fwd.run, fwd.kept = _KEEPING, fwd.kept + nbytes
            return True
        fwd.run = _CLOSED
        return False

    def _begin_forward(self, device: torch.device) -> _Forward:
        """A forward starts (rule 1): derive what is due; the rule 9 warning, if due."""
        if self.forwards and any(isinstance(v, MemoryShare) for v in self._specs.values()):
            self._update_budgets()
        elif not self.forwards and isinstance(self._specs["device"], MemoryShare):
            self._first_budget(device)
        # An auto budget that found no room already said why (no_room_warning).
        said = "kept" in self._warned or ("device room" in self._warned and not self.device_budget)
        if self._kept_nothing >= KEPT_NOTHING_FORWARDS and not said:
            self._warned.add("kept")
            newest = self._traces[0].sizes[-1] if self._traces[0].sizes else 0
            self._warning = kept_nothing_warning(
                self.windows.plan_budget or 0, self.device_budget or 0, newest
            )
        self._fwd = _Forward([_Alignment(t) for t in self._traces], self.windows.plan_budget)
        return self._fwd

    # ------------------------------------------------------------- unpacking
    def backward_started(self) -> bool:
        """An unpack ran. ``True`` when it ended a forward (the first unpack of a backward)
        on any device (rule 2 of NOTE [ Budgets per device ])."""
        if self._fwd is None and not self._others:  # the common case: two reads per unpack
            return False
        ended = False
        for other in list(self._others.values()):
            ended |= other.backward_started()
        with self._lock:
            fwd, self._fwd = self._fwd, None
            if fwd is None:
                return ended
            self._end_forward(fwd)
            return True

    # ------------------------------------------------------------ per device
    def _plan_of(self, device: torch.device) -> BudgetControl:
        """The plan of ``device``, made at its first counting tensor (NOTE [ Budgets per
        device ] rule 1): the same settings, its own memory and figures."""
        plan = self._others.get(device)
        if plan is not None:
            return plan
        with self._lock:
            plan = self._others.get(device)
            if plan is None:
                memory = self._memory
                plan = BudgetControl(
                    device_budget=self._specs["device"],
                    host_budget=self.host_budget,  # the host's: derived here only
                    max_inflight=self._user_inflight,
                    prefetch=self._user_prefetch,
                    memory_headroom=self._headroom,
                    probe=self._probe,
                    memory=None if memory is None else memory.devices.setdefault(
                        str(device), PlanMemory()
                    ),
                )
                plan._device = device
                plan._warned = self._warned  # each warning once per pipeline
                plan._apply = lambda _windows: self._push()
                self._others = {**self._others, device: plan}  # read without the lock
        self._push()
        return plan

    def device_budgets(self) -> dict[torch.device, int | None]:
        """The device budget in force on each device seen so far (bytes; ``None``: none)."""
        out: dict[torch.device, int | None] = {}
        if self._device is not None:
            out[self._device] = self.device_budget
        for device, plan in self._others.items():
            out[device] = plan.device_budget
        return out

    def kept_bytes(self) -> dict[torch.device, int]:
        """Bytes the plan of each device keeps in its running forward (or kept in its
        last one, between forwards)."""
        out: dict[torch.device, int] = {}
        for device, plan in [(self._device, self), *self._others.items()]:
            if device is not None:
                fwd = plan._fwd if plan._fwd is not None else plan._fwd_done
                out[device] = fwd.kept
        return out

    def _end_forward(self, fwd: _Forward) -> None:
        self.forwards += 1
        self._fwd_done = fwd
        sizes = fwd.sizes
        # Rule 7: how far off the prediction the run started from was (only from a
        # trace the forward kept matching: a misaligned one says nothing of the next).
        if fwd.align is not None and not fwd.align.contradictions and fwd.predicted > 0:
            self._errors.append(sum(sizes[fwd.run_start :]) / fwd.predicted)
        else:
            self._errors.append(1.0)
        self._margin = min(MAX_MARGIN, max(1.0, *self._errors))
        # Rule 9: a plan that had a budget and tensors to spend it on, and kept nothing.
        # (A device_budget of 0 asks for nothing to be kept: no warning for that.)
        planned = fwd.plan_budget is not None and self._specs["device"] != 0
        kept_nothing = bool(self._traces and planned and sizes and fwd.kept == 0)
        self._kept_nothing = self._kept_nothing + 1 if kept_nothing else 0
        if self._tier is not None:
            self._tier_used = self._tier.used_bytes
        trace = Trace.of(sizes)  # rule 4
        if trace in self._traces:
            self._traces.remove(trace)
        else:
            if self._traces:
                self.replans += 1
                if self._stats is not None:
                    self._stats.replans = self.replans
            self._derive_due = True
        self._traces.insert(0, trace)
        del self._traces[REMEMBERED_TRACES:]
        self._set_windows(self._derive_windows())
        self._remember()

    # ---------------------------------------------------------- auto budgets
    def _update_budgets(self) -> None:
        """At a forward's start: follow the peaks; derive what is due (rules 3 and 4)."""
        device = self._device or _CPU
        kept, on_host = self._fwd_done.kept, device.type == "cpu"
        meters = {
            "device": (device, kept + (self._tier_used if on_host else 0)),
            "host": (_CPU, self._tier_used + (kept if on_host else 0)),
        }
        shared = [w for w, spec in self._specs.items() if isinstance(spec, MemoryShare)]
        for which in shared:
            self._derive_due |= self._follow(which, *meters[which])
        if not self._derive_due:
            return
        self._derive_due = False
        for which in shared:
            figure = self._derive(which, meters[which][0], None)
            if which == "device":
                self.device_budget = figure
            else:
                self.host_budget = figure or 0
                if self._tier is not None:
                    self._tier.cap_bytes = self.host_budget
        self._publish()
        self._set_windows(self._derive_windows())

    def _first_budget(self, device: torch.device) -> None:
        """``device_budget`` for the first forward (NOTE [ Auto budgets ] rule 5): half its
        share of the room the peak so far leaves, since the step's own peak is not known
        yet. Derived again, in full, when the second forward starts."""
        if self.device_budget is not None:
            return
        self._device = device
        figure = self._derive("device", device, 0)
        if figure is None:
            return
        self.device_budget = figure // 2
        self._derive_due = True
        log.info(
            "device_budget %s for the first forward: %s (half of %s: the step's own peak is "
            "not known yet)",
            self._specs["device"], format_bytes(self.device_budget), format_bytes(figure),
        )  # fmt: skip
        self._publish()
        self._set_windows(self._derive_windows())

    def _follow(self, which: str, device: torch.device, held_bytes: int) -> bool:
        """Track ``which`` budget's high-water mark; ``True`` when its baseline rose."""
        try:
            peak = self._probe.peak(device)
        except Exception:  # a reading that fails leaves the budget as it is
            log.debug("%s_budget auto: reading the peak failed", which, exc_info=True)
            return False
        old = self._tracks.get(which)
        self._tracks[which] = new = track_peak(old, peak, held_bytes)
        return old is None or new.baseline_bytes > old.baseline_bytes

    def _derive(self, which: str, device: torch.device, held_bytes: int | None) -> int | None:
        """``which`` budget from the memory there is (``held_bytes``: start its track)."""
        share = self._specs[which]
        assert isinstance(share, MemoryShare)
        try:
            reading = self._probe.read(device)
        except Exception:
            log.warning("%s_budget %s: reading %s failed", which, share, device, exc_info=True)
            reading = None
        if reading is None:
            if which not in self._warned:
                self._warned.add(which)
                self._warning = (
                    f"tensorstore-hooks: {which}_budget {share} cannot read the memory of "
                    f"{device} (only CPU and CUDA): no {which} budget. Give {which}_budget "
                    "as a size instead."
                )
            return None
        if held_bytes is not None or which not in self._tracks:
            self._tracks[which] = track_peak(None, reading.peak_bytes, held_bytes or 0)
        base = self._tracks[which].baseline_bytes
        headroom = headroom_bytes(self._headroom, reading.limit_bytes)
        figure = auto_budget(share, reading, base, self._headroom)
        if figure == 0 and f"{which} room" not in self._warned:
            self._warned.add(f"{which} room")
            self._warning = no_room_warning(which, share, reading, base, headroom)
        last = self._logged.get(which)
        moved = last is None or abs(figure - last) * _LOG_STEP >= max(last, 1)
        _log_auto(which, share, reading, base, headroom, figure, info=moved)
        if moved:
            self._logged[which] = figure
        return figure

    def _publish(self) -> None:
        if self._stats is not None:
            self._stats.effective_device_budget = self.device_budget
            self._stats.effective_host_budget = self.host_budget

    # ---------------------------------------------------------------- windows
    def _derive_windows(self) -> Windows:
        if self._traces:
            trace = self._traces[0]
            seen, largest = trace.total, max(trace.sizes, default=0)
        else:
            fwd = self._fwd
            seen, largest = (fwd.seen, fwd.largest) if fwd is not None else (0, 0)
        return derive_windows(
            seen_bytes=seen,
            largest_bytes=largest,
            max_inflight=self._user_inflight,
            prefetch=self._user_prefetch,
            device_budget=self.device_budget,
            host_budget=self.host_budget,
            accelerator=self._device is not None and self._device.type != "cpu",
        )

    def _set_windows(self, windows: Windows) -> None:
        if windows != self.windows:
            self.windows = windows
            self._push()

    def _push(self) -> None:
        """Apply the windows in force: this plan's, or with several devices the smallest
        any plan derived (rule 3 of NOTE [ Budgets per device ])."""
        apply = self._apply
        if apply is None:
            return
        others = self._others
        if not others:
            apply(self.windows)
            return
        plans = [self.windows, *(p.windows for p in others.values())]
        apply(
            Windows(
                max_inflight=_least(w.max_inflight for w in plans),
                prefetch=_least(w.prefetch for w in plans),
                plan_budget=self.windows.plan_budget,
            )
        )


def _least(sizes: Iterable[int]) -> int:
    """The smallest window that is not 0 (0: none is open yet)."""
    return min((n for n in sizes if n > 0), default=0)
