"""The record table: one record per offloaded tensor, and every change made to one.

NOTE [ Record lifecycle ]
A tensor the pipeline stores has one :class:`Record` from pack until the last handle
to it dies. This module is the only code that changes a record. The pipeline's units
say what they want through the intent methods of :class:`RecordTable` (and of its
parts ``copies``, the host copies, and ``reads``, the read-ahead); each takes
the table's one lock, checks the move against :data:`TRANSITIONS` (through
:meth:`Record.move`: any other move raises :class:`IllegalTransition`, a bug in
tensorstore-hooks) and returns what the caller must do outside the lock. The units
(write-behind, prefetcher, device stager) only do I/O.

    intent              move                              the caller then
    add                 new QUEUED, or new HELD           starts the write, or the copy
                        (held in the host tier), or new   into the host tier (or, OPEN,
                        OPEN (a span views may join)      nothing yet)
    add_plain           new QUEUED, as add, for the       starts the write
                        common tensor; else nothing
                        (NOTE [ Pack fast path ])
    share               none: one more handle (dedup)     -
    cover               none: one more handle (a view     -
                        the record's span holds)
    join                none: the open span grows         writes it if it is complete
    take_open           OPEN -> QUEUED (or HELD)          writes it (or holds it)
    spill               HELD -> QUEUED                    submits the write (host copy)
    write_directly      HELD -> QUEUED                    writes from the device
    copies.done         HELD/QUEUED/WRITING -> DIRTY      gives the worthless copy back
                        (modified before the copy ran)
    begin_write         QUEUED -> WRITING                 puts the bytes in the store
    end_write           WRITING -> STORED                 -
                        WRITING -> MEMORY (write failed)  warns once (fallback)
                        WRITING -> DIRTY (modified)       deletes what it wrote
    claim_for_unpack    OPEN/QUEUED/WRITING -> MEMORY     returns the tensor itself
                        (the tail shortcut)               (or reads, waits, raises)
    loaded              none: what unpack brought back    -
                        is remembered (weakly)
    free                any -> FREED                      deletes the key, or waits for
                                                          the write under way

Rules, numbered so code can cite them:

1. A record holds the saved tensor until its bytes are in the store or in a host copy,
   then drops it: that is what frees activation memory.
2. Stored bytes are deleted only when the last handle dies (a weak reference's
   callback, shielded from signals: NOTE [ Signals and finalizers ] in
   ``runtime/_signals.py``), never on unpack: unpack may run many times
   (``retain_graph=True``, double backward).
3. A record counts in flight (``max_inflight``) from QUEUED (or OPEN) until its
   write has finished (:meth:`RecordTable.write_finished`), whatever state it ends
   in; an OPEN record that never reaches a write (freed, or unpacked from memory,
   while open) leaves the bytes in flight when that is seen.
4. A host copy goes back to its pool or tier only when no copy to the device reads
   it any more (rule 4 of NOTE [ Host tier wiring ] in ``pipeline/_device.py``).
5. Dedup: a tensor saved twice (``exp`` saves its output, and so do the ``sin`` and
   ``cos`` that read it) is written once. The key is the storage address plus view
   and version, but the allocator reuses an address as soon as a tensor dies, so a
   hit is trusted only while a weak reference proves the first saver is still alive.
6. The lock is re-entrant: a handle's finalizer may run, and free a record, while it
   is held (dropping a tensor can free a graph).
7. A record moves the *span* of what its views cover (NOTE [ Span unions ] in
   ``pipeline/_spans.py``): the views of one storage saved in one forward share one
   record, and each handle carries the view it stands for, rebuilt over the
   record's tensor at unpack.
8. One copy back per record while it lives: what an unpack brought back is kept by
   a weak reference, and a later unpack of the same record (another handle, another
   view of its span, a second backward) while that tensor is alive and unchanged
   gets it again (``stats.reuse_hits``) rather than a second read.

NOTE [ Detached aliases ]
The pack hook receives the saved tensor with its ``grad_fn``; for ops that save their
own output (ReLU, attention) that ``grad_fn`` is the very node that holds our handle.
Anything we keep that references the tensor itself closes a cycle through C++ that
Python's collector cannot see: the graph would outlive ``del loss`` (forever for a
kept tensor, until its write ends for a stored one). So records and kept handles hold
``t.detach()``: the same storage and the same version counter, no autograd history.
Unpack returns it as is; autograd re-attaches the history it saved itself.
"""

from __future__ import annotations

import enum
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from types import MethodType
from typing import Protocol, TypeAlias

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tensorstore_hooks.errors import StoreUnavailableError
from tensorstore_hooks.pipeline._spans import OPEN_PACKS, Pattern, Span, View
from tensorstore_hooks.pipeline._staging import CopyEvent, Loaded, alloc_bytes, returned_bytes
from tensorstore_hooks.pipeline._stats import OffloadStats
from tensorstore_hooks.runtime import foreign, never_compiled, shielded

__all__ = [
    "TRANSITIONS",
    "HostCopies",
    "ReadAhead",
    "Claim",
    "DedupKey",
    "Fetch",
    "Freed",
    "Handle",
    "HostCopy",
    "IllegalTransition",
    "Ready",
    "Record",
    "RecordTable",
    "Refused",
    "State",
    "VersionCounter",
    "Wait",
    "WriteEnd",
    "WriteJob",
    "dedup_key",
    "inplace_error",
]


class State(enum.IntEnum):
    """Where a record's bytes are: see NOTE [ Record lifecycle ]."""

    QUEUED = 0
    WRITING = 1
    STORED = 2
    MEMORY = 3
    DIRTY = 4
    FREED = 5
    HELD = 6
    OPEN = 7


TRANSITIONS: Mapping[State, frozenset[State]] = {
    State.QUEUED: frozenset({State.WRITING, State.MEMORY, State.DIRTY, State.FREED}),
    State.WRITING: frozenset({State.STORED, State.MEMORY, State.DIRTY, State.FREED}),
    State.STORED: frozenset({State.FREED}),
    State.MEMORY: frozenset({State.FREED}),
    State.DIRTY: frozenset({State.FREED}),
    State.FREED: frozenset(),
    State.HELD: frozenset({State.QUEUED, State.DIRTY, State.FREED}),
    State.OPEN: frozenset({State.QUEUED, State.HELD, State.MEMORY, State.FREED}),
}
"""The allowed moves of NOTE [ Record lifecycle ]: state -> states it may move to."""

