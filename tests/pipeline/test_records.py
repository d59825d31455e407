"""The record table's intent methods on their own: NOTE [ Record lifecycle ].

Every allowed move is made by some intent and no intent makes another one; an intent
asked for what a record's state does not allow answers "no" and leaves the record as
it was; each returns what its caller must do outside the lock. No store, no threads
of the pipeline: records, handles and the table alone.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch

from tensorstore_hooks import StoreUnavailableError
from tensorstore_hooks.pipeline._records import (
    TRANSITIONS,
    Fetch,
    Freed,
    Handle,
    HostCopy,
    IllegalTransition,
    Ready,
    Record,
    RecordTable,
    Refused,
    State,
    Wait,
    dedup_key,
)
from tensorstore_hooks.pipeline._spans import Span, pattern_of
from tensorstore_hooks.pipeline._stats import OffloadStats

N = 64  # bytes of every saved tensor below: 16 float32


class Owner:
    """What owns a table in real use (the pipeline): its bound method frees records."""

    def __init__(self) -> None:
        self.stats = OffloadStats()
        self.table = RecordTable(self.release, self.stats)
        self.freed: list[Freed | None] = []

    def release(self, rec: Record) -> None:
        self.freed.append(self.table.free(rec))


@pytest.fixture
def owner() -> Owner:
    return Owner()


def saved() -> torch.Tensor:
    return torch.arange(16, dtype=torch.float32)


def add(owner: Owner, t: torch.Tensor | None = None, *, held: bool = False) -> Handle:
    t = saved() if t is None else t
    return owner.table.add(t, N, guard=None, key=None, held=held, host_rule=False)


def add_open(owner: Owner) -> Handle:
    """An OPEN record: the first of a storage's views with gaps (NOTE [ Span unions ])."""
    t = torch.arange(32, dtype=torch.float32).view(8, 4)[:, :2]  # 8 rows of 2, 4 apart
    pattern = pattern_of(tuple(t.shape), tuple(t.stride()), t.storage_offset())
    assert pattern is not None and not pattern.region
    span = Span.of(pattern)
    return owner.table.add(
        t, N, guard=None, key=None, held=False, host_rule=False, span=span, open_span=True
    )


def host_copy(t: torch.Tensor) -> HostCopy:
    buf = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)
    host = buf.view(t.dtype)
    host.copy_(t)
    return HostCopy(host, buf, None)


# --------------------------------------------------- records in every state
def in_state(owner: Owner, state: State) -> tuple[Handle, Record]:
    """A live record in ``state``, made through intents only (FREED: its handle dead)."""
    table = owner.table
    handle = add_open(owner) if state == State.OPEN else add(owner, held=state == State.HELD)
    rec = handle.rec
    if state in (State.WRITING, State.STORED, State.DIRTY):
        assert table.begin_write(rec) is not None
    if state == State.STORED:
        table.end_write(rec, key="k", error=None, dirty=False)
    elif state == State.DIRTY:
        table.end_write(rec, key=None, error=None, dirty=True)
    elif state == State.MEMORY:
        assert isinstance(table.claim_for_unpack(rec), Ready)  # the tail shortcut
    elif state == State.FREED:
        del handle
        gc.collect()
        return Handle(rec), rec  # a stand-in; the record itself is freed
    assert rec.state == state
    return handle, rec


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[tuple[State, State]]]:
    """Every move records make while the test runs."""
    seen: set[tuple[State, State]] = set()
    move = Record.move

    def recording(rec: Record, to: State) -> None:
        frm = rec.state
        move(rec, to)
        seen.add((frm, to))

    monkeypatch.setattr(Record, "move", recording)
    yield seen


