"""A tensor's chunks as objects on a :class:`~tensorstore_hooks.storage.io.ChunkIO`:
the chunk layout (format 4), the optional compressor, and the checksums that bind
each chunk to its place.

NOTE [ Chunk objects ]
A tensor of ``n`` payload bytes occupies a run of chunks of one size class ``C``
(NOTE [ Segment layout ] in ``storage/zarr/_store.py``). The run holds the *stored stream*:
the payload rotated left by ``rot`` bytes (``0 <= rot < 4096``, in the tensor's
index entry), i.e. ``payload[rot:]`` then ``payload[:rot]``, ``n`` bytes in all.
Chunk ``i`` holds stream bytes ``[i*C, min(n, (i+1)*C))``. Each chunk is one object,
exactly what Zarr reads for a chunk of a 1-D uint8 array with codecs ``bytes``
[+ compressor]:

1. Uncompressed: exactly ``C`` bytes, the stream slice and then padding. The
   padding is zeros in a new object (memory and object stores write it; a new local
   file is extended with a hole) and unspecified in a local chunk file rewritten in
   place (NOTE [ Spare chunk files ]): no reader takes it for a tensor's bytes.
2. Compressed (``lz4``, ``zstd``): the compressor's output for the stream slice
   zero-padded to ``C``.
3. No checksum inside the object: uncompressed chunk files are block-aligned in
   size and offset, and local ones are written and read with ``O_DIRECT`` where the
   filesystem allows it (NOTE [ Direct I/O ] in ``storage/io/_local.py``).
4. Why the rotation: ``O_DIRECT`` needs the memory address, the file offset and the
   length block-aligned, and a CPU tensor's bytes start 64 bytes past a page
   boundary. With ``rot = -address mod 4096``, stream byte ``j < n - rot`` is
   payload byte ``rot + j`` at ``address + rot + j``: page-aligned wherever ``j``
   is. So each chunk is written by one ``pwritev`` straight from the tensor's own
   memory (no copy), and only the last stream bytes (the payload's last partial
   block and its first ``rot`` bytes, under 8 KiB) go through a zero-padded bounce
   buffer; no byte outside the tensor reaches the disk. The run needs exactly ``n``
   bytes, as without rotation (placing the payload at an in-chunk offset instead
   would need ``rot + n``: an 8 MiB tensor would take nine 1 MiB chunks instead of
   one 8 MiB chunk). A read lands the stream in a page-aligned buffer at a block
   boundary, ``rot`` bytes after where the tensor's storage starts, and moves the
   last ``rot`` bytes to the front (under 4 KiB): the storage keeps the original
   address alignment, with no copy of the rest. Writes that cannot go from the
   source (memory the kernel cannot pin for I/O, ``EFAULT``; compressed, buffered or
   object-store chunks) store ``rot = 0``; a copied write copies the payload into a
   pooled aligned buffer first, chunk by chunk (also what :attr:`ChunkCodec.zero_copy`
   off does: the alternative measured in BENCHMARKS.md).
5. Size classes below :data:`DIRECT_MIN_CHUNK_BYTES` stay buffered even with direct
   I/O on. Measured here at 64 KiB, a direct write + read costs 220 us and 88 us of
   CPU against 11 us for a buffered rewrite of the same file (two sleeps on the
   device and the page pinning, for little data), and what such chunks would keep in
   the page cache is small: in the benchmark's training step, 3 MiB of 2.1 GiB.

NOTE [ Bound chunk checksums ]
Each chunk's crc32c is kept in the tensor's index entry only (``crc``: 4
little-endian bytes per chunk, in order): of the stream slice the chunk holds
(uncompressed) or of the whole object (compressed). A write computes it from the
memory the chunk is written from (no copy), on the checksum thread while the write
runs. A read checks every chunk against it, so a chunk that is corrupted, truncated,
swapped with another, moved to another position or rewritten for another key (a
key resurrected by a lost delete record) is an
:class:`~tensorstore_hooks.IntegrityError`, never another tensor's bytes. Chunks
whose bytes are identical compare equal, and then the bytes read are the right ones
anyway. Plain zarr reads the arrays without any checksum; comparing with the index's
``crc`` is how an outside reader verifies (docs/layout.md).
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from zarr.abc.codec import BytesBytesCodec
from zarr.codecs import BloscCodec, ZstdCodec

from tensorstore_hooks.errors import IntegrityError
from tensorstore_hooks.storage.io import (
    BLOCK_BYTES,
    BufferPool,
    ChunkIO,
    address_of,
    aligned_empty,
    round_up,
)
from tensorstore_hooks.storage.zarr._checksum import (
    OVERLAP_BYTES,
    READ_PIECE_BYTES,
    RunningCrc,
    crc,
)
from tensorstore_hooks.storage.zarr._options import (
    parse_codec,  # the one codec-spec parser (config uses it too)
)

if TYPE_CHECKING:  # numcodecs (untyped) is imported when a compressing store opens
    from numcodecs.abc import Codec

__all__ = ["DIRECT_MIN_CHUNK_BYTES", "ChunkCodec", "parse_codec"]

DIRECT_MIN_CHUNK_BYTES = 256 << 10
"""Chunk size classes below this stay buffered even with direct I/O on (NOTE [ Chunk
objects ] rule 4)."""
_ZERO_BLOCK = memoryview(bytes(BLOCK_BYTES))
_bounce = threading.local()


def _bounce_buffer() -> memoryview:
    """This thread's two aligned blocks for the last stream bytes of a direct write
    (NOTE [ Chunk objects ] rule 4); a write is over before its thread writes again."""
    buf = getattr(_bounce, "buf", None)
    if buf is None:
        buf = _bounce.buf = aligned_empty(2 * BLOCK_BYTES).data
    return buf


class ChunkCodec:
    """Encodes, writes, reads and verifies the chunks of one namespace. Thread-safe.

    ``pool`` provides the aligned copy buffers of direct writes that cannot go from
    the payload's own memory.
    """

    def __init__(self, codec: str, pool: BufferPool) -> None:
        self.name, self.level = parse_codec(codec)
        self._compressor = _compressor(self.name, self.level)
        self._pool = pool
        self._zeros = b""
        self.zero_copy = True
        """Direct writes go from the payload's own memory (NOTE [ Chunk objects ] rule
        4); ``False``: through a pooled copy buffer, one copy (for measurements)."""

    @property
    def compressed(self) -> bool:
        return self._compressor is not None

    def zarr_compressors(self) -> list[BytesBytesCodec]:
        """The codecs after ``bytes`` in the segment arrays' metadata."""
        if self.name == "zstd":
            return [ZstdCodec(level=self.level or 3)]
        if self.name == "lz4":
            return [BloscCodec(cname="lz4", clevel=5, shuffle="noshuffle", typesize=1, blocksize=0)]
        return []

    def moves_direct(self, io: ChunkIO, chunk: int) -> bool:
        """Whether chunks of ``chunk`` bytes move with ``O_DIRECT`` through ``io``."""
        return self._compressor is None and io.uses_direct_io and chunk >= DIRECT_MIN_CHUNK_BYTES

    # ------------------------------------------------------------------ write
    def write(
        self,
        io: ChunkIO,
        paths: Sequence[str],
        data: memoryview,
        chunk: int,
        direct: bool | None = None,
    ) -> tuple[bytes, int]:
        """Write ``data`` as the chunks ``paths`` of ``chunk`` bytes each; returns their
        crc32c values (NOTE [ Bound chunk checksums ]) and the rotation the stream was
        stored with (NOTE [ Chunk objects ] rule 4). ``direct``: the caller's
        :meth:`moves_direct` decision (taken once, so that what it counts is what was
        done); ``None``: decided here."""
        if direct is None:
            direct = self.moves_direct(io, chunk)
        if self._compressor is not None:
            return self._write_compressed(io, paths, data, chunk), 0
        if direct:
            if self.zero_copy:
                written = self._write_direct(io, paths, data, len(data), chunk, in_place=False)
                if written is not None:
                    return written
            return self._write_copied(io, paths, data, chunk), 0
        if io.supports_rewrite_in_place:
            return self._write_local(io, paths, data, chunk), 0
        return self._write_objects(io, paths, data, chunk), 0

    def write_aligned(
        self,
        io: ChunkIO,
        paths: Sequence[str],
        region: memoryview,
        n: int,
        chunk: int,
        direct: bool | None = None,
    ) -> bytes:
        """:meth:`write` of ``region[:n]``, where ``region`` starts on a ``BLOCK_BYTES``
        boundary and has at least ``round_up(n, BLOCK_BYTES)`` writable bytes: with
        direct I/O every block goes to the disk straight from it (the bytes after
        ``n`` up to the next block are zeroed first), with no copy at all and no
        rotation. ``direct`` as in :meth:`write`."""
        if direct is None:
            direct = self.moves_direct(io, chunk)
        if direct:
            written = self._write_direct(io, paths, region, n, chunk, in_place=True)
            if written is not None:
                return written[0]
            return self._write_copied(io, paths, region[:n], chunk)
        return self.write(io, paths, region[:n], chunk, False)[0]

    def _write_direct(
        self,
        io: ChunkIO,
        paths: Sequence[str],
        data: memoryview,
        n: int,
        chunk: int,
        *,
        in_place: bool,
    ) -> tuple[bytes, int] | None:
        """NOTE [ Chunk objects ] rule 4: every chunk in one ``pwritev`` from ``data``'s
        own memory, the last stream bytes through a bounce buffer (``in_place``: an
        aligned region the caller lets us pad: its padding is zeroed where it is and
        nothing is bounced). Returns ``(crcs, rot)``, or ``None`` when ``data`` cannot
        be written from (too short for a whole aligned block, or memory the kernel
        refuses to pin): nothing acknowledged, the caller copies instead."""
        rot = 0 if in_place else -address_of(data) % BLOCK_BYTES
        whole = (n - rot) // BLOCK_BYTES * BLOCK_BYTES  # stream bytes sent from `data`
        if whole <= 0 and not in_place:
            return None
        direct = data[rot : rot + whole]
        if in_place:
            tail = data[whole : round_up(n)]
            tail[n - whole :] = _ZERO_BLOCK[: len(tail) - (n - whole)]
        else:
            tail = _bounce_buffer()
            left = n - rot - whole  # the payload's last partial block, then its first rot bytes
            tail[:left] = data[rot + whole : n]
            tail[left : left + rot] = data[:rot]
            padded = round_up(n - whole)
            tail[n - whole : padded] = _ZERO_BLOCK[: padded - (n - whole)]
        crcs = bytearray()
        for i, path in enumerate(paths):
            lo, hi = i * chunk, min(n, (i + 1) * chunk)
            running = RunningCrc(background=hi - lo >= OVERLAP_BYTES)
            try:
                views: list[memoryview] = []
                if lo < whole:
                    views.append(direct[lo : min(hi, whole)])
                    running.feed(views[-1])
                if hi > whole:
                    b_lo = max(lo, whole) - whole
                    running.feed(tail[b_lo : hi - whole])
                    views.append(tail[b_lo : round_up(hi - whole)])
                try:
                    io.write_aligned(path, views, chunk)
                except OSError as e:
                    if e.errno == errno.EFAULT:  # memory that cannot take part in I/O
                        return None
                    raise
            finally:
                # Never leave the helper reading a buffer the caller may reuse.
                value = running.value()
            crcs += value.to_bytes(4, "little")
        return bytes(crcs), rot

    def _write_copied(
        self, io: ChunkIO, paths: Sequence[str], data: memoryview, chunk: int
    ) -> bytes:
        """Direct writes of chunks copied into a pooled aligned buffer (one copy): for
        payloads :meth:`_write_direct` cannot send from their own memory."""
        total = len(data)
        copy = self._pool.acquire(round_up(min(chunk, total)))
        crcs = bytearray()
        try:
            sv = copy.view
            for i, path in enumerate(paths):
                lo = i * chunk
                size = min(chunk, total - lo)
                padded = round_up(size)
                running = RunningCrc(background=size >= OVERLAP_BYTES)
                try:
                    sv[:size] = data[lo : lo + size]
                    # The checksum reads the copy while it is still in the cache.
                    running.feed(sv[:size])
                    sv[size:padded] = _ZERO_BLOCK[: padded - size]
                    io.write_aligned(path, [sv[:padded]], chunk)
                finally:
                    value = running.value()
                crcs += value.to_bytes(4, "little")
        finally:
            self._pool.release(copy)
        return bytes(crcs)

    def _write_local(
        self, io: ChunkIO, paths: Sequence[str], data: memoryview, chunk: int
    ) -> bytes:
        """Buffered local files: the payload slice only (rule 1), checksummed on the
        helper thread while the kernel copies it (NOTE [ Overlapped checksums ])."""
        crcs = bytearray()
        for i, path in enumerate(paths):
            piece = data[i * chunk : (i + 1) * chunk]
            running = RunningCrc(background=len(piece) >= OVERLAP_BYTES)
            try:
                running.feed(piece)
                io.write_sized(path, [piece], chunk)
            finally:
                value = running.value()
            crcs += value.to_bytes(4, "little")
        return bytes(crcs)

    def _write_objects(
        self, io: ChunkIO, paths: Sequence[str], data: memoryview, chunk: int
    ) -> bytes:
        """Memory and object stores: whole chunks, zero-padded, in one batch."""
        items = []
        crcs = bytearray()
        for i, path in enumerate(paths):
            piece = data[i * chunk : (i + 1) * chunk]
            crcs += crc(piece).to_bytes(4, "little")
            parts: list[memoryview] = [piece]
            if len(piece) < chunk:
                parts.append(self._zero_pad(chunk - len(piece)))
            items.append((path, parts))
        io.write_many(items)
        return bytes(crcs)

    def _write_compressed(
        self, io: ChunkIO, paths: Sequence[str], data: memoryview, chunk: int
    ) -> bytes:
        assert self._compressor is not None
        items = []
        crcs = bytearray()
        for i, path in enumerate(paths):
            piece = data[i * chunk : (i + 1) * chunk]
            if len(piece) < chunk:
                piece = memoryview(b"".join([piece, self._zero_pad(chunk - len(piece))]))
            obj = memoryview(self._compressor.encode(np.frombuffer(piece, dtype=np.uint8))).cast(
                "B"
            )
            crcs += crc(obj).to_bytes(4, "little")
            items.append((path, [obj]))
        io.write_many(items)
        return bytes(crcs)

    def _zero_pad(self, n: int) -> memoryview:
        if len(self._zeros) < n:
            self._zeros = bytes(n)
        return memoryview(self._zeros)[:n]

    # ------------------------------------------------------------------- read
    def read(
        self,
        io: ChunkIO,
        paths: Sequence[str],
        region: memoryview,
        n: int,
        chunk: int,
        crcs: bytes,
        what: str,
        first: int = 0,
        direct: bool | None = None,
    ) -> None:
        """Fill ``region[:n]`` from the chunks ``paths``, verifying each against
        ``crcs``. ``region`` starts on a ``BLOCK_BYTES`` boundary and has at least
        ``round_up(n, BLOCK_BYTES)`` writable bytes (a direct read fills whole blocks).
        ``what`` names the key in messages, ``first`` the run position of ``paths[0]``,
        ``direct`` as in :meth:`write`.

        Raises :class:`IntegrityError` (corrupt, truncated, misplaced) and lets
        ``FileNotFoundError`` (a missing chunk) and other OS errors through.
        """
        if direct is None:
            direct = self.moves_direct(io, chunk)
        if self._compressor is not None:
            self._read_objects(io, paths, region, n, chunk, crcs, what, first)
        elif direct:
            self._read_direct(io, paths, region, n, chunk, crcs, what, first)
        elif io.supports_direct_read:
            self._read_local(io, paths, region, n, chunk, crcs, what, first)
        else:
            self._read_objects(io, paths, region, n, chunk, crcs, what, first)

    def _read_direct(
        self,
        io: ChunkIO,
        paths: Sequence[str],
        region: memoryview,
        n: int,
        chunk: int,
        crcs: bytes,
        what: str,
        first: int = 0,
    ) -> None:
        """One ``O_DIRECT`` read per chunk into its place in ``region``; chunk ``i`` is
        checksummed on the helper thread while ``i + 1`` is read."""
        checks: list[tuple[int, str, RunningCrc]] = []
        try:
            for i, path in enumerate(paths):
                lo = i * chunk
                size = min(chunk, n - lo)
                got, stored = io.read_aligned(path, region[lo : lo + round_up(size)])
                if stored != chunk or got < size:
                    raise IntegrityError(
                        f"{what}: chunk {path} is truncated ({stored} bytes, expected {chunk})"
                    )
                running = RunningCrc(background=size >= OVERLAP_BYTES)
                checks.append((i, path, running))
                running.feed(region[lo : lo + size])
        finally:
            values = _drain(checks)
        for (i, path, _), value in zip(checks, values, strict=True):
            _verify(what, path, value, crcs, i, first)

    def _read_local(
        self,
        io: ChunkIO,
        paths: Sequence[str],
        region: memoryview,
        n: int,
        chunk: int,
        crcs: bytes,
        what: str,
        first: int = 0,
    ) -> None:
        """Buffered local files: ``readinto`` the payload slice, checksumming piece ``j``
        while ``j + 1`` is read (NOTE [ Overlapped checksums ])."""
        background = chunk >= OVERLAP_BYTES
        for i, path in enumerate(paths):
            lo = i * chunk
            piece = region[lo : min(n, lo + chunk)]
            step = READ_PIECE_BYTES if background else max(len(piece), 1)
            parts = [piece[j : j + step] for j in range(0, len(piece), step)]
            running = RunningCrc(background)

            def filled(
                j: int, parts: list[memoryview] = parts, running: RunningCrc = running
            ) -> None:
                running.feed(parts[j])

            try:
                stored = io.readinto(path, parts, filled)
            finally:
                value = running.value()
            if stored != chunk:
                raise IntegrityError(
                    f"{what}: chunk {path} is truncated ({stored} bytes, expected {chunk})"
                )
            _verify(what, path, value, crcs, i, first)

    def _read_objects(
        self,
        io: ChunkIO,
        paths: Sequence[str],
        region: memoryview,
        n: int,
        chunk: int,
        crcs: bytes,
        what: str,
        first: int = 0,
    ) -> None:
        """Whole objects (memory and object stores, compressed chunks): verify, decode,
        copy the payload slice into place."""
        blobs = io.read_many(paths)
        for i, (path, blob) in enumerate(zip(paths, blobs, strict=True)):
            mv = memoryview(blob).cast("B")
            lo = i * chunk
            size = min(chunk, n - lo)
            if self._compressor is None:
                if len(mv) != chunk:
                    raise IntegrityError(
                        f"{what}: chunk {path} is truncated ({len(mv)} bytes, expected {chunk})"
                    )
                _verify(what, path, crc(mv[:size]), crcs, i, first)
                region[lo : lo + size] = mv[:size]
                continue
            _verify(what, path, crc(mv), crcs, i, first)
            try:
                body = memoryview(self._compressor.decode(mv)).cast("B")
            except Exception as e:
                raise IntegrityError(f"{what}: chunk {path} does not decompress: {e}") from e
            if len(body) != chunk:
                raise IntegrityError(
                    f"{what}: chunk {path} decompressed to {len(body)} bytes, expected {chunk}"
                )
            region[lo : lo + size] = body[:size]


def _drain(checks: list[tuple[int, str, RunningCrc]]) -> list[int]:
    """Every pending checksum's value (waiting for all of them, so no helper work is
    left reading a buffer after the read returns); the first failure is re-raised."""
    values: list[int] = []
    error: BaseException | None = None
    for _, _, running in checks:
        try:
            values.append(running.value())
        except BaseException as e:
            if error is None:
                error = e
            values.append(-1)
    if error is not None:
        raise error
    return values


def _verify(what: str, path: str, value: int, crcs: bytes, i: int, first: int) -> None:
    if crcs[4 * i : 4 * i + 4] != value.to_bytes(4, "little"):
        raise IntegrityError(
            f"{what}: checksum mismatch: chunk {path} is not this key's chunk {first + i}: "
            "its crc32c differs from the "
            "one the index recorded for this array and position (the chunk is corrupted, or "
            "a chunk file was swapped, moved or rewritten for another key)"
        )


def _compressor(name: str, level: int | None) -> Codec | None:
    from numcodecs import Blosc, Zstd

    if name == "zstd":
        return Zstd(level=level)
    if name == "lz4":
        return Blosc(cname="lz4", clevel=5, shuffle=Blosc.NOSHUFFLE, blocksize=0)
    return None
