"""The one retry layer: classifiers plugged into one loop, one
deadline per logical operation however the layers nest.

The Retrier runs on a fake clock here; the end-to-end checks (a prefetched read
with one deadline, a daemon client that obeys the read's deadline, errors that
cannot heal raised at once) are in ``test_faults_hooks.py``.
"""

from __future__ import annotations

import errno
import threading
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


# ------------------------------------------------------------ NOTE [ Outages ]
def _hung(clock: _FakeClock, attempts: list[float]) -> Any:
    """An attempt at a store that never answers: it takes all the time it is given."""

    def attempt(left_s: float) -> None:
        attempts.append(clock.now)
        clock.now += left_s
        raise TimeoutError("no answer")

    return attempt


def _paced(clock: _FakeClock, deadline_s: float) -> Retrier:
    policy = RetryPolicy(deadline_s=deadline_s, paced_probes=True, min_attempt_s=0.0)
    return Retrier(policy, label="t", sleep=clock.sleep, clock=clock)


def test_a_hung_store_costs_one_deadline_however_many_calls() -> None:
    """Rules 1-2 and 4: once down, calls fail at once (no attempt, no time) until as
    long as the last attempt took has passed; the first success ends the outage."""
    clock = _FakeClock()
    retrier = _paced(clock, 3.0)
    attempts: list[float] = []
    with pytest.raises(RetriesExhausted) as first:
        retrier.call("delete 0", _hung(clock, attempts))
    assert first.value.attempts == 1 and retrier.down and clock.now == 3.0

    # 100 more calls, one after another (a freed graph's deletes): no attempt, no time.
    attempts.clear()
    for i in range(100):
        with pytest.raises(RetriesExhausted) as info:
            retrier.call(f"delete {i + 1}", _hung(clock, attempts))
        assert info.value.attempts == 0
        assert isinstance(info.value.cause, TimeoutError)  # the outage's error, named
        assert info.value.down_since == 0.0
    assert attempts == [] and clock.now == 3.0
    assert retrier.stats.not_attempted == 100

    # As long as the failed attempt took (3 s) later, one call probes: one attempt.
    clock.now = 5.9
    with pytest.raises(RetriesExhausted):
        retrier.call("too early", _hung(clock, attempts))
    clock.now = 6.0
    with pytest.raises(RetriesExhausted) as probe:
        retrier.call("probe", _hung(clock, attempts))
    assert probe.value.attempts == 1 and attempts == [6.0] and clock.now == 9.0
    with pytest.raises(RetriesExhausted) as after:
        retrier.call("right after the probe", _hung(clock, attempts))
    assert after.value.attempts == 0 and attempts == [6.0]

    clock.now = 12.0
    assert retrier.call("back", lambda _left: "ok") == "ok"
    assert not retrier.down
    assert retrier.call("normal again", lambda _left: 1) == 1


def test_instant_failures_are_probed_by_every_call() -> None:
    """Rule 2: failures that take no time (a refused connection) are tried by every
    call, so a store that is back is found by the very next call."""
    clock = _FakeClock()
    retrier = _paced(clock, 1.0)
    attempts = 0

    def refused(_left: float) -> None:
        nonlocal attempts
        attempts += 1
        raise ConnectionRefusedError("refused")

    with pytest.raises(RetriesExhausted):
        retrier.call("x", refused)
    assert retrier.down
    attempts = 0
    for _ in range(3):
        with pytest.raises(RetriesExhausted) as info:
            retrier.call("y", refused)
        assert info.value.attempts == 1
    assert attempts == 3
    assert retrier.call("back", lambda _left: 7) == 7 and not retrier.down


