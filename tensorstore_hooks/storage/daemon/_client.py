"""DaemonStore: the client of the storage daemon (``tsh://HOST:PORT``, ``tsh+unix:///path``).

The daemon itself lives in ``tensorstore_hooks.server`` and is never imported here;
both sides share only :mod:`tensorstore_hooks.protocol`.

NOTE [ Reconnect and resume ]
A connection that fails (reset, EOF, the daemon restarting) is dropped with every
idle pooled connection (they are most likely dead too), and the request is retried
on a fresh connection with jittered exponential backoff until ``reconnect_deadline_s``
has passed, after which :class:`StoreUnavailableError` names the URL. A fresh
connection resumes the session (HELLO with the session id; the token is checked
again), so keys written before are reachable if the daemon still has them: a
restarted daemon with a disk tier keeps every tensor that had reached disk, but
tensors held only in its RAM are gone (reads raise KeyNotFoundError). If the session
itself is gone (its lease expired), a new one is opened and a warning logged.

A PUT retried after a lost answer may leave the first copy behind in the session;
it is freed with the session (``close()`` or the lease).
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
import stat
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator

import numpy as np

from tensorstore_hooks._codec import Buffer, TensorMeta, as_memoryview
from tensorstore_hooks._units import format_bytes
from tensorstore_hooks.errors import (
    ConfigError,
    IntegrityError,
    KeyNotFoundError,
    QuotaExceededError,
    StoreUnavailableError,
    TensorStoreError,
)
from tensorstore_hooks.protocol import (
    MAX_KEYS_PER_REQUEST,
    Bye,
    Delete,
    ErrorCode,
    Get,
    Header,
    ListKeys,
    Msgpack,
    Ping,
    ProtocolError,
    Put,
    Request,
    Stats,
    is_valid_key,
    unpack_body,
)
from tensorstore_hooks.runtime import foreign
from tensorstore_hooks.storage._retry import Failure, Retrier, RetriesExhausted, RetryPolicy
from tensorstore_hooks.storage._store import BlobStore
from tensorstore_hooks.storage.daemon._conn import (
    Connection,
    ConnectionPool,
    DaemonAddress,
    Lost,
    TlsOptions,
    hello_request,
    parse_daemon_url,
)
from tensorstore_hooks.storage.daemon._session import DaemonSession

__all__ = ["DaemonAddress", "DaemonStore", "fetch_stats", "parse_daemon_url"]

log = logging.getLogger("tensorstore_hooks.daemon_client")

_Lost = Lost  # the retry loop in DaemonStore._call catches this


def _classify_connection(exc: BaseException) -> Failure:
    """The daemon client's classifier (NOTE [ One retry layer ] in ``storage/_retry.py``).

    A lost connection heals (reconnect and resume the session); anything else is
    the daemon's answer or a refusal no retry can change, raised unchanged.
    """
    return Failure.TRANSIENT if isinstance(exc, _Lost) else Failure.ANSWER


def read_token_file(path: str | os.PathLike[str], who: str) -> str:
    """A token file's contents, stripped; warns if other users may read it."""
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            token = f.read().strip()
    except OSError as e:
        raise ConfigError(f"{who}: cannot read token_file {os.fspath(path)!r}: {e}") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        warnings.warn(
            f"{who}: token file {os.fspath(path)!r} is readable by other users (mode "
            f"{stat.S_IMODE(mode):o}): chmod 600 it",
            stacklevel=3,
        )
    if not token:
        raise ConfigError(f"{who}: token_file {os.fspath(path)!r} is empty")
    return token


def env_token() -> str | None:
    """``TSH_TOKEN``, surrounding whitespace (a trailing newline from a file) stripped."""
    return os.environ.get("TSH_TOKEN", "").strip() or None


def _keepalive(
    ref: weakref.ReferenceType[DaemonStore], stop: threading.Event, every_s: float
) -> None:
    # Holds only a weak reference, so a store its owner forgot to close can still be
    # garbage collected (its finalizer then stops this thread).
    while not stop.wait(every_s):
        store = ref()
        if store is None:
            return
        try:
            store._ping_if_idle(every_s)
        except Exception as e:  # the next real request reports problems
            log.debug("keepalive ping to %s failed: %s", store.url, e)
        del store



