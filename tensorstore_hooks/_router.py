"""The router: what pack and unpack do with each saved tensor, for any framework.

Both the PyTorch hooks (:meth:`Router.pack` / :meth:`Router.unpack`) and the Paddle
hooks (which see their tensors through a zero-copy torch alias) go through one
:class:`Router` per session. Pack asks the policy (:meth:`Router.decide`), counts the
decision (:meth:`Router.account`) and then keeps the tensor (:class:`Kept`), moves it
to pinned host memory (:class:`Host`) or hands it to the record table and the
write-behind (:meth:`Router.store`); unpack reverses that (:meth:`Router.load` for a
stored tensor, :meth:`Router.unkeep` for a kept one). A planner that overrides the
policy (budgets) sits between :meth:`decide` and :meth:`account`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._budgets import BUDGET_LABEL
from ._codec import is_dense, unsupported_reason
from ._eager import never_compiled
from ._forks import foreign
from ._records import Handle, RecordTable, State, dedup_key
from ._signals import shielded
from ._stats import OffloadStats, RouteStats
from ._trace import PACK_RANGE, UNPACK_RANGE, Timeline, span
from ._warn import warn_user
from .errors import StoreUnavailableError

if TYPE_CHECKING:
    from ._budgets import BudgetControl
    from ._device import DeviceStager
    from ._prefetch import Prefetcher
    from ._writebehind import WriteBehind

__all__ = ["Host", "Kept", "Route", "Router", "inplace_error"]

log = logging.getLogger("tensorstore_hooks")


def inplace_error(what: str) -> RuntimeError:
    """Torch's error for a saved tensor modified in place (NOTE [ In-place checks ])."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation ({what} was saved for backward by an offloaded op and changed "
        "afterwards). tensorstore-hooks keeps torch's rule: do not modify saved tensors in "
        "place, or clone them before modifying."
    )


class Kept:
    """A tensor left in place, with its version at pack (see NOTE [ In-place checks ]).

    Holds ``t.detach()``: see NOTE [ Detached aliases ]. ``guard`` is what the version
    is read from (``_version``): the tensor itself, or another framework's counter.
    """

    __slots__ = ("guard", "tensor", "version")

    def __init__(self, t: Any, guard: Any = None) -> None:
        self.tensor = t.detach()
        self.guard = self.tensor if guard is None else guard
        self.version: int = self.guard._version


class Host:
    """A tensor moved to pinned host memory by a ``host`` rule, and where it came from."""

    __slots__ = ("device", "tensor")

    def __init__(self, t: Any, device: Any) -> None:
        self.tensor = t
        self.device = device


@dataclass(frozen=True, slots=True)
class Route:
    """The decision for one saved tensor, before it is counted."""

    action: str
    """``"keep"``, ``"host"`` or ``"store"``."""
    label: str
    """The policy rule that decided (``"default"``, ``"rules[0] module=..."``, ...)."""
    nbytes: int


