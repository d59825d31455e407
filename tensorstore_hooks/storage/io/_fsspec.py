"""Any fsspec filesystem (S3, GCS, ...), batching many objects into one concurrent call.

NOTE [ No stray tasks ]
An attempt on an async filesystem runs as one coroutine on fsspec's event loop,
cut off at the time it has left (``fsspec.asyn.sync(..., timeout=...)``, which
cancels it). fsspec's own batch helpers (``cat`` of many paths, ``rm``) start a
task per object and, when cancelled, leave those tasks running: against a hung
endpoint each then fails on its own after a read timeout, holding a connection
until then, and asyncio prints "Task exception was never retrieved" for it. So
every batch here goes through :func:`_gather_each`: the requests of one attempt
are children of its coroutine, cancelled with it and awaited before the attempt
returns. Deletes on S3 call ``DeleteObjects`` directly (1000 keys a request), so
deleting many objects is one operation with one deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from tensorstore_hooks._codec import as_memoryview
from tensorstore_hooks.errors import ConfigError, StoreClosedError, StoreUnavailableError
from tensorstore_hooks.storage._retry import (
    Failure,
    Retrier,
    RetriesExhausted,
    RetryPolicy,
    RetryStats,
    classify,
    error_chain,
    service_code,
)
from tensorstore_hooks.storage._urls import link_protocols
from tensorstore_hooks.storage.io._base import Buffer, ChunkIO

if TYPE_CHECKING:  # fsspec (untyped) is imported when a store opens, aiobotocore with s3fs
    from aiobotocore.session import AioSession
    from fsspec import AbstractFileSystem

__all__ = ["FsspecIO"]

log = logging.getLogger("tensorstore_hooks")

T = TypeVar("T")


class FsspecIO(ChunkIO):
    """Any fsspec filesystem (``s3://``, ``gs://``, ``simplecache::...``), with retries.

    Batched calls (``write_many``/``read_many``) use fsspec's ``pipe``/``cat`` with
    many paths, which async filesystems such as s3fs run concurrently; a batch read
    that fails for some paths retries only those.

    Every call runs under a :class:`~tensorstore_hooks.storage._retry.RetryPolicy`: transient
    failures (throttling, 5xx, connection resets, timeouts) are retried with jittered
    backoff until ``policy.deadline_s``; on an async filesystem each attempt is also
    cut off at the deadline. Permanent failures (missing bucket, access denied) and
    an expired deadline raise :class:`~tensorstore_hooks.StoreUnavailableError` naming
    the URL, the object and the fix. A missing object is ``FileNotFoundError``, as the
    :class:`ChunkIO` contract says. Counters: :attr:`retry_stats`.
    See NOTE [ One retry layer ] in ``storage/_retry.py``.
    """

    def __init__(
        self,
        fs: AbstractFileSystem,
        root: str,
        url: str,
        *,
        retry: RetryPolicy | None = None,
        owns_fs: bool = False,
    ) -> None:
        from fsspec.asyn import AsyncFileSystem

        super().__init__(url)
        self.fs = fs
        self.root = root.rstrip("/")
        self._retrier = Retrier(retry or RetryPolicy(), label=f"FsspecIO({url})")
        # Blocking calls into an async filesystem go through fsspec.asyn.sync, which
        # can bound one attempt; a filesystem in asynchronous mode cannot be driven here.
        self._async = isinstance(fs, AsyncFileSystem) and not getattr(fs, "asynchronous", False)
        self._owns_fs = owns_fs
        self._closed = False
        # NOTE [ Requests that land late ] in storage/zarr/_store.py
        self._uncertain: set[str] = set()
        self._uncertain_lock = threading.Lock()

    # ------------------------------------------------------------ opening
    @classmethod
    def open_filesystem(
        cls, url: str, storage_options: Mapping[str, object], retry: RetryPolicy
    ) -> tuple[AbstractFileSystem, str, bool]:
        """``fsspec.core.url_to_fs`` with this class's defaults: returns (fs, path, owned).

        For S3 (also inside a chain such as ``simplecache::s3://``), options the user
        did not set are chosen so that this class is the only retry layer: botocore
        makes one attempt, connect/read timeouts fit the deadline, and the filesystem
        is a private instance (``skip_instance_cache``) that :meth:`close` may shut.
        ``owned`` is true when every S3 link of the URL is such a private instance.
        """
        import fsspec

        opts = dict(storage_options)
        links = link_protocols(url)
        owned = any(p in _S3_PROTOCOLS for p in links)
        for proto in links:
            if proto not in _S3_PROTOCOLS:
                continue
            if len(links) == 1:
                target = opts
            else:  # chained URL: fsspec takes each link's options under its protocol
                target = opts[proto] = _options(opts.get(proto), proto)
            config = _options(target.get("config_kwargs"), "config_kwargs")
            config.setdefault("retries", {"total_max_attempts": 1})
            config.setdefault("connect_timeout", min(5.0, retry.deadline_s))
            config.setdefault("read_timeout", min(15.0, max(retry.deadline_s, 1.0)))
            target["config_kwargs"] = config
            target.setdefault("skip_instance_cache", True)
            owned = owned and target["skip_instance_cache"] is True
            if "session" not in target and set(target) <= _s3fs_parameters():
                # Private filesystems, one botocore session: credentials and service
                # models load once per process, not once per store (~0.2 s each).
                target["session"] = _shared_aio_session()
        fs, path = fsspec.core.url_to_fs(url, **opts)
        for inner in _filesystems(fs):
            if _is_s3(inner) and owned:
                # s3fs loops over its own retryable errors 5 times (see NOTE [ One retry layer ]).
                inner.retries = 1
        return fs, path, owned

    # ------------------------------------------------------------ plumbing
    @property
    def retry_stats(self) -> RetryStats:
        """Calls, retries and failures so far (live counters)."""
        return self._retrier.stats

    @property
    def retry_policy(self) -> RetryPolicy:
        return self._retrier.policy

    def _full(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def _attempt(self, method: str, time_left_s: float, *args: object, **kwargs: object) -> object:
        """One call of ``fs.<method>``, bounded by ``time_left_s`` where fsspec allows;
        returns what the (untyped) filesystem returns, for the caller to check."""
        if self._async:
            coro_fn = getattr(self.fs, "_" + method, None)
            if coro_fn is not None:
                from fsspec.asyn import sync

                return sync(self.fs.loop, coro_fn, *args, timeout=time_left_s, **kwargs)
        return getattr(self.fs, method)(*args, **kwargs)

    def _run(self, what: str, fn: Callable[[float], T]) -> T:
        """``fn(time_left_s)`` under the retry policy; failures become StoreUnavailableError."""
        if self._closed:
            raise StoreClosedError(f"FsspecIO({self.url}) is closed")
        try:
            return self._retrier.call(what, fn)
        except RetriesExhausted as e:
            raise self._unavailable(e) from e.cause

    def _call(self, what: str, method: str, *args: object, **kwargs: object) -> object:
        return self._run(what, lambda t: self._attempt(method, t, *args, **kwargs))

    def _note_uncertain(self, paths: Sequence[str]) -> None:
        with self._uncertain_lock:
            self._uncertain.update(paths)

    def _changing(self, paths: Sequence[str], attempt: Callable[[], T]) -> T:
        """One attempt of a request that changes ``paths``: if it fails, the service may
        still apply it later (a timeout while it waits on its storage servers)."""
        try:
            return attempt()
        except FileNotFoundError:
            raise  # a definite answer (nothing there), not an unknown outcome
        except BaseException:
            self._note_uncertain(paths)
            raise

    def take_uncertain(self, paths: Sequence[str]) -> bool:
        with self._uncertain_lock:
            if not self._uncertain:
                return False
            hit = not self._uncertain.isdisjoint(paths)
            self._uncertain.difference_update(paths)
            return hit

    def _unavailable(self, e: RetriesExhausted) -> StoreUnavailableError:
        cause = e.cause
        detail = f"{type(cause).__name__}: {cause}"
        if not str(cause):  # fsspec's timeout says nothing
            silent = " (no answer in time)" if isinstance(cause, TimeoutError) else ""
            detail = f"{type(cause).__name__}{silent}"
        codes = {code for c in error_chain(cause) if (code := service_code(c)) is not None}
        if e.failure is Failure.TRANSIENT:
            if e.down_since is not None and e.attempts == 0:
                how_long = (
                    f"the store has not answered for {time.monotonic() - e.down_since:.1f}s "
                    "and this call was not attempted (calls now and then test whether it "
                    "is back: NOTE [ Outages ])"
                )
            elif e.down_since is not None and e.attempts == 1:
                how_long = f"the store has been failing for {time.monotonic() - e.down_since:.1f}s"
            else:
                how_long = (
                    f"still failing after {e.attempts} attempts over {e.elapsed_s:.1f}s "
                    f"(retry deadline {self.retry_policy.deadline_s:g}s)"
                )
            return StoreUnavailableError(
                f"FsspecIO({self.url}): {e.what} failed: {how_long}; last error {detail}. "
                "The store is unreachable or throttling: check the endpoint and network, "
                "or allow a longer retry_deadline_s."
            )
        if "NoSuchBucket" in codes or (
            isinstance(cause, FileNotFoundError) and "bucket" in str(cause).lower()
        ):
            fix = "the bucket does not exist: create it or fix the URL"
        elif isinstance(cause, PermissionError) or codes & _DENIED_CODES:
            fix = (
                "access denied: check the credentials in storage_options "
                "(key/secret/token, or the environment) and the bucket policy"
            )
        else:
            fix = "the request was refused; check the URL and storage_options"
        return StoreUnavailableError(f"FsspecIO({self.url}): {e.what} failed: {fix} ({detail})")

    @staticmethod
    def _join(parts: Sequence[Buffer]) -> bytes:
        return b"".join(as_memoryview(p).cast("B") for p in parts)

    # ------------------------------------------------------------ ChunkIO
    def write(self, path: str, parts: Sequence[Buffer]) -> None:
        data = self._join(parts)
        full = self._full(path)
        self._run(
            f"writing {path!r}",
            lambda t: self._changing([path], lambda: self._attempt("pipe_file", t, full, data)),
        )

    def write_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        if len(items) <= 1:
            if items:
                self.write(*items[0])
            return
        pending = {self._full(p): self._join(parts) for p, parts in items}
        relative = {self._full(p): p for p, _ in items}

        def attempt(time_left_s: float) -> None:
            # Objects are written concurrently and each one's outcome kept, so a retry
            # re-sends only the failed ones (a batch of 100 under 5% throttling would
            # otherwise almost never succeed as a whole).
            batch = list(pending.items())
            if self._async:
                from fsspec.asyn import sync

                outcomes = self._changing(
                    [relative[p] for p, _ in batch],
                    lambda: sync(self.fs.loop, self._pipe_each, batch, timeout=time_left_s),
                )
            else:
                outcomes = [_outcome(self.fs.pipe_file, p, d) for p, d in batch]
            errors = []
            for (path, _), err in zip(batch, outcomes, strict=True):
                if err is None:
                    del pending[path]
                else:
                    self._note_uncertain([relative[path]])
                    errors.append(err)
            if errors:
                errors.sort(key=lambda err: classify(err) is Failure.TRANSIENT)
                raise errors[0]

        self._run(f"writing {len(items)} objects ({items[0][0]!r}, ...)", attempt)

    async def _pipe_each(self, batch: list[tuple[str, bytes]]) -> list[BaseException | None]:
        results = await _gather_each(
            [functools.partial(self.fs._pipe_file, p, d) for p, d in batch], _BATCH_CONCURRENCY
        )
        return [r if isinstance(r, BaseException) else None for r in results]

    def _each(self, method: str, paths: list[str], time_left_s: float) -> list[object]:
        """``fs.<method>(path)`` for every path within one attempt: each path's result
        or exception, in order. Async filesystems run them concurrently as one
        coroutine whose every request is cancelled with the attempt (NOTE [ No stray
        tasks ]); others call one path after another."""
        if not self._async:
            return [_result(getattr(self.fs, method), p) for p in paths]
        from fsspec.asyn import sync

        calls = [functools.partial(getattr(self.fs, "_" + method), p) for p in paths]
        out = sync(self.fs.loop, _gather_each, calls, _BATCH_CONCURRENCY, timeout=time_left_s)
        if not isinstance(out, list):
            raise TypeError(f"FsspecIO({self.url}): {method} returned {type(out).__name__}")
        return out

    def read(self, path: str) -> bytes:
        return _as_bytes(self._call(f"reading {path!r}", "cat_file", self._full(path)))

    def read_many(self, paths: Sequence[str]) -> list[bytes]:
        if len(paths) <= 1:
            return [self.read(p) for p in paths]
        full = [self._full(p) for p in paths]
        done: dict[str, bytes] = {}

        def attempt(time_left_s: float) -> None:
            todo = [f for f in full if f not in done]
            if self._async:
                got = self._each("cat_file", todo, time_left_s)
            else:  # one call: a wrapped filesystem may batch it itself
                found = self.fs.cat(todo, on_error="return")
                got = [found.get(f) if isinstance(found, dict) else None for f in todo]
            errors: list[BaseException] = []
            for f, v in zip(todo, got, strict=True):
                if v is None:
                    v = FileNotFoundError(f)
                if isinstance(v, BaseException):
                    errors.append(v)
                else:
                    done[f] = _as_bytes(v)
            if errors:
                # A missing object or a permanent error decides; otherwise the
                # transient failures are retried, and only those paths re-read.
                errors.sort(key=lambda err: classify(err) is Failure.TRANSIENT)
                raise errors[0]

        self._run(f"reading {len(full)} objects ({paths[0]!r}, ...)", attempt)
        return [done[f] for f in full]

    def delete(self, paths: Sequence[str]) -> None:
        """Delete ``paths`` (missing ones are fine) in one operation: one deadline for
        all of them, however many (S3: one request per 1000 objects)."""
        if not paths:
            return
        pending = {self._full(p): p for p in paths}

        def attempt(time_left_s: float) -> None:
            batch = list(pending)
            outcomes = self._changing(
                [pending[f] for f in batch], lambda: self._delete_batch(batch, time_left_s)
            )
            errors = []
            for f, err in zip(batch, outcomes, strict=True):
                if err is None or isinstance(err, FileNotFoundError):
                    del pending[f]  # gone, or never there
                else:
                    self._note_uncertain([pending[f]])
                    errors.append(err)
            if errors:
                errors.sort(key=lambda err: classify(err) is Failure.TRANSIENT)
                raise errors[0]

        self._run(f"deleting {len(paths)} objects ({paths[0]!r}, ...)", attempt)

    def _delete_batch(self, batch: list[str], time_left_s: float) -> list[BaseException | None]:
        """One attempt at deleting ``batch``: each object's error, or ``None``."""
        if self._async and _is_s3(self.fs):
            from fsspec.asyn import sync

            out = sync(self.fs.loop, self._bulk_delete, batch, timeout=time_left_s)
            if not isinstance(out, list):
                raise TypeError(f"FsspecIO({self.url}): a delete returned {type(out).__name__}")
            return out
        if not self._async:
            try:  # one call for the batch (a wrapped filesystem may batch it itself)
                self.fs.rm(batch)
                return [None] * len(batch)
            except FileNotFoundError:
                pass  # some were missing: each on its own, below
            except Exception as e:
                return [e] * len(batch)
        done = self._each("rm_file", batch, time_left_s)
        return [r if isinstance(r, BaseException) else None for r in done]

    async def _bulk_delete(self, paths: list[str]) -> list[BaseException | None]:
        """S3 DeleteObjects, 1000 keys a request, a few requests at once; a request's
        failure is each of its objects' (S3 reports none for a missing key)."""
        groups = [paths[i : i + _S3_DELETE_KEYS] for i in range(0, len(paths), _S3_DELETE_KEYS)]
        results = await _gather_each(
            [functools.partial(self.fs._bulk_delete, g) for g in groups], _DELETE_CONCURRENCY
        )
        out: list[BaseException | None] = []
        for group, r in zip(groups, results, strict=True):
            out += [r if isinstance(r, BaseException) else None] * len(group)
        return out

    def exists(self, path: str) -> bool:
        return bool(self._call(f"checking {path or '/'!r}", "exists", self._full(path)))

    def listdir(self, path: str) -> list[str]:
        try:
            entries = self._call(f"listing {path or '/'!r}", "ls", self._full(path), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        if not isinstance(entries, Iterable):
            raise TypeError(f"FsspecIO({self.url}): ls returned {type(entries).__name__}")
        return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def remove_tree(self, path: str) -> None:
        if self._async and _is_s3(self.fs):
            # Listed, then deleted as a batch: s3fs's recursive rm leaves tasks behind
            # when an attempt is cut off (NOTE [ No stray tasks ]).
            root = self._full(path)
            try:
                found = self._call(f"listing {path or '/'!r}", "find", root)
            except FileNotFoundError:
                return
            if not isinstance(found, list):
                raise TypeError(f"FsspecIO({self.url}): find returned {type(found).__name__}")
            prefix = self.root + "/"
            names = [str(f) for f in found]
            self.delete([f[len(prefix) :] if f.startswith(prefix) else f for f in names])
            return
        with contextlib.suppress(FileNotFoundError):
            self._call(f"removing {path or '/'!r}", "rm", self._full(path), recursive=True)

    def close(self) -> None:
        """Close the HTTP sessions of a filesystem this object owns (idempotent).

        Without this, aiohttp connectors are closed only by garbage collection, which
        may come after the event loop is gone (ResourceWarning, 'Unclosed connector').
        """
        if self._closed:
            return
        self._closed = True
        if not self._owns_fs:
            return  # a shared (cached) filesystem may be in use elsewhere
        for fs in _filesystems(self.fs):
            if not _is_s3(fs) or getattr(fs, "_s3", None) is None:
                continue
            from fsspec.asyn import sync

            try:
                sync(fs.loop, _close_s3, fs, timeout=5.0)
            except Exception as e:  # closing must never fail the caller
                log.debug("FsspecIO(%s): closing the S3 session failed: %r", self.url, e)


_S3_PROTOCOLS = frozenset({"s3", "s3a"})
_BATCH_CONCURRENCY = 32  # objects in flight per batch; s3fs's own default is similar
_S3_DELETE_KEYS = 1000  # the most keys one DeleteObjects request may name
_DELETE_CONCURRENCY = 3  # DeleteObjects requests in flight (s3fs's own choice)
_DENIED_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}
)

_AIO_SESSION: tuple[int, AioSession] | None = None
_AIO_SESSION_LOCK = threading.Lock()


def _shared_aio_session() -> AioSession:
    """This process's aiobotocore session for the S3 filesystems made here (new after fork)."""
    global _AIO_SESSION
    with _AIO_SESSION_LOCK:
        if _AIO_SESSION is None or _AIO_SESSION[0] != os.getpid():
            from aiobotocore.session import AioSession

            _AIO_SESSION = (os.getpid(), AioSession())
        return _AIO_SESSION[1]


@functools.cache
def _s3fs_parameters() -> frozenset[str]:
    """Options s3fs consumes itself. Any other option goes to the botocore session s3fs
    would create (``profile``, ...), so a shared session must not replace it then."""
    import inspect

    from s3fs import S3FileSystem

    named = {
        name
        for name, p in inspect.signature(S3FileSystem.__init__).parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name != "self"
    }
    return frozenset(
        named | {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache"}
    )


def _options(value: object, name: str) -> dict[str, object]:
    """A copy of the storage options under ``name`` (absent or empty: empty)."""
    if not value:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"FsspecIO: storage_options[{name!r}] must be a mapping of options, "
            f"got {type(value).__name__} {value!r:.80}"
        )
    return dict(value)


def _as_bytes(data: object) -> bytes:
    """What a filesystem read returned, as ``bytes`` (no copy when it is ``bytes``)."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, bytearray | memoryview):
        return bytes(data)
    raise TypeError(f"FsspecIO: a read returned {type(data).__name__}, not bytes")


def _outcome(fn: Callable[..., object], *args: object) -> BaseException | None:
    try:
        fn(*args)
    except Exception as e:
        return e
    return None


def _result(fn: Callable[..., object], *args: object) -> object:
    """``fn(*args)``, or the exception it raised."""
    try:
        return fn(*args)
    except Exception as e:
        return e


async def _gather_each(
    calls: Sequence[Callable[[], Awaitable[object]]], concurrency: int
) -> list[object]:
    """Await every call, at most ``concurrency`` at once: each one's result or exception,
    in order (NOTE [ No stray tasks ]).

    Cancelled (the attempt's timeout), it cancels every request still running and
    returns only once they have ended, their outcomes retrieved: no task outlives
    the attempt, and none leaves a "Task exception was never retrieved" behind."""
    limit = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[object]]) -> object:
        async with limit:
            return await call()

    # gather(return_exceptions=True) retrieves every outcome and, when it is itself
    # cancelled, cancels what is still running.
    results = await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            raise r  # cancellation (the attempt's timeout) and the like
    return results


def _filesystems(fs: AbstractFileSystem) -> list[AbstractFileSystem]:
    """``fs`` and the filesystems it wraps (``simplecache::s3://`` has ``.fs``)."""
    out = [fs]
    inner = getattr(fs, "__dict__", {}).get("fs")
    while inner is not None and all(inner is not f for f in out) and len(out) < 4:
        out.append(inner)
        inner = getattr(inner, "__dict__", {}).get("fs")
    return out


def _is_s3(fs: AbstractFileSystem) -> bool:
    protocol = getattr(type(fs), "protocol", None)
    names = protocol if isinstance(protocol, tuple | list) else (protocol,)
    return any(n in _S3_PROTOCOLS for n in names)


async def _close_s3(fs: AbstractFileSystem) -> None:
    # s3fs keeps the client's async context manager in _s3creator; leaving it closes
    # the aiohttp session. Its own finalizer does the same at garbage collection,
    # and leaving twice is harmless.
    creator = getattr(fs, "_s3creator", None)
    fs._s3 = None
    if creator is not None:
        await creator.__aexit__(None, None, None)
