"""The device_budget plan on its own: sizes in, keep/move decisions out.

See NOTE [ Device budget plan ] in ``tensorstore_hooks/pipeline/_budgets.py``; the rule numbers
below are that note's. The windows are given as 0 here, so the plan spends the whole
budget (NOTE [ Windows ] rule 3).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorstore_hooks.pipeline._budgets import (
    KEPT_NOTHING_FORWARDS,
    BudgetControl,
    Trace,
    plan_keep,
    scaled_rest,
)

MiB = 1 << 20


def control(budget: int | None) -> BudgetControl:
    return BudgetControl(device_budget=budget, max_inflight=0, prefetch=0)


def run_forward(ctl: BudgetControl, saves: Sequence[int | tuple[int, bool]]) -> list[bool]:
    """Pack every save in order (``n``: counts; ``(n, False)``: kept by the rules), then
    start backward; the keep decisions."""
    out = []
    for save in saves:
        n, counts = save if isinstance(save, tuple) else (save, True)
        out.append(ctl.keep("store" if counts else "keep", n))
    ctl.backward_started()
    return out


def kept_bytes(sizes: Sequence[int], decisions: Sequence[bool]) -> int:
    return sum(n for n, k in zip(sizes, decisions, strict=True) if k)


def newest_tail(sizes: Sequence[int], budget: int) -> list[bool]:
    """What a plan that knew the forward in advance keeps: plan_keep's tail."""
    n = plan_keep(sizes, budget)
    return [False] * (len(sizes) - n) + [True] * n


# ------------------------------------------------------------------ plan_keep (rule 5)
def test_plan_keep_newest_first_stops_at_first_misfit() -> None:
    # A contiguous tail; 3 MiB does not fit after 4+2, so 1 MiB before it is not kept.
    assert plan_keep([1 * MiB, 3 * MiB, 2 * MiB, 4 * MiB], 7 * MiB) == 2
    assert plan_keep([1, 2, 3], 6) == 3
    assert plan_keep([1, 2, 3], 0) == 0
    assert plan_keep([], 10) == 0


def test_scaled_rest_scales_each_kind_by_its_own_ratio() -> None:
    kinds = Trace.of([4, 4, 8, 4, 8, 2]).kinds
    assert kinds == ((4, 3, True), (8, 2, True), (2, 1, False))
    # Seen kinds scale by their ratio; kind 2 (not seen, not spread) by the cautious 1.0.
    rest = scaled_rest(kinds, {4: 2, 8: 1}, {4: 0.5, 8: 0.25}, 1.0)
    assert rest == 4 * 0.5 + 8 * 0.25 + 2 * 1.0
    # A kind of every block not seen yet: the rest is unknown.
    assert scaled_rest(kinds, {4: 1}, {4: 1.0}, 1.0) == math.inf
    # Kinds whose tensors sit together (the end of a forward) are guessed cautiously.
    kinds = Trace.of([4, 8, 4, 8, 2, 2]).kinds
    assert scaled_rest(kinds, {4: 2, 8: 2}, {4: 0.5, 8: 0.5}, 0.75) == 2 * 2 * 0.75


# ----------------------------------------------------------------- steady sizes
def test_first_forward_follows_the_rules_and_records() -> None:
    ctl = control(10 * MiB)
    assert run_forward(ctl, [4 * MiB] * 3) == [False, False, False]  # rule 3
    assert ctl.traces[0].sizes == (4 * MiB,) * 3
    assert ctl.forwards == 1 and ctl.replans == 0


def test_later_forwards_keep_the_newest_within_budget() -> None:
    ctl = control(10 * MiB)
    saves = [4 * MiB, 3 * MiB, 4 * MiB, 5 * MiB]
    run_forward(ctl, saves)
    # Newest first: 5 fits, 5+4 fits, 5+4+3 does not -> the last two are kept.
    for _ in range(3):
        assert run_forward(ctl, saves) == [False, False, True, True]
    assert ctl.replans == 0


def test_tensors_that_do_not_count_are_ignored() -> None:
    # Rule 2: parameters, small tensors and keep rules never spend the budget and
    # never shift the plan's positions.
    ctl = control(6 * MiB)
    saves = [4 * MiB, (50 * MiB, False), 4 * MiB, (1, False), 2 * MiB]
    assert run_forward(ctl, saves) == [False] * 5
    assert ctl.traces[0].sizes == (4 * MiB, 4 * MiB, 2 * MiB)
    assert run_forward(ctl, saves) == [False, False, True, False, True]


def test_no_budget_records_but_keeps_nothing() -> None:
    ctl = control(None)
    for _ in range(3):
        assert run_forward(ctl, [MiB] * 4) == [False] * 4
    assert ctl.traces[0].sizes == (MiB,) * 4


@pytest.mark.filterwarnings("ignore:tensorstore-hooks. device_budget kept nothing")
def test_deterministic() -> None:
    rng = random.Random(3)
    forwards = [[rng.randrange(1, 9) * MiB for _ in range(rng.randrange(5, 12))] for _ in range(8)]
    runs = []
    for _ in range(2):
        ctl = control(12 * MiB)
        runs.append([run_forward(ctl, f) for f in forwards])
    assert runs[0] == runs[1]


