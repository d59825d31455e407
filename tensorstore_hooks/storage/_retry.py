"""Retrying object-store calls: which failures are transient, and for how long to retry.

Object stores fail in two ways that need opposite handling. Throttling (S3
``SlowDown``, HTTP 429/503), server errors (5xx), connection resets and timeouts go
away on their own: retry them with jittered exponential backoff until a deadline.
A missing bucket, denied access or bad credentials never go away: fail at once, so
a misconfigured job stops in seconds instead of hanging. A missing *object* is
neither; it is an answer, passed to the caller unchanged as ``FileNotFoundError``.

:func:`classify` decides from the exception and its ``__cause__``/``__context__``
chain (s3fs translates botocore's ``ClientError`` into builtin ``OSError`` subclasses
and keeps the original as the cause). :class:`Retrier` runs a call under a
:class:`RetryPolicy` and counts what happened (:class:`RetryStats`).

NOTE [ One retry layer ]
Every retry loop of the library is :meth:`Retrier.call`; each layer plugs in only a
*classifier* that says which of its failures heal by themselves:

* :func:`classify`: object stores under fsspec (service codes, HTTP status, errno);
* ``DaemonStore``'s connection classifier: a lost connection heals (reconnect and
  resume), an answer of the daemon is final;
* :func:`classify_store_read`: what ``store.get`` raised to the offload pipeline.

Layers nest (the pipeline reads from a ``DaemonStore`` whose calls retry; a
``ZarrStore`` reads through ``FsspecIO`` whose calls retry), so two rules keep one
deadline per logical operation: (1) a call made inside another's attempt (on the
same thread) gets at most the outer call's time left, and (2) once an inner call has
given up, the outer one does not retry: the inner layer already spent the time.

s3fs retries some errors itself (5 tries) and botocore retries again under it (5
attempts, up to about 15 s of backoff per call), so a dead endpoint would take
minutes to report and a deadline could not hold. :class:`~tensorstore_hooks.storage.io.FsspecIO`
therefore turns the inner layers down to a single attempt (unless the user set them),
with every attempt of an async filesystem also bounded by the time left
(``fsspec.asyn.sync(..., timeout=...)``).

NOTE [ Outages ]
A store that accepts connections and never answers costs a whole attempt per call:
deleting the keys of a freed graph one by one, or a step's reads, would wait one
read timeout per object. So an outage costs one deadline, whatever the number of
calls or objects (with ``RetryPolicy.paced_probes``):

1. A call that spends its whole deadline on transient failures declares the store
   *down* (logged once at WARNING).
2. While it is down, calls are *probes*, paced: a call makes a single attempt only
   if the time since the last failed attempt ended is at least what that attempt
   took; any other call fails at once, with no attempt (``RetriesExhausted`` with
   ``attempts == 0`` and the outage's last error). So probing takes at most half
   of the time: a hung endpoint (attempts that last the whole deadline) is tried
   about once per deadline, while one whose failures take less than the first
   backoff (a refused connection, a 503) is still tried by every call, and a store
   that is back is found by the next call.
3. One probe at a time: a call that arrives while another thread's probe is running
   waits for its outcome (within its own deadline), then makes its attempt if the
   store is back, or fails at once if not.
4. The first call that succeeds ends the outage (logged at WARNING).
5. A call that failed at once counts as one whose inner layer gave up (rule (2) of
   NOTE [ One retry layer ]): the outage already spent the time, so an enclosing
   call does not retry it either.

Without ``paced_probes`` every call makes one attempt while the store is down.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import functools
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tensorstore_hooks.errors import (
    ConfigError,
    IntegrityError,
    KeyNotFoundError,
    QuotaExceededError,
    StoreClosedError,
    StoreUnavailableError,
    TensorStoreError,
    UnsupportedTensorError,
)

__all__ = [
    "Classifier",
    "Failure",
    "RetryPolicy",
    "RetryStats",
    "Retrier",
    "RetriesExhausted",
    "classify",
    "classify_store_read",
    "error_chain",
    "service_code",
]

log = logging.getLogger("tensorstore_hooks.retry")

T = TypeVar("T")


class Failure(enum.Enum):
    """How a failed object-store call should be handled."""

    TRANSIENT = "transient"
    """Throttling, 5xx, connection reset/refused, timeout: retry until the deadline."""
    PERMANENT = "permanent"
    """Missing bucket, access denied, bad request, anything unrecognised: fail now."""
    NOT_FOUND = "not_found"
    """The object does not exist: an answer, not a failure (``FileNotFoundError``)."""
    ANSWER = "answer"
    """The call's own answer (a missing key, a checksum mismatch, a refused request):
    raised to the caller unchanged, never retried, and proof that the store is up."""


Classifier = Callable[[BaseException], Failure]
"""A layer's verdict on one failure of its calls (see NOTE [ One retry layer ])."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long and how often to retry transient failures of one operation."""

    deadline_s: float = 30.0
    """Wall time one operation may spend, retries included; then it fails."""
    first_backoff_s: float = 0.05
    """Backoff before the first retry; doubles each retry (with jitter)."""
    max_backoff_s: float = 2.0
    """Cap on one backoff."""
    min_attempt_s: float = 1.0
    """The least time an attempt gets even when the deadline is nearer (async filesystems)."""
    paced_probes: bool = False
    """While the store is down, pace the calls' attempts so that an outage costs one
    deadline (NOTE [ Outages ]); ``False``: every call makes one attempt."""

    def __post_init__(self) -> None:
        if not self.deadline_s > 0:
            raise ValueError(f"RetryPolicy.deadline_s must be > 0, got {self.deadline_s!r}")


