"""The wire protocol between :class:`~tensorstore_hooks.DaemonStore` and the daemon.

Pure functions and value types only: no sockets, no asyncio. The daemon
(``tensorstore_hooks.server``) and the blocking client (``_daemon_client``) both
frame and validate messages through this module, so the two can never disagree.
``docs/daemon.md`` is the prose version of what follows.

Frames::

    frame   = prefix header payload
    prefix  = magic b"TSH1" | u32 header_len | u64 payload_len      (16 bytes, little-endian)
    header  = msgpack map, header_len bytes (0 < header_len <= MAX_HEADER_BYTES)
    payload = payload_len raw bytes (payload_len <= MAX_FRAME_PAYLOAD)

A *message* is one frame with a header followed by zero or more *continuation
frames* (``header_len == 0``) until the message's payload, announced by the header
field ``size``, is complete. A 64 MiB PUT therefore travels as four frames of at
most 16 MiB, and a receiver never needs a buffer larger than what it reserved. A
sender that fails in the middle of a message (the daemon, when a disk read fails
after a GET answer started) sends an error header (``ok: false``, no payload) where
the next continuation frame was due, then closes the connection.

Every size the receiver of untrusted bytes can be made to allocate is bounded here:
frame payload, header bytes, msgpack strings/arrays/maps (``max_bin_len = 0``: a
header carries no binary blobs), keys per request and key length.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, TypeAlias, TypeGuard, TypeVar, overload

import msgpack

from tensorstore_hooks._codec import Buffer, TensorMeta
from tensorstore_hooks.errors import IntegrityError

__all__ = [
    "MAGIC",
    "MAX_FRAME_PAYLOAD",
    "MAX_HEADER_BYTES",
    "MAX_KEYS_PER_REQUEST",
    "MAX_KEY_LEN",
    "MAX_TOKEN_LEN",
    "OPS",
    "PREFIX",
    "PREFIX_BYTES",
    "PROTOCOL_VERSION",
    "REQUEST_TYPES",
    "Bye",
    "Delete",
    "ErrorCode",
    "Get",
    "Header",
    "Hello",
    "ListKeys",
    "Msgpack",
    "Ping",
    "ProtocolError",
    "Put",
    "Request",
    "Stats",
    "body_size",
    "error_header",
    "frame_chunks",
    "is_valid_key",
    "is_valid_session_id",
    "message_head",
    "pack_header",
    "pack_prefix",
    "parse_prefix",
    "parse_request",
    "raise_for_error",
    "unpack_body",
    "unpack_header",
]

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change; HELLO carries it and the daemon refuses others."""

MAGIC = b"TSH1"
PREFIX = struct.Struct("<4sIQ")
PREFIX_BYTES = PREFIX.size  # 16

MAX_HEADER_BYTES = 64 * 1024
"""Largest msgpack header accepted. A DELETE of MAX_KEYS_PER_REQUEST keys fits easily."""
MAX_FRAME_PAYLOAD = 16 * 1024 * 1024
"""Largest payload one frame may carry; larger messages use continuation frames."""
MAX_KEYS_PER_REQUEST = 512
MAX_KEY_LEN = 64
MAX_TOKEN_LEN = 1024
MAX_MESSAGE_LEN = 1024
"""Longest error message a peer is asked to read."""

_MAX_HEADER_STR = 4096
_MAX_HEADER_ARRAY = MAX_KEYS_PER_REQUEST
_MAX_HEADER_MAP = 32

# fullmatch, never "$": "$" also matches before a trailing newline.
_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,%d}" % MAX_KEY_LEN)  # noqa: UP031 - regex braces
_SESSION_RE = re.compile(r"[A-Za-z0-9_-]{16,64}")

Msgpack: TypeAlias = (
    "bool | int | float | str | bytes | Sequence[Msgpack] | Mapping[str, Msgpack] | None"
)
"""A value msgpack carries: a header field, a STATS or LIST body, a journal record.

Decoding gives lists and dicts; encoding takes any sequence or mapping (a tuple packs
as an array). Read from a peer or a file, a value is untrusted: narrow it with
``isinstance`` before use."""
Header: TypeAlias = dict[str, Msgpack]
"""A message header: a msgpack map with string keys (``op``, ``id``, ``ok``, ...)."""