def _tls_context(
    addr: DaemonAddress, who: str, given: dict[str, str | os.PathLike[str] | None]
) -> ssl.SSLContext | None:
    """The TLS context for ``addr`` from the ``tls_*`` options (``None``: no TLS);
    a ``tls_*`` option given for a URL without TLS is a :class:`ConfigError`."""
    if addr.tls:
        paths = (os.fspath(v) if v is not None else None for v in given.values())
        return TlsOptions(*paths).context(addr.url)
    if any(v is not None for v in given.values()):
        raise ConfigError(
            f"{who}: {', '.join(k for k, v in given.items() if v is not None)} "
            "apply only to tsh+tls:// URLs; use tsh+tls://HOST:PORT for a TLS daemon"
        )
    return None

class DaemonStore(BlobStore):
    """A :class:`TensorStore` kept by a ``tensorstore-hooks serve`` daemon.

    ``url``: ``tsh://HOST:PORT``, ``tsh+tls://HOST:PORT`` or ``tsh+unix:///path.sock``.
    ``token``: the daemon's token; else the contents of ``token_file`` (a warning if
    other users may read it); else the ``TSH_TOKEN`` environment variable (stripped).

    * Opening connects once and says HELLO (``check=False`` skips that): an
      unreachable daemon or a refused token raises :class:`StoreUnavailableError`
      naming the URL here, not at the first write.
    * TLS (``tsh+tls://``): ``tls_ca`` is the CA bundle that signed the daemon's
      certificate (default: the system's); the certificate and host name are always
      verified. ``tls_cert``/``tls_key``: this client's certificate, for a daemon
      that requires one (``--tls-client-ca``).
    * Unix socket: before sending the token, the client checks that the process
      listening is its own user's or root's (``SO_PEERCRED``); ``peer_uid`` names
      another uid to trust instead.

    * Thread-safe: up to ``connections`` sockets, each used by one thread at a time.
    * ``put`` raises :class:`QuotaExceededError` when the daemon's RAM and disk tiers
      are full (the offload hooks then keep the tensor: a fallback).
    * The daemon drops a session that stays silent for its lease; a background
      thread pings while the store is idle. ``close()`` ends the session and frees
      its tensors on the daemon at once.
    * Transport failures are retried, see NOTE [ Reconnect and resume ]; past
      ``reconnect_deadline_s`` they raise :class:`StoreUnavailableError`.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        connections: int = 4,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 120.0,
        reconnect_deadline_s: float = 30.0,
        keepalive: bool = True,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        peer_uid: int | None = None,
        check: bool = True,
    ) -> None:
        self._addr = parse_daemon_url(url)
        who = f"DaemonStore({self._addr.url})"
        if token is None and token_file is not None:
            token = read_token_file(token_file, who)
        if token is None:
            token = env_token()
        if connections < 1:
            raise ConfigError(f"DaemonStore: connections must be >= 1, got {connections}")
        self._tls = _tls_context(
            self._addr, who, {"tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key}
        )
        self._sess = DaemonSession(
            self._addr,
            token,
            tls=self._tls,
            client_cert=self._tls is not None and tls_cert is not None,
            peer_uid=peer_uid,
            connect_timeout_s=connect_timeout_s,
            io_timeout_s=io_timeout_s,
            on_open=self._start_keepalive,
        )
        self._connect = self._sess.connect
        self._reconnect_deadline_s = reconnect_deadline_s
        self._keepalive_enabled = keepalive
        self._pool = ConnectionPool(connections)
        self._last_activity = time.monotonic()
        self._keepalive_thread: threading.Thread | None = None
        self._pid = os.getpid()  # NOTE [ Fork safety ]: only this process ends the session
        self._finalizer = weakref.finalize(self, _finish, self._pool, self._pid)
        if check:
            self._check_reachable()

    # -------------------------------------------------------------- plumbing
    @property
    def url(self) -> str:
        return self._addr.url

    def __enter__(self) -> DaemonStore:
        return self

    @property
    def session_id(self) -> str | None:
        """The daemon session (a secret: with the token it grants access to the keys)."""
        return self._sess.id

    @property
    def sessions_lost(self) -> int:
        """How many times the daemon had forgotten this store's session (keys lost)."""
        return self._sess.lost

    def _fail(self, msg: str) -> str:
        return f"DaemonStore({self.url}): {msg}"

    def _check_reachable(self) -> None:
        # A wrong URL or token fails at open, not 30 s into backward.
        try:
            conn = self._acquire()
        except Lost as e:
            self._pool.close_all()
            self._finalizer.detach()
            hint = (
                "try again when it has room"
                if "BUSY" in str(e)
                else "is `tensorstore-hooks serve` running there, and is this its URL?"
            )
            raise StoreUnavailableError(self._fail(f"cannot reach the daemon: {e}; {hint}")) from e
        except BaseException:
            self._pool.close_all()
            self._finalizer.detach()
            raise
        self._release(conn)

    def _start_keepalive(self) -> None:
        # Called by DaemonSession.connect with its lock held: one thread per store.
        if not self._keepalive_enabled or self._keepalive_thread is not None:
            return
        every = max(0.05, self._sess.lease_s / 3)
        t = threading.Thread(
            target=_keepalive,
            args=(weakref.ref(self), self._pool.stop, every),
            name="tsh-keepalive",
            daemon=True,
        )
        self._keepalive_thread = t
        t.start()

    def _acquire(self) -> Connection:
        if self._pool.forked:
            self._keepalive_thread = None  # the parent's thread did not follow the fork
        return self._pool.acquire(self._connect, self._fail("the store is closed; open a new one"))

    def _release(self, conn: Connection) -> None:
        self._pool.release(conn)

    def _drop_idle(self) -> None:
        self._pool.drop_idle()

    def _call(
        self,
        req: Request,
        payload: Buffer | None = None,
        *,
        retry: bool = True,
        sent: list[bool] | None = None,
    ) -> tuple[Header, np.ndarray | None]:
        """One request with reconnect/retry; daemon error codes become library errors.

        Retried by the library's one retry loop (NOTE [ One retry layer ] in
        ``storage/_retry.py``) with :func:`_classify_connection`: only a lost connection heals.
        ``sent``, if given, gets one item per attempt that sent the request (more than
        one: an earlier attempt may have been carried out, its answer lost).
        """

        def attempt(time_left_s: float) -> tuple[Header, np.ndarray | None]:
            conn = self._acquire()
            if sent is not None:
                sent.append(True)  # from here the daemon may have acted on it
            try:
                answer, body = conn.call(req, payload)
            except _Lost:
                self._release(conn)
                self._drop_idle()
                raise
            except ProtocolError as e:
                self._release(conn)
                raise self._translate(e, req) from e
            except BaseException:  # a final error (TLS refused): the slot goes back
                self._release(conn)
                raise
            self._release(conn)
            self._last_activity = time.monotonic()
            return answer, body

        try:
            if not retry:
                return attempt(0.0)
            return self._call_retrier().call(req.op.upper(), attempt)
        except (_Lost, RetriesExhausted) as e:
            cause = e.cause if isinstance(e, RetriesExhausted) else e
            elapsed_s = e.elapsed_s if isinstance(e, RetriesExhausted) else 0.0
            raise StoreUnavailableError(
                self._fail(
                    "the daemon is unreachable (gave up after "
                    f"{elapsed_s:.1f}s, reconnect_deadline_s="
                    f"{self._reconnect_deadline_s:g}): {cause}; "
                    "is `tensorstore-hooks serve` running there?"
                )
            ) from cause

    def _call_retrier(self) -> Retrier:
        retrier = self.__dict__.get("_retrier")
        if retrier is None:
            # Jittered backoff from 20 ms doubling to 1 s (clients of a restarted
            # daemon must not reconnect in lockstep), for reconnect_deadline_s.
            policy = RetryPolicy(
                deadline_s=max(self._reconnect_deadline_s, 1e-3),
                first_backoff_s=0.02,
                max_backoff_s=1.0,
                min_attempt_s=0.0,
            )
            retrier = Retrier(policy, label=self.url, classify=_classify_connection)
            retrier = self.__dict__.setdefault("_retrier", retrier)
        return retrier

    def _translate(self, e: ProtocolError, req: Request) -> TensorStoreError:
        if e.code is ErrorCode.NOT_FOUND:
            return KeyNotFoundError(self._fail(e.message))
        if e.code in (ErrorCode.QUOTA_EXCEEDED, ErrorCode.TOO_LARGE):
            return QuotaExceededError(self._fail(e.message))
        if e.code is ErrorCode.UNAUTHORIZED:
            return StoreUnavailableError(self._fail(f"refused: {e.message}"))
        if e.code is ErrorCode.INTERNAL:
            return StoreUnavailableError(self._fail(f"the daemon failed: {e.message}"))
        return TensorStoreError(self._fail(f"{req.op.upper()} rejected: {e}"))

    def _ping_if_idle(self, idle_s: float) -> None:
        if time.monotonic() - self._last_activity >= idle_s and self._sess.id is not None:
            self._call(Ping(id=0), retry=False)

    def _ping(self) -> Header:
        answer, _ = self._call(Ping(id=0))
        return answer

    @staticmethod
    def _missing_key(key: object, url: str) -> KeyNotFoundError:
        return KeyNotFoundError(f"DaemonStore({url}): no key {key!r} (not a key this store issues)")

    # ------------------------------------------------------------- the store
    def _check_writer(self, what: str) -> None:
        if foreign(self._pid):  # NOTE [ Fork safety ] (tensorstore_hooks/runtime/_forks.py)
            raise StoreUnavailableError(
                self._fail(
                    f"cannot {what} here: this process is a fork of the one that opened "
                    "the store, whose daemon session it must leave alone; open a store of "
                    "this process's own with tsh.open_store(...)"
                )
            )

    def put_blob(self, meta: TensorMeta, payload: Buffer) -> str:
        self._check_writer("write")
        n = meta.nbytes
        limit = self._sess.limits.get("max_tensor_bytes")
        if isinstance(limit, int) and n > limit:
            raise QuotaExceededError(
                self._fail(
                    f"a tensor of {format_bytes(n)} exceeds the daemon's max_tensor "
                    f"({format_bytes(limit)})"
                )
            )
        data = as_memoryview(payload).cast("B") if n else None
        if data is not None and len(data) != n:
            raise IntegrityError(self._fail(f"payload has {len(data)} bytes, metadata says {n}"))
        answer, _ = self._call(Put(id=0, meta=meta, size=n), data)
        key = answer.get("key")
        if not is_valid_key(key):
            raise TensorStoreError(self._fail(f"PUT answer carries an invalid key {key!r}"))
        return key

    def get_blob(self, key: str) -> tuple[TensorMeta, np.ndarray]:
        if not is_valid_key(key):
            raise self._missing_key(key, self.url)
        answer, body = self._call(Get(id=0, key=key))
        meta = TensorMeta.from_dict(answer.get("meta"))
        if body is None:
            body = np.empty(0, dtype=np.uint8)
        if len(body) != meta.nbytes:
            raise IntegrityError(
                self._fail(f"key {key!r}: {len(body)} payload bytes, metadata says {meta.nbytes}")
            )
        return meta, body

    def meta(self, key: str) -> TensorMeta:
        if not is_valid_key(key):
            raise self._missing_key(key, self.url)
        answer, _ = self._call(Get(id=0, key=key, head=True))
        return TensorMeta.from_dict(answer.get("meta"))

    def delete(self, key: str) -> None:
        self._check_writer("delete")
        if not is_valid_key(key):
            raise self._missing_key(key, self.url)
        sent: list[bool] = []
        answer, _ = self._call(Delete(id=0, keys=(key,)), sent=sent)
        if answer.get("missing") and len(sent) <= 1:
            raise KeyNotFoundError(self._fail(f"no key {key!r} to delete"))
        # Missing on a retry: the attempt whose answer was lost (the daemon restarting,
        # a dropped connection) deleted it. The key is gone, as asked.

    def delete_many(self, keys: Iterable[str]) -> None:
        self._check_writer("delete")
        valid = [k for k in keys if is_valid_key(k)]
        for i in range(0, len(valid), MAX_KEYS_PER_REQUEST):
            self._call(Delete(id=0, keys=tuple(valid[i : i + MAX_KEYS_PER_REQUEST])))

    def keys(self) -> Iterator[str]:
        _, body = self._call(ListKeys(id=0))
        keys = unpack_body(body) if body is not None else []
        if not isinstance(keys, list) or not all(is_valid_key(k) for k in keys):
            raise TensorStoreError(self._fail("LIST answer is not a list of keys"))
        return iter(keys)

    def __contains__(self, key: object) -> bool:
        if not is_valid_key(key):
            return False
        try:
            self.meta(str(key))
        except KeyNotFoundError:
            return False
        return True

    def __len__(self) -> int:
        return _count(self._ping(), "keys")

    @property
    def nbytes(self) -> int:
        return _count(self._ping(), "nbytes")

    def stats(self) -> dict[str, Msgpack]:
        """The daemon's statistics (what ``tensorstore-hooks stats`` shows)."""
        _, body = self._call(Stats(id=0))
        snap = unpack_body(body) if body is not None else {}
        if not isinstance(snap, dict):
            raise TensorStoreError(self._fail("STATS answer is not a map"))
        return snap

    def close(self) -> None:
        """End the session (the daemon frees its tensors at once) and close the sockets.

        Idempotent; never raises because the daemon is unreachable.
        """
        pool = self._pool
        if foreign(self._pid):  # a forked child: close its copies of the sockets, no BYE
            self._finalizer.detach()
            pool.close_all()
            return
        with pool.cond:
            if pool.closed:
                return
        conn = pool.take_idle()
        pool.stop.set()
        if self._keepalive_thread is not None:
            self._keepalive_thread.join(timeout=5.0)
        sess = self._sess
        if sess.id is not None:
            try:
                if conn is None:
                    conn = sess.new_conn(min(1.0, sess.connect_timeout_s), 5.0)
                    sess.hello(conn, sess.id)
                conn.sock.settimeout(5.0)
                conn.call(Bye(id=0))
            except (_Lost, ProtocolError, OSError, TensorStoreError) as e:
                log.debug(
                    "%s: BYE failed (%s); the daemon frees the session after its lease", self.url, e
                )
        if conn is not None:
            conn.close()
        pool.close_all()
        self._finalizer.detach()