@dataclass(slots=True)
class RetryStats:
    """Counters of one :class:`Retrier` (read them any time; updated under a lock)."""

    calls: int = 0
    """Operations started."""
    retries: int = 0
    """Attempts repeated after a transient failure."""
    gave_up: int = 0
    """Operations that failed: a permanent error, the deadline passed, or the store was
    down (NOTE [ Outages ])."""
    not_attempted: int = 0
    """Of those, the operations that failed at once because the store was down."""
    last_error: str = ""
    """``repr`` of the latest transient error (for messages and logs)."""


class RetriesExhausted(Exception):
    """Internal: an operation failed for good. ``cause`` is the last error."""

    def __init__(
        self,
        what: str,
        cause: BaseException,
        failure: Failure,
        attempts: int,
        elapsed_s: float,
        *,
        down_since: float | None = None,
    ) -> None:
        super().__init__(what)
        self.what = what
        self.cause = cause
        self.failure = failure
        self.attempts = attempts
        self.elapsed_s = elapsed_s
        self.down_since = down_since
        """Clock time the outage began, if the store is down (see :class:`Retrier`)."""


# --------------------------------------------------------------------- classify
# Error codes of S3-compatible services (botocore ClientError) that clear up by themselves.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "ProvisionedThroughputExceededException",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "OperationAborted",
    }
)
_PERMANENT_CODES = frozenset(
    {
        "NoSuchBucket",
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "InvalidBucketName",
        "NotSignedUp",
    }
)
# errno values that s3fs/aiohttp/the OS use for "try again": EBUSY is how s3fs reports
# SlowDown/ServiceUnavailable/503, EREMOTEIO its InternalError/500.
_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EBUSY",
        "EAGAIN",
        "EREMOTEIO",
        "ETIMEDOUT",
        "ECONNRESET",
        "ECONNREFUSED",
        "ECONNABORTED",
        "EPIPE",
        "ENETDOWN",
        "ENETUNREACH",
        "ENETRESET",
        "EHOSTUNREACH",
        "EHOSTDOWN",
    )
    if hasattr(errno, name)
)
_TRANSIENT_STATUS = frozenset({408, 429})


