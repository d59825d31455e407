"""Request handlers: one method per request type, found by one table lookup.

Like distributed's ``Server.handlers``: :data:`~tensorstore_hooks.protocol.REQUEST_TYPES`
names every request, and :class:`Handlers` maps each type to the coroutine that
serves it. A handler returns False when the connection should close after it.
HELLO is served by the connection's handshake (``_connection``), never here.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from tensorstore_hooks.protocol import (
    Bye,
    Delete,
    ErrorCode,
    Get,
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

from ._tiers import Reservation, TierError
from ._wire import Head

if TYPE_CHECKING:
    from ._app import Daemon
    from ._connection import Client
    from ._sessions import Session

__all__ = ["Handlers"]

Handler = Callable[[Any, Any, Head], Awaitable[bool]]


def _missing(key: str) -> str:
    return (
        f"no key {key!r} in this session (never stored, already deleted, another session's, "
        "or held in RAM by a daemon that restarted)"
    )


class Handlers:
    """Serves the requests of authenticated connections for one :class:`Daemon`."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.table: dict[type[Request], Handler] = {
            Hello: self.hello,
            Put: self.put,
            Get: self.get,
            Delete: self.delete,
            ListKeys: self.list_keys,
            Ping: self.ping,
            Stats: self.stats,
            Bye: self.bye,
        }
        self.needs_session: frozenset[type[Request]] = frozenset((Put, Get, Delete, ListKeys))
        """Requests an observer connection (no session) may not make."""

    async def error(self, c: Client, code: ErrorCode, message: str, req_id: int | None) -> bool:
        self.d.stats.count("errors")
        await c.conn.send(error_header(code, message, req_id=req_id))
        return True

    async def dispatch(self, c: Client, head: Head) -> bool:
        """Serve one request; returns False when the connection should close."""
        h = head.header
        raw_id = h.get("id")
        req_id = raw_id if isinstance(raw_id, int) and not isinstance(raw_id, bool) else None
        limit = self.d.limits.max_tensor_bytes
        if head.size > limit:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"message of {head.size} bytes > max_tensor ({limit})",
                fatal=True,
            )
        try:
            req = parse_request(h)
        except ProtocolError as e:
            await c.conn.read_body(head, None)  # keep the stream in step, then answer
            return await self.error(c, e.code, e.message, req_id)
        if head.size and not isinstance(req, Put):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "only PUT carries a payload", fatal=True)
        self.d.stats.count(req.op)
        s = c.session
        if s is not None:
            if s.ended:
                raise ProtocolError(ErrorCode.NOT_FOUND, "the session has ended", fatal=True)
            s.last_seen = time.monotonic()
            s.requests += 1
        elif type(req) in self.needs_session:
            await c.conn.read_body(head, None)
            return await self.error(
                c,
                ErrorCode.BAD_REQUEST,
                f"{req.op.upper()} needs a session (observer connection)",
                req.id,
            )
        return await self.table[type(req)](c, req, head)

    # ------------------------------------------------------------- handlers
    async def hello(self, c: Client, req: Hello, head: Head) -> bool:
        return await self.error(c, ErrorCode.BAD_REQUEST, "HELLO was already done", req.id)

    async def ping(self, c: Client, req: Ping, head: Head) -> bool:
        reply: dict[str, Any] = {"id": req.id, "ok": True, "lease_s": self.d.config.lease_s}
        s = c.session
        if s is not None:
            reply.update(keys=len(s.entries), nbytes=s.nbytes)
        await c.conn.send(reply)
        return True

    async def stats(self, c: Client, req: Stats, head: Head) -> bool:
        body = msgpack.packb(self.d.stats.snapshot(self.d), use_bin_type=True)
        await c.conn.send({"id": req.id, "ok": True}, body)
        return True

    async def bye(self, c: Client, req: Bye, head: Head) -> bool:
        s = c.session
        if s is not None:
            self.d.sessions.end(s, "closed by the client")
            self.d.kick(s, "the session was closed by another connection", keep=c)
            c.session = None
        await c.conn.send({"id": req.id, "ok": True})
        return False

    async def put(self, c: Client, req: Put, head: Head) -> bool:
        s = c.session
        assert s is not None
        try:
            res: Reservation = await self.d.sessions.admit(s, req.size)
        except TierError as err:
            await c.conn.read_body(head, None)
            return await self.error(c, err.code, err.message, req.id)
        staging = self.d.staging
        ticket = staging.open() if res.tier == "disk" else None
        try:
            # Receive straight into the buffer the tensor will live in; a disk-bound
            # payload counts against staging as it arrives (NOTE [ Staging as bytes
            # arrive ]); np.empty's pages are only touched as bytes land.
            buf = np.empty(req.size, dtype=np.uint8)
            reserve = functools.partial(staging.take, ticket) if ticket is not None else None
            await c.conn.read_body(head, buf.data, reserve)
            if s.ended:
                return await self.error(c, ErrorCode.NOT_FOUND, "the session has ended", req.id)
            key = secrets.token_urlsafe(16)
            if res.tier == "ram":
                self.d.sessions.store_ram(s, res, key, req.meta, buf)
            else:
                await self.d.sessions.store_disk(s, res, key, req.meta, buf)
        except TierError as err:
            return await self.error(c, err.code, err.message, req.id)
        finally:
            self.d.sessions.release(s, res)
            if ticket is not None:
                staging.close(ticket)
        s.last_seen = time.monotonic()
        await c.conn.send({"id": req.id, "ok": True, "key": key, "tier": res.tier})
        return True

    async def get(self, c: Client, req: Get, head: Head) -> bool:
        s: Session | None = c.session
        assert s is not None
        found = s.entries.get(req.key)
        if found is None:
            return await self.error(c, ErrorCode.NOT_FOUND, _missing(req.key), req.id)
        reply = {"id": req.id, "ok": True, "meta": found.meta.to_dict(), "tier": found.tier}
        if req.head:
            await c.conn.send(reply)
            return True
        try:
            buf = await self.d.tiers.read(found)
        except TierError as err:
            return await self.error(c, err.code, err.message, req.id)
        await c.conn.send(reply, buf)
        return True

    async def delete(self, c: Client, req: Delete, head: Head) -> bool:
        s = c.session
        assert s is not None
        missing = []
        for key in req.keys:
            entry = s.entries.get(key)
            if entry is None:
                missing.append(key)
            else:
                self.d.sessions.free(entry)
        await c.conn.send(
            {"id": req.id, "ok": True, "deleted": len(req.keys) - len(missing), "missing": missing}
        )
        return True

    async def list_keys(self, c: Client, req: ListKeys, head: Head) -> bool:
        s = c.session
        assert s is not None
        body = msgpack.packb(list(s.entries), use_bin_type=True)
        await c.conn.send({"id": req.id, "ok": True}, body)
        return True
