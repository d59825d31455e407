"""Framed, zero-copy message I/O on one non-blocking socket, for asyncio.

The daemon does not use asyncio streams: ``StreamReader.readexactly`` copies every
byte through an internal buffer and, on Python < 3.12, ``writelines`` copies what
the kernel did not take at once. Here payloads are received with ``recv_into``
straight into the buffer the tensor will live in, and sent with ``sendmsg`` of
the header and payload memoryviews. Waiting for readiness uses the selector
(``add_reader``/``add_writer``), so this needs a selector event loop (the default
on Linux and macOS; uvloop works too).

Every read of a frame runs under a deadline, so a peer that stops mid-frame (or
sends one byte a minute) is dropped after ``read_timeout_s``.

A transfer that holds a shared budget (a PUT payload, a GET piece) sets
:attr:`FrameConn.hold`: every wait on the peer is then reported to it, and a budget
that preempts it (NOTE [ Preemption ] in ``_payload``) ends the wait with
:class:`~._payload.Preempted`. Bytes read only to be discarded go through one buffer
shared by every connection (their content is never looked at).

TLS: after :meth:`FrameConn.start_tls` the socket is a non-blocking
``ssl.SSLSocket``. It has no ``sendmsg`` (so each buffer is sent on its own, and
the TLS layer copies it into records anyway), and it may want to write while
reading or read while writing (``SSLWantWriteError``/``SSLWantReadError``): every
I/O loop here waits for whichever the TLS layer asks for. Bytes the TLS layer
already decrypted are not visible to the selector, so every loop tries the
socket before it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import select
import socket
import ssl
import struct
import sys
import termios
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from tensorstore_hooks._codec import Buffer, as_memoryview
from tensorstore_hooks.protocol import (
    MAGIC,
    MAX_FRAME_PAYLOAD,
    PREFIX_BYTES,
    ErrorCode,
    Header,
    ProtocolError,
    body_size,
    frame_chunks,
    message_head,
    pack_prefix,
    parse_prefix,
    unpack_header,
)

from ._payload import PIECE_BYTES, Hold, Preempted

__all__ = ["DISCARD_BYTES", "ConnectionClosed", "FrameConn", "Head", "with_timeout"]

DISCARD_BYTES = 1 << 20
"""The one buffer every connection reads discarded bytes into (a budget of its own)."""
_DRAINED_BYTES = 256 << 10
"""A preempted answer goes on once the peer's unread bytes fall below this."""
_DRAIN_POLL_S = 0.05
_discard: bytearray | None = None


def _discard_buffer() -> memoryview:
    """The shared discard buffer (made at the first use)."""
    global _discard
    if _discard is None:
        _discard = bytearray(DISCARD_BYTES)
    return memoryview(_discard)


def discard_bytes() -> int:
    """Bytes the shared discard buffer takes now (0 until a first discard)."""
    return DISCARD_BYTES if _discard is not None else 0

T = TypeVar("T")
Reserve = Callable[[int], Awaitable[None]]
_Waker = Callable[["asyncio.Future[None]"], None]
_AddWatch = Callable[[int, _Waker, "asyncio.Future[None]"], None]
"""``loop.add_reader`` / ``loop.add_writer`` as used here."""


class ConnectionClosed(Exception):
    """The peer closed the connection (or reset it)."""


if sys.version_info >= (3, 11):

    async def with_timeout(aw: Awaitable[T], seconds: float) -> T:
        """Await ``aw`` or raise ``TimeoutError`` (a timer, no extra task on 3.11+)."""
        async with asyncio.timeout(seconds):
            return await aw

else:  # pragma: no cover - Python 3.10

    async def with_timeout(aw: Awaitable[T], seconds: float) -> T:
        try:
            return await asyncio.wait_for(aw, seconds)
        except asyncio.TimeoutError as e:
            raise TimeoutError from e


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _want(conn: FrameConn, e: ssl.SSLError) -> None:
    if isinstance(e, ssl.SSLWantWriteError):
        await conn._writable()
    else:
        await conn._readable()


class Head:
    """The first frame of a message: its header and how its payload is split."""

    __slots__ = ("first_len", "header", "size")

    def __init__(self, header: Header, first_len: int, size: int) -> None:
        self.header = header
        self.first_len = first_len
        """Payload bytes carried by the first frame."""
        self.size = size
        """Total payload bytes of the message (``header['size']``, default 0)."""