_IN_MEMORY = (State.OPEN, State.QUEUED, State.WRITING, State.MEMORY)
"""States in which unpack may return the saved tensor itself (the tail shortcut)."""
_COPYING = (State.HELD, State.QUEUED, State.WRITING)
"""States in which a finished copy to host replaces the saved tensor (rule 1)."""
_READABLE = (State.STORED, State.HELD)
"""What the read-ahead reads: stored records, and held ones (from the host tier)."""


class IllegalTransition(RuntimeError):
    """Internal error: a record was asked to make a move the lifecycle forbids (a bug)."""


class VersionCounter(Protocol):
    """What in-place checks read: a torch tensor, or another framework's counter."""

    @property
    def _version(self) -> int: ...


DedupKey: TypeAlias = tuple[
    int, int | torch.SymInt, tuple[int, ...], tuple[int, ...], int, torch.dtype, torch.device
]
"""Storage address, offset, shape, strides, version, dtype, device: rule 5."""


def inplace_error(what: str) -> RuntimeError:
    """Torch's error for a saved tensor modified in place (NOTE [ In-place checks ])."""
    return RuntimeError(_inplace_message(what))


def _inplace_message(what: str) -> str:
    return (
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation ({what} was saved for backward by an offloaded op and changed "
        "afterwards). tensorstore-hooks keeps torch's rule: do not modify saved tensors in "
        "place, or clone them before modifying."
    )


class HostCopy:
    """A record's copy in host memory: ``host`` is the view, ``buf`` the buffer it is in.

    ``event``: the copy to host still running (``None`` once it has completed).
    ``readers``: copies back to the device running out of ``buf``; ``orphaned``: the
    buffer goes back when the last of them ends (rule 4). ``keep``: the saved tensor of
    a record freed while ``event`` was still running, which that copy still reads: it
    lives as long as this copy is not given back (rule 2 of NOTE [ Stream ordering ]).
    """

    __slots__ = ("buf", "event", "host", "keep", "orphaned", "readers")

    def __init__(self, host: torch.Tensor, buf: torch.Tensor, event: CopyEvent | None) -> None:
        self.host = host
        self.buf = buf
        self.event = event
        self.readers = 0
        self.orphaned = False
        self.keep: torch.Tensor | None = None


class Record:
    """One offloaded tensor. Read anywhere; changed only by :class:`RecordTable`."""

    __slots__ = (
        "_done",
        "_written",
        "dedup_key",
        "device",
        "device_nbytes",
        "dtype",
        "error",
        "fetch",
        "guard",
        "guard_ref",
        "host_rule",
        "joined_at",
        "key",
        "members",
        "nbytes",
        "payload",
        "plain",
        "pos",
        "refs",
        "returned",
        "source",
        "span",
        "span_key",
        "staged",
        "state",
        "storage_ref",
        "strong",
        "unpacked",
        "version",
        "view",
        "write_started",
    )

    def __init__(
        self,
        t: torch.Tensor,
        nbytes: int,
        pos: int,
        guard: VersionCounter | None = None,
        state: State = State.QUEUED,
        span: Span | None = None,
    ) -> None:
        # The saved tensor (or the span of it and its sibling views: rule 7) until its
        # bytes are elsewhere, detached: NOTE [ Detached aliases ]. ``n == 1`` first:
        # the common region span costs no property call (NOTE [ Pack fast path ]).
        self.source: torch.Tensor | None
        if span is None or span.n == 1 or span.region:
            self.source = t.detach()
        else:
            self.source = span.source(t).detach()
        # What in-place checks read ``_version`` from: the tensor itself (its storage's
        # counter, which every view shares), or for another framework's tensor (seen
        # here through a zero-copy alias) that tensor's counter.
        self.guard: VersionCounter | None = self.source if guard is None else guard
        self.version: int = self.source._version if guard is None else guard._version
        # Outlives ``guard``: see NOTE [ In-place checks ]. A span's views keep their
        # base alive, and share its counter: the base is watched.
        base = t if span is None or t._base is None else t._base
        self.guard_ref: weakref.ref[VersionCounter] | None
        try:
            self.guard_ref = weakref.ref(base if guard is None else guard)
        except TypeError:  # another framework's guard without weak references
            self.guard_ref = None
        self.nbytes = nbytes
        """Bytes the record moves: the saved tensor's payload, or its span's (rule 7)."""
        self.payload = nbytes
        """Payload bytes of the saved tensors this record offloads (``bytes_offloaded``)."""
        self.members = 1  # tensors offloaded into it (``tensors_offloaded``)
        self.span = span
        self.view: View | None = None  # the first handle's view over the record's tensor
        self.dtype = t.dtype
        # What it takes on its device when read back (its span, rounded): the
        # read-ahead window counts this (rule 7 of NOTE [ Stream ordering ]).
        device = self.device = t.device
        if span is None:
            self.device_nbytes = returned_bytes(t)
        else:
            moved = (span.intervals[-1][1] if span.n == 1 else span.elements) * t.element_size()
            # alloc_bytes rounds only CUDA's blocks: no call for any other device.
            self.device_nbytes = alloc_bytes(moved, device) if device.type == "cuda" else moved
        self.storage_ref: StorageWeakRef | None = None  # its storage, while alive (rule 7)
        self.span_key: tuple[int, torch.device] | None = None  # where the index files it
        self.joined_at = 0  # saves counted when a view last joined it (OPEN)
        # What the last unpack brought back (rule 8): its storage, weakly (what autograd
        # made of the views unpack returned keeps it alive), the tensor over it, and the
        # event its copy completed on.
        self.returned: _Returned | None = None
        # Held strongly while a live handle of the record has not unpacked it yet (its
        # siblings will: rule 8), and the handles (tokens) that did since it came back.
        self.strong: torch.Tensor | None = None
        self.unpacked: set[int] = set()
        self.state = state
        self.host_rule = False  # sent here by a ``host`` rule (counted as host, not offloaded)
        self.plain = False  # made by add_plain: of no accelerator (NOTE [ Pack fast path ])
        self.key: str | None = None
        self.refs = 1
        self.pos = pos
        self.fetch: Future[Loaded] | None = None  # the read running ahead, if any
        self.staged: HostCopy | None = None  # the copy in host memory, if any
        self.dedup_key: DedupKey | None = None
        self.error: BaseException | None = None  # why the write failed (fallback)
        self.write_started = False
        self._written = False  # the writer is finished with it (writing_done says it)
        self._done: threading.Event | None = None  # made when first asked for

    @property
    def writing_done(self) -> threading.Event:
        """Set once the writer is finished with the record. Made when first asked for
        (a free or an unpack that waits for the write): most records never are, and an
        Event costs pack two Python calls (NOTE [ Pack fast path ])."""
        done = self._done
        if done is None:
            with _DONE_LOCK:  # two threads asking at once get one event
                done = self._done
                if done is None:
                    done = self._done = threading.Event()
                    if self._written:
                        done.set()
        return done

    def _writing_over(self) -> None:
        """The writer is finished with the record: wake whoever waits (see writing_done).

        The flag is set before the event is read and :attr:`writing_done` reads the flag
        after publishing its event, so one of the two always sets it."""
        self._written = True
        done = self._done
        if done is not None:
            done.set()

    def move(self, to: State) -> None:
        """Change state along :data:`TRANSITIONS`; raises :class:`IllegalTransition`."""
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(
                f"tensorstore-hooks internal error: a record of {self.nbytes} bytes cannot "
                f"move {self.state.name} -> {to.name} (see NOTE [ Record lifecycle ]); "
                "please report this"
            )
        self.state = to

    def modified(self) -> bool:
        """True if the saved tensor changed in place since pack (NOTE [ In-place checks ]).

        After the write the tensor is gone from the record but its weak reference
        is not: a tensor still alive is still checked.
        """
        guard = self.guard
        if guard is None and self.guard_ref is not None:
            guard = self.guard_ref()
        return guard is not None and guard._version != self.version

    def _drop_source(self) -> None:
        self.source = self.guard = None


_storage_expired = torch.UntypedStorage._expired  # StorageWeakRef.expired, without its two
# Python calls (NOTE [ Pack fast path ])

_DONE_LOCK = threading.Lock()
"""Makes each record's ``writing_done`` event once (rarely taken)."""


def dedup_key(t: torch.Tensor) -> DedupKey:
    """Identity of a saved view; trusted only with a live weak reference (rule 5)."""
    return (
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t._version,
        t.dtype,
        t.device,
    )


def _takes(rec: Record, pattern: Pattern) -> bool:
    span = rec.span
    return span is not None and (span.fits(pattern) or span.holds_all_of(pattern))


class _Returned(tuple[StorageWeakRef, torch.dtype, View, "CopyEvent | None"]):
    """What an unpack brought back for a record (rule 8): ``(storage, dtype, view,
    event)``. A tuple, made in C: every unpack makes one (NOTE [ Pack fast path ]);
    the fields are read only when an unpack gets it again."""

    __slots__ = ()

    @property
    def storage(self) -> StorageWeakRef:
        return self[0]

    @property
    def dtype(self) -> torch.dtype:
        return self[1]

    @property
    def view(self) -> View:
        """The record's tensor over ``storage``."""
        return self[2]

    @property
    def event(self) -> CopyEvent | None:
        return self[3]


def _returned(rec: Record) -> torch.Tensor | None:
    """What the last unpack of ``rec`` brought back, if its storage still lives (rule 8).

    Autograd makes a tensor of its own of what unpack returns (sharing the storage, not
    the tensor object), so the storage is what tells whether it lives. Backward reads
    saved tensors, never writes them: a storage alive holds what was read.
    """
    returned = rec.returned
    if returned is None or returned.storage.expired():
        return None
    storage = torch.UntypedStorage._new_with_weak_ptr(returned.storage.cdata)
    if storage is None:
        return None
    shape, stride, offset = returned.view
    with torch.no_grad():
        out = torch.empty(0, dtype=returned.dtype, device=storage.device)
        return out.set_(storage, offset, shape, stride)


def _view_of(t: torch.Tensor) -> View:
    return tuple(t.shape), tuple(t.stride()), int(t.storage_offset())


# ------------------------------------------------------------- what callers get
@dataclass(frozen=True, slots=True)
class Ready:
    """Unpack: the saved tensor is in memory; return it (moved to ``device``)."""

    tensor: torch.Tensor
    reused: bool = False
    """What an earlier unpack brought back (rule 8): already on its device, ready once
    the consuming stream waits on ``event``."""
    event: CopyEvent | None = None


@dataclass(frozen=True, slots=True)
class Fetch:
    """Unpack: read the bytes back; ``read`` is the read running ahead (``None``: read now)."""

    read: Future[Loaded] | None


@dataclass(frozen=True, slots=True)
class Wait:
    """Unpack: the bytes are being written from the device; wait, then claim again."""

    done: threading.Event


@dataclass(frozen=True, slots=True)
class Refused:
    """Unpack: the tensor cannot be given back; raise :meth:`error`."""

    kind: type[Exception]
    """``RuntimeError`` (torch's in-place error) or ``StoreUnavailableError``."""
    message: str

    def error(self) -> Exception:
        """The exception to raise (made here, so a caller's frame holds no cycle
        through its traceback that would keep the graph alive)."""
        return self.kind(self.message)


def _modified(what: str) -> Refused:
    return Refused(RuntimeError, _inplace_message(what))


Claim: TypeAlias = Ready | Fetch | Wait | Refused


@dataclass(frozen=True, slots=True)
class WriteJob:
    """A write to do: ``source`` into the store, after ``event`` (the copy to host)."""

    source: torch.Tensor | None
    event: CopyEvent | None
    from_device: bool = False
    """``source`` is the saved tensor itself, not a host copy of it (on an accelerator,
    the writer copies it out first: rule 8 of NOTE [ Stream ordering ])."""


@dataclass(frozen=True, slots=True)
class WriteEnd:
    """What a finished write leaves the writer to do outside the lock."""

    discard: str | None
    """A key whose bytes nobody wants (freed, served from memory or modified): delete it."""
    give_back: HostCopy | None
    """A host copy to return to its pool or tier."""
    error: BaseException | None
    """The write failed and the record fell back to memory (warn once)."""


@dataclass(frozen=True, slots=True)
class Freed:
    """What freeing a record leaves to do outside the lock."""

    key: str | None
    """Stored bytes to delete."""
    write_running: threading.Event | None
    """A write under way that deletes what it wrote; wait for it (rule 2)."""
    give_back: HostCopy | None
    """A host copy to return to its pool or tier."""
    last: bool
    """This was the last live record of a table that is closing: close now."""


# ------------------------------------------------------------------ handles
class Handle:
    """What autograd keeps for an offloaded tensor: a pointer to its record, and the
    view of the record's tensor it stands for (``None``: the tensor itself; rule 7)."""

    __slots__ = ("__weakref__", "rec", "token", "view")

    def __init__(self, rec: Record, view: View | None = None) -> None:
        self.rec = rec
        self.view = view
        self.token = object()  # tells its unpacks apart from its siblings' (rule 8)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """This handle's saved tensor over ``t``, the record's tensor as unpack got it."""
        span = self.rec.span
        if self.view is None or span is None:
            return t
        return span.rebuild(t, self.view)


class _Finalizer(weakref.ref[Handle]):
    """A weak reference to a handle whose callback gives up its record: the finalizer.

    A plain ``weakref.ref`` callback rather than ``weakref.finalize``, whose own
    Python ``__call__`` would run before any shielded code (NOTE [ Signals and
    finalizers ]). Kept alive by :data:`_finalizers` (as ``weakref.finalize`` keeps
    its registry), which holds ``release`` strongly and the table not at all.
    """

    __slots__ = ("pid", "rec", "release", "token")
    pid: int
    rec: Record
    release: Callable[[Record], None]
    token: object


def _finalize(handle: Handle, rec: Record, release: Callable[[Record], None]) -> None:
    """Give ``handle`` its finalizer. Made with ``weakref.ref``'s own constructor and its
    fields set here: no Python ``__new__``/``__init__`` on the pack path."""
    ref = _Finalizer(handle, _handle_died)
    ref.rec = rec
    ref.release = release
    ref.token = handle.token
    ref.pid = os.getpid()  # NOTE [ Fork safety ]: a forked child's copy frees nothing
    _finalizers.add(ref)


_finalizers: set[_Finalizer] = set()
"""The finalizers of live handles (set operations are atomic under the GIL)."""


@never_compiled  # may run inside compiled code: NOTE [ torch.compile ], rule 3
@shielded  # NOTE [ Signals and finalizers ]: a signal must not cut this in half
def _handle_died(ref: _Finalizer) -> None:
    _finalizers.discard(ref)
    if not foreign(ref.pid):
        ref.rec.unpacked.discard(id(ref.token))  # a dead handle unpacks no more (rule 8)
        ref.release(ref.rec)


# ----------------------------------------------------------- the table's parts
class HostCopies:
    """The records' host copies: attached, completed, lent to reads, taken back.

    Part of the record table (:attr:`RecordTable.copies`, under its lock); the device
    stager and the write-behind call it. A copy a read still uses is given back by
    its last reader (rule 4).
    """

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock

    def attach(self, rec: Record, copy: HostCopy) -> bool:
        """``rec``'s copy to host has started into ``copy``; ``False``: the record is
        gone (an interrupted pack) and the caller gives ``copy`` back."""
        with self._lock:
            if rec.state not in (State.HELD, State.QUEUED):
                return False
            rec.staged = copy
            return True

    def done(self, rec: Record) -> HostCopy | None:
        """``rec``'s copy to host has completed: drop the saved tensor (rule 1).

        A tensor modified in place before the copy ran moves to DIRTY (NOTE [ In-place
        checks ]); its copy is worthless and is returned for the caller to give back.
        """
        with self._lock:
            copy = rec.staged
            if copy is None:
                return None
            copy.event = None
            if rec.source is not None and rec.state in _COPYING:
                if rec.modified():
                    rec.move(State.DIRTY)
                rec._drop_source()
            return self._take(rec) if rec.state == State.DIRTY else None

    def let_go(self, rec: Record) -> HostCopy | None:
        """The consuming stream now waits (on the device) for ``rec``'s copy to host:
        the saved tensor may go before the copy is seen complete (NOTE [ Copy window ]
        in ``pipeline/_device.py``). As :meth:`done`, but the copy's event stays: host
        readers of the bytes still wait for it. Returns a DIRTY record's copy to give back.
        """
        with self._lock:
            if rec.staged is None:
                return None
            if rec.source is not None and rec.state in _COPYING:
                if rec.modified():
                    rec.move(State.DIRTY)
                rec._drop_source()
            return self._take(rec) if rec.state == State.DIRTY else None

    def take(self, rec: Record) -> HostCopy | None:
        """Detach ``rec``'s host copy for the caller to give back (``None``: it has
        none, or a read still uses it and its last reader gives it back)."""
        with self._lock:
            return self._take(rec)

    def _take(self, rec: Record) -> HostCopy | None:
        copy, rec.staged = rec.staged, None
        if copy is None:
            return None
        if copy.readers:
            copy.orphaned = True
            return None
        return copy

    def borrow(self, rec: Record) -> HostCopy | None:
        """``rec``'s host copy for a copy back to the device (``None``: it has none).

        Follow with :meth:`end_read` once that copy has completed.
        """
        if rec.staged is None:  # the common case (CPU tensors, stored ones): no lock
            return None
        with self._lock:
            copy = rec.staged
            if copy is not None:
                copy.readers += 1
            return copy

    def end_read(self, copy: HostCopy) -> bool:
        """A read of ``copy`` has ended; ``True``: it was the last one of a copy its
        record let go of, and the caller gives it back (rule 4)."""
        with self._lock:
            copy.readers -= 1
            if copy.orphaned and copy.readers == 0:
                copy.orphaned = False
                return True
            return False


class ReadAhead:
    """The read-ahead's claims on records: its cursor and its window.

    Part of the record table (:attr:`RecordTable.reads`, under its lock, over its
    pack order): NOTE [ Prefetch order ] in ``pipeline/_prefetch.py``. The prefetcher plans and
    submits reads; unpack and free take them back through the table.
    """

    def __init__(
        self, lock: threading.RLock, order: list[Record | None], stats: OffloadStats
    ) -> None:
        self._lock = lock
        self._order = order  # the table's, changed in place only
        self._stats = stats
        self.cursor = -1  # pack position the next read ahead looks at
        self._window = 0  # bytes read ahead and not yet unpacked

    def restart(self) -> None:
        """A backward begins: read ahead from the newest record down."""
        with self._lock:
            self.cursor = len(self._order) - 1

    def plan(self, window_bytes: int) -> list[tuple[Record, Future[Loaded]]]:
        """The next records to read ahead, newest first, within ``window_bytes``, each
        with the future its read completes (the caller runs each read into it).

        Each is claimed (its device bytes count in the window) and its future is the
        one unpack will find: there is no moment a record's read ahead is a
        placeholder an unpack could claim and wait on forever. A record whose saved
        tensor is still in memory (a held record whose copy to host has not been seen
        complete) is skipped: unpack returns that tensor, nothing need come back.
        """
        out: list[tuple[Record, Future[Loaded]]] = []
        stats = self._stats
        with self._lock:
            while 0 <= self.cursor < len(self._order):
                rec = self._order[self.cursor]
                if (
                    rec is not None
                    and rec.state in _READABLE
                    and rec.fetch is None
                    and rec.source is None
                    and (rec.returned is None or _returned(rec) is None)  # rule 8: back already
                ):
                    size = rec.device_nbytes
                    if self._window and self._window + size > window_bytes:
                        break
                    fut: Future[Loaded] = Future()
                    rec.fetch = fut
                    self._window += size
                    held = stats.held_bytes + size  # stats.hold(size), inline
                    stats.held_bytes = held
                    if held > stats.peak_held_bytes:
                        stats.peak_held_bytes = held
                    out.append((rec, fut))
                self.cursor -= 1
        return out

    def _forget(self, rec: Record) -> None:
        """``rec`` is freed: cancel its read ahead (lock held)."""
        if rec.fetch is not None:
            rec.fetch.cancel()
            rec.fetch = None
            self._window -= rec.device_nbytes
            self._stats.hold(-rec.device_nbytes)

    def _reset(self) -> None:
        """Nothing is live: start over (lock held)."""
        self.cursor = -1
        self._stats.hold(-self._window)
        self._window = 0


# -------------------------------------------------------------------- table
class RecordTable:
    """Records in pack order, their every change, and the counts that follow them.

    Owns, under its one lock: the records' states and fields, dedup (rule 5), the
    bytes in flight (rule 3), and ``stats`` that move with them; its parts
    :attr:`copies` (host copies) and :attr:`reads` (the read-ahead's cursor and
    window) share the lock.

    ``on_last_handle(rec)`` runs (on whatever thread drops the last reference) when a
    handle dies; it calls :meth:`free`. It must be a bound method: the table keeps it
    weakly and each handle's finalizer strongly, so its owner lives while any handle
    does, yet owner -> table -> owner is no reference cycle (plain reference counting
    frees a pipeline and its store, with no wait for the collector).
    """

    _COMPACT_MIN = 1024

    def __init__(self, on_last_handle: Callable[[Record], None], stats: OffloadStats) -> None:
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # Weakly, as a WeakMethod would, but called without its Python __call__.
        self._owner = weakref.ref(on_last_handle.__self__)  # type: ignore[attr-defined]
        self._release = on_last_handle.__func__  # type: ignore[attr-defined]
        self._stats = stats
        self._order: list[Record | None] = []
        self._live = 0
        self._dedup: dict[DedupKey, tuple[weakref.ref[torch.Tensor], Record]] = {}
        # Live records with a span, by storage (rule 7), and the open ones, oldest first.
        self._spans: dict[tuple[int, torch.device], list[Record]] = {}
        self._open: list[Record] = []
        self._saves = 0  # tensors stored, shared or joined: the clock of OPEN_PACKS
        self._inflight = 0  # bytes queued or being written (rule 3)
        self.closing = False
        """Set by :meth:`close`: the pipeline takes no more tensors (an attribute, not a
        property: pack reads it for every tensor)."""
        self.copies = HostCopies(self._lock)
        """The records' host copies (the device stager's buffers)."""
        self.reads = ReadAhead(self._lock, self._order, stats)
        """The read-ahead's cursor and window over the pack order."""

    # ------------------------------------------------------------ reading
    @property
    def live(self) -> int:
        """Records not yet freed."""
        return self._live

    @property
    def inflight(self) -> int:
        """Bytes queued or being written (rule 3)."""
        return self._inflight

    def records(self) -> list[Record]:
        """The live records, in pack order."""
        with self._lock:
            return [r for r in self._order if r is not None]

    # ---------------------------------------------------------------- pack
    @shielded  # a reference taken must get its handle: NOTE [ Signals and finalizers ]
    def share(self, t: torch.Tensor, key: DedupKey | None) -> Handle | None:
        """A new handle to the live record already holding ``t`` (rule 5), or ``None``."""
        if key is None:
            return None
        with self._lock:
            hit = self._dedup.get(key)
            if hit is None:
                return None
            ref, rec = hit
            alive = ref()
            stale = alive is None or alive.untyped_storage().data_ptr() != key[0]
            if stale or rec.state == State.FREED:
                return None
            rec.refs += 1
            self._stats.dedup_hits += 1
            self._saves += 1
            return self._handle(rec, rec.view)

    @shielded  # as share
    def cover(self, t: torch.Tensor, pattern: Pattern, view_span: int) -> Handle | None:
        """A new handle to the live record whose span holds every element of ``t`` (of
        ``pattern``, spanning ``view_span`` elements), or ``None`` (rule 7; NOTE [ Span
        unions ], rule 3)."""
        with self._lock:
            rec = self._find(t, lambda r: r.span is not None and r.span.covers(pattern, view_span))
            if rec is None:
                return None
            rec.refs += 1
            self._stats.dedup_hits += 1
            self._saves += 1
            if rec.state == State.OPEN:
                rec.joined_at = self._saves
            return self._handle(rec, _view_of(t))

    @shielded  # as share
    def join(self, t: torch.Tensor, pattern: Pattern, nbytes: int, room: int) -> Handle | None:
        """``t`` joins an open span of its storage (NOTE [ Span unions ], rule 3): a new
        handle, the span grown by ``t``'s rows (if the bytes in flight stay within
        ``room``), or taken over by region ``t``; ``None``: no open span takes it.
        The caller writes the record if :meth:`complete` says so."""
        with self._lock:
            rec = self._find(t, lambda r: r.state == State.OPEN and _takes(r, pattern))
            if rec is None or rec.span is None:
                return None
            span = rec.span
            if span.fits(pattern):
                grown = Span(span.start, span.n, span.period, list(span.intervals))
                grown.join(pattern)
            elif span.holds_all_of(pattern):
                grown = Span.of(pattern)
            else:
                return None
            delta = (grown.elements - span.elements) * t.element_size()
            if self._inflight + delta > room:
                return None  # the caller writes the span as it is, then stores ``t``
            rec.span = grown
            rec.source = grown.source(t).detach()
            rec.nbytes += delta
            rec.device_nbytes = alloc_bytes(grown.elements * t.element_size(), t.device)
            rec.payload += nbytes
            rec.members += 1
            rec.refs += 1
            rec.joined_at = self._saves = self._saves + 1
            self._inflight += delta
            self._stats.hold(delta)
            self._stats.tensors_offloaded += 1
            self._stats.bytes_offloaded += nbytes
            return self._handle(rec, _view_of(t))

    def filed(self, t: torch.Tensor) -> bool:
        """Whether any live record is filed under ``t``'s storage address (its storage
        may have died since: :meth:`cover` and :meth:`join` check). Cheap: no lock."""
        return (t.untyped_storage().data_ptr(), t.device) in self._spans

    def _find(self, t: torch.Tensor, want: Callable[[Record], bool]) -> Record | None:
        """A live span record of ``t``'s storage, dtype and version that ``want`` (lock held)."""
        records = self._spans.get((t.untyped_storage().data_ptr(), t.device))
        if not records:
            return None
        version = t._version
        for rec in records:
            ref = rec.storage_ref
            if (
                ref is not None
                and not ref.expired()
                and rec.dtype == t.dtype
                and rec.version == version
                and rec.state not in (State.FREED, State.DIRTY)
                and want(rec)
            ):
                return rec
        return None

    @staticmethod
    def complete(rec: Record) -> bool:
        """Whether an OPEN record's span covers its whole period: nothing can join it any
        more, so it is written now (NOTE [ Span unions ], rule 4)."""
        return rec.state == State.OPEN and rec.span is not None and rec.span.region

    def take_open(
        self,
        *,
        stale: bool = False,
        only: Record | None = None,
        holds: Callable[[Record], bool] | None = None,
    ) -> list[tuple[Record, bool]]:
        """OPEN records to write now, with whether each goes to the host tier (``holds``
        says): OPEN -> QUEUED (the caller starts its write) or OPEN -> HELD (the caller
        copies it into the tier; it leaves the bytes in flight). ``only`` that one, the
        stale ones (no view joined in ``OPEN_PACKS`` saves), or all (NOTE [ Span
        unions ], rule 4). An open record already freed or unpacked leaves the bytes
        in flight now (rule 3)."""
        with self._lock:
            if only is not None:
                due = [only] if only in self._open else []
            elif stale:
                due = [r for r in self._open if self._saves - r.joined_at >= OPEN_PACKS]
            else:
                due = list(self._open)
            if not due:
                return []
            self._open = [r for r in self._open if r not in due]
            out = []
            for rec in due:
                if rec.state != State.OPEN:
                    self._never_written(rec)
                elif holds is not None and holds(rec):
                    rec.move(State.HELD)
                    self._inflight -= rec.nbytes
                    self._stats.hold(-rec.nbytes)
                    self._cond.notify_all()
                    out.append((rec, True))
                else:
                    rec.move(State.QUEUED)
                    out.append((rec, False))
            return out

    def gathered(self, rec: Record, source: torch.Tensor) -> None:
        """``source`` (``rec``'s span with the gaps left out, made on its device) is what
        ``rec`` moves now (NOTE [ Span unions ], rule 5); its storage's counter stays the
        guard."""
        with self._lock:
            if rec.source is not None and rec.state in (State.QUEUED, State.HELD):
                rec.source = source.detach()

    @property
    def has_open(self) -> bool:
        """Whether any span is open (cheap: no lock)."""
        return bool(self._open)

    def _never_written(self, rec: Record) -> None:
        """``rec`` was OPEN and never reaches a write: its bytes leave the flight (lock held)."""
        self._inflight -= rec.nbytes
        self._stats.hold(-rec.nbytes)
        self._cond.notify_all()
        rec._writing_over()

    def wait_for_room(self, nbytes: int, max_inflight: int) -> float:
        """Block while ``nbytes`` more would put more than ``max_inflight`` in flight.

        A single record larger than the window still goes, alone. Returns the seconds
        waited (backpressure).
        """
        with self._lock:
            if not self._inflight or self._inflight + nbytes <= max_inflight:
                return 0.0
            t0 = time.perf_counter()
            while self._inflight and self._inflight + nbytes > max_inflight:
                self._cond.wait(0.05)
            return time.perf_counter() - t0

    def add(
        self,
        t: torch.Tensor,
        nbytes: int,
        *,
        guard: VersionCounter | None,
        key: DedupKey | None,
        held: bool,
        host_rule: bool,
        span: Span | None = None,
        open_span: bool = False,
    ) -> Handle:
        """A new record for ``t``, last in pack order, and its first handle.

        QUEUED (counted in flight: the caller starts its write), HELD (the caller
        copies it into the host tier), or OPEN (``open_span``: counted in flight, other
        views of its storage may join its span; the caller writes nothing yet).
        ``host_rule``: a ``host`` rule sent it (counted as host, not as offloaded).
        ``span``: what the record moves (rule 7; ``None``: ``t``'s own bytes, and no
        other view shares them but ``t`` saved again).
        """
        state = State.OPEN if open_span else State.HELD if held else State.QUEUED
        nbytes_moved = nbytes if span is None else span.elements * t.element_size()
        with self._lock:
            rec = Record(t, nbytes_moved, len(self._order), guard, state, span)
            rec.payload = nbytes
            rec.host_rule = host_rule
            self._order.append(rec)
            self._live += 1
            if key is not None:
                rec.dedup_key = key
                self._dedup[key] = (weakref.ref(t), rec)
            if span is not None:
                self._index(rec, t)
            if not host_rule:
                self._stats.tensors_offloaded += 1
                self._stats.bytes_offloaded += nbytes
            if not held:
                self._count_inflight(rec)
            if open_span:
                self._saves += 1
                rec.joined_at = self._saves
                self._open.append(rec)
            else:
                self._saves += 1
            return self._handle(rec, rec.view)

    @shielded  # as add
    def add_plain(self, t: torch.Tensor, nbytes: int, max_inflight: int) -> Handle | None:
        """:meth:`share`, the span checks, :meth:`wait_for_room` and :meth:`add` at once,
        for the common tensor (NOTE [ Pack fast path ]): contiguous, of a storage no live
        record is filed under, no span open, and room in flight for its ``nbytes``. Then
        it is what :meth:`add` makes of it (a new QUEUED record, its span the region
        ``t`` covers, counted in flight: the caller starts its write) and its first
        handle; otherwise ``None`` and nothing changed (the caller takes those steps)."""
        numel = t.numel()
        if not numel or not t.is_contiguous():
            return None
        storage = t.untyped_storage()
        device = t.device
        where = (storage.data_ptr(), device)
        offset = int(t.storage_offset())
        key = (where[0], offset, tuple(t.shape), tuple(t.stride()), t._version, t.dtype, device)
        with self._lock:
            inflight = self._inflight
            if self._open or key in self._dedup or (inflight and inflight + nbytes > max_inflight):
                return None
            filed = self._spans.get(where)
            if filed is not None:
                for other in filed:  # records written and dropped: the address is reused
                    ref = other.storage_ref
                    if ref is not None and not _storage_expired(ref.cdata):
                        return None  # a live storage: ``cover`` or ``join`` may take ``t``
            # rule 1 of NOTE [ Span unions ]: a contiguous view is the region it fills
            span = Span(offset, 1, numel, [(0, numel)])
            rec = Record(t, nbytes, len(self._order), None, State.QUEUED, span)
            rec.plain = True
            self._order.append(rec)
            self._live += 1
            rec.dedup_key = key
            self._dedup[key] = (weakref.ref(t), rec)
            rec.storage_ref = StorageWeakRef(storage)
            rec.span_key = where
            if filed is None:
                self._spans[where] = [rec]
            else:
                filed.append(rec)
            stats = self._stats
            stats.tensors_offloaded += 1
            stats.bytes_offloaded += nbytes
            self._inflight = inflight + nbytes
            held = stats.held_bytes + nbytes  # stats.hold, inline
            stats.held_bytes = held
            if held > stats.peak_held_bytes:
                stats.peak_held_bytes = held
            self._saves += 1
            return self._handle(rec)

    def _index(self, rec: Record, t: torch.Tensor) -> None:
        """File span record ``rec`` under ``t``'s storage (lock held): ``cover`` and
        ``join`` find it there while the storage lives."""
        storage = t.untyped_storage()
        rec.storage_ref = StorageWeakRef(storage)
        if rec.span is not None and not rec.span.region:
            rec.view = _view_of(t)  # the record's tensor is the span, not ``t`` itself
        key = rec.span_key = (storage.data_ptr(), t.device)
        records = self._spans.setdefault(key, [])
        records.append(rec)

    def _unindex(self, rec: Record) -> None:
        """Take freed ``rec`` out of the span index (lock held)."""
        key, rec.span_key, rec.storage_ref = rec.span_key, None, None
        if key is None:
            return
        records = self._spans.get(key)
        if records is not None and rec in records:
            records.remove(rec)
            if not records:
                del self._spans[key]

    def _handle(self, rec: Record, view: View | None = None) -> Handle:
        owner = self._owner()
        if owner is None:
            raise IllegalTransition("tensorstore-hooks internal error: the pipeline is gone")
        handle = Handle(rec, view)
        _finalize(handle, rec, MethodType(self._release, owner))
        return handle

    def _count_inflight(self, rec: Record) -> None:
        self._inflight += rec.nbytes
        self._stats.hold(rec.nbytes)

    def spill(self, rec: Record) -> bool:
        """HELD ``rec`` leaves the host tier for the store (counted in flight and as a
        spill); ``False``: freed meanwhile, and its free gave the room back."""
        with self._lock:
            if rec.state != State.HELD:
                return False
            rec.move(State.QUEUED)
            self._count_inflight(rec)
            self._stats.tensors_spilled += 1
            self._stats.bytes_spilled += rec.nbytes
            return True

    def write_directly(self, rec: Record) -> bool:
        """HELD ``rec`` found no room in the host tier in time: it is written from the
        device instead. ``False``: it no longer needs that (spilled or freed)."""
        with self._lock:
            if rec.state != State.HELD:
                return False
            rec.move(State.QUEUED)
            self._count_inflight(rec)
            return True

    # ---------------------------------------------------------------- write
    def begin_write(self, rec: Record) -> WriteJob | None:
        """QUEUED -> WRITING: what to write. ``None``: the write is not wanted (freed,
        or served from memory, before it ran): call :meth:`end_write` with nothing."""
        with self._lock:
            if rec.state != State.QUEUED:
                return None
            rec.move(State.WRITING)
            rec.write_started = True
            copy = rec.staged
            if copy is not None:
                return WriteJob(copy.host, copy.event)
            return WriteJob(rec.source, None, from_device=True)

    def unchanged(self, rec: Record) -> bool:
        """Whether ``rec``'s bytes may still be written: not DIRTY and, while the saved
        tensor is held, not modified since pack (NOTE [ In-place checks ])."""
        guard = rec.guard
        return rec.state != State.DIRTY and (guard is None or guard._version == rec.version)

    def end_write(
        self,
        rec: Record,
        *,
        key: str | None,
        error: BaseException | None,
        dirty: bool,
        keep_live: bool = False,
    ) -> WriteEnd:
        """The write of ``rec`` is over (or was skipped: :meth:`begin_write` said so).

        ``key``: what was written; ``error``: why the write failed; ``dirty``: the
        saved tensor changed in place; ``keep_live``: it changed without a version bump
        (NOTE [ In-place checks ]). WRITING -> STORED (the saved tensor is dropped:
        rule 1), MEMORY (the tensor stays: a failed write, a fallback; or ``keep_live``)
        or DIRTY. Bytes nobody wants any more are returned as ``discard``, and a host
        copy nobody wants as ``give_back``. Follow with :meth:`write_finished`.
        """
        with self._lock:
            give_back = None
            failed = None
            if dirty:
                if rec.state == State.WRITING:
                    rec.move(State.DIRTY)
                if rec.state == State.DIRTY:
                    rec._drop_source()
            elif error is not None or keep_live:
                if rec.state == State.WRITING:
                    give_back = self._fall_back(rec, error)
                    failed = error
            elif key is not None and rec.state == State.WRITING:
                rec.move(State.STORED)
                rec.key = key
                rec._drop_source()
                key = None
                give_back = self.copies._take(rec)
            if rec.state in (State.FREED, State.DIRTY):
                give_back = self.copies._take(rec)  # freed mid-write, or worthless
            return WriteEnd(key, give_back, failed)

    def _fall_back(self, rec: Record, error: BaseException | None) -> HostCopy | None:
        """``rec`` stays in memory, kept: its write failed, or (``None``) it changed."""
        rec.move(State.MEMORY)
        rec.error = error
        give_back = None
        if rec.source is None and rec.staged is not None:
            # The device tensor is gone already: a pageable copy of the host copy is the
            # tensor now (unpack moves it back to its device); the buffer goes back.
            rec.source = rec.staged.host.clone()
            give_back = self.copies._take(rec)
        stats = self._stats
        stats.fallbacks += error is not None
        if not rec.host_rule:
            stats.tensors_offloaded -= rec.members
            stats.bytes_offloaded -= rec.payload
            stats.tensors_kept += rec.members
            stats.bytes_kept += rec.payload
        return give_back

    def write_finished(self, rec: Record) -> None:
        """The writer is done with ``rec``, clean-up included: it leaves the bytes in
        flight (rule 3), and whoever waits for the write (a free, ``flush()``) goes on."""
        with self._lock:
            self._inflight -= rec.nbytes
            self._stats.hold(-rec.nbytes)
            self._cond.notify_all()
        rec._writing_over()

    def wait_for_writes(self) -> None:
        """Block until no write is queued or running (``flush()``)."""
        with self._lock:
            while self._inflight > 0:
                self._cond.wait(0.1)

    # --------------------------------------------------------------- unpack
    def claim_for_unpack(self, rec: Record, token: object = None) -> Claim:
        """What unpack does for ``rec``: :class:`Ready`, :class:`Fetch`, :class:`Wait`
        or :class:`Refused`. Never deletes anything (rule 2).

        In memory (not yet written, or kept after a failed write): the tensor itself,
        and a pending write is cancelled (the tail shortcut, ``stats.tail_hits``).
        Stored, held, or written from a host copy: the read ahead for it, if one runs
        (it leaves the window), else the read-ahead cursor jumps to just below it.
        """
        with self._lock:
            state = rec.state
            src = rec.source
            if src is not None and state in _IN_MEMORY:
                if state != State.MEMORY:
                    rec.move(State.MEMORY)  # its write is not wanted any more
                    self._stats.tail_hits += 1
                    if state == State.OPEN:
                        self._open.remove(rec)
                        self._never_written(rec)
                if rec.modified():
                    return _modified(f"a tensor of shape {tuple(src.shape)}")
                return Ready(src)
            if state == State.HELD and src is not None:
                # Its copy to host has not been reaped yet: the tensor itself.
                if rec.modified():
                    return _modified(f"a tensor of shape {tuple(src.shape)}")
                return Ready(src)
            if state == State.DIRTY:
                return _modified("a tensor")
            if state in (State.MEMORY, State.FREED):
                return Refused(
                    StoreUnavailableError,
                    f"offload: a saved tensor is no longer available ({state.name.lower()}); "
                    "was the graph freed or were the hooks closed?",
                )
            if state in _READABLE or rec.staged is not None:
                # No need to wait for a write: stored, held, or with its host copy.
                guard = rec.guard  # rec.modified(), inline: once per unpack
                if guard is None and rec.guard_ref is not None:
                    guard = rec.guard_ref()
                if guard is not None and guard._version != rec.version:  # NOTE [ In-place checks ]
                    return _modified(f"a tensor of {rec.nbytes} bytes")
                again = None if rec.returned is None else _returned(rec)
                if again is not None and rec.returned is not None:  # rule 8
                    self._stats.reuse_hits += 1
                    self.reads._forget(rec)  # a read ahead (if any) is not needed
                    rec.unpacked.add(id(token))
                    if len(rec.unpacked) >= rec.refs:
                        rec.strong = None  # every handle has it: the views keep it
                    return Ready(again, reused=True, event=rec.returned.event)
                reads = self.reads  # reads._claim(rec), inline: once per unpack
                fut = rec.fetch
                if fut is not None:
                    rec.fetch = None
                    reads._window -= rec.device_nbytes
                    self._stats.held_bytes -= rec.device_nbytes  # stats.hold(-n): no new peak
                else:
                    reads.cursor = rec.pos - 1
                return Fetch(fut)
            return Wait(rec.writing_done)  # written from the device

    def loaded(
        self, rec: Record, t: torch.Tensor, event: CopyEvent | None, token: object = None
    ) -> None:
        """Unpack (of the handle ``token`` stands for) brought ``t`` back for ``rec``
        (ready after ``event``): a later unpack of the record gets it again while it
        lives, and it lives until every live handle of the record has had it (rule 8)."""
        view = (tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))  # _view_of, inline
        back = _Returned((StorageWeakRef(t.untyped_storage()), t.dtype, view, event))
        with self._lock:
            if rec.state != State.FREED:
                rec.returned = back
                rec.unpacked = {id(token)}
                rec.strong = t if rec.refs > 1 else None

    # ----------------------------------------------------------------- free
    def free(self, rec: Record) -> Freed | None:
        """A handle of ``rec`` died. On the last: any -> FREED, and what to clean up.

        Returns ``None`` while other handles remain (or if already freed).
        """
        with self._lock:
            rec.refs -= 1
            if rec.refs > 0 or rec.state == State.FREED:
                if rec.strong is not None and len(rec.unpacked) >= rec.refs:
                    strong, rec.strong = rec.strong, None  # dropped outside the lock
                else:
                    return None
            else:
                strong = None
        if strong is not None:
            del strong
            return None
        with self._lock:
            if rec.refs > 0 or rec.state == State.FREED:
                return None
            prev = rec.state
            rec.move(State.FREED)
            if prev == State.OPEN:  # never written: it leaves the flight now (rule 3)
                self._open.remove(rec)
                self._never_written(rec)
            self._unindex(rec)
            rec.returned = None
            strong, rec.strong = rec.strong, None
            if rec.dedup_key is not None:
                hit = self._dedup.get(rec.dedup_key)
                if hit is not None and hit[1] is rec:
                    del self._dedup[rec.dedup_key]
            self._order[rec.pos] = None
            self._live -= 1
            key, rec.key = rec.key, None
            self.reads._forget(rec)
            copy = rec.staged
            source = rec.source  # dropped below, outside the lock: it may free graph pieces
            if copy is not None and copy.event is not None and source is not None:
                copy.keep = source  # a copy to host still reads it: it goes with the copy
            # A write under way gives its host copy back when it ends (end_write).
            give_back = None if prev in (State.QUEUED, State.WRITING) else self.copies._take(rec)
            rec._drop_source()
            idle = self._live == 0
            if idle:
                self._order.clear()
                self.reads._reset()
            elif self._wants_compaction():
                self._compact()
            running = None
            if key is None and rec.write_started and not rec._written:
                # A write in progress deletes what it wrote once it sees the record
                # unwanted: waiting for it keeps "graph freed => every key gone".
                running = rec.writing_done
            last = idle and self.closing
        del source, strong
        return Freed(key, running, give_back, last)

    def close(self) -> bool:
        """Take no more tensors; ``True`` if nothing is live (close now)."""
        with self._lock:
            self.closing = True
            return self._live == 0

    def _wants_compaction(self) -> bool:
        return len(self._order) > self._COMPACT_MIN and self._live * 4 < len(self._order)

    def _compact(self) -> None:
        """Drop freed slots; the read-ahead cursor keeps pointing at the same record."""
        order = self._order
        cursor_rec = None
        for i in range(min(self.reads.cursor, len(order) - 1), -1, -1):
            if order[i] is not None:
                cursor_rec = order[i]
                break
        live = [r for r in order if r is not None]
        for i, r in enumerate(live):
            r.pos = i
        order[:] = live  # in place: the read-ahead walks this very list
        self.reads.cursor = cursor_rec.pos if cursor_rec is not None else -1