@functools.lru_cache(maxsize=1)
def _transient_types() -> tuple[type[BaseException], ...]:
    """Exception classes of the HTTP stacks under fsspec that mean 'the wire failed'.

    Imported lazily: none of these packages is a dependency of the library.
    """
    types: list[type[BaseException]] = [ConnectionError, TimeoutError, asyncio.TimeoutError]
    try:
        from fsspec.exceptions import FSTimeoutError

        types.append(FSTimeoutError)
    except ImportError:  # pragma: no cover - fsspec is a dependency
        pass
    try:
        from botocore import exceptions as bce

        types += [
            bce.ConnectionError,  # EndpointConnectionError, ConnectionClosedError, timeouts
            bce.HTTPClientError,
            bce.IncompleteReadError,
            bce.ResponseStreamingError,
        ]
    except (ImportError, AttributeError):
        pass
    try:
        import aiohttp

        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    except ImportError:
        pass
    try:
        from http.client import IncompleteRead, RemoteDisconnected

        types += [IncompleteRead, RemoteDisconnected]
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


def error_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` followed by its causes (``__cause__``, else ``__context__``), at most 8."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(out) < 8 and all(cur is not e for e in out):
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def service_code(exc: BaseException) -> str | None:
    """The service's error code (``"SlowDown"``, ``"NoSuchBucket"``) of a botocore error."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error")
        if isinstance(err, dict) and err.get("Code") is not None:
            return str(err["Code"])
    return None


def _http_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        meta = response.get("ResponseMetadata")
        if isinstance(meta, dict) and isinstance(meta.get("HTTPStatusCode"), int):
            return int(meta["HTTPStatusCode"])
    for attr in ("status", "status_code", "code"):  # aiohttp, requests, gcsfs HttpError
        value = getattr(exc, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def classify(exc: BaseException) -> Failure:
    """Decide whether ``exc`` from an object-store call is worth retrying.

    Looks at the exception and its causes: service error codes (``SlowDown``,
    ``NoSuchBucket``, ...), HTTP status (5xx/408/429 transient, other 4xx permanent),
    connection and timeout errors of the OS, aiohttp and botocore, and the ``errno``
    s3fs attaches. ``FileNotFoundError`` is ``NOT_FOUND`` unless the *bucket* is what
    is missing. Anything unrecognised is ``PERMANENT``: a programming error must not
    be retried for a minute.
    """
    chain = error_chain(exc)
    for e in chain:
        code = service_code(e)
        if code in _PERMANENT_CODES:
            return Failure.PERMANENT
        if code in _TRANSIENT_CODES:
            return Failure.TRANSIENT
    if isinstance(exc, FileNotFoundError):
        return Failure.NOT_FOUND
    if isinstance(exc, PermissionError):
        return Failure.PERMANENT
    transient_types = _transient_types()
    for e in chain:
        status = _http_status(e)
        if status is not None:
            if status >= 500 or status in _TRANSIENT_STATUS:
                return Failure.TRANSIENT
            if status >= 400:
                return Failure.PERMANENT
        if isinstance(e, transient_types):
            return Failure.TRANSIENT
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return Failure.TRANSIENT
    return Failure.PERMANENT


_FINAL_STORE_ERRORS = (
    KeyNotFoundError,
    IntegrityError,
    UnsupportedTensorError,
    ConfigError,
    QuotaExceededError,
    StoreClosedError,
)


def classify_store_read(exc: BaseException) -> Failure:
    """Decide whether a failed ``store.get`` of the offload pipeline is worth retrying.

    The store's own answers are final (:data:`Failure.ANSWER`): a missing key, a
    checksum mismatch, an unsupported tensor, a closed store. A
    :class:`~tensorstore_hooks.StoreUnavailableError` heals unless an OS error under
    it says otherwise (``EISDIR``: a chunk that is a directory never becomes a file;
    ``EACCES``, ``ENOSPC``, ...); without such a cause (a user store that says it is
    unreachable) it is retried. Other exceptions go through :func:`classify`
    (connection and timeout errors heal; anything unrecognised does not).
    """
    if isinstance(exc, _FINAL_STORE_ERRORS):
        return Failure.ANSWER
    if isinstance(exc, StoreUnavailableError):
        for e in error_chain(exc)[1:]:
            if isinstance(e, OSError) and not isinstance(e, TensorStoreError) and e.errno:
                return classify(e)
        return Failure.TRANSIENT
    if isinstance(exc, TensorStoreError):
        return Failure.PERMANENT
    failure = classify(exc)
    return Failure.PERMANENT if failure is Failure.NOT_FOUND else failure


class _Operation:
    """The deadline of the logical operation running on this thread.

    See NOTE [ One retry layer ].
    """

    __slots__ = ("deadline", "inner_gave_up")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        """``time.monotonic()`` value after which nothing inside may retry."""
        self.inner_gave_up = False
        """Set by a nested call that gave up: this operation must not retry it."""


class _Current(threading.local):
    op: _Operation | None = None


_current = _Current()


# ---------------------------------------------------------------------- retrier
class Retrier:
    """Runs callables under a :class:`RetryPolicy`; thread-safe; counts in ``stats``.

    ``call(what, fn)`` calls ``fn(time_left_s)`` until it returns, retrying the
    failures that ``classify`` (the layer's classifier, default :func:`classify`)
    calls transient, with jittered exponential backoff ("equal jitter": half fixed,
    half random, so many ranks throttled at once spread out). ``fn`` receives the
    seconds left before the deadline so it can bound its own attempt. Raises
    :class:`RetriesExhausted` (permanent failure or deadline passed) or, unchanged,
    what the classifier calls an answer (``NOT_FOUND``, ``ANSWER``).

    The deadline is the policy's, shortened to what an enclosing call on the same
    thread has left; a call whose nested call gave up does not retry (see
    NOTE [ One retry layer ]).

    Once a call has exhausted its deadline on transient errors the store counts as
    *down* until a call succeeds: later calls make a single attempt each, paced with
    ``policy.paced_probes`` so that a dead or hung endpoint costs one deadline, not
    one per call or object, and writers fall back to memory quickly (NOTE
    [ Outages ]). Outages are logged at WARNING, retries at INFO.
    """

    def __init__(
        self,
        policy: RetryPolicy,
        *,
        label: str,
        classify: Classifier = classify,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.label = label
        self.stats = RetryStats()
        self._classify = classify
        self._lock = threading.Lock()
        self._probe_done = threading.Condition(self._lock)
        self._sleep = sleep
        self._clock = clock
        self._rng = random.Random()
        self._down_since: float | None = None
        self._last_error: BaseException | None = None  # the outage's latest failure
        self._prober: int | None = None  # the thread whose probe is running (rule 3)
        self._next_probe = 0.0  # clock time from which the next probe may start (rule 2)

    @property
    def down(self) -> bool:
        """True during an outage (a call ran out of time on transient errors)."""
        return self._down_since is not None

    def call(self, what: str, fn: Callable[[float], T]) -> T:
        policy = self.policy
        start = self._clock()
        outer = _current.op
        budget_s = policy.deadline_s
        if outer is not None:  # rule (1) of NOTE [ One retry layer ]
            budget_s = min(budget_s, outer.deadline - time.monotonic())
        deadline = start + budget_s
        op = _Operation(time.monotonic() + budget_s)
        down_since, probe = self._admit(what, outer, deadline)
        attempt = 0
        _current.op = op
        try:
            while True:
                attempt += 1
                op.inner_gave_up = False
                attempt_start = self._clock()
                try:
                    result = fn(max(deadline - attempt_start, policy.min_attempt_s))
                except Exception as e:
                    attempt_s = self._clock() - attempt_start
                    failure = self._classify(e)
                    if failure in (Failure.NOT_FOUND, Failure.ANSWER):
                        self._up()
                        raise
                    backoff = self._backoff_or_give_up(
                        what, e, failure, attempt, start, deadline, down_since, op
                    )
                    if backoff is None:
                        self._pace(attempt_s)
                        if outer is not None:
                            outer.inner_gave_up = True  # rule (2)
                        raise RetriesExhausted(
                            what,
                            e,
                            failure,
                            attempt,
                            self._clock() - start,
                            down_since=self._down_since if down_since is None else down_since,
                        ) from e
                else:
                    self._up()
                    return result
                self._sleep(backoff)
        finally:
            _current.op = outer
            if probe:
                with self._probe_done:
                    self._prober = None
                    self._probe_done.notify_all()

    def _admit(
        self, what: str, outer: _Operation | None, deadline: float
    ) -> tuple[float | None, bool]:
        """Count the call; returns (when the outage began, whether this call is a probe),
        or raises at once when the store is down and no probe is due (NOTE [ Outages ])."""
        me = threading.get_ident()
        with self._probe_done:
            self.stats.calls += 1
            while True:
                down_since = self._down_since
                if down_since is None or not self.policy.paced_probes:
                    return down_since, False
                if self._prober is None:
                    if self._clock() >= self._next_probe:  # rule 2
                        self._prober = me
                        return down_since, True
                    break
                left = deadline - self._clock()
                if self._prober == me or left <= 0:
                    break
                self._probe_done.wait(left)  # rule 3: the running probe's outcome
            self.stats.gave_up += 1
            self.stats.not_attempted += 1
            cause = self._last_error
        if outer is not None:
            outer.inner_gave_up = True  # rule 5: the outage spent the time
        if cause is None:  # pragma: no cover - an outage always has its error
            cause = TimeoutError("the store is down")
        log.debug("%s: %s not attempted: the store is down", self.label, what)
        raise RetriesExhausted(what, cause, Failure.TRANSIENT, 0, 0.0, down_since=down_since)

    def _pace(self, attempt_s: float) -> None:
        """After a call's last failed attempt (of ``attempt_s`` seconds): during an
        outage, the next probe waits as long, unless that was shorter than the first
        backoff (NOTE [ Outages ] rule 2)."""
        with self._lock:
            if self._down_since is not None:
                slow = attempt_s >= self.policy.first_backoff_s
                self._next_probe = self._clock() + attempt_s if slow else 0.0

    def _backoff_or_give_up(
        self,
        what: str,
        e: Exception,
        failure: Failure,
        attempt: int,
        start: float,
        deadline: float,
        down_since: float | None,
        op: _Operation,
    ) -> float | None:
        """The sleep before the next attempt, or None to give up (counted, logged)."""
        policy = self.policy
        now = self._clock()
        backoff = min(policy.max_backoff_s, policy.first_backoff_s * 2 ** (attempt - 1))
        went_down = False
        with self._lock:
            backoff *= 0.5 + 0.5 * self._rng.random()
            # The last backoff is cut to the time left: a call fails at its deadline,
            # not up to one backoff before it.
            retry = (
                failure is Failure.TRANSIENT
                and not op.inner_gave_up
                and down_since is None
                and deadline - now >= policy.first_backoff_s
            )
            backoff = min(backoff, max(deadline - now, 0.0))
            if retry:
                self.stats.retries += 1
                self.stats.last_error = repr(e)
            else:
                self.stats.gave_up += 1
                if failure is Failure.TRANSIENT:
                    self._last_error = e
                went_down = (
                    failure is Failure.TRANSIENT
                    and not op.inner_gave_up
                    and self._down_since is None
                )
                if went_down:
                    # The outage began when this call's first attempt failed.
                    self._down_since = start
        if went_down:
            how = (
                "calls make one attempt each"
                if not policy.paced_probes
                else "calls fail at once but a probe now and then (NOTE [ Outages ])"
            )
            log.warning(
                "%s: %s failed for %.1fs (%s: %s); treating the store as down: %s until one "
                "succeeds",
                self.label,
                what,
                now - start,
                type(e).__name__,
                e,
                how,
            )
        if not retry:
            return None
        log.info(
            "%s: %s failed (%s: %s); retry %d in %.2fs",
            self.label,
            what,
            type(e).__name__,
            e,
            attempt,
            backoff,
        )
        return backoff

    def _up(self) -> None:
        if self._down_since is None:
            return
        with self._lock:
            since, self._down_since = self._down_since, None
            self._last_error = None
        if since is not None:
            log.warning(
                "%s: the store answers again after %.1fs", self.label, self._clock() - since
            )