_T = TypeVar("_T")
_D = TypeVar("_D")
_B = TypeVar("_B", bound="_Bare")


class ErrorCode(str, Enum):
    """The ``code`` of an error frame."""

    BAD_REQUEST = "BAD_REQUEST"
    """Malformed or out-of-protocol input. Fatal for the connection when framing broke."""
    UNAUTHORIZED = "UNAUTHORIZED"
    """Missing or wrong token, or a request before HELLO."""
    NOT_FOUND = "NOT_FOUND"
    """Unknown key (or another session's), or a session that expired."""
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    """Memory and disk tiers are full: the client keeps the tensor itself."""
    TOO_LARGE = "TOO_LARGE"
    """A frame, header or tensor over the advertised limits."""
    BUSY = "BUSY"
    """Connection cap reached; retry later."""
    INTERNAL = "INTERNAL"
    """The daemon failed (disk I/O error, bug); the request may be retried."""


class ProtocolError(Exception):
    """A message violated the protocol, or an error frame was received.

    ``fatal`` means the connection is unusable afterwards (the stream lost its
    framing, or the peer is closing it).
    """

    def __init__(self, code: ErrorCode, message: str, *, fatal: bool = False) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.fatal = fatal


# ------------------------------------------------------------------------ framing
def pack_prefix(header_len: int, payload_len: int) -> bytes:
    return PREFIX.pack(MAGIC, header_len, payload_len)


def parse_prefix(buf: bytes | bytearray) -> tuple[int, int]:
    """Validate a 16-byte prefix; return ``(header_len, payload_len)``.

    Raises a fatal :class:`ProtocolError` (the stream cannot be resynchronised).
    """
    magic, header_len, payload_len = PREFIX.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}; not a tensorstore-hooks peer "
            "or an incompatible protocol version)",
            fatal=True,
        )
    if header_len > MAX_HEADER_BYTES:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"header of {header_len} bytes > {MAX_HEADER_BYTES}", fatal=True
        )
    if payload_len > MAX_FRAME_PAYLOAD:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"frame payload of {payload_len} bytes > {MAX_FRAME_PAYLOAD}",
            fatal=True,
        )
    return header_len, payload_len


def pack_header(header: Mapping[str, Msgpack]) -> bytes:
    """msgpack a header map; raises :class:`ProtocolError` if it exceeds the limit."""
    data: bytes = msgpack.packb(header, use_bin_type=True)
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"header of {len(data)} bytes > {MAX_HEADER_BYTES}"
        )
    return data


def unpack_header(buf: bytes | bytearray) -> Header:
    """Decode an untrusted header. Raises a fatal ``BAD_REQUEST`` :class:`ProtocolError`.

    Strings, arrays and maps are bounded; binary and extension types are refused.
    """
    try:
        obj = msgpack.unpackb(
            buf,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=0,
            max_ext_len=0,
            max_str_len=_MAX_HEADER_STR,
            max_array_len=_MAX_HEADER_ARRAY,
            max_map_len=_MAX_HEADER_MAP,
        )
    except Exception as e:  # msgpack raises ValueError, ExtraData, StackError, ...
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"header is not valid msgpack: {type(e).__name__}", fatal=True
        ) from e
    if not isinstance(obj, dict):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"header must be a map, got {type(obj).__name__}", fatal=True
        )
    return obj


def unpack_body(buf: Buffer, *, max_items: int = 1 << 24) -> Msgpack:
    """Decode a msgpack *payload* sent by the daemon (STATS, LIST answers)."""
    try:
        return msgpack.unpackb(
            buf,
            raw=False,
            strict_map_key=True,
            max_bin_len=0,
            max_ext_len=0,
            max_str_len=1 << 20,
            max_array_len=max_items,
            max_map_len=max_items,
        )
    except Exception as e:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"body is not valid msgpack: {e}") from e


def body_size(header: Mapping[str, Msgpack]) -> int:
    """The payload bytes a message announces (``size``, default 0). Fatal if malformed."""
    size = header.get("size", 0)
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size < 1 << 48:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "field 'size' must be a byte count", fatal=True)
    return size


def message_head(header: Mapping[str, Msgpack], first_payload_len: int) -> bytes:
    """Prefix + packed header of a message's first frame."""
    packed = pack_header(header)
    return pack_prefix(len(packed), first_payload_len) + packed


