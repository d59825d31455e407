"""Request handlers: one method per request type, found by one table lookup.

Like distributed's ``Server.handlers``: :data:`~tensorstore_hooks.protocol.REQUEST_TYPES`
names every request, and :class:`Handlers` maps each one's op to the coroutine that
serves it. A handler returns False when the connection should close after it.
HELLO is served by the connection's handshake (``_connection``), never here.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import msgpack
import numpy as np

from tensorstore_hooks.protocol import (
    Bye,
    Delete,
    ErrorCode,
    Get,
    Header,
    Hello,
    ListKeys,
    Ping,
    ProtocolError,
    Put,
    Request,
    Stats,
    error_header,
    parse_request,
)

from ._answers import send_built, send_entry
from ._conns import Conn
from ._payload import FAIR_STALL_S, PUT_STALL_S, Preempted
from ._services import Services
from ._tensor_rules import meta_problem
from ._tiers import Reservation, TierError
from ._wire import Head

__all__ = ["Handlers"]

Handler = Callable[[Conn, Request, Head], Awaitable[bool]]
R = TypeVar("R", bound=Request)


class _Route(Generic[R]):
    """One entry of the handler table: the coroutine that serves requests of ``kind``."""

    __slots__ = ("handler", "kind")

    def __init__(self, kind: type[R], handler: Callable[[Conn, R, Head], Awaitable[bool]]) -> None:
        self.kind = kind
        self.handler = handler

    def __call__(self, c: Conn, req: Request, head: Head) -> Awaitable[bool]:
        if not isinstance(req, self.kind):  # the table is keyed by the op of this type
            raise TypeError(f"handler table: the {self.kind.op} route got {type(req).__name__}")
        return self.handler(c, req, head)


def _route(
    kind: type[R], handler: Callable[[Conn, R, Head], Awaitable[bool]]
) -> tuple[str, Handler]:
    """A table entry: the request's op and its route."""
    return kind.op, _Route(kind, handler)


def _missing(key: str) -> str:
    return (
        f"no key {key!r} in this session (never stored, already deleted, another session's, "
        "or held in RAM by a daemon that restarted)"
    )