def test_every_allowed_move_is_made_by_an_intent(moves: set[tuple[State, State]]) -> None:
    owner = Owner()
    table = owner.table
    for state in State:  # -> every state, and each of them -> FREED
        handle, rec = in_state(owner, state)
        del handle
        gc.collect()
        assert rec.state == State.FREED
    # OPEN -> QUEUED, OPEN -> HELD (written, or held in the host tier), OPEN -> MEMORY
    _o1, o1 = in_state(owner, State.OPEN)
    assert table.take_open(only=o1) == [(o1, False)] and o1.state == State.QUEUED
    _o2, o2 = in_state(owner, State.OPEN)
    assert table.take_open(holds=lambda r: True) == [(o2, True)] and o2.state == State.HELD
    _o3, o3 = in_state(owner, State.OPEN)
    assert isinstance(table.claim_for_unpack(o3), Ready) and o3.state == State.MEMORY
    # HELD -> QUEUED, twice over
    _h1, r1 = in_state(owner, State.HELD)
    assert table.spill(r1)
    _h2, r2 = in_state(owner, State.HELD)
    assert table.write_directly(r2)
    # HELD/QUEUED -> DIRTY: modified before its copy to host completed
    for held in (True, False):
        t = saved()
        h = table.add(t, N, guard=None, key=None, held=held, host_rule=False)
        assert table.copies.attach(h.rec, host_copy(t))
        t.add_(1)
        assert table.copies.done(h.rec) is not None and h.rec.state == State.DIRTY
    # WRITING -> MEMORY: a failed write, and the tail shortcut while writing
    _h3, r3 = in_state(owner, State.WRITING)
    table.end_write(r3, key=None, error=OSError("full"), dirty=False)
    _h4, r4 = in_state(owner, State.WRITING)
    assert isinstance(table.claim_for_unpack(r4), Ready) and r4.state == State.MEMORY
    # QUEUED -> DIRTY through the writer's own check (no host copy)
    t = saved()
    h5 = table.add(t, N, guard=None, key=None, held=False, host_rule=False)
    t.add_(1)
    assert table.begin_write(h5.rec) is not None and not table.unchanged(h5.rec)
    table.end_write(h5.rec, key=None, error=None, dirty=True)
    allowed = {(a, b) for a, bs in TRANSITIONS.items() for b in bs}
    assert moves == allowed


# ----------------------------------------------------------- intents that say no
@pytest.mark.parametrize("state", [s for s in State if s != State.HELD], ids=lambda s: s.name)
def test_spill_and_write_directly_need_a_held_record(owner: Owner, state: State) -> None:
    _handle, rec = in_state(owner, state)
    inflight = owner.table.inflight
    assert owner.table.spill(rec) is False and owner.table.write_directly(rec) is False
    assert rec.state == state and owner.table.inflight == inflight
    assert owner.stats.tensors_spilled == 0


@pytest.mark.parametrize("state", [s for s in State if s != State.QUEUED], ids=lambda s: s.name)
def test_begin_write_needs_a_queued_record(owner: Owner, state: State) -> None:
    _handle, rec = in_state(owner, state)
    started = rec.write_started
    assert owner.table.begin_write(rec) is None
    assert rec.state == state and rec.write_started == started


@pytest.mark.parametrize(
    "state", [State.WRITING, State.STORED, State.MEMORY, State.DIRTY, State.FREED]
)
def test_a_host_copy_attaches_only_to_held_or_queued_records(owner: Owner, state: State) -> None:
    _handle, rec = in_state(owner, state)
    copy = host_copy(saved())
    assert owner.table.copies.attach(rec, copy) is False and rec.staged is None


def test_an_illegal_move_raises_and_leaves_the_record_as_it_was(owner: Owner) -> None:
    _handle, rec = in_state(owner, State.STORED)
    with pytest.raises(IllegalTransition, match="STORED -> WRITING"):
        rec.move(State.WRITING)
    assert rec.state == State.STORED


# ------------------------------------------------------------------------ pack
def test_add_counts_queued_records_in_flight_and_held_ones_not(owner: Owner) -> None:
    table, stats = owner.table, owner.stats
    h1 = add(owner)
    assert h1.rec.state == State.QUEUED and table.inflight == N and stats.held_bytes == N
    h2 = add(owner, held=True)
    assert h2.rec.state == State.HELD and table.inflight == N
    h3 = table.add(saved(), N, guard=None, key=None, held=True, host_rule=True)
    assert h3.rec.host_rule
    assert (stats.tensors_offloaded, stats.bytes_offloaded) == (2, 2 * N)  # not the host rule's
    assert [r.pos for r in table.records()] == [0, 1, 2] and table.live == 3