# ----------------------------------------------------------------- dynamic shapes
def block_trace(length: int, blocks: int = 4) -> list[int]:
    """A transformer-like forward at sequence length ``length``: per block two ``L x d``
    tensors, an ``L x L`` score matrix and a ``4L x d`` MLP one; then the logits."""
    d = 64
    block = [length * d * 4, length * length * 4, length * d * 4, 4 * length * d * 4]
    return block * blocks + [length * 300 * 4]


def assert_newest(sizes: Sequence[int], got: Sequence[bool], budget: int, share: float) -> None:
    """``got`` keeps a tail of the newest that fits (never an older tensor) and at
    least ``share`` of the bytes the best such tail holds."""
    ideal = newest_tail(sizes, budget)
    n = sum(got)
    assert list(got) == [False] * (len(sizes) - n) + [True] * n  # a tail
    assert n <= sum(ideal)  # within the best tail
    assert kept_bytes(sizes, got) >= share * kept_bytes(sizes, ideal)


@pytest.mark.parametrize("share", [0.2, 0.4, 0.7])
def test_another_length_is_scaled_kind_by_kind(share: float) -> None:
    # The finding this fixes: a forward of another length used to keep nothing.
    # Scaling each kind by its own factor (L x d by L, L x L by L^2) predicts the rest,
    # so the forward keeps its newest tail. The logits, never seen before the end of
    # a forward, are guessed at the largest ratio (L^2's when the length grows), and
    # no run starts inside the first block: at most a block less than the best tail.
    budget = int(sum(block_trace(96, blocks=12)) * share)
    ctl = control(budget)
    run_forward(ctl, block_trace(60, blocks=12))  # (at 64, L x L = L x d: one kind)
    block = sum(block_trace(120, blocks=1)) - 120 * 300 * 4
    for length in (96, 80, 120, 72, 100):
        sizes = block_trace(length, blocks=12)
        got = run_forward(ctl, sizes)
        assert_newest(sizes, got, budget, 0.0)
        assert kept_bytes(sizes, got) >= kept_bytes(sizes, newest_tail(sizes, budget)) - block
        start = len(sizes) - plan_keep(sizes, budget)
        if length < 96 and start >= 4:  # shrinking, past the first block: exact
            assert got == newest_tail(sizes, budget)
    assert ctl.replans == 5


def test_bucketed_lengths_stop_replanning() -> None:
    budget = sum(block_trace(64)) // 4
    ctl = control(budget)
    buckets = [64, 96, 128]
    for length in buckets:
        run_forward(ctl, block_trace(length))
    replans = ctl.replans
    for length in [96, 64, 128, 128, 64, 96]:
        sizes = block_trace(length)  # each matches a remembered trace: predicted exactly
        assert run_forward(ctl, sizes) == newest_tail(sizes, budget)
    assert ctl.replans == replans  # every bucket is remembered (rule 4)


def test_gradient_accumulation_with_micro_batches_of_other_lengths() -> None:
    # Rule 1: forward, backward, forward, backward -> one forward per micro-batch,
    # each planned for its own length.
    budget = sum(block_trace(64)) // 3
    ctl = control(budget)
    for step in range(3):
        for length in (64, 112, 80, 128):
            sizes = block_trace(length)
            got = run_forward(ctl, sizes)
            assert kept_bytes(sizes, got) <= budget
            if step:  # every length is remembered from the first step
                assert got == newest_tail(sizes, budget)
    assert ctl.forwards == 12