class Router:
    """Routes saved tensors of one session. Made by the session; used by the hooks.

    Not thread-safe for pack (autograd packs on the forward thread); :meth:`load` may
    run on several threads.
    """

    def __init__(
        self,
        *,
        policy: Any,
        stats: OffloadStats,
        table: RecordTable,
        writer: WriteBehind,
        prefetcher: Prefetcher,
        stager: DeviceStager,
        scope: Any = None,
        budget: BudgetControl | None = None,
    ) -> None:
        self.policy = policy
        self.scope = scope
        self.stats = stats
        self.closing = False
        """Set when the session closes: from then on every tensor is kept."""
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

    # ------------------------------------------------------------ torch hooks
    @never_compiled  # called from compiled graphs: NOTE [ torch.compile ], rule 3
    def pack(self, t: torch.Tensor) -> Any:
        """The PyTorch pack hook. Returns the tensor's stand-in in the autograd graph."""
        with span(PACK_RANGE, self.timeline):  # NOTE [ Profiler ranges ]
            return self._pack(t)

    def _pack(self, t: torch.Tensor) -> Any:
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
        action = self.route(t, nbytes)
        if action == "store":
            if _parameter(t):  # NOTE [ Parameters are copied at pack ]
                return self.store(t.detach().clone(), nbytes, guard=t)
            return self.store(t, nbytes)
        if action == "host":
            if self._stager.tier is not None and self._stager.accelerated(t.device):
                # One pinned pool, one cap: NOTE [ Host tier wiring ].
                return self.store(t, nbytes, host=True)
            return _pack_host(t)
        return Kept(t)

    @never_compiled
    def unpack(self, packed: Any) -> torch.Tensor:
        """The PyTorch unpack hook. May run many times for one stand-in; never deletes."""
        if isinstance(packed, Handle):
            with span(UNPACK_RANGE, self.timeline):  # NOTE [ Profiler ranges ]
                return self.load(packed)  # load() notes the backward step itself
        self.backward_step()
        self.emit_warning()
        if isinstance(packed, Kept):
            return self.unkeep(packed)
        assert isinstance(packed, Host)
        return packed.tensor.to(packed.device, non_blocking=True)

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
        counted by :meth:`store`. Once the session is closing, a ``store`` is kept.
        """
        action, nbytes = route.action, route.nbytes
        self._count(action, route.label, nbytes)
        if action != "store":
            log.debug("pack: %s %d B (%s)", action, nbytes, route.label)
        if action == "host":
            self.stats.tensors_host += 1
            self.stats.bytes_host += nbytes
            return action
        if action != "store" or self.closing:
            self.stats.tensors_kept += 1
            self.stats.bytes_kept += nbytes
            return "keep"
        return action

    def route(self, t: torch.Tensor, nbytes: int, *, parameter: bool | None = None) -> str:
        """:meth:`decide`, the budget's plan, then :meth:`account`: the action for ``t``."""
        route = self.decide(t, nbytes, parameter=parameter)
        budget = self.budget
        if budget is not None and budget.keep(
            route.action, nbytes, accelerator=t.device.type != "cpu"
        ):
            route = Route("keep", BUDGET_LABEL, nbytes)
        return self.account(route)

    def backward_step(self) -> None:
        """Every unpack calls this: the first of a backward ends the forward for the
        budget and starts the read-ahead at the newest stored tensor (the newest kept
        ones are consumed meanwhile)."""
        if self.budget is not None and self.budget.backward_started():
            self._prefetcher.restart()

    def keep_unsupported(self, reason: str) -> None:
        """Count a tensor kept because the codec cannot store it (sparse, subclass, ...)."""
        self._count("keep", f"unsupported: {reason}", 0)
        self.stats.tensors_kept += 1

    def _count(self, action: str, label: str, nbytes: int) -> None:
        for table, name in ((self.stats.per_action, action), (self.stats.per_rule, label)):
            route = table.get(name)
            if route is None:
                route = table[name] = RouteStats()
            route.tensors += 1
            route.bytes += nbytes

    # ----------------------------------------------------------------- store
    def store(
        self, t: torch.Tensor, nbytes: int, *, guard: Any = None, host: bool = False
    ) -> Handle:
        """Queue ``t`` for write-behind and return its handle (blocks at ``max_inflight``).

        ``guard``: the object whose ``_version`` tells whether the saved tensor was
        modified in place (default ``t``; another framework passes its own tensor's
        counter, since a zero-copy alias has a counter of its own). An accelerator
        tensor goes to the host tier when there is one (NOTE [ Host tier wiring ]);
        ``host``: a ``host`` rule sent it (counted as host, not as offloaded).
        """
        table = self._table
        # Dedup needs torch's version counter in the key; a guarded alias has none.
        key = dedup_key(t) if guard is None else None
        held = self._stager.holds(t)
        with table.lock:
            handle = self._reuse(t, key, nbytes)
            if handle is not None:
                return handle
            if not held:
                self._writer.admit(nbytes)  # backpressure (may wait: not shielded)
        handle = self._admit(t, nbytes, guard, key, held=held, host=host)
        if held:
            self._writer.hold(handle.rec, t)  # may wait for spills: not shielded
        return handle

    @shielded  # a reference taken must get its handle: NOTE [ Signals and finalizers ]
    def _reuse(self, t: torch.Tensor, key: tuple[Any, ...] | None, nbytes: int) -> Handle | None:
        rec = self._table.reuse(t, key)
        if rec is None:
            return None
        self.stats.dedup_hits += 1
        log.debug("pack: store %d B: the tensor of record %d (dedup)", nbytes, rec.pos)
        return self._table.handle(rec)

    @shielded  # a record counted in flight must get its handle and its write
    def _admit(
        self,
        t: torch.Tensor,
        nbytes: int,
        guard: Any,
        key: tuple[Any, ...] | None,
        *,
        held: bool,
        host: bool,
    ) -> Handle:
        table = self._table
        with table.lock:
            rec = table.add(t, nbytes, guard, key, State.HELD if held else State.QUEUED)
            rec.host_rule = host
            self._writer.count(rec)
            if not held:
                self._writer.enqueue(rec)
            handle = table.handle(rec)
        if log.isEnabledFor(logging.DEBUG):  # the hot path: no tuple(shape) unless asked
            shape = tuple(t.shape)
            where = "host tier" if held else "store"
            log.debug("pack: %s %d B %s %s as record %d", where, nbytes, t.dtype, shape, rec.pos)
        if not held:
            self._writer.start(rec, t)
        return handle

    def load(self, handle: Handle) -> torch.Tensor:
        """The tensor behind ``handle``: from memory, a read ahead, or a read of its own."""
        self.emit_warning()
        self.backward_step()
        rec = handle.rec
        t0 = time.perf_counter()
        while True:
            with self._table.lock:
                state = rec.state
                src = rec.source
                if src is not None and state in (State.QUEUED, State.WRITING, State.MEMORY):
                    self._writer.cancel(rec)  # the tail shortcut
                    if rec.modified():
                        raise inplace_error(f"a tensor of shape {tuple(src.shape)}")
                    return _on_device(src, rec.device)
                if state == State.HELD and src is not None:
                    # Its copy to host has not been reaped yet: the tensor itself.
                    if rec.modified():
                        raise inplace_error(f"a tensor of shape {tuple(src.shape)}")
                    return src
                if state == State.DIRTY:
                    raise inplace_error("a tensor")
                if state in (State.MEMORY, State.FREED):
                    raise StoreUnavailableError(
                        f"offload: a saved tensor is no longer available ({state.name.lower()}); "
                        "was the graph freed or the session closed?"
                    )
                if state in (State.STORED, State.HELD) or rec.staged is not None:
                    # Stored, held in the host tier, or on its way to the store with
                    # its host copy still there: no need to wait for the write.
                    if rec.modified():  # NOTE [ In-place checks ]
                        raise inplace_error(f"a tensor of {rec.nbytes} bytes")
                    fut = self._prefetcher.claim(rec)
                    break
                done = rec.writing_done  # written from the device: wait for the write
            done.wait()
        return self._prefetcher.take(rec, fut, t0)

    # ------------------------------------------------------------------ kept
    @staticmethod
    def keep(t: Any, guard: Any = None) -> Kept:
        """A :class:`Kept` stand-in for ``t`` (``guard``: see :class:`Kept`)."""
        return Kept(t, guard)

    def unkeep(self, kept: Kept) -> Any:
        """The kept tensor; raises torch's in-place error if it was modified since pack."""
        self.backward_step()
        if kept.guard._version != kept.version:
            raise inplace_error(f"a tensor of shape {tuple(kept.tensor.shape)}")
        return kept.tensor

    @property
    def host_tier(self) -> bool:
        """Whether a ``host_budget`` is set (NOTE [ Host tier wiring ])."""
        return self._stager.tier is not None

    def warn_once(self, topic: str, message: str) -> None:
        """Warn the user once per session and ``topic`` (at the user's line)."""
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
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


def _pack_host(t: torch.Tensor) -> Any:
    if t.device.type == "cpu":
        return Kept(t)  # already in host memory; a copy would only add memory
    if is_dense(tuple(t.shape), tuple(t.stride())):
        packed = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=True)
    else:
        packed = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    packed.copy_(t.detach(), non_blocking=True)
    return Host(packed, t.device)