def _count(answer: Header, field: str) -> int:
    """A count a PING answer carries (0 when absent)."""
    value = answer.get(field, 0)
    if not isinstance(value, int | float | str):
        raise TensorStoreError(f"DaemonStore: PING answer's {field!r} is {value!r}, not a count")
    return int(value)


def _finish(pool: ConnectionPool, pid: int) -> None:
    """The store was dropped without ``close()``: :meth:`ConnectionPool.finish`, which
    ends the session; in a forked child only its own sockets close (no BYE)."""
    if foreign(pid):
        pool.close_all()
    else:
        pool.finish()


def fetch_stats(
    url: str,
    *,
    token: str | None = None,
    timeout_s: float = 10.0,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> dict[str, Msgpack]:
    """One STATS request on an observer connection (no session is opened)."""
    addr = parse_daemon_url(url)
    if token is None:
        token = env_token()
    tls = TlsOptions(tls_ca, tls_cert, tls_key).context(addr.url) if addr.tls else None
    try:
        cert = tls is not None and tls_cert is not None
        conn = Connection(addr, timeout_s, timeout_s, tls=tls, client_cert=cert)
    except _Lost as e:
        raise StoreUnavailableError(f"stats: cannot reach the daemon at {addr.url}: {e}") from e
    try:
        conn.call(hello_request(token, None, client="tensorstore-hooks stats", open_session=False))
        _, body = conn.call(Stats(id=0))
        with contextlib.suppress(_Lost, ProtocolError):
            conn.call(Bye(id=0))
    except (_Lost, ProtocolError) as e:
        raise StoreUnavailableError(f"stats: {addr.url}: {e}") from e
    finally:
        conn.close()
    snap = unpack_body(body) if body is not None else None
    if not isinstance(snap, dict):
        raise StoreUnavailableError(f"stats: {addr.url}: the answer is not a statistics map")
    return snap