def frame_chunks(size: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of each frame's share of a ``size``-byte payload (at least one)."""
    start = 0
    while True:
        stop = min(size, start + MAX_FRAME_PAYLOAD)
        yield start, stop
        if stop >= size:
            return
        start = stop


def is_valid_key(key: object) -> TypeGuard[str]:
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None


def is_valid_session_id(sid: object) -> TypeGuard[str]:
    return isinstance(sid, str) and _SESSION_RE.fullmatch(sid) is not None


def error_header(
    code: ErrorCode, message: str, *, req_id: int | None = None, fatal: bool = False
) -> Header:
    return {
        "id": req_id,
        "ok": False,
        "code": code.value,
        "message": message[:MAX_MESSAGE_LEN],
        "fatal": fatal,
    }


def raise_for_error(header: Mapping[str, Msgpack]) -> None:
    """Raise the :class:`ProtocolError` an error answer carries; return if ``ok``."""
    if header.get("ok") is True:
        return
    code_s = header.get("code")
    try:
        code = ErrorCode(code_s) if isinstance(code_s, str) else ErrorCode.INTERNAL
    except ValueError:
        code = ErrorCode.INTERNAL
    msg = header.get("message")
    raise ProtocolError(
        code,
        msg if isinstance(msg, str) else repr(msg),
        fatal=header.get("fatal") is True,
    )


# ----------------------------------------------------------------------- requests
# NOTE [ Request types ]
# Each request type names its op once (``op``), encodes itself for the client
# (``to_header``) and parses an untrusted header for the daemon (``from_header``).
# ``REQUEST_TYPES`` is the one list of ops: the daemon's handler table, its counters
# and the metrics all derive from it, and the client never spells an op by hand.


@dataclass(frozen=True, slots=True)
class Hello:
    """Authenticate the connection and open, join or resume a session."""

    op: ClassVar[str] = "hello"
    id: int
    version: int
    """Protocol version of the client; must equal :data:`PROTOCOL_VERSION`."""
    token: str | None
    session: str | None
    """Session to join/resume; ``None`` opens a new one."""
    client: str
    """Free-form client description for logs (library version, pid)."""
    open_session: bool
    """False: an observer connection (``stats`` CLI) that may only PING/STATS/BYE."""

    def to_header(self) -> Header:
        return {
            "op": self.op,
            "id": self.id,
            "version": self.version,
            "token": self.token,
            "session": self.session,
            "client": self.client,
            "open_session": self.open_session,
        }

    @classmethod
    def from_header(cls, h: Header, req_id: int) -> Hello:
        token = _field(h, "token", str, None)
        if token is not None and len(token) > MAX_TOKEN_LEN:
            raise _bad("token too long")
        session = _field(h, "session", str, None)
        if session is not None and not is_valid_session_id(session):
            raise _bad("field 'session': invalid session id")
        return cls(
            id=req_id,
            version=_field(h, "version", int),
            token=token,
            session=session,
            client=str(_field(h, "client", str, ""))[:256],
            open_session=_field(h, "open_session", bool, True),
        )


@dataclass(frozen=True, slots=True)
class Put:
    """Store ``size`` payload bytes described by ``meta``; answered with a new key."""

    op: ClassVar[str] = "put"
    id: int
    meta: TensorMeta
    size: int

    def to_header(self) -> Header:
        return {"op": self.op, "id": self.id, "meta": self.meta.to_dict(), "size": self.size}

    @classmethod
    def from_header(cls, h: Header, req_id: int) -> Put:
        size = _field(h, "size", int)
        try:
            meta = TensorMeta.from_dict(h.get("meta"))
        except IntegrityError as e:
            raise _bad(f"field 'meta': {e}") from e
        if size != meta.nbytes:
            raise _bad(f"field 'size' ({size}) differs from meta.nbytes ({meta.nbytes})")
        return cls(id=req_id, meta=meta, size=size)


@dataclass(frozen=True, slots=True)
class Get:
    """Read a key; ``head`` returns only its metadata (no payload)."""

    op: ClassVar[str] = "get"
    id: int
    key: str
    head: bool = False

    def to_header(self) -> Header:
        return {"op": self.op, "id": self.id, "key": self.key, "head": self.head}

    @classmethod
    def from_header(cls, h: Header, req_id: int) -> Get:
        return cls(id=req_id, key=_key(h), head=_field(h, "head", bool, False))


@dataclass(frozen=True, slots=True)
class Delete:
    """Delete keys of the caller's session; answered with the keys that were missing."""

    op: ClassVar[str] = "delete"
    id: int
    keys: tuple[str, ...]

    def to_header(self) -> Header:
        return {"op": self.op, "id": self.id, "keys": list(self.keys)}

    @classmethod
    def from_header(cls, h: Header, req_id: int) -> Delete:
        given: list[object] = _field(h, "keys", list)
        if len(given) > MAX_KEYS_PER_REQUEST:
            raise _bad(f"at most {MAX_KEYS_PER_REQUEST} keys per DELETE")
        keys = tuple(k for k in given if is_valid_key(k))
        if len(keys) != len(given):
            raise _bad("field 'keys': every key must be a valid key string")
        return cls(id=req_id, keys=keys)


@dataclass(frozen=True, slots=True)
class _Bare:
    """A request that carries nothing but its id."""

    op: ClassVar[str]
    id: int

    def to_header(self) -> Header:
        return {"op": self.op, "id": self.id}

    @classmethod
    def from_header(cls: type[_B], h: Header, req_id: int) -> _B:
        return cls(id=req_id)


@dataclass(frozen=True, slots=True)
class ListKeys(_Bare):
    """The caller's session's keys, as a msgpack array in the payload."""

    op: ClassVar[str] = "list"


@dataclass(frozen=True, slots=True)
class Ping(_Bare):
    """Renew the lease; answered with the session's key count and bytes."""

    op: ClassVar[str] = "ping"


@dataclass(frozen=True, slots=True)
class Stats(_Bare):
    """Daemon-wide statistics, as a msgpack map in the payload."""

    op: ClassVar[str] = "stats"


@dataclass(frozen=True, slots=True)
class Bye(_Bare):
    """End the session (its tensors are freed at once) and close the connection."""

    op: ClassVar[str] = "bye"


Request = Hello | Put | Get | Delete | ListKeys | Ping | Stats | Bye

REQUEST_TYPES: tuple[type[Request], ...] = (Hello, Put, Get, Delete, ListKeys, Ping, Stats, Bye)
"""Every request type; see NOTE [ Request types ]."""
OPS: tuple[str, ...] = tuple(t.op for t in REQUEST_TYPES)
"""Every op name, in :data:`REQUEST_TYPES` order."""
_BY_OP: dict[str, type[Request]] = {t.op: t for t in REQUEST_TYPES}


def _bad(msg: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, msg)


@overload
def _field(h: Header, name: str, kind: type[_T]) -> _T: ...
@overload
def _field(h: Header, name: str, kind: type[_T], default: _D) -> _T | _D: ...
def _field(h: Header, name: str, kind: type[_T], default: object = ...) -> object:
    """Field ``name`` of ``h``, checked to be a ``kind``: ``default`` when absent (also when
    ``None`` with a ``None`` default); without a default, a missing field is an error."""
    if name not in h:
        if default is ...:
            raise _bad(f"missing field {name!r}")
        return default
    v = h[name]
    if v is None and default is None:
        return None
    # bool is an int subclass: never let True pass as a size or an id.
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is int):
        raise _bad(f"field {name!r} must be {kind.__name__}, got {type(v).__name__}")
    return v


def _key(h: Header, name: str = "key") -> str:
    key = _field(h, name, str)
    if not is_valid_key(key):
        raise _bad(f"field {name!r}: invalid key (1-{MAX_KEY_LEN} characters of [A-Za-z0-9_-])")
    return key


def parse_request(h: Header) -> Request:
    """Validate a request header; raise a non-fatal ``BAD_REQUEST`` :class:`ProtocolError`.

    The caller still owns the stream position: if the header announces a payload
    (``size``), it must be consumed or the connection closed.
    """
    op = _field(h, "op", str)
    req_id = _field(h, "id", int)
    if not 0 <= req_id < 1 << 63:
        raise _bad("field 'id' out of range")
    kind = _BY_OP.get(op)
    if kind is None:
        raise _bad(f"unknown op {op[:32]!r}")
    req: Request = kind.from_header(h, req_id)
    return req
