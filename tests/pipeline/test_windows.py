"""Derived prefetch / max_inflight windows (NOTE [ Windows ] in ``pipeline/_budgets.py``)."""

from __future__ import annotations

from tensorstore_hooks.pipeline._budgets import (
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_PREFETCH,
    derive_windows,
)

MiB = 1 << 20


def test_user_sizes_win() -> None:
    w = derive_windows(
        seen_bytes=2048 * MiB, largest_bytes=64 * MiB, max_inflight=7, prefetch=9,
        device_budget=None,
    )  # fmt: skip
    assert (w.max_inflight, w.prefetch, w.plan_budget) == (7, 9, None)


def test_derived_from_what_a_forward_saves() -> None:
    # One eighth of a forward, at least two of its largest tensors, at most the old sizes.
    w = derive_windows(
        seen_bytes=800 * MiB, largest_bytes=20 * MiB, max_inflight=None, prefetch=None,
        device_budget=None,
    )  # fmt: skip
    assert w.max_inflight == w.prefetch == 100 * MiB
    w = derive_windows(
        seen_bytes=800 * MiB, largest_bytes=80 * MiB, max_inflight=None, prefetch=None,
        device_budget=None,
    )  # fmt: skip
    assert w.max_inflight == w.prefetch == 160 * MiB
    w = derive_windows(
        seen_bytes=64 << 30, largest_bytes=MiB, max_inflight=None, prefetch=None,
        device_budget=None,
    )  # fmt: skip
    assert (w.max_inflight, w.prefetch) == (DEFAULT_MAX_INFLIGHT, DEFAULT_PREFETCH)
    w = derive_windows(
        seen_bytes=0, largest_bytes=0, max_inflight=None, prefetch=None, device_budget=None
    )
    assert (w.max_inflight, w.prefetch) == (0, 0)


def test_windows_count_against_the_device_budget_on_cpu() -> None:
    w = derive_windows(
        seen_bytes=2048 * MiB, largest_bytes=16 * MiB, max_inflight=None, prefetch=None,
        device_budget=400 * MiB,
    )  # fmt: skip
    assert w.max_inflight == w.prefetch == 100 * MiB  # a quarter of the budget each
    assert w.plan_budget == 200 * MiB
    assert w.max_inflight + w.prefetch + w.plan_budget == 400 * MiB
    # Given windows larger than the budget leave the plan nothing.
    w = derive_windows(
        seen_bytes=2048 * MiB, largest_bytes=16 * MiB, max_inflight=300 * MiB,
        prefetch=200 * MiB, device_budget=400 * MiB,
    )  # fmt: skip
    assert w.plan_budget == 0


def test_accelerator_write_behind_lives_in_the_host_budget() -> None:
    w = derive_windows(
        seen_bytes=2048 * MiB, largest_bytes=16 * MiB, max_inflight=None, prefetch=None,
        device_budget=400 * MiB, host_budget=200 * MiB, accelerator=True,
    )  # fmt: skip
    assert w.prefetch == 100 * MiB and w.max_inflight == 50 * MiB
    assert w.plan_budget == 300 * MiB
