"""Sending a stored tensor to a client: from RAM as it is, from disk piece by piece.

See NOTE [ Answers read from disk ] in ``_payload`` for the memory rules. A disk
read that fails before anything was sent is an ordinary error answer; one that
fails after the answer started cannot be answered in its place, so the daemon sends
an error frame where the next continuation frame was due and closes the connection
(the protocol allows it: ``docs/daemon.md``, Wire format).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import numpy as np

from tensorstore_hooks.errors import KeyNotFoundError, TensorStoreError
from tensorstore_hooks.protocol import (
    MAX_FRAME_PAYLOAD,
    ErrorCode,
    Header,
    error_header,
    message_head,
    pack_prefix,
)

from ._disk import DiskTier
from ._model import Entry
from ._payload import ANSWER_PIECE_BYTES, PUT_STALL_S, AnswerBudget, Preempted
from ._tiers import TierError, Tiers
from ._wire import ConnectionClosed, FrameConn

__all__ = ["send_built", "send_entry"]

log = logging.getLogger("tensorstore_hooks.server")


async def send_entry(
    wire: FrameConn, reply: Header, e: Entry, tiers: Tiers, budget: AnswerBudget
) -> None:
    """Send ``reply`` with ``e``'s payload.

    Raises TierError when nothing was sent yet (the caller answers with it). Once
    the answer has started, a failed read is sent as an error frame in place of the
    next continuation frame, and ConnectionClosed ends the connection.
    """
    buf = e.buf
    if buf is not None:  # the RAM tier (also while it is being spilled): no copy
        tiers.answer_started(e)  # its bytes stay counted in RAM until the send ends
        try:
            await wire.send(reply, buf)
        finally:
            tiers.answer_ended(e)
        return
    disk = tiers.disk
    if disk is None or e.disk_key is None:  # pragma: no cover - a disk entry has both
        raise TierError(ErrorCode.NOT_FOUND, f"key {e.key!r} was deleted")
    if e.nbytes:
        reply["size"] = e.nbytes
    disk.start_reading(e)
    try:
        started = False
        for start, length in disk.pieces(e, ANSWER_PIECE_BYTES):
            await _send_piece(wire, reply, e, disk, budget, (start, length), started)
            started = True
    finally:
        disk.done_reading(e)


async def send_built(
    wire: FrameConn,
    reply: Header,
    session: str,
    build: Callable[[], bytes],
    budget: AnswerBudget,
    estimate: int | None = None,
) -> None:
    """Send ``reply`` with the payload ``build()`` makes (a LIST or STATS answer),
    counted in ``budget`` for ``session`` while the socket takes it (NOTE [ Answers
    read from disk ], rule 5). ``estimate``: its size at most, to hold it before it
    is built (else it is built first). A client that stalls it while others need the
    budget is dropped (ConnectionClosed)."""
    body = build() if estimate is None else None
    need = len(body) if body is not None else estimate or 0
    hold = await budget.acquire(session, need, stall_s=PUT_STALL_S, fair_stall_s=PUT_STALL_S)
    parts: list[bytes | memoryview] | None = None
    try:
        if body is None:
            body = build()
        reply["size"] = len(body)
        parts = _frames(reply, memoryview(body))
        frames = -(-len(body) // MAX_FRAME_PAYLOAD) or 1
        try:
            await wire.send_resumable(parts, 0, hold, wire.read_timeout_s * frames)
        except Preempted:
            raise ConnectionClosed(
                "dropped: the client stopped reading its answer while others needed the "
                "daemon's answer buffer"
            ) from None
    finally:
        parts = body = None
        budget.release(hold)


def _frames(reply: Header | None, data: np.ndarray | memoryview) -> list[bytes | memoryview]:
    """The frames of one piece, prefixes and payload views in sending order;
    ``reply``: the message's header if the piece opens the message."""
    view = memoryview(data.data if isinstance(data, np.ndarray) else data).cast("B")
    parts: list[bytes | memoryview] = []
    for lo in range(0, max(len(view), 1), MAX_FRAME_PAYLOAD):
        part = view[lo : lo + MAX_FRAME_PAYLOAD]
        if reply is not None and lo == 0:
            parts.append(message_head(reply, len(part)))
        else:
            parts.append(pack_prefix(0, len(part)))
        if len(part):
            parts.append(part)
    return parts


async def _send_piece(
    wire: FrameConn,
    reply: Header,
    e: Entry,
    disk: DiskTier,
    budget: AnswerBudget,
    span: tuple[int, int],
    started: bool,
) -> None:
    """Send the payload bytes ``span`` = (start, length) of ``e`` as frames, holding
    their budget only while the socket takes them (NOTE [ Answers read from disk ],
    rule 4: preempted, it gives the budget back, waits for the peer to read, and
    reads the piece again to go on from where the peer got to). The peer has
    ``read_timeout`` in all to take the piece."""
    loop = asyncio.get_running_loop()
    left_s = wire.read_timeout_s
    pos = 0
    while True:
        if pos:  # preempted: nothing is held while the peer reads what it was sent
            t0 = loop.time()
            await wire.wait_drained(max(0.001, left_s))
            left_s -= loop.time() - t0
        hold = await budget.acquire(e.owner.id, span[1])
        parts: list[bytes | memoryview] | None = None
        try:
            piece = await _read(wire, reply, e, disk, span, started or pos > 0, pos > 0)
            parts = _frames(None if started else reply, piece)
            del piece  # the views in ``parts`` are all that keep it
            t0 = loop.time()
            try:
                await wire.send_resumable(parts, pos, hold, max(0.001, left_s))
                return
            except Preempted as p:
                pos = p.sent
            finally:
                left_s -= loop.time() - t0
        finally:
            parts = None  # the buffer goes before its budget does (rule 1)
            budget.release(hold)


async def _read(
    wire: FrameConn,
    reply: Header,
    e: Entry,
    disk: DiskTier,
    span: tuple[int, int],
    answer_started: bool,
    mid_frame: bool,
) -> np.ndarray:
    try:
        return await disk.read(e, span[0], span[1])
    except (KeyNotFoundError, TensorStoreError) as exc:
        code, message = _read_failed(e, exc)
        if not answer_started:
            raise TierError(code, message) from exc
        if mid_frame:  # no frame boundary to put an error frame at: only the close says it
            log.warning("GET answer cut off in the middle of a frame: %s", message)
            raise ConnectionClosed(f"answer cut off: {message}") from exc
        await _cut_off(wire, reply, code, message)
        raise  # pragma: no cover - _cut_off always raises


def _read_failed(e: Entry, exc: Exception) -> tuple[ErrorCode, str]:
    if isinstance(exc, KeyNotFoundError):
        return ErrorCode.NOT_FOUND, f"key {e.key!r}: {exc}"
    # NOTE [ Disk failures ], rule 5
    return ErrorCode.INTERNAL, f"reading key {e.key!r} from the disk tier: {exc}"


async def _cut_off(wire: FrameConn, reply: Header, code: ErrorCode, message: str) -> None:
    """End an answer that has started with an error frame, then the connection."""
    log.warning("GET answer cut off: %s", message)
    req_id = reply.get("id")
    await wire.send(
        error_header(
            code,
            f"{message} (the answer was cut off)",
            req_id=req_id if isinstance(req_id, int) else None,
            fatal=True,
        )
    )
    raise ConnectionClosed(f"answer cut off: {message}")