def test_share_hits_only_while_the_first_saver_lives(owner: Owner) -> None:
    table = owner.table
    t = saved()
    key = dedup_key(t)
    first = table.add(t, N, guard=None, key=key, held=False, host_rule=False)
    second = table.share(t, key)
    assert second is not None and second.rec is first.rec and first.rec.refs == 2
    assert owner.stats.dedup_hits == 1
    assert table.share(t, None) is None
    del t  # the first saver died: its address may be reused, so no hit any more
    gc.collect()
    assert table.share(saved(), key) is None


def test_wait_for_room_blocks_until_a_write_finishes(owner: Owner) -> None:
    table = owner.table
    assert table.wait_for_room(N, max_inflight=N) == 0.0  # empty: always room
    h = add(owner)
    assert table.wait_for_room(N, max_inflight=2 * N) == 0.0
    rec = h.rec
    table.begin_write(rec)
    timer = threading.Timer(0.1, lambda: table.write_finished(rec))
    timer.start()
    waited = table.wait_for_room(N, max_inflight=N)
    timer.join()
    assert waited >= 0.05 and table.inflight == 0 and rec.writing_done.is_set()


# -------------------------------------------------------------------- host tier
def test_spill_counts_and_puts_the_record_in_flight(owner: Owner) -> None:
    h = add(owner, held=True)
    assert owner.table.spill(h.rec)
    assert h.rec.state == State.QUEUED and owner.table.inflight == N
    assert (owner.stats.tensors_spilled, owner.stats.bytes_spilled) == (1, N)
    h2 = add(owner, held=True)
    assert owner.table.write_directly(h2.rec) and owner.stats.tensors_spilled == 1


def test_a_completed_copy_replaces_the_saved_tensor(owner: Owner) -> None:
    t = saved()
    h = owner.table.add(t, N, guard=None, key=None, held=True, host_rule=False)
    copy = host_copy(t)
    assert owner.table.copies.done(h.rec) is None  # no copy yet: nothing to do
    assert owner.table.copies.attach(h.rec, copy)
    assert owner.table.copies.done(h.rec) is None
    assert h.rec.source is None and h.rec.staged is copy and h.rec.state == State.HELD


def test_a_copy_read_while_let_go_goes_back_with_its_last_reader(owner: Owner) -> None:
    t = saved()
    h = owner.table.add(t, N, guard=None, key=None, held=True, host_rule=False)
    copy = host_copy(t)
    copies = owner.table.copies
    copies.attach(h.rec, copy)
    assert copies.borrow(h.rec) is copy and copies.borrow(h.rec) is copy
    assert copies.take(h.rec) is None  # two reads running: not given back yet
    assert copies.borrow(h.rec) is None  # let go of: no new reader
    assert copies.end_read(copy) is False
    assert copies.end_read(copy) is True  # the last reader gives it back
    h2 = owner.table.add(t, N, guard=None, key=None, held=True, host_rule=False)
    copies.attach(h2.rec, copy2 := host_copy(t))
    assert copies.take(h2.rec) is copy2  # nobody reading: straight back


# ------------------------------------------------------------------------ write
def test_a_write_stores_and_drops_the_tensor(owner: Owner) -> None:
    table = owner.table
    h = add(owner)
    job = table.begin_write(h.rec)
    assert job is not None and job.source is h.rec.source and job.event is None
    assert h.rec.state == State.WRITING and h.rec.write_started
    end = table.end_write(h.rec, key="k1", error=None, dirty=False)
    assert (end.discard, end.give_back, end.error) == (None, None, None)
    assert h.rec.state == State.STORED and h.rec.key == "k1" and h.rec.source is None
    table.write_finished(h.rec)
    assert table.inflight == 0 and owner.stats.held_bytes == 0