def test_a_forward_with_more_or_fewer_tensors_stays_within_budget() -> None:
    # A tensor that drops below min_bytes at a short length changes the count; the
    # alignment contradicts itself there, and the prediction turns cautious.
    budget = 3 * MiB
    ctl = control(budget)
    long = [MiB, 2 * MiB, MiB // 16, MiB, 2 * MiB, MiB // 16, MiB, 2 * MiB, MiB // 16]
    short = [n // 2 for n in long if n >= MiB]  # the small kind is gone
    run_forward(ctl, long)
    for sizes in (short, long, short, long):
        got = run_forward(ctl, sizes)
        assert kept_bytes(sizes, got) <= budget
    # Both counts are remembered now: each is predicted from its own kind.
    assert run_forward(ctl, short) == newest_tail(short, budget)
    assert run_forward(ctl, long) == newest_tail(long, budget)


def test_a_prediction_too_low_ends_the_run_within_budget_and_calibrates() -> None:
    # The reference promises a short rest; this forward is far longer (an extra tail
    # the reference did not have). The run starts, meets the budget, and ends there.
    budget = 4 * MiB
    ctl = control(budget)
    run_forward(ctl, [MiB] * 6)
    longer = [MiB] * 6 + [MiB] * 6
    got = run_forward(ctl, longer)
    assert kept_bytes(longer, got) == budget
    assert got[-1] is False  # the newest were moved: the prediction was wrong
    # Rule 7: the next forward's prediction is scaled up, never past the budget.
    got = run_forward(ctl, longer)
    assert kept_bytes(longer, got) <= budget


def test_two_forwards_before_one_backward_are_one_forward() -> None:
    ctl = control(4 * MiB)
    for _ in range(4):
        ctl.keep("store", 2 * MiB)
    ctl.backward_started()
    assert ctl.traces[0].sizes == (2 * MiB,) * 4 and ctl.forwards == 1


def test_retain_graph_backward_does_not_start_a_forward() -> None:
    ctl = control(4 * MiB)
    run_forward(ctl, [2 * MiB] * 3)
    ctl.backward_started()  # a second backward over the retained graph: unpacks only
    ctl.backward_started()
    assert ctl.forwards == 1 and ctl.replans == 0
    assert run_forward(ctl, [2 * MiB] * 3) == [False, True, True]


# ------------------------------------------------------------------- rule 9: warning
def test_a_plan_that_keeps_nothing_warns_once() -> None:
    ctl = control(MiB)  # every tensor is 2 MiB: nothing ever fits
    for _ in range(KEPT_NOTHING_FORWARDS + 1):  # the first forward only records
        run_forward(ctl, [2 * MiB] * 4)
    with pytest.warns(UserWarning, match="kept nothing in 3 forwards in a row") as info:
        ctl.keep("store", 2 * MiB)
    message = str(info[0].message)
    assert "1.00 MiB" in message and "newest tensor a forward saves (2.00 MiB)" in message
    assert "Raise device_budget (to at least 2.00 MiB)" in message
    ctl.backward_started()
    for _ in range(KEPT_NOTHING_FORWARDS + 1):  # once per pipeline
        run_forward(ctl, [2 * MiB] * 4)


def test_a_zero_budget_keeps_nothing_without_a_warning() -> None:
    ctl = control(0)
    for _ in range(2 * KEPT_NOTHING_FORWARDS):  # pytest turns a warning into an error
        assert run_forward(ctl, [MiB] * 4) == [False] * 4


def test_a_plan_that_keeps_sometimes_does_not_warn() -> None:
    ctl = control(3 * MiB)
    for i in range(4 * KEPT_NOTHING_FORWARDS):
        run_forward(ctl, [4 * MiB] * 3 if i % 3 else [MiB] * 3)


# -------------------------------------------------------------- property tests
sizes_st = st.lists(st.integers(1, 64), min_size=0, max_size=24)
forwards_st = st.lists(sizes_st, min_size=1, max_size=8)


_QUIET = pytest.mark.filterwarnings("ignore:tensorstore-hooks. device_budget kept nothing")


@_QUIET
@settings(max_examples=300, deadline=None)
@given(forwards=forwards_st, budget=st.integers(0, 400))
def test_any_sequence_keeps_one_run_within_budget_ending_at_the_newest_or_a_misfit(
    forwards: list[list[int]], budget: int
) -> None:
    # What rule 5 promises whatever the sizes: the plan is predicted from earlier
    # forwards (rule 6), so a run need not reach the newest tensor (a prediction too
    # low ends it early) nor start where a plan knowing the forward would.
    ctl = control(budget)
    for n, sizes in enumerate(forwards):
        got = run_forward(ctl, sizes)
        if n == 0:
            assert not any(got)  # rule 3: the first forward follows the rules
        kept = kept_bytes(sizes, got)
        assert kept <= budget  # never more than the budget, whatever the prediction
        idx = [i for i, k in enumerate(got) if k]
        if not idx:
            continue
        first, last = idx[0], idx[-1]
        assert idx == list(range(first, last + 1))  # one contiguous run
        # The run ends at the forward's newest tensor, or just before the first one that
        # did not fit beside it (that one and every later one moved).
        assert last == len(sizes) - 1 or kept + sizes[last + 1] > budget


@_QUIET
@settings(max_examples=200, deadline=None)
@given(sizes=sizes_st, budget=st.integers(0, 400), repeats=st.integers(2, 5))
def test_a_steady_sequence_gives_the_plan_of_its_trace(
    sizes: list[int], budget: int, repeats: int
) -> None:
    ctl = control(budget)
    assert run_forward(ctl, sizes) == [False] * len(sizes)  # rule 3
    for _ in range(repeats - 1):
        assert run_forward(ctl, sizes) == newest_tail(sizes, budget)
    assert ctl.replans == 0


@_QUIET
@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(16, 160), min_size=2, max_size=8),
    share=st.floats(0.02, 0.9),
)
def test_scaled_forwards_keep_their_newest_tail(lengths: list[int], share: float) -> None:
    # Forwards that differ only by a sequence length keep a tail of their newest.
    budget = int(sum(block_trace(max(lengths))) * share)
    ctl = control(budget)
    run_forward(ctl, block_trace(lengths[0]))
    for length in lengths[1:]:
        sizes = block_trace(length)
        assert_newest(sizes, run_forward(ctl, sizes), budget, 0.0)
