"""The router: what pack and unpack do with each saved tensor, for any framework.

Both the PyTorch hooks (:meth:`Router.pack` / :meth:`Router.unpack`) and the Paddle
hooks (which see their tensors through a zero-copy torch alias) go through one
:class:`Router` per pipeline. Pack asks the policy (:meth:`Router.decide`), counts the
decision (:meth:`Router.account`) and then keeps the tensor (:class:`Kept`), moves it
to pinned host memory (:class:`Host`) or hands it to the record table and the
write-behind (:meth:`Router.store`); unpack reverses that (:meth:`Router.load` for a
stored tensor, :meth:`Router.unkeep` for a kept one). A planner that overrides the
policy (budgets) sits between :meth:`decide` and :meth:`account`. What happens to a
stored tensor's record is the record table's to decide (NOTE [ Record lifecycle ]).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Generic, Protocol, TypeAlias, TypeVar

import torch

from tensorstore_hooks._codec import DTYPES, span_of, unsupported_reason
from tensorstore_hooks._warn import warn_user
from tensorstore_hooks.config import Policy
from tensorstore_hooks.pipeline._budgets import BUDGET_LABEL, BudgetControl
from tensorstore_hooks.pipeline._device import DeviceStager
from tensorstore_hooks.pipeline._ledger import DecisionLedger
from tensorstore_hooks.pipeline._prefetch import Prefetcher
from tensorstore_hooks.pipeline._recompute import CAST_LABEL, TO_COPY, Recomputed, recomputable
from tensorstore_hooks.pipeline._records import (
    DedupKey,
    Fetch,
    Handle,
    Ready,
    Record,
    RecordTable,
    Refused,
    VersionCounter,
    dedup_key,
    inplace_error,
)
from tensorstore_hooks.pipeline._spans import Pattern, Span, pattern_of
from tensorstore_hooks.pipeline._staging import CopyEvent, device_bytes
from tensorstore_hooks.pipeline._stats import OffloadStats, RouteStats
from tensorstore_hooks.pipeline._timeline import (
    PACK_RANGE,
    UNPACK_RANGE,
    Timeline,
    ranges_off,
    span,
)
from tensorstore_hooks.pipeline._writebehind import WriteBehind
from tensorstore_hooks.runtime import PipelineEffects, foreign, never_compiled, shielded

__all__ = [
    "CAPTURE_LABEL",
    "Host",
    "Kept",
    "ModulePaths",
    "Packed",
    "Route",
    "Router",
    "inplace_error",
]

log = logging.getLogger("tensorstore_hooks")

CAPTURE_LABEL = "cuda graph capture"
"""The stats label (``stats.per_rule``) of tensors kept because a graph was being
captured (rule 10 of NOTE [ Stream ordering ])."""

_MOVES = frozenset(("store", "host"))  # actions that take a tensor off its device
# NOTE [ Pack fast path ]: what it reads per tensor, looked up once.
_Tensor = torch.Tensor
_STRIDED = torch.strided
_STORABLE = frozenset(dtype for dtype, _ in DTYPES.values())  # unsupported_reason's dtypes
_graph_task_id = torch._C._current_graph_task_id  # -1: no backward runs (_in_backward)
_DEBUG = logging.DEBUG
_T = TypeVar("_T", bound="_Detachable")
_D = TypeVar("_D")


class _Detachable(Protocol):
    """A tensor of any framework: ``detach()`` gives an alias without autograd history."""

    def detach(self: _T) -> _T: ...


class Kept(Generic[_T]):
    """A tensor left in place, with its version at pack (see NOTE [ In-place checks ]).

    Holds ``t.detach()``: see NOTE [ Detached aliases ]. ``guard`` is what the version
    is read from (``_version``): the tensor itself, or another framework's counter.
    """

    __slots__ = ("guard", "tensor", "version")

    def __init__(self, t: _T, guard: VersionCounter | None = None) -> None:
        self.tensor: _T = t.detach()
        self.guard: VersionCounter
        if guard is not None:
            self.guard = guard
        elif isinstance(self.tensor, torch.Tensor):
            self.guard = self.tensor
        else:
            raise TypeError(f"Kept: a {type(t).__name__} needs a version guard")
        self.version: int = self.guard._version


class Host(Generic[_T, _D]):
    """A tensor moved to pinned host memory by a ``host`` rule, and where it came from.

    ``ready``: the event recorded on the producing stream after the copy to host
    (``None``: the copy has completed); unpack's stream waits on it before copying
    back (rules 3 and 8 of NOTE [ Stream ordering ]).
    """

    __slots__ = ("device", "ready", "tensor")

    def __init__(self, t: _T, device: _D, ready: CopyEvent | None = None) -> None:
        self.tensor = t
        self.device = device
        self.ready = ready


Packed: TypeAlias = (
    "Handle | Kept[torch.Tensor] | Host[torch.Tensor, torch.device] | Recomputed"
)
"""What the torch pack hook returns: the tensor's stand-in in the autograd graph."""