def test_a_staged_write_writes_the_host_copy_and_gives_it_back(owner: Owner) -> None:
    t = saved()
    h = owner.table.add(t, N, guard=None, key=None, held=False, host_rule=False)
    copy = host_copy(t)
    owner.table.copies.attach(h.rec, copy)
    job = owner.table.begin_write(h.rec)
    assert job is not None and job.source is copy.host
    end = owner.table.end_write(h.rec, key="k", error=None, dirty=False)
    assert end.give_back is copy and h.rec.staged is None


def test_a_failed_write_falls_back_to_memory(owner: Owner) -> None:
    t = saved()
    h = owner.table.add(t, N, guard=None, key=None, held=False, host_rule=False)
    copy = host_copy(t)
    owner.table.copies.attach(h.rec, copy)
    owner.table.copies.done(h.rec)  # the device tensor is gone: only the host copy
    owner.table.begin_write(h.rec)
    boom = OSError(28, "No space left on device")
    end = owner.table.end_write(h.rec, key=None, error=boom, dirty=False)
    assert end.error is boom and end.give_back is copy and end.discard is None
    rec = h.rec
    assert rec.state == State.MEMORY and rec.error is boom
    assert rec.source is not None and torch.equal(rec.source, t)  # a copy of the copy
    stats = owner.stats
    assert (stats.fallbacks, stats.tensors_offloaded, stats.tensors_kept) == (1, 0, 1)
    claim = owner.table.claim_for_unpack(rec)
    assert isinstance(claim, Ready) and torch.equal(claim.tensor, t)


def test_a_modified_tensor_makes_the_write_dirty_and_its_bytes_unwanted(owner: Owner) -> None:
    t = saved()
    h = owner.table.add(t, N, guard=None, key=None, held=False, host_rule=False)
    owner.table.begin_write(h.rec)
    assert owner.table.unchanged(h.rec)
    t.add_(1)  # during the write
    assert not owner.table.unchanged(h.rec)
    end = owner.table.end_write(h.rec, key="k", error=None, dirty=True)
    assert end.discard == "k" and h.rec.state == State.DIRTY and h.rec.source is None
    claim = owner.table.claim_for_unpack(h.rec)
    assert isinstance(claim, Refused)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        raise claim.error()


def test_bytes_written_for_a_record_freed_meanwhile_are_unwanted(owner: Owner) -> None:
    t = saved()
    h = owner.table.add(t, N, guard=None, key=None, held=False, host_rule=False)
    rec = h.rec
    copy = host_copy(t)
    owner.table.copies.attach(rec, copy)
    owner.table.begin_write(rec)
    del h
    gc.collect()
    freed = owner.freed[-1]
    assert freed is not None and freed.write_running is rec.writing_done
    assert freed.give_back is None  # the write under way gives it back
    end = owner.table.end_write(rec, key="k", error=None, dirty=False)
    assert end.discard == "k" and end.give_back is copy and rec.state == State.FREED
    owner.table.write_finished(rec)
    assert rec.writing_done.is_set() and owner.table.inflight == 0


# ----------------------------------------------------------------------- unpack
@pytest.mark.parametrize("state", [State.QUEUED, State.WRITING])
def test_unpack_before_the_write_is_the_tail_shortcut(owner: Owner, state: State) -> None:
    _h, rec = in_state(owner, state)
    claim = owner.table.claim_for_unpack(rec)
    assert isinstance(claim, Ready) and claim.tensor is rec.source
    assert rec.state == State.MEMORY and owner.stats.tail_hits == 1
    assert isinstance(owner.table.claim_for_unpack(rec), Ready)  # again: no second count
    assert owner.stats.tail_hits == 1


def test_unpack_of_a_held_record_before_its_copy_is_reaped(owner: Owner) -> None:
    _h, rec = in_state(owner, State.HELD)
    claim = owner.table.claim_for_unpack(rec)
    assert isinstance(claim, Ready) and claim.tensor is rec.source and rec.state == State.HELD


