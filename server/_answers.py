"""Sending a stored tensor to a client: from RAM as it is, from disk piece by piece.

See NOTE [ Answers read from disk ] in ``_payload`` for the memory rules. A disk
read that fails before anything was sent is an ordinary error answer; one that
fails after the answer started cannot be answered in its place, so the daemon sends
an error frame where the next continuation frame was due and closes the connection
(the protocol allows it: ``docs/daemon.md``, Wire format).
"""

from __future__ import annotations

import logging

from tensorstore_hooks.errors import KeyNotFoundError, TensorStoreError
from tensorstore_hooks.protocol import MAX_FRAME_PAYLOAD, ErrorCode, Header, error_header

from ._disk import DiskTier
from ._model import Entry
from ._payload import ANSWER_PIECE_BYTES, AnswerBudget
from ._tiers import TierError
from ._wire import ConnectionClosed, FrameConn

__all__ = ["send_entry"]

log = logging.getLogger("tensorstore_hooks.server")


async def send_entry(
    wire: FrameConn,
    reply: Header,
    e: Entry,
    disk: DiskTier | None,
    budget: AnswerBudget,
) -> None:
    """Send ``reply`` with ``e``'s payload.

    Raises TierError when nothing was sent yet (the caller answers with it). Once
    the answer has started, a failed read is sent as an error frame in place of the
    next continuation frame, and ConnectionClosed ends the connection.
    """
    if e.buf is not None:  # the RAM tier (also while it is being spilled): no copy
        await wire.send(reply, e.buf)
        return
    if disk is None or e.disk_key is None:  # pragma: no cover - a disk entry has both
        raise TierError(ErrorCode.NOT_FOUND, f"key {e.key!r} was deleted")
    disk.start_reading(e)
    try:
        started = False
        for start, length in disk.pieces(e, ANSWER_PIECE_BYTES):
            async with budget.hold(e.owner.id, length):
                try:
                    piece = await disk.read(e, start, length)
                except (KeyNotFoundError, TensorStoreError) as exc:
                    code, message = _read_failed(e, exc)
                    if not started:
                        raise TierError(code, message) from exc
                    await _cut_off(wire, reply, code, message)
                view = memoryview(piece.data)
                for lo in range(0, max(length, 1), MAX_FRAME_PAYLOAD):
                    part = view[lo : lo + MAX_FRAME_PAYLOAD]
                    if started:
                        await wire.send_more(part)
                    else:
                        await wire.send_first(reply, e.nbytes, part)
                        started = True
    finally:
        disk.done_reading(e)


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
