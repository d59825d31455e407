"""One connection: the handshake (HELLO), then requests until it closes.

A connection task is only ever cancelled while it waits for the next message (or at
the end of the drain period on shutdown), never in the middle of a request: a
session that ends under a busy connection is noticed when that request completes.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from tensorstore_hooks.protocol import (
    MAX_FRAME_PAYLOAD,
    MAX_KEYS_PER_REQUEST,
    PROTOCOL_VERSION,
    ErrorCode,
    Header,
    Hello,
    ProtocolError,
    error_header,
    parse_request,
)

from ._conns import Conn
from ._handlers import Handlers
from ._model import Session
from ._services import Services
from ._stats import server_version
from ._wire import ConnectionClosed, with_timeout

__all__ = ["serve_connection"]

log = logging.getLogger("tensorstore_hooks.server")


async def serve_connection(svc: Services, handlers: Handlers, c: Conn) -> None:
    """Run one connection to its end; never raises (errors become error frames).

    It leaves the connection registry as soon as it stops serving requests.
    """
    conn = c.wire
    limits = svc.limits
    linger = False
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.handshake_timeout_s
        try:
            # One deadline for TLS and the whole HELLO, however slowly its bytes come.
            await with_timeout(_open(svc, c, deadline), limits.handshake_timeout_s)
        except ConnectionClosed as e:
            if conn.tls:  # let the TLS alert reach the client before the close
                log.info("connection %s: %s", c.peer, e)
                linger = True
            raise
        while not svc.conns.draining and c.kick_reason is None:
            c.idle = True
            head = await conn.read_head(limits.idle_timeout_s)
            c.idle = False
            if not await handlers.dispatch(c, head):
                break
            # One request per turn: a client pipelining requests whose bytes are
            # always ready would otherwise never give the event loop back
            # (see NOTE [ Fairness ] in _conns).
            await asyncio.sleep(0)
        if c.kick_reason is not None:
            conn.send_nowait(error_header(ErrorCode.NOT_FOUND, c.kick_reason, fatal=True))
    except asyncio.CancelledError:
        if c.kick_reason is not None:
            conn.send_nowait(error_header(ErrorCode.NOT_FOUND, c.kick_reason, fatal=True))
    except ConnectionClosed:
        log.debug("connection %s closed (%s)", c.peer, "TLS failed" if linger else "by the peer")
    except TimeoutError:
        log.info("closing connection %s: timed out", c.peer)
        conn.send_nowait(
            error_header(ErrorCode.BAD_REQUEST, "timed out waiting for the client", fatal=True)
        )
    except ProtocolError as e:
        svc.stats.count("errors")
        log.warning("closing connection %s: %s", c.peer, e)
        conn.send_nowait(error_header(e.code, e.message, fatal=True))
        linger = True
    except Exception as e:
        svc.stats.count("errors")
        log.exception("closing connection %s after an internal error", c.peer)
        conn.send_nowait(error_header(ErrorCode.INTERNAL, f"internal error: {e}", fatal=True))
        linger = True
    finally:
        svc.conns.remove(c)
    try:
        if linger and not svc.conns.draining:
            await conn.linger_close()
    finally:
        conn.close()


def _token_ok(expected: str | None, given: str | None) -> bool:
    if expected is None:
        return True
    return given is not None and hmac.compare_digest(
        given.encode("utf-8"), expected.encode("utf-8")
    )


async def _open(svc: Services, c: Conn, deadline: float) -> None:
    """TLS (if served), then HELLO; the caller bounds both with one deadline."""
    if svc.tls is not None:
        await c.wire.start_tls(svc.tls)
    await _handshake(svc, c, deadline)


async def _handshake(svc: Services, c: Conn, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    for _ in range(3):
        head = await c.wire.read_head(max(0.001, deadline - loop.time()))
        if head.header.get("op") != "hello":
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED, "the first message must be HELLO", fatal=True
            )
        if head.size:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "HELLO carries no payload", fatal=True)
        try:
            req = parse_request(head.header)
        except ProtocolError as e:
            raise ProtocolError(e.code, e.message, fatal=True) from e
        if not isinstance(req, Hello):
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED, "the first message must be HELLO", fatal=True
            )
        svc.stats.count("hello")
        if req.version != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"protocol version {req.version} is not supported (this daemon speaks "
                f"{PROTOCOL_VERSION}); upgrade tensorstore-hooks on both sides",
                fatal=True,
            )
        if not _token_ok(svc.token, req.token):
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED,
                "missing or wrong token: pass token= to the store or set TSH_TOKEN",
                fatal=True,
            )
        if not c.authenticated and not svc.conns.authenticate(c):
            raise ProtocolError(
                ErrorCode.BUSY,
                f"the daemon is at its connection cap ({svc.limits.max_connections})",
                fatal=True,
            )
        session: Session | None = None
        resumed = False
        if not req.open_session:
            c.observer = True
        elif req.session is not None:
            session = svc.sessions.get(req.session)
            if session is None:
                await c.wire.send(
                    error_header(
                        ErrorCode.NOT_FOUND,
                        "session unknown or expired (its tensors were freed); "
                        "send HELLO without a session to open a new one",
                        req_id=req.id,
                    )
                )
                continue
            resumed = True
        else:
            session = svc.sessions.open()
        if session is not None:
            svc.conns.attach(c, session)
            session.last_seen = time.monotonic()
            if resumed:
                log.info("session %s joined from %s (%r)", session.label, c.peer, req.client)
        await c.wire.send(_welcome(svc, req, session, resumed))
        return
    raise ProtocolError(ErrorCode.BAD_REQUEST, "too many HELLO attempts", fatal=True)


def _welcome(svc: Services, req: Hello, s: Session | None, resumed: bool) -> Header:
    return {
        "id": req.id,
        "ok": True,
        "session": s.id if s is not None else None,
        "resumed": resumed,
        "lease_s": svc.config.lease_s,
        "server": server_version(),
        "version": PROTOCOL_VERSION,
        "limits": {
            "max_tensor_bytes": svc.limits.max_tensor_bytes,
            "max_frame_payload": MAX_FRAME_PAYLOAD,
            "max_keys_per_request": MAX_KEYS_PER_REQUEST,
            "memory_quota": svc.config.memory_quota_bytes,
            "disk_quota": svc.tiers.disk_quota,
        },
    }