def test_one_probe_at_a_time_and_the_others_wait_for_it() -> None:
    """Rule 3, with real threads: a call that arrives while a probe runs waits for its
    outcome; the probe succeeds, so the waiting call makes its own attempt."""
    retrier = Retrier(
        RetryPolicy(deadline_s=0.5, paced_probes=True, first_backoff_s=0.01), label="t"
    )
    with pytest.raises(RetriesExhausted):
        retrier.call("x", lambda _left: (_ for _ in ()).throw(ConnectionRefusedError()))
    assert retrier.down
    probing, release = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def probe(_left: float) -> str:
        probing.set()
        # The same thread again while its own probe runs: refused, never a deadlock.
        with pytest.raises(RetriesExhausted) as nested:
            retrier.call("nested", lambda _l: "no")
        assert nested.value.attempts == 0
        assert release.wait(5)
        return "back"

    prober = threading.Thread(target=lambda: results.update(probe=retrier.call("p", probe)))
    prober.start()
    assert probing.wait(5)
    waiter = threading.Thread(
        target=lambda: results.update(waiter=retrier.call("w", lambda _l: "mine"))
    )
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()  # waiting for the probe, not failing at once
    release.set()
    prober.join(5)
    waiter.join(5)
    assert results == {"probe": "back", "waiter": "mine"}
    assert not retrier.down


def test_a_call_waiting_for_a_failed_probe_fails_at_once() -> None:
    retrier = Retrier(
        RetryPolicy(deadline_s=0.5, paced_probes=True, first_backoff_s=0.01), label="t"
    )
    probing, release = threading.Event(), threading.Event()

    def hang_then_fail(_left: float) -> None:
        probing.set()
        release.wait(5)
        raise TimeoutError("no answer")

    with pytest.raises(RetriesExhausted):
        retrier.call("x", lambda _left: (_ for _ in ()).throw(TimeoutError()))
    errors: list[RetriesExhausted] = []

    def run(fn: Any) -> None:
        try:
            retrier.call("c", fn)
        except RetriesExhausted as e:
            errors.append(e)

    prober = threading.Thread(target=run, args=(hang_then_fail,))
    prober.start()
    assert probing.wait(5)
    attempted: list[int] = []
    waiter = threading.Thread(target=run, args=(lambda _l: attempted.append(1),))
    waiter.start()
    time.sleep(0.1)
    release.set()
    prober.join(5)
    waiter.join(5)
    assert attempted == []  # the probe failed: the waiting call made no attempt
    assert sorted(e.attempts for e in errors) == [0, 1]


def test_a_call_refused_during_an_outage_is_not_retried_outside() -> None:
    """Rule 5: an enclosing layer (the pipeline's reads) does not retry a call the
    outage refused: the time was already spent."""
    clock = _FakeClock()
    inner = _paced(clock, 2.0)
    with pytest.raises(RetriesExhausted):
        inner.call("x", _hung(clock, []))
    outer = Retrier(
        RetryPolicy(deadline_s=30.0),
        label="outer",
        classify=classify_store_read,
        sleep=clock.sleep,
        clock=clock,
    )
    calls = 0

    def read(_left: float) -> None:
        nonlocal calls
        calls += 1
        try:
            inner.call("read", _hung(clock, []))
        except RetriesExhausted as e:
            raise StoreUnavailableError("down") from e.cause

    before = clock.now
    with pytest.raises(RetriesExhausted):
        outer.call("read key", read)
    assert calls == 1 and clock.now == before and outer.stats.retries == 0


def test_without_paced_probes_every_call_makes_one_attempt() -> None:
    """Without ``paced_probes`` every call makes one attempt while down."""
    clock = _FakeClock()
    retrier = Retrier(RetryPolicy(deadline_s=1.0), label="t", sleep=clock.sleep, clock=clock)
    attempts: list[float] = []
    with pytest.raises(RetriesExhausted):
        retrier.call("x", _hung(clock, attempts))
    attempts.clear()
    for _ in range(3):
        with pytest.raises(RetriesExhausted) as info:
            retrier.call("y", _hung(clock, attempts))
        assert info.value.attempts == 1
    assert len(attempts) == 3