@pytest.mark.parametrize("state", [State.STORED, State.HELD])
def test_unpack_of_a_readable_record_fetches(owner: Owner, state: State) -> None:
    t = saved()
    h = owner.table.add(t, N, guard=None, key=None, held=state == State.HELD, host_rule=False)
    h2 = add(owner)  # a second record, packed later
    rec = h.rec
    if state == State.STORED:
        owner.table.begin_write(rec)
        owner.table.end_write(rec, key="k", error=None, dirty=False)
    else:
        owner.table.copies.attach(rec, host_copy(t))
        owner.table.copies.done(rec)
    owner.table.reads.cursor = 5
    claim = owner.table.claim_for_unpack(rec)
    assert isinstance(claim, Fetch) and claim.read is None
    assert owner.table.reads.cursor == rec.pos - 1  # a miss: the cursor jumps below it
    del h2


def test_unpack_of_a_record_being_written_without_a_copy_in_memory_waits(
    owner: Owner,
) -> None:
    _h, rec = in_state(owner, State.WRITING)
    # Neither the tensor nor a host copy in memory, and not stored yet: unpack waits
    # for the write rather than fail (no intent leaves a record so today).
    rec.source = None
    claim = owner.table.claim_for_unpack(rec)
    assert isinstance(claim, Wait) and claim.done is rec.writing_done


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        (State.DIRTY, RuntimeError, "inplace operation"),
        (State.FREED, StoreUnavailableError, "no longer available"),
    ],
)
def test_unpack_refuses_what_it_cannot_give_back(
    owner: Owner, state: State, error: type[Exception], match: str
) -> None:
    _h, rec = in_state(owner, state)
    claim = owner.table.claim_for_unpack(rec)
    assert isinstance(claim, Refused)
    with pytest.raises(error, match=match):
        raise claim.error()


def test_unpack_of_a_stored_tensor_modified_since_pack_is_refused(owner: Owner) -> None:
    t = saved()
    h = owner.table.add(t, N, guard=None, key=None, held=False, host_rule=False)
    owner.table.begin_write(h.rec)
    owner.table.end_write(h.rec, key="k", error=None, dirty=False)
    t.add_(1)  # alive and changed: the weak reference still sees it
    claim = owner.table.claim_for_unpack(h.rec)
    assert isinstance(claim, Refused) and claim.kind is RuntimeError


# -------------------------------------------------------------------- read ahead
def stored(owner: Owner, n: int) -> list[Handle]:
    handles = []
    for i in range(n):
        h = add(owner)
        owner.table.begin_write(h.rec)
        owner.table.end_write(h.rec, key=f"k{i}", error=None, dirty=False)
        owner.table.write_finished(h.rec)
        handles.append(h)
    return handles


def test_read_ahead_plans_newest_first_within_the_window(owner: Owner) -> None:
    handles = stored(owner, 5)
    reads = owner.table.reads
    reads.restart()
    planned = reads.plan(2 * N)
    assert [r.pos for r, _ in planned] == [4, 3] and owner.stats.held_bytes == 2 * N
    assert reads.plan(2 * N) == []  # the window is full
    rec, fut = planned[0]
    claim = owner.table.claim_for_unpack(rec)
    # A hit: it leaves the window, and unpack waits on the very future the read runs
    # into (planned and claimed before the read was even submitted: no placeholder).
    assert isinstance(claim, Fetch) and claim.read is fut
    assert owner.stats.held_bytes == N
    assert [r.pos for r, _ in reads.plan(2 * N)] == [2]
    del handles


def test_a_read_planned_for_a_record_freed_meanwhile_is_cancelled(owner: Owner) -> None:
    handles = stored(owner, 2)
    reads = owner.table.reads
    reads.restart()
    ((rec, fut),) = reads.plan(N)
    del handles[1]
    gc.collect()
    assert rec.state == State.FREED and rec.fetch is None
    assert fut.cancelled()  # the reader sees it and does not run
    assert owner.stats.held_bytes == 0


def test_read_ahead_skips_a_held_record_still_holding_its_tensor(owner: Owner) -> None:
    # Its copy to host has not been seen complete: unpack returns the tensor itself.
    held = add(owner, held=True)
    handles = stored(owner, 1)
    reads = owner.table.reads
    reads.restart()
    assert [r.pos for r, _ in reads.plan(4 * N)] == [1]
    assert isinstance(owner.table.claim_for_unpack(held.rec), Ready)
    del handles