class FrameConn:
    """One peer. Not shared between tasks: the connection's handler owns it."""

    def __init__(self, sock: socket.socket, read_timeout_s: float) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.read_timeout_s = read_timeout_s
        self.bytes_in = 0
        self.bytes_out = 0
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._prefix = bytearray(PREFIX_BYTES)
        self.tls = False
        self.hold: Hold | None = None
        """The budget holder of the transfer in progress (its waits on the peer are
        reported to it), or None."""

    async def start_tls(self, ctx: ssl.SSLContext) -> None:
        """Run the server side of a TLS handshake (the caller bounds it in time).

        A peer that starts with a plaintext frame is answered, in plaintext, with an
        ``UNAUTHORIZED`` error saying that this daemon needs ``tsh+tls://``.
        Raises :class:`ConnectionClosed` when the handshake fails (bad or missing
        client certificate, not TLS at all); :attr:`tls` is then already True, and
        OpenSSL has queued its alert for the peer (close with :meth:`linger_close`).
        """
        while True:
            try:
                first = self.sock.recv(4, socket.MSG_PEEK)
                break
            except (BlockingIOError, InterruptedError):
                await self._readable()
            except OSError as e:
                raise ConnectionClosed(str(e)) from e
        if not first:
            raise ConnectionClosed("peer closed the connection before the TLS handshake")
        if MAGIC.startswith(first):
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED,
                "this daemon only speaks TLS: connect with tsh+tls://HOST:PORT "
                "(and tls_ca= if its certificate is not from a public CA)",
                fatal=True,
            )
        tls = ctx.wrap_socket(self.sock, server_side=True, do_handshake_on_connect=False)
        self.sock = tls
        self.tls = True
        while True:
            try:
                tls.do_handshake()
                return
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError) as e:
                await _want(self, e)
            except (ssl.SSLError, OSError) as e:
                raise ConnectionClosed(f"TLS handshake failed: {e}") from e

    def has_input(self) -> bool:
        """True if a request (or part of one) is waiting to be read (never blocks)."""
        if self.tls and isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return True
        try:
            readable, _, _ = select.select([self._fd], [], [], 0)
        except (OSError, ValueError):
            return False
        return bool(readable)

    # ------------------------------------------------------------ readiness
    async def _wait(self, add: _AddWatch, remove: Callable[[int], object]) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()
        add(self._fd, _wake, fut)
        hold = self.hold
        if hold is not None:
            hold.check()
            hold.block(fut)  # a budget may preempt it while it waits on the peer
        try:
            await fut
        finally:
            remove(self._fd)
            if hold is not None:
                hold.unblock()
        if hold is not None:
            hold.check()

    def _readable(self) -> Awaitable[None]:
        return self._wait(self._loop.add_reader, self._loop.remove_reader)

    def _writable(self) -> Awaitable[None]:
        return self._wait(self._loop.add_writer, self._loop.remove_writer)

    # ---------------------------------------------------------------- reads
    async def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` completely; raise :class:`ConnectionClosed` on EOF."""
        sock = self.sock
        while view:
            try:
                n = sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                await self._readable()
                continue
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError) as e:
                await _want(self, e)
                continue
            except OSError as e:
                raise ConnectionClosed(str(e)) from e
            if n == 0:
                raise ConnectionClosed("peer closed the connection")
            self.bytes_in += n
            view = view[n:]

    async def read_head(self, idle_timeout_s: float) -> Head:
        """Wait up to ``idle_timeout_s`` for a message, then read its prefix and header.

        Raises ``TimeoutError``, :class:`ConnectionClosed` or a fatal :class:`ProtocolError`.
        """
        view = memoryview(self._prefix)
        try:
            got = self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            got = -1
        except ssl.SSLWantWriteError:
            await with_timeout(self._writable(), idle_timeout_s)
            got = 0
        except OSError as e:
            raise ConnectionClosed(str(e)) from e
        if got == 0:
            raise ConnectionClosed("peer closed the connection")
        if got < 0:
            await with_timeout(self._readable(), idle_timeout_s)
            got = 0
        else:
            self.bytes_in += got
        return await with_timeout(self._read_head_rest(view, got), self.read_timeout_s)

    async def _read_head_rest(self, view: memoryview, got: int) -> Head:
        await self.recv_into(view[got:])
        header_len, payload_len = parse_prefix(self._prefix)
        if header_len == 0:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, "continuation frame without a message", fatal=True
            )
        raw = bytearray(header_len)
        await self.recv_into(memoryview(raw))
        header = unpack_header(raw)
        size = body_size(header)
        if payload_len > size:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"frame carries {payload_len} payload bytes but the message announces {size}",
                fatal=True,
            )
        return Head(header, payload_len, size)

    async def read_body(
        self,
        head: Head,
        dest: memoryview | None,
        reserve: Reserve | None = None,
        hold: Hold | None = None,
    ) -> None:
        """Receive the message's payload into ``dest`` (``None``: read and discard).

        ``dest`` must be exactly ``head.size`` bytes. Each frame has its own deadline.
        ``reserve(n)``, if given, is awaited before each piece of at most
        ``PIECE_BYTES`` is received (the PUT payload budget, see NOTE [ Payload bytes
        as they arrive ]); time spent waiting in it does not count against the deadline.
        ``hold``: the budget holder the waits on the peer are reported to; raises
        :class:`~._payload.Preempted` if the budget takes it back.
        """
        if dest is not None and len(dest) != head.size:
            raise ValueError("destination does not match the message size")
        self.hold = hold
        try:
            await self._read_body(head, dest, reserve)
        finally:
            self.hold = None

    async def _read_body(
        self, head: Head, dest: memoryview | None, reserve: Reserve | None
    ) -> None:
        pos = 0
        frame_len = head.first_len
        while True:
            if frame_len:
                if reserve is not None and dest is not None:
                    await self._recv_reserved(dest, pos, frame_len, reserve)
                else:
                    await with_timeout(self._recv_part(dest, pos, frame_len), self.read_timeout_s)
                pos += frame_len
            if pos >= head.size:
                return
            frame_len = await with_timeout(
                self._read_continuation(head.size - pos), self.read_timeout_s
            )

    async def _recv_reserved(self, dest: memoryview, pos: int, n: int, reserve: Reserve) -> None:
        left_s = self.read_timeout_s  # this frame's deadline, paused while reserving
        end = pos + n
        while pos < end:
            k = min(PIECE_BYTES, end - pos)
            await reserve(k)
            t0 = self._loop.time()
            await with_timeout(self.recv_into(dest[pos : pos + k]), max(0.001, left_s))
            left_s -= self._loop.time() - t0
            pos += k

    async def _recv_part(self, dest: memoryview | None, pos: int, n: int) -> None:
        if dest is not None:
            await self.recv_into(dest[pos : pos + n])
            return
        scratch = _discard_buffer()
        while n:
            k = min(n, len(scratch))
            await self.recv_into(scratch[:k])
            n -= k

    async def _read_continuation(self, remaining: int) -> int:
        await self.recv_into(memoryview(self._prefix))
        header_len, payload_len = parse_prefix(self._prefix)
        if header_len != 0:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"new message while {remaining} payload bytes of the previous one are due",
                fatal=True,
            )
        if payload_len == 0 or payload_len > remaining:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"continuation frame of {payload_len} bytes, {remaining} expected at most",
                fatal=True,
            )
        return payload_len

    # --------------------------------------------------------------- writes
    async def send(self, header: Header, payload: Buffer | None = None) -> None:
        """Send one message: ``header`` (its ``size`` is set here) and an optional payload.

        The payload (any buffer) is split into frames of at most 16 MiB and handed
        to ``sendmsg`` without copying. Deadline: ``read_timeout_s`` per frame.
        """
        view = as_memoryview(payload).cast("B") if payload is not None else memoryview(b"")
        size = len(view)
        if size:
            header["size"] = size
        buffers: list[bytes | memoryview] = []
        for i, (start, stop) in enumerate(frame_chunks(size)):
            buffers.append(
                message_head(header, stop - start) if i == 0 else pack_prefix(0, stop - start)
            )
            if stop > start:
                buffers.append(view[start:stop])
        frames = -(-size // MAX_FRAME_PAYLOAD) or 1
        await with_timeout(self._sendmsg_all(buffers), self.read_timeout_s * frames)

    async def send_first(self, header: Header, size: int, part: Buffer) -> None:
        """Start a message of ``size`` payload bytes: ``header`` and its first ``part``
        (at most ``MAX_FRAME_PAYLOAD``); :meth:`send_more` sends the rest. Deadline:
        ``read_timeout_s``."""
        view = as_memoryview(part).cast("B")
        if size:
            header["size"] = size
        buffers: list[bytes | memoryview] = [message_head(header, len(view))]
        if len(view):
            buffers.append(view)
        await with_timeout(self._sendmsg_all(buffers), self.read_timeout_s)

    async def send_more(self, part: Buffer) -> None:
        """One continuation frame of the message :meth:`send_first` started."""
        view = as_memoryview(part).cast("B")
        assert 0 < len(view) <= MAX_FRAME_PAYLOAD
        await with_timeout(
            self._sendmsg_all([pack_prefix(0, len(view)), view]), self.read_timeout_s
        )

    async def _sendmsg_all(self, buffers: Sequence[bytes | memoryview]) -> None:
        if self.tls:
            await self._send_tls(buffers)
            return
        sock = self.sock
        bufs = [memoryview(b).cast("B") for b in buffers]
        sent = 0
        while bufs:
            try:
                n = sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                try:
                    await self._writable()
                except Preempted:
                    raise Preempted(sent) from None
                continue
            except OSError as e:
                raise ConnectionClosed(str(e)) from e
            self.bytes_out += n
            sent += n
            while n:
                first = bufs[0]
                if n >= len(first):
                    n -= len(first)
                    bufs.pop(0)
                else:
                    bufs[0] = first[n:]
                    n = 0
            while bufs and not bufs[0]:
                bufs.pop(0)

    async def _send_tls(self, buffers: Sequence[bytes | memoryview]) -> None:
        sock = self.sock
        sent = 0
        for b in buffers:
            view = memoryview(b).cast("B")
            while view:
                try:
                    n = sock.send(view)
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError) as e:
                    # Retry with the same bytes: OpenSSL requires it after a WANT (a
                    # preempted send resumes at ``sent``, with this very view again).
                    try:
                        await _want(self, e)
                    except Preempted:
                        raise Preempted(sent) from None
                    continue
                except (BlockingIOError, InterruptedError):
                    try:
                        await self._writable()
                    except Preempted:
                        raise Preempted(sent) from None
                    continue
                except OSError as e:
                    raise ConnectionClosed(str(e)) from e
                self.bytes_out += n
                sent += n
                view = view[n:]

    async def send_resumable(
        self, parts: Sequence[bytes | memoryview], pos: int, hold: Hold, timeout_s: float
    ) -> None:
        """Send the bytes of ``parts`` (taken as one run) from offset ``pos`` on, while
        ``hold`` holds their budget; at most ``timeout_s`` waiting on the peer.

        Raises :class:`~._payload.Preempted` whose ``sent`` is the offset the peer
        got to if the budget takes ``hold`` back (call again from there, with the
        same bytes: TLS needs the interrupted write repeated as it was),
        ``TimeoutError`` or :class:`ConnectionClosed`.
        """
        bufs: list[bytes | memoryview] = []
        skip = pos
        for part in parts:
            view = memoryview(part).cast("B")
            if skip >= len(view):
                skip -= len(view)
                continue
            bufs.append(view[skip:])
            skip = 0
        self.hold = hold
        try:
            await with_timeout(self._sendmsg_all(bufs), timeout_s)
        except Preempted as e:
            raise Preempted(pos + e.sent) from None
        finally:
            self.hold = None

    async def wait_drained(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the peer has read all but
        :data:`_DRAINED_BYTES` of what the kernel holds for it."""
        await with_timeout(self._drained(), timeout_s)

    async def _drained(self) -> None:
        tcp = self.sock.family in (socket.AF_INET, socket.AF_INET6)
        lowat = getattr(socket, "TCP_NOTSENT_LOWAT", None)
        if tcp and lowat is not None:
            # Writable only once fewer than _DRAINED_BYTES are unsent: no polling.
            before = self.sock.getsockopt(socket.IPPROTO_TCP, lowat)
            self.sock.setsockopt(socket.IPPROTO_TCP, lowat, _DRAINED_BYTES)
            try:
                await self._writable()
            finally:
                with contextlib.suppress(OSError):
                    self.sock.setsockopt(socket.IPPROTO_TCP, lowat, before)
            return
        while True:
            await self._writable()
            if self._unsent() <= _DRAINED_BYTES:
                return
            await asyncio.sleep(_DRAIN_POLL_S)

    def _unsent(self) -> int:
        try:
            out = fcntl.ioctl(self._fd, termios.TIOCOUTQ, b"\0\0\0\0")
        except OSError:
            return 0
        return int(struct.unpack("i", out)[0])

    def send_nowait(self, header: Header) -> None:
        """Best effort, never blocks: used for a last error frame before closing."""
        with contextlib.suppress(OSError, ProtocolError):
            self.sock.send(message_head(header, 0))

    async def linger_close(self, timeout_s: float = 0.5, max_bytes: int = 1 << 20) -> None:
        """Close after a fatal error frame so that the peer can read it.

        Closing a socket with unread input makes the kernel send a reset, and the
        peer then loses the error frame still queued for it. So: stop writing, read
        and discard what the peer already sent (bounded in time and bytes), close.
        """
        try:
            self.sock.shutdown(socket.SHUT_WR)
            await with_timeout(self._drain(max_bytes), timeout_s)
        except (OSError, TimeoutError, ConnectionClosed):
            pass
        finally:
            self.close()

    async def _drain(self, max_bytes: int) -> None:
        view = _discard_buffer()
        while max_bytes > 0:
            try:
                n = self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                await self._readable()
                continue
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError) as e:
                await _want(self, e)
                continue
            if n == 0:
                return
            max_bytes -= n

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