@dataclass(frozen=True, slots=True)
class Route:
    """The decision for one saved tensor, before it is counted."""

    action: str
    """``"keep"``, ``"host"`` or ``"store"``."""
    label: str
    """The policy rule that decided (``"default"``, ``"rules[0] module=..."``, ...)."""
    nbytes: int


class ModulePaths(Protocol):
    """Where ``module`` rules read the running module's path: ``hooks``' ``ModuleScope``
    (or paddle's ``LayerScope``), which module hooks keep up to date."""

    def current(self) -> str | None:
        """The dotted path of the innermost module running on this thread (``None``:
        none is running, or nothing is attached)."""
        ...


class Router:
    """Routes saved tensors of one pipeline. Made by the pipeline; used by the hooks.

    Not thread-safe for pack (autograd packs on the forward thread); :meth:`load` may
    run on several threads.
    """

    def __init__(
        self,
        *,
        policy: Policy,
        stats: OffloadStats,
        table: RecordTable,
        writer: WriteBehind,
        prefetcher: Prefetcher,
        stager: DeviceStager,
        scope: ModulePaths | None = None,
        budget: BudgetControl | None = None,
    ) -> None:
        self.policy = policy
        self.scope = scope
        """Where ``module`` rules read the running module's path (``None``: no model)."""
        self.stats = stats
        self.timeline: Timeline | None = None
        """Set while ``hooks.trace()`` records (NOTE [ Profiler ranges ])."""
        self._table = table
        self._writer = writer
        self._prefetcher = prefetcher
        self._stager = stager
        self._warned: set[str] = set()
        self._pid = os.getpid()  # NOTE [ Fork safety ]: a forked child keeps what it packs
        self.budget = budget
        """Between :meth:`decide` and :meth:`account`: NOTE [ Device budget plan ]."""
        self.ledger = DecisionLedger()
        """Every counted decision per module path, for ``hooks.report()``
        (NOTE [ Report ledger ])."""
        self.effects: PipelineEffects | None = None
        """Told when bytes start and stop moving (NOTE [ Process-wide effects ], effect 2)."""
        self._stored = False  # the running forward stored something

    @property
    def closing(self) -> bool:
        """Whether the pipeline is closing: from then on every tensor is kept."""
        return self._table.closing

    # ------------------------------------------------------------ torch hooks
    @never_compiled  # called from compiled graphs: NOTE [ torch.compile ], rule 3
    def pack(self, t: torch.Tensor) -> Packed:
        """The PyTorch pack hook. Returns the tensor's stand-in in the autograd graph."""
        if ranges_off(self.timeline):  # nobody would see the range
            packed = self._pack_fast(t)
            return packed if packed is not None else self._pack(t)
        with span(PACK_RANGE, self.timeline):  # NOTE [ Profiler ranges ]
            return self._pack(t)

    # NOTE [ Pack fast path ]
    # A GPU's kernels must hide the host time of pack and unpack, and most saved
    # tensors are alike: a plain dense tensor of the host the policy stores, in no span
    # union, not a parameter cast, not a dedup hit. For those, pack and unpack run a
    # path of their own (issue 34, finding F; benchmarks/python_calls.py counts it and
    # tests/pipeline/test_call_counts.py holds it): every check is a C attribute or a
    # C call (type identity, not isinstance, whose Parameter metaclass is Python; the
    # dtype table and torch's C functions bound once), one lock per table change
    # (``RecordTable.add_plain`` is share + wait_for_room + add at once), no dataclass
    # made per tensor, no property read, no profiler range nobody would see. Rules:
    # 1. It decides exactly as the general path does, calling the same policy, budget
    #    and write-behind, so every counter, ledger row and log line is the same.
    # 2. Whatever is not that tensor leaves the fast path *before* anything is counted
    #    (``_pack_fast`` and ``add_plain`` return ``None``, changing nothing) and takes
    #    the general path: subclasses and parameters, accelerator tensors (their
    #    streams, the host tier, graph captures), a backward running, a forked child,
    #    actions other than ``store``, casts to recompute, dedup and span candidates
    #    (a storage a live record is filed under, an open span), no room in flight.
    # 3. Seams stay seams: pack goes through ``Router.store`` and unpack through
    #    ``RecordTable.claim_for_unpack``, so a test or a wrapper that replaces either
    #    sees every tensor.
    def _pack_fast(self, t: torch.Tensor) -> Packed | None:
        """Pack ``t`` on the fast path (NOTE [ Pack fast path ]); ``None``: not a tensor
        for it, and nothing was counted (the caller takes the general path)."""
        base = t._base
        if (
            type(t) is not _Tensor
            or (base is not None and type(base) is not _Tensor)  # not a parameter's view
            or t.layout is not _STRIDED
            or t.dtype not in _STORABLE
            or t.is_quantized
            or t.is_nested
            or _graph_task_id() != -1  # saved during backward: rule 3 of the checkpoint NOTE
            or os.getpid() != self._pid  # NOTE [ Fork safety ]
        ):
            return None
        device = t.device
        if device.type == "meta" or self._stager.accelerated(device):
            return None
        if self._writer.pending_warning is not None:  # emit_warning's test, inline
            self.emit_warning()
        policy = self.policy
        path = self.scope.current() if self.scope is not None else None
        decision = policy.decide(t, path, parameter=False)
        if decision.action != "store":
            return None
        if policy.recompute_casts:  # recomputable(t)'s first test, inline
            fn = (t if base is None else base).grad_fn
            if fn is not None and fn.name() == TO_COPY:
                return None
        nbytes = t.numel() * t.element_size()
        held = t.untyped_storage().nbytes()  # device_bytes(t): no rounding off CUDA
        budget = self.budget
        if budget is not None and budget.keep("store", held, device=device):
            self.ledger.would_move(held, nbytes, accelerator=False)
            self.account(Route("keep", BUDGET_LABEL, nbytes))
            return Kept(t)
        if self._table.closing:
            self.ledger.would_move(held, nbytes, accelerator=False)
            self.account(Route("store", decision.label, nbytes))
            return Kept(t)
        self.ledger.count_moved(path, "store", decision.label, nbytes, held)
        stats = self.stats
        for table, name in ((stats.per_action, "store"), (stats.per_rule, decision.label)):
            route = table.get(name)  # _count, inline
            if route is None:
                route = table[name] = RouteStats()
            route.tensors += 1
            route.bytes += nbytes
        return self.store(t, nbytes, plain=True)

    def _pack(self, t: torch.Tensor) -> Packed:
        self.emit_warning()
        reason = unsupported_reason(t)
        if reason is not None:
            self.keep_unsupported(reason)
            return Kept(t)
        nbytes = t.numel() * t.element_size()
        if foreign(self._pid):  # a forked child: NOTE [ Fork safety ], rule 2
            self.account(Route("keep", "forked child", nbytes))
            return Kept(t)
        if _in_backward():
            # Saved while backward runs (a reentrant checkpoint's recompute, a
            # create_graph backward): needed at once, so stored bytes would only be
            # read straight back. NOTE [ Checkpoint composition ], rule 3.
            self.account(Route("keep", "saved during backward", nbytes))
            return Kept(t)
        if self._stager.capturing(t.device):
            # Copies need event waits, illegal while a graph is being captured: rule 10
            # of NOTE [ Stream ordering ].
            self.account(Route("keep", CAPTURE_LABEL, nbytes))
            return Kept(t)
        parameter = _parameter(t)
        decided = self.decide(t, nbytes, parameter=parameter)
        if decided.action in _MOVES and self.policy.recompute_casts:
            cast = recomputable(t)  # NOTE [ Parameter casts ]
            if cast is not None:
                self._recompute(nbytes)
                return cast
        action = self.plan(t, decided)
        if action == "store":
            if parameter:  # NOTE [ Parameters are copied at pack ]
                return self.store(t.detach().clone(), nbytes, guard=t)
            return self.store(t, nbytes)
        if action == "host":
            if not self._stager.accelerated(t.device):
                return Kept(t)  # already in host memory; a copy would only add memory
            if self._stager.tier is not None:
                # One pinned pool, one cap: NOTE [ Host tier wiring ].
                return self.store(t, nbytes, host=True)
            host, ready = self._stager.pin(t)
            return Host(host, t.device, ready)
        return Kept(t)

    @never_compiled
    def unpack(self, packed: Packed) -> torch.Tensor:
        """The PyTorch unpack hook. May run many times for one stand-in; never deletes."""
        if isinstance(packed, Handle):  # a plain class: no Python __instancecheck__
            if ranges_off(self.timeline):  # nobody would see the range
                return self.load(packed)
            with span(UNPACK_RANGE, self.timeline):  # NOTE [ Profiler ranges ]
                return self.load(packed)  # load() notes the backward step itself
        if isinstance(packed, Recomputed):
            self.backward_step()
            return packed.unpack()  # NOTE [ Parameter casts ], rules 3 and 4
        device = packed.tensor.device if isinstance(packed, Kept) else packed.device
        if self._stager.capturing(device):
            return self._unpack_capturing(packed)
        self.backward_step()
        self.emit_warning()
        if isinstance(packed, Kept):
            return self.unkeep(packed)
        return self._stager.unpin(packed.tensor, packed.device, packed.ready)

    def _unpack_capturing(
        self, packed: Kept[torch.Tensor] | Host[torch.Tensor, torch.device]
    ) -> torch.Tensor:
        """Unpack while a graph is being captured: a kept tensor as is (no read ahead
        starts: its reads would wait on events); nothing comes back from host memory."""
        if isinstance(packed, Kept):
            if packed.guard._version != packed.version:
                raise inplace_error(f"a tensor of shape {tuple(_shape(packed.tensor))}")
            return packed.tensor
        raise _capture_error()

    # --------------------------------------------------------------- routing
    def decide(self, t: torch.Tensor, nbytes: int, *, parameter: bool | None = None) -> Route:
        """The policy's decision for supported tensor ``t`` (``nbytes`` of payload).

        ``parameter`` overrides the policy's own parameter test (for tensors of another
        framework). Counts nothing: see :meth:`account`.
        """
        path = self.scope.current() if self.scope is not None else None
        decision = self.policy.decide(t, path, parameter=parameter)
        return Route(decision.action, decision.label, nbytes)

    def account(self, route: Route) -> str:
        """Count ``route`` and return the action to take: ``keep``, ``host`` or ``store``.

        A ``keep`` and a ``host`` are counted as kept/host here; a ``store`` is
        counted by :meth:`store`. Once the pipeline is closing, a ``store`` is kept.
        """
        action, nbytes = route.action, route.nbytes
        self._count(action, route.label, nbytes)
        if action != "store":
            log.debug("pack: %s %d B (%s)", action, nbytes, route.label)
        if action == "host":
            self.stats.tensors_host += 1
            self.stats.bytes_host += nbytes
            return action
        if action != "store" or self._table.closing:
            self.stats.tensors_kept += 1
            self.stats.bytes_kept += nbytes
            return "keep"
        return action

    def route(self, t: torch.Tensor, nbytes: int, *, parameter: bool | None = None) -> str:
        """:meth:`decide`, the budget's plan, then :meth:`account`: the action for ``t``."""
        return self.plan(t, self.decide(t, nbytes, parameter=parameter))

    def plan(self, t: torch.Tensor, route: Route) -> str:
        """The budget's plan over the policy's ``route`` for ``t``, then :meth:`account`."""
        nbytes = route.nbytes
        budget = self.budget
        accelerator = t.device.type != "cpu"
        held = device_bytes(t)
        if route.action in _MOVES:
            self.ledger.would_move(held, nbytes, accelerator=accelerator)
        if budget is not None and budget.keep(route.action, held, device=t.device):
            route = Route("keep", BUDGET_LABEL, nbytes)
        return self.account(route)

    def backward_step(self) -> None:
        """Every unpack calls this: the first of a backward ends the forward for the
        budget and starts the read-ahead at the newest stored tensor (the newest kept
        ones are consumed meanwhile)."""
        # Every counted pack sets ``forwarding`` (after the budget's forward began, if it
        # had one), and only a pack opens a span: after the first unpack that follows
        # packs, the others have no call to make (NOTE [ Pack fast path ]).
        if not self.ledger.forwarding:
            return
        self.ledger.backward_started()
        if self._table.has_open:
            self.close_spans()  # the forward is over: nothing more joins (NOTE [ Span unions ])
        if self.budget is not None and self.budget.backward_started():
            if not self._stored and self._table.live == 0 and self.effects is not None:
                self.effects.idle()  # a forward that moved nothing, nothing left stored
            self._stored = False
            self._prefetcher.restart()

    def _recompute(self, nbytes: int) -> None:
        """Count a parameter cast recomputed at unpack (NOTE [ Parameter casts ], rule 5)."""
        self._count("recompute", CAST_LABEL, nbytes)
        self.stats.recomputed += 1
        self.stats.bytes_recomputed += nbytes
        log.debug("pack: recompute %d B (%s)", nbytes, CAST_LABEL)

    def keep_unsupported(self, reason: str) -> None:
        """Count a tensor kept because the codec cannot store it (sparse, subclass, ...)."""
        self._count("keep", f"unsupported: {reason}", 0)
        self.stats.tensors_kept += 1

    def _count(self, action: str, label: str, nbytes: int) -> None:
        path = self.scope.current() if self.scope is not None else None
        self.ledger.count(path, action, label, nbytes)
        for table, name in ((self.stats.per_action, action), (self.stats.per_rule, label)):
            route = table.get(name)
            if route is None:
                route = table[name] = RouteStats()
            route.tensors += 1
            route.bytes += nbytes

    # ----------------------------------------------------------------- store
    def store(
        self,
        t: torch.Tensor,
        nbytes: int,
        *,
        guard: VersionCounter | None = None,
        host: bool = False,
        plain: bool = False,
    ) -> Handle:
        """Queue ``t`` for write-behind and return its handle (blocks at ``max_inflight``).

        ``guard``: the object whose ``_version`` tells whether the saved tensor was
        modified in place (default ``t``; another framework passes its own tensor's
        counter, since a zero-copy alias has a counter of its own). An accelerator
        tensor goes to the host tier when there is one (NOTE [ Host tier wiring ]);
        ``host``: a ``host`` rule sent it (counted as host, not as offloaded).
        ``plain``: the caller found ``t`` on no accelerator (NOTE [ Pack fast path ]).
        """
        if not self._stored:
            self._stored = True
            if self.effects is not None:
                self.effects.moving()
        if guard is None and not host and (plain or not self._stager.accelerated(t.device)):
            handle = self._store_plain(t, nbytes)  # NOTE [ Pack fast path ]
            if handle is not None:
                return handle
        # Dedup needs torch's version counter in the key; a guarded alias has none.
        key = dedup_key(t) if guard is None else None
        handle = self._table.share(t, key)
        if handle is not None:
            log.debug("pack: store %d B: the tensor of record %d (dedup)", nbytes, handle.rec.pos)
            return handle
        pattern = None
        if guard is None and not host:  # NOTE [ Span unions ]
            pattern = pattern_of(tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))
            if pattern is not None:
                handle = self._share_span(t, pattern, nbytes)
                if handle is not None:
                    return handle
        if self._table.has_open:
            self.close_spans(stale=True)  # rule 4 of NOTE [ Span unions ]
        span = None if pattern is None else Span.of(pattern)
        open_span = span is not None and not span.region
        held = not open_span and self._stager.holds(t)
        if not held:
            moved = nbytes if span is None else span.elements * t.element_size()
            if self._table.has_open and not self._writer.has_room(moved):
                self.close_spans()  # written before pack waits for their room (rule 4)
            self._writer.admit(moved)  # backpressure (may wait: not shielded)
        handle = self._admit(
            t, nbytes, guard, key, held=held, host=host, span=span, open_span=open_span
        )
        if held:
            self._writer.hold(handle.rec, t)  # may wait for spills: not shielded
        return handle

    def _share_span(self, t: torch.Tensor, pattern: Pattern, nbytes: int) -> Handle | None:
        """``t`` as a view of a record's span: one it holds, or an open one it joins
        (NOTE [ Span unions ], rule 3); ``None``: neither."""
        table = self._table
        if not table.filed(t):  # no record over its storage: nothing to cover or join
            return None
        handle = table.cover(t, pattern, span_of(tuple(t.shape), tuple(t.stride())))
        if handle is None:
            handle = table.join(t, pattern, nbytes, self._writer.max_inflight)
            if handle is not None and table.complete(handle.rec):
                self.close_spans(only=handle.rec)  # nothing more can join: write it now
        if handle is not None:
            log.debug("pack: store %d B: a view in record %d's span", nbytes, handle.rec.pos)
        return handle

    def close_spans(self, *, stale: bool = False, only: Record | None = None) -> None:
        """Write open spans (NOTE [ Span unions ], rule 4): ``only`` that record, the
        stale ones, or all. On an accelerator the gaps are left out on the device first
        (rule 5), so the copy to host moves only the elements saved."""
        stager = self._stager
        for rec, held in self._table.take_open(
            stale=stale, only=only, holds=lambda r: stager.holds_bytes(r.nbytes, r.device)
        ):
            src, union = rec.source, rec.span
            if src is None or union is None:
                continue
            if stager.accelerated(rec.device) and not union.region:
                with torch.no_grad():
                    src = union.gather(src)
                self._table.gathered(rec, src)
            if held:
                self._writer.hold(rec, src)
            else:
                self._writer.start(rec, src)

    @shielded  # a record counted in flight must get its handle and its write
    def _store_plain(self, t: torch.Tensor, nbytes: int) -> Handle | None:
        """:meth:`store` of a tensor on no accelerator in one table call when it is the
        common one (``RecordTable.add_plain``: NOTE [ Pack fast path ]); ``None``: it is
        not, nothing changed."""
        handle = self._table.add_plain(t, nbytes, self._writer.max_inflight)
        if handle is None:
            return None
        if log.isEnabledFor(_DEBUG):  # the hot path: no tuple(shape) unless asked
            shape = tuple(t.shape)
            log.debug("pack: store %d B %s %s as record %d", nbytes, t.dtype, shape, handle.rec.pos)
        self._writer.start(handle.rec, t)
        return handle

    @shielded  # a record counted in flight must get its handle and its write
    def _admit(
        self,
        t: torch.Tensor,
        nbytes: int,
        guard: VersionCounter | None,
        key: DedupKey | None,
        *,
        held: bool,
        host: bool,
        span: Span | None = None,
        open_span: bool = False,
    ) -> Handle:
        handle = self._table.add(
            t, nbytes, guard=guard, key=key, held=held, host_rule=host, span=span,
            open_span=open_span,
        )  # fmt: skip
        if log.isEnabledFor(logging.DEBUG):  # the hot path: no tuple(shape) unless asked
            shape = tuple(t.shape)
            where = "host tier" if held else "store"
            log.debug(
                "pack: %s %d B %s %s as record %d", where, nbytes, t.dtype, shape, handle.rec.pos
            )
        if not held and not open_span:
            self._writer.start(handle.rec, t)
        return handle

    def load(self, handle: Handle) -> torch.Tensor:
        """The tensor behind ``handle``: from memory, a read ahead, or a read of its own."""
        rec = handle.rec
        stager = self._stager
        if not rec.plain and stager.accelerated(rec.device) and stager.capturing(rec.device):
            return self._load_capturing(handle)
        if self._writer.pending_warning is not None:  # emit_warning's test, inline
            self.emit_warning()
        if self.ledger.forwarding:  # backward_step's test, inline: one call less per unpack
            self.backward_step()
        t0 = time.perf_counter()
        while True:
            claim = self._table.claim_for_unpack(rec, handle.token)
            if isinstance(claim, Fetch):  # the common case first
                t, event = self._prefetcher.take(rec, claim.read, t0)
                self._table.loaded(rec, t, event, handle.token)
                return t if handle.view is None else handle.tensor(t)
            if isinstance(claim, Ready):
                if not claim.reused:
                    return handle.tensor(_on_device(claim.tensor, rec.device))
                t = claim.tensor  # rule 8 of NOTE [ Record lifecycle ]
                if claim.event is not None:
                    t = self._stager.finish((t, claim.event))
                return handle.tensor(t)
            if isinstance(claim, Refused):
                raise claim.error()
            claim.done.wait()  # written from the device: wait for the write

    def _load_capturing(self, handle: Handle) -> torch.Tensor:
        """Unpack while a graph is being captured: only a tensor still on its device."""
        rec = handle.rec
        claim = self._table.claim_for_unpack(rec)
        if isinstance(claim, Refused):
            raise claim.error()
        if isinstance(claim, Ready) and claim.tensor.device == rec.device and claim.event is None:
            return handle.tensor(claim.tensor)
        raise _capture_error()

    # ------------------------------------------------------------------ kept
    @staticmethod
    def keep(t: _T, guard: VersionCounter | None = None) -> Kept[_T]:
        """A :class:`Kept` stand-in for ``t`` (``guard``: see :class:`Kept`)."""
        return Kept(t, guard)

    def unkeep(self, kept: Kept[_T]) -> _T:
        """The kept tensor; raises torch's in-place error if it was modified since pack."""
        self.backward_step()
        if kept.guard._version != kept.version:
            raise inplace_error(f"a tensor of shape {tuple(_shape(kept.tensor))}")
        return kept.tensor

    @property
    def host_tier(self) -> bool:
        """Whether a ``host_budget`` is set (NOTE [ Host tier wiring ])."""
        return self._stager.tier is not None

    def warn_once(self, topic: str, message: str) -> None:
        """Warn the user once per pipeline and ``topic`` (at the user's line)."""
        if topic not in self._warned:
            self._warned.add(topic)
            warn_user(message)

    def emit_warning(self) -> None:
        """Issue the pending one-time fallback warning (on the caller's thread)."""
        msg = self._writer.take_warning()
        if msg is not None:
            warn_user(msg)  # at the user's line, not torch's (tensorstore_hooks._warn)


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` where it was saved (a fallback after a spill keeps a host copy)."""
    return t if t.device == device else t.to(device)


# NOTE [ Parameters are copied at pack ]
# A parameter stored (``skip_parameters: false``) is copied on the forward thread and
# written from the copy; its own version counter still guards it (in-place checks).
# Wrappers free and re-gather parameter storage after forward: FSDP2 calls
# ``storage.resize_(0)`` on each unsharded parameter. A write-behind reading the
# parameter itself could run after that free (a failed write) or during it (freed
# memory read, or a crash). Activations are never freed under a saved tensor.
def _parameter(t: torch.Tensor) -> bool:
    base = t._base
    if type(t) is _Tensor and (base is None or type(base) is _Tensor):
        return False  # the common case, without Parameter's Python __instancecheck__
    return isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter)


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


def _shape(t: object) -> tuple[int, ...]:
    shape = getattr(t, "shape", ())
    return tuple(int(n) for n in shape)


def _capture_error() -> RuntimeError:
    return RuntimeError(
        "tensorstore-hooks: a saved tensor these hooks moved off the device cannot be "
        "brought back while a CUDA graph is being captured (its copy needs event waits, "
        "which capture forbids). Run backward outside the capture: tensors saved during "
        "a capture stay on the device, so a backward captured with its forward works."
    )
