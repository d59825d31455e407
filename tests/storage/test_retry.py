"""The one retry layer: classifiers plugged into one loop, one
deadline per logical operation however the layers nest.

The Retrier runs on a fake clock here; the end-to-end checks (a prefetched read
with one deadline, a daemon client that obeys the read's deadline, errors that
cannot heal raised at once) are in ``test_faults_hooks.py``.
"""

from __future__ import annotations

import errno
import time
from typing import Any

import pytest

from tensorstore_hooks import (
    IntegrityError,
    KeyNotFoundError,
    QuotaExceededError,
    StoreClosedError,
    StoreUnavailableError,
)
from tensorstore_hooks.storage._retry import (
    Failure,
    Retrier,
    RetriesExhausted,
    RetryPolicy,
    classify_store_read,
)


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.now += s


def _caused(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize(
    ("error", "want"),
    [
        (KeyNotFoundError("k"), Failure.ANSWER),
        (IntegrityError("checksum"), Failure.ANSWER),
        (QuotaExceededError("full"), Failure.ANSWER),
        (StoreClosedError("closed"), Failure.ANSWER),
        (StoreUnavailableError("connection reset"), Failure.TRANSIENT),
        (
            _caused(StoreUnavailableError("read failed"), IsADirectoryError(errno.EISDIR, "dir")),
            Failure.PERMANENT,
        ),
        (
            _caused(StoreUnavailableError("read failed"), OSError(errno.EAGAIN, "again")),
            Failure.TRANSIENT,
        ),
        (ConnectionResetError("reset"), Failure.TRANSIENT),
        (TimeoutError("slow"), Failure.TRANSIENT),
        (FileNotFoundError("gone"), Failure.PERMANENT),
        (OSError("I/O error"), Failure.PERMANENT),
        (RuntimeError("bug"), Failure.PERMANENT),
    ],
    ids=lambda v: v.name if isinstance(v, Failure) else f"{type(v).__name__}",
)
def test_classify_store_read(error: BaseException, want: Failure) -> None:
    assert classify_store_read(error) is want


def test_classifier_is_plugged_in_and_answers_pass_unchanged() -> None:
    clock = _FakeClock()
    seen: list[BaseException] = []

    def only_value_errors_heal(e: BaseException) -> Failure:
        seen.append(e)
        if isinstance(e, ValueError):
            return Failure.TRANSIENT
        return Failure.ANSWER

    retrier = Retrier(
        RetryPolicy(deadline_s=10.0),
        label="t",
        classify=only_value_errors_heal,
        sleep=clock.sleep,
        clock=clock,
    )
    attempts = iter([ValueError("blip"), ValueError("blip"), None])

    def fn(_left: float) -> str:
        err = next(attempts)
        if err is not None:
            raise err
        return "ok"

    assert retrier.call("x", fn) == "ok"
    assert retrier.stats.retries == 2 and len(seen) == 2

    answer = KeyError("the answer")

    def refuse(_left: float) -> None:
        raise answer

    with pytest.raises(KeyError) as info:
        retrier.call("y", refuse)
    assert info.value is answer  # unchanged, not wrapped


def test_last_backoff_is_cut_to_the_deadline() -> None:
    clock = _FakeClock()
    policy = RetryPolicy(deadline_s=3.0, first_backoff_s=0.5, max_backoff_s=2.0)
    retrier = Retrier(policy, label="t", sleep=clock.sleep, clock=clock)

    def busy(_left: float) -> None:
        raise ConnectionResetError("reset")

    with pytest.raises(RetriesExhausted):
        retrier.call("x", busy)
    # Gave up at the deadline, not up to one backoff (2 s) before it.
    assert 3.0 - policy.first_backoff_s <= clock.now <= 3.0


def test_nested_call_gets_the_outer_time_left() -> None:
    """Rule (1): an inner layer's own deadline is cut to what the outer call has left."""
    inner = Retrier(RetryPolicy(deadline_s=60.0, first_backoff_s=0.01), label="inner")
    outer = Retrier(
        RetryPolicy(deadline_s=0.3, first_backoff_s=0.01),
        label="outer",
        classify=lambda e: Failure.TRANSIENT,
    )
    inner_calls = 0

    def inner_attempt(_left: float) -> None:
        raise ConnectionResetError("reset")

    def outer_attempt(_left: float) -> None:
        nonlocal inner_calls
        inner_calls += 1
        inner.call("inner", inner_attempt)

    t0 = time.monotonic()
    with pytest.raises(RetriesExhausted):
        outer.call("outer", outer_attempt)
    elapsed = time.monotonic() - t0
    assert elapsed < 2.0, f"the inner layer kept its own 60 s deadline ({elapsed:.1f}s)"
    # Rule (2): the inner layer gave up, so the outer one did not retry it.
    assert inner_calls == 1
    assert outer.stats.retries == 0
    assert inner.stats.retries > 0


def test_outer_retries_failures_that_no_inner_layer_retried() -> None:
    """An outer layer still retries what failed outside any inner retry loop."""
    clock = _FakeClock()
    retrier = Retrier(
        RetryPolicy(deadline_s=10.0),
        label="outer",
        classify=classify_store_read,
        sleep=clock.sleep,
        clock=clock,
    )
    attempts = 0

    def flaky(_left: float) -> int:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise StoreUnavailableError("blip")
        return attempts

    assert retrier.call("x", flaky) == 3


def test_sequential_calls_each_get_their_own_deadline() -> None:
    """The operation deadline is per call: a finished call leaves nothing behind."""
    retrier = Retrier(RetryPolicy(deadline_s=0.2, first_backoff_s=0.01), label="t")

    def busy(_left: float) -> Any:
        raise ConnectionResetError("reset")

    for _ in range(2):
        with pytest.raises(RetriesExhausted):
            retrier.call("x", busy)
        assert retrier.call("y", lambda _left: 1) == 1  # ends the outage
    # A fresh call outside any operation is not cut short by an earlier one.
    other = Retrier(RetryPolicy(deadline_s=0.3, first_backoff_s=0.01), label="other")
    t0 = time.monotonic()
    with pytest.raises(RetriesExhausted):
        other.call("z", busy)
    assert time.monotonic() - t0 >= 0.2