def test_the_read_ahead_window_counts_the_span_a_view_comes_back_with(owner: Owner) -> None:
    base = torch.arange(64, dtype=torch.float32).view(8, 8)
    h = owner.table.add(base[:, ::2], 4 * 16, guard=None, key=None, held=False, host_rule=False)
    assert h.rec.nbytes == 64 and h.rec.device_nbytes == (7 * 8 + 6 + 1) * 4


# ------------------------------------------------------------------------- free
def test_free_waits_for_the_last_handle_and_says_what_to_clean_up(owner: Owner) -> None:
    t = saved()
    key = dedup_key(t)
    h1 = owner.table.add(t, N, guard=None, key=key, held=False, host_rule=False)
    h2 = owner.table.share(t, key)
    rec = h1.rec
    owner.table.begin_write(rec)
    owner.table.end_write(rec, key="k", error=None, dirty=False)
    owner.table.write_finished(rec)
    del h1
    gc.collect()
    assert owner.freed == [None] and rec.state == State.STORED  # one handle left
    del h2
    gc.collect()
    freed = owner.freed[-1]
    assert freed == Freed(key="k", write_running=None, give_back=None, last=False)
    assert rec.state == State.FREED and rec.key is None and owner.table.live == 0


def test_free_gives_a_held_records_copy_back(owner: Owner) -> None:
    t = saved()
    h = owner.table.add(t, N, guard=None, key=None, held=True, host_rule=False)
    copy = host_copy(t)
    owner.table.copies.attach(h.rec, copy)
    del h
    gc.collect()
    freed = owner.freed[-1]
    assert freed is not None and freed.give_back is copy and freed.key is None


def test_the_last_free_of_a_closing_table_says_close(owner: Owner) -> None:
    h = add(owner)
    assert owner.table.close() is False and owner.table.closing
    owner.table.begin_write(h.rec)
    owner.table.end_write(h.rec, key="k", error=None, dirty=False)
    owner.table.write_finished(h.rec)
    del h
    gc.collect()
    freed = owner.freed[-1]
    assert freed is not None and freed.last
    assert Owner().table.close() is True  # nothing live: close at once


def test_compaction_keeps_the_cursor_on_its_record(owner: Owner) -> None:
    handles: list[Handle | None] = list(stored(owner, 1100))
    owner.table.reads.cursor = 1050
    target = handles[1050]
    assert target is not None
    for i in range(1000):  # free most of them (not the cursor's): the table compacts
        handles[i] = None
    gc.collect()
    target_rec = target.rec
    assert len(owner.table.records()) == 100
    assert owner.table.reads.cursor == target_rec.pos and target_rec.pos < 1050
    # Compacted once, when three quarters were free: 1100 slots became 274.
    positions = [r.pos for r in owner.table.records()]
    assert positions == list(range(174, 274))


def test_the_table_frees_without_its_owner_being_collected() -> None:
    # The table keeps its owner's method weakly: no cycle through the table.
    owner = Owner()
    h = add(owner)
    ref = weakref.ref(owner)
    gc.disable()
    try:
        del owner
        assert ref() is not None  # the handle's finalizer keeps the owner alive ...
        del h
        assert ref() is None  # ... and nothing else does
    finally:
        gc.enable()


# ------------------------------------------------------------ the written word
def test_the_lifecycle_note_names_the_intents_that_exist(owner: Owner) -> None:
    import tensorstore_hooks.pipeline._records as records

    doc = records.__doc__ or ""
    note = doc.split("NOTE [ Record lifecycle ]")[1].split("Rules,")[0]
    rows = [
        line.split()[0]
        for line in note.splitlines()
        if line.startswith("    ") and line[4] != " "  # the intent column
    ]
    intents = [r for r in rows if r not in ("intent",) and r[0].islower()]
    assert {"add", "free", "claim_for_unpack", "begin_write", "end_write", "spill"} <= set(intents)
    for name in intents:
        target: object = owner.table
        for part in name.split("."):
            target = getattr(target, part)
        assert callable(target), name
