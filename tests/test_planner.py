"""The device_budget planner on its own: traces in, keep/move decisions out.

See NOTE [ Device budget plan ] in ``tensorstore_hooks/_planner.py``; the rule
numbers below are that note's.
"""

from __future__ import annotations

import pytest

from tensorstore_hooks._planner import BudgetPlanner, plan_keep

MiB = 1 << 20


def run_forward(planner: BudgetPlanner, saves: list[tuple[int, bool]]) -> list[bool]:
    """Pack every (nbytes, counts) in order, then start backward; the keep decisions."""
    out = [planner.decide(n, counts) for n, counts in saves]
    planner.backward_started()
    return out


def test_plan_keep_newest_first_stops_at_first_misfit() -> None:
    # Rule 5: a contiguous tail; 3 MiB does not fit after 4+2, so 1 MiB before it is not kept.
    assert plan_keep([1 * MiB, 3 * MiB, 2 * MiB, 4 * MiB], 7 * MiB) == 2
    assert plan_keep([1, 2, 3], 6) == 3
    assert plan_keep([1, 2, 3], 0) == 0
    assert plan_keep([], 10) == 0


def test_first_forward_follows_the_rules_and_records() -> None:
    p = BudgetPlanner(10 * MiB)
    saves = [(4 * MiB, True), (4 * MiB, True), (4 * MiB, True)]
    assert run_forward(p, saves) == [False, False, False]  # rule 3
    assert p.trace == (4 * MiB, 4 * MiB, 4 * MiB)
    assert p.kept == (4 * MiB, 4 * MiB)
    assert p.forwards == 1 and p.replans == 0


def test_later_forwards_keep_the_newest_within_budget() -> None:
    p = BudgetPlanner(10 * MiB)
    saves = [(4 * MiB, True), (3 * MiB, True), (4 * MiB, True), (5 * MiB, True)]
    run_forward(p, saves)
    # Newest first: 5 fits, 5+4 fits, 5+4+3 does not -> the last two are kept.
    for _ in range(3):
        assert run_forward(p, saves) == [False, False, True, True]
    assert p.replans == 0


def test_tensors_that_do_not_count_are_ignored() -> None:
    # Rule 2: parameters, small tensors and keep rules never spend the budget and
    # never shift the plan's positions.
    p = BudgetPlanner(6 * MiB)
    saves = [(4 * MiB, True), (50 * MiB, False), (4 * MiB, True), (1, False), (2 * MiB, True)]
    assert run_forward(p, saves) == [False] * 5
    assert p.trace == (4 * MiB, 4 * MiB, 2 * MiB)
    assert run_forward(p, saves) == [False, False, True, False, True]


def test_replanned_when_the_sizes_change() -> None:
    p = BudgetPlanner(8 * MiB)
    a = [(4 * MiB, True)] * 4
    run_forward(p, a)
    assert run_forward(p, a) == [False, False, True, True]
    # A different size mid-forward: from there on the rules (move), rule 6.
    b = [(4 * MiB, True), (4 * MiB, True), (1 * MiB, True), (1 * MiB, True), (2 * MiB, True)]
    assert run_forward(p, b) == [False, False, False, False, False]
    assert p.replans == 1
    assert p.trace == tuple(n for n, _ in b)
    # Then the new plan: 2+1+1+4 = 8 fits.
    assert run_forward(p, b) == [False, True, True, True, True]
    assert p.replans == 1


def test_longer_and_shorter_forwards_replan() -> None:
    p = BudgetPlanner(4 * MiB)
    run_forward(p, [(2 * MiB, True)] * 3)
    # Longer: past the trace's end the rules apply (no overspending).
    assert run_forward(p, [(2 * MiB, True)] * 5) == [False, True, True, False, False]
    assert p.replans == 1
    assert run_forward(p, [(2 * MiB, True)] * 5) == [False, False, False, True, True]
    # Shorter: a prefix that matches follows the old plan, then the plan is redone.
    assert run_forward(p, [(2 * MiB, True)] * 2) == [False, False]
    assert p.replans == 2
    assert run_forward(p, [(2 * MiB, True)] * 2) == [True, True]


def test_deterministic() -> None:
    saves = [(n * MiB, n % 3 != 0) for n in (5, 1, 7, 3, 2, 6, 4, 9, 1)]
    runs = []
    for _ in range(2):
        p = BudgetPlanner(12 * MiB)
        runs.append([run_forward(p, saves) for _ in range(3)])
    assert runs[0] == runs[1]


def test_gradient_accumulation_one_forward_per_backward() -> None:
    # Rule 1: forward, backward, forward, backward -> one forward per micro-batch.
    p = BudgetPlanner(4 * MiB)
    micro = [(2 * MiB, True)] * 4
    run_forward(p, micro)
    run_forward(p, micro)
    assert p.forwards == 2 and p.replans == 0
    assert run_forward(p, micro) == [False, False, True, True]


def test_two_forwards_before_one_backward_are_one_forward() -> None:
    p = BudgetPlanner(4 * MiB)
    for n in range(2):
        for _ in range(2):
            p.decide(2 * MiB, True)
        del n
    p.backward_started()
    assert p.trace == (2 * MiB,) * 4 and p.forwards == 1


def test_retain_graph_backward_does_not_start_a_forward() -> None:
    p = BudgetPlanner(4 * MiB)
    run_forward(p, [(2 * MiB, True)] * 3)
    p.backward_started()  # a second backward over the retained graph: unpacks only
    p.backward_started()
    assert p.forwards == 1 and p.replans == 0
    assert run_forward(p, [(2 * MiB, True)] * 3) == [False, True, True]


def test_budget_change_takes_effect_next_forward() -> None:
    p = BudgetPlanner(4 * MiB)
    saves = [(2 * MiB, True)] * 3
    run_forward(p, saves)
    assert p.decide(2 * MiB, True) is False
    p.set_budget(6 * MiB)  # mid-forward: the running forward keeps its plan
    assert p.decide(2 * MiB, True) is True
    assert p.decide(2 * MiB, True) is True
    p.backward_started()
    assert run_forward(p, saves) == [True, True, True]
    p.set_budget(0)
    assert run_forward(p, saves) == [False, False, False]


def test_bad_budget() -> None:
    with pytest.raises(ValueError, match="budget_bytes"):
        BudgetPlanner(-1)