class Handlers:
    """Serves the requests of authenticated connections."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc
        self.table: dict[str, Handler] = dict(
            [
                _route(Hello, self.hello),
                _route(Put, self.put),
                _route(Get, self.get),
                _route(Delete, self.delete),
                _route(ListKeys, self.list_keys),
                _route(Ping, self.ping),
                _route(Stats, self.stats),
                _route(Bye, self.bye),
            ]
        )
        self.needs_session: frozenset[type[Request]] = frozenset((Put, Get, Delete, ListKeys))
        """Requests an observer connection (no session) may not make."""

    async def error(self, c: Conn, code: ErrorCode, message: str, req_id: int | None) -> bool:
        self.svc.stats.count("errors")
        await c.wire.send(error_header(code, message, req_id=req_id))
        return True

    async def dispatch(self, c: Conn, head: Head) -> bool:
        """Serve one request; returns False when the connection should close."""
        h = head.header
        raw_id = h.get("id")
        req_id = raw_id if isinstance(raw_id, int) and not isinstance(raw_id, bool) else None
        limit = self.svc.limits.max_tensor_bytes
        if head.size > limit:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"message of {head.size} bytes > max_tensor ({limit})",
                fatal=True,
            )
        try:
            req = parse_request(h)
        except ProtocolError as e:
            await c.wire.read_body(head, None)  # keep the stream in step, then answer
            return await self.error(c, e.code, e.message, req_id)
        if head.size and not isinstance(req, Put):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "only PUT carries a payload", fatal=True)
        self.svc.stats.count(req.op)
        s = c.session
        if s is not None:
            if s.ended:
                raise ProtocolError(ErrorCode.NOT_FOUND, "the session has ended", fatal=True)
            s.last_seen = time.monotonic()
            s.requests += 1
        elif type(req) in self.needs_session:
            await c.wire.read_body(head, None)
            return await self.error(
                c,
                ErrorCode.BAD_REQUEST,
                f"{req.op.upper()} needs a session (observer connection)",
                req.id,
            )
        return await self.table[req.op](c, req, head)

    # ------------------------------------------------------------- handlers
    async def hello(self, c: Conn, req: Hello, head: Head) -> bool:
        return await self.error(c, ErrorCode.BAD_REQUEST, "HELLO was already done", req.id)

    async def ping(self, c: Conn, req: Ping, head: Head) -> bool:
        reply: Header = {"id": req.id, "ok": True, "lease_s": self.svc.config.lease_s}
        s = c.session
        if s is not None:
            reply.update(keys=len(s.entries), nbytes=s.nbytes)
        await c.wire.send(reply)
        return True

    async def stats(self, c: Conn, req: Stats, head: Head) -> bool:
        def build() -> bytes:
            return bytes(msgpack.packb(self.svc.snapshot(), use_bin_type=True))

        who = c.session.id if c.session is not None else f"observer {c.peer}"
        await send_built(c.wire, {"id": req.id, "ok": True}, who, build, self.svc.answers)
        return True

    async def bye(self, c: Conn, req: Bye, head: Head) -> bool:
        s = c.session
        if s is not None:
            self.svc.sessions.end(s, "closed by the client")
            self.svc.conns.kick(s, "the session was closed by another connection", keep=c)
            self.svc.conns.detach(c)
        await c.wire.send({"id": req.id, "ok": True})
        return False

    async def put(self, c: Conn, req: Put, head: Head) -> bool:
        s = c.session
        assert s is not None
        problem = meta_problem(req.meta, self.svc.limits.max_tensor_bytes)
        if problem is not None:  # NOTE [ Storable metadata ]
            await c.wire.read_body(head, None)
            return await self.error(c, problem[0], problem[1], req.id)
        sessions = self.svc.sessions
        try:
            res: Reservation = await sessions.admit(s, req.meta)
        except TierError as err:
            await c.wire.read_body(head, None)
            return await self.error(c, err.code, err.message, req.id)
        puts = self.svc.puts
        ticket = puts.open(s.id) if res.tier == "disk" else None
        try:
            # Receive straight into the buffer the tensor will live in; a disk-bound
            # payload counts against the PUT budget as it arrives (NOTE [ Payload bytes
            # as they arrive ]); np.empty's pages are only touched as bytes land.
            buf = np.empty(req.size, dtype=np.uint8)
            reserve = functools.partial(puts.take, ticket) if ticket is not None else None
            try:
                await c.wire.read_body(head, buf.data, reserve, ticket)
            except Preempted:  # NOTE [ Preemption ]: its buffer goes, and the connection
                raise ProtocolError(
                    ErrorCode.BUSY,
                    f"dropped: this PUT's payload stalled for {PUT_STALL_S:g}s or more "
                    f"({FAIR_STALL_S:g}s while its session was over its share) while other "
                    "clients needed the daemon's PUT buffer; send it again",
                    fatal=True,
                ) from None
            if s.ended:
                return await self.error(c, ErrorCode.NOT_FOUND, "the session has ended", req.id)
            key = secrets.token_urlsafe(16)
            if res.tier == "ram":
                sessions.store_ram(s, res, key, req.meta, buf)
            else:
                await sessions.store_disk(s, res, key, req.meta, buf)
        except TierError as err:
            return await self.error(c, err.code, err.message, req.id)
        finally:
            sessions.release(s, res)
            if ticket is not None:
                puts.close(ticket)
        s.last_seen = time.monotonic()
        await c.wire.send({"id": req.id, "ok": True, "key": key, "tier": res.tier})
        return True

    async def get(self, c: Conn, req: Get, head: Head) -> bool:
        s = c.session
        assert s is not None
        found = s.entries.get(req.key)
        if found is None:
            return await self.error(c, ErrorCode.NOT_FOUND, _missing(req.key), req.id)
        if found.buf is None and self.svc.tiers.disk is not None:
            lost = self.svc.tiers.disk.lost
            if lost is not None:  # NOTE [ Disk failures ], rule 4
                return await self.error(c, ErrorCode.NOT_FOUND, lost, req.id)
        reply: Header = {"id": req.id, "ok": True, "meta": found.meta.to_dict(), "tier": found.tier}
        if req.head:
            await c.wire.send(reply)
            return True
        try:
            await send_entry(c.wire, reply, found, self.svc.tiers, self.svc.answers)
        except TierError as err:
            return await self.error(c, err.code, err.message, req.id)
        return True

    async def delete(self, c: Conn, req: Delete, head: Head) -> bool:
        s = c.session
        assert s is not None
        missing: list[str] = []
        found = []
        for key in req.keys:
            entry = s.entries.get(key)
            if entry is None:
                missing.append(key)
            else:
                found.append(entry)
        try:
            self.svc.sessions.free_keys(found)  # NOTE [ Durable deletes ]
        except TierError as err:
            return await self.error(c, err.code, err.message, req.id)
        await c.wire.send(
            {"id": req.id, "ok": True, "deleted": len(req.keys) - len(missing), "missing": missing}
        )
        return True

    async def list_keys(self, c: Conn, req: ListKeys, head: Head) -> bool:
        s = c.session
        assert s is not None
        keys = list(s.entries)
        # msgpack: an array header of at most 5 bytes, a str header of at most 2 a key
        # (keys are shorter than 256 characters).
        estimate = 5 + sum(len(k) + 2 for k in keys)

        def build() -> bytes:
            return bytes(msgpack.packb(keys, use_bin_type=True))

        reply: Header = {"id": req.id, "ok": True}
        await send_built(c.wire, reply, s.id, build, self.svc.answers, estimate)
        return True
