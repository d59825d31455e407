"""A tensor's chunks as objects on a :class:`~tensorstore_hooks._chunkio.ChunkIO`:
the chunk layout (format 3), the optional compressor, and the checksums that bind
each chunk to its place.

NOTE [ Chunk objects ]
A tensor of ``n`` payload bytes occupies a run of chunks of one size class ``C``
(NOTE [ Segment layout ] in ``_zarr_store.py``); chunk ``i`` holds payload bytes
``[i*C, min(n, (i+1)*C))``. Each chunk is one object, exactly what Zarr reads for a
chunk of a 1-D uint8 array with codecs ``bytes`` [+ compressor]:

1. Uncompressed: exactly ``C`` bytes, the payload slice and then padding. The
   padding is zeros in a new object (memory and object stores write it; a new local
   file is extended with a hole) and unspecified in a local chunk file rewritten in
   place (NOTE [ Spare chunk files ]): no reader takes it for a tensor's bytes.
2. Compressed (``lz4``, ``zstd``): the compressor's output for the payload slice
   zero-padded to ``C``.
3. No checksum inside the object (format 2 appended zarr's 4-byte ``crc32c``, so no
   chunk file was a whole number of blocks). Uncompressed chunk files are now
   block-aligned in size and offset, and local ones are written and read with
   ``O_DIRECT`` where the filesystem allows it (NOTE [ Direct I/O ] in
   ``_chunkio.py``): a write stages the bytes in a page-aligned pooled buffer (one
   copy, none at all from :meth:`ChunkCodec.write_aligned`) and writes the blocks
   that hold payload, a read lands in the buffer that becomes the tensor's storage.
   Measured against the alternative of a trailer in an object of its own: see
   docs/layout.md ("Why no checksum in the chunk").
4. Size classes below :data:`DIRECT_MIN_CHUNK_BYTES` stay buffered even with direct
   I/O on. Measured here at 64 KiB, a direct write + read costs 220 us and 88 us of
   CPU against 11 us for a buffered rewrite of the same file (two sleeps on the
   device and the page pinning, for little data), and what such chunks would keep in
   the page cache is small: in the benchmark's training step, 3 MiB of 2.1 GiB.

NOTE [ Bound chunk checksums ]
Each chunk's crc32c is kept in the tensor's index entry only (``crc``: 4
little-endian bytes per chunk, in order): of the payload slice the chunk holds
(uncompressed) or of the whole object (compressed). A read checks every chunk
against it, so a chunk that is corrupted, truncated, swapped with another, moved to
another position or rewritten for another key (a key resurrected by a lost delete
record) is an :class:`~tensorstore_hooks.IntegrityError`, never another tensor's
bytes. Chunks whose bytes are identical compare equal, and then the bytes read are
the right ones anyway. Plain zarr reads the arrays without any checksum; comparing
with the index's ``crc`` is how an outside reader verifies (docs/layout.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from zarr.codecs import BloscCodec, ZstdCodec

from ._aligned import BLOCK_BYTES, BufferPool, address_of, round_up
from ._checksum import OVERLAP_BYTES, READ_PIECE_BYTES, RunningCrc, crc
from ._chunkio import ChunkIO
from ._zarr_options import parse_codec  # the one codec-spec parser (config uses it too)
from .errors import IntegrityError

__all__ = ["DIRECT_MIN_CHUNK_BYTES", "ChunkCodec", "parse_codec"]

DIRECT_MIN_CHUNK_BYTES = 256 << 10
"""Chunk size classes below this stay buffered even with direct I/O on (NOTE [ Chunk
objects ] rule 4)."""
_ZERO_BLOCK = memoryview(bytes(BLOCK_BYTES))


class ChunkCodec:
    """Encodes, writes, reads and verifies the chunks of one namespace. Thread-safe.

    ``pool`` provides the aligned staging buffers of direct writes.
    """

    def __init__(self, codec: str, pool: BufferPool) -> None:
        self.name, self.level = parse_codec(codec)
        self._compressor = _compressor(self.name, self.level)
        self._pool = pool
        self._zeros = b""

    @property
    def compressed(self) -> bool:
        return self._compressor is not None

    def zarr_compressors(self) -> list[Any]:
        """The codecs after ``bytes`` in the segment arrays' metadata."""
        if self.name == "zstd":
            return [ZstdCodec(level=self.level or 3)]
        if self.name == "lz4":
            return [BloscCodec(cname="lz4", clevel=5, shuffle="noshuffle", typesize=1, blocksize=0)]
        return []

    # ------------------------------------------------------------------ write
    def write(self, io: ChunkIO, paths: Sequence[str], data: memoryview, chunk: int) -> bytes:
        """Write ``data`` as the chunks ``paths`` of ``chunk`` bytes each; returns their
        crc32c values (NOTE [ Bound chunk checksums ])."""
        if self._compressor is not None:
            return self._write_compressed(io, paths, data, chunk)
        if io.uses_direct_io and chunk >= DIRECT_MIN_CHUNK_BYTES:
            return self._write_direct(io, paths, data, chunk, in_place=False)
        if io.supports_rewrite_in_place:
            return self._write_local(io, paths, data, chunk)
        return self._write_objects(io, paths, data, chunk)

    def write_aligned(
        self, io: ChunkIO, paths: Sequence[str], region: memoryview, n: int, chunk: int
    ) -> bytes:
        """:meth:`write` of ``region[:n]``, where ``region`` starts on a ``BLOCK_BYTES``
        boundary and has at least ``round_up(n, BLOCK_BYTES)`` writable bytes: with
        direct I/O every block goes to the disk straight from it (the bytes after
        ``n`` up to the next block are zeroed first), with no copy at all."""
        if self._compressor is None and io.uses_direct_io and chunk >= DIRECT_MIN_CHUNK_BYTES:
            return self._write_direct(io, paths, region, chunk, in_place=True, n=n)
        return self.write(io, paths, region[:n], chunk)

    def _write_direct(
        self,
        io: ChunkIO,
        paths: Sequence[str],
        data: memoryview,
        chunk: int,
        *,
        in_place: bool,
        n: int | None = None,
    ) -> bytes:
        """NOTE [ Chunk objects ] rule 3. ``in_place``: ``data`` is an aligned region
        the caller lets us pad (see :meth:`write_aligned`); else its blocks are staged
        in a pooled aligned buffer, or, when ``data`` happens to be aligned, sent from
        it and only the last partial block staged."""
        total = len(data) if n is None else n
        aligned = in_place or address_of(data) % BLOCK_BYTES == 0
        staging = None
        tail = None
        crcs = bytearray()
        try:
            for i, path in enumerate(paths):
                lo = i * chunk
                size = min(chunk, total - lo)
                piece = data[lo : lo + size]
                whole = size - size % BLOCK_BYTES
                running = RunningCrc(background=size >= OVERLAP_BYTES)
                try:
                    views: list[memoryview] = []
                    if aligned and in_place:
                        running.feed(piece)
                        padded = round_up(size)
                        if padded > size:
                            data[lo + size : lo + padded] = _ZERO_BLOCK[: padded - size]
                        views.append(data[lo : lo + padded])
                    elif aligned:
                        running.feed(piece)
                        if whole:
                            views.append(piece[:whole])
                        if size > whole:
                            if tail is None:
                                tail = self._pool.acquire(BLOCK_BYTES)
                            tv = tail.view
                            tv[: size - whole] = piece[whole:]
                            tv[size - whole : BLOCK_BYTES] = _ZERO_BLOCK[
                                : BLOCK_BYTES - size + whole
                            ]
                            views.append(tv[:BLOCK_BYTES])
                    else:
                        padded = round_up(size)
                        if staging is None:
                            staging = self._pool.acquire(round_up(min(chunk, total)))
                        sv = staging.view
                        sv[:size] = piece
                        # The checksum reads the copy while it is still in the cache
                        # (measured: 0.38 ms for 8 MiB against 0.5 ms from the source).
                        running.feed(sv[:size])
                        if padded > size:
                            sv[size:padded] = _ZERO_BLOCK[: padded - size]
                        views.append(sv[:padded])
                    io.write_aligned(path, views, chunk)
                finally:
                    # Never leave the helper reading a buffer the caller may reuse.
                    value = running.value()
                crcs += value.to_bytes(4, "little")
        finally:
            if staging is not None:
                self._pool.release(staging)
            if tail is not None:
                self._pool.release(tail)
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
            parts: list[Any] = [piece]
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
    ) -> None:
        """Fill ``region[:n]`` from the chunks ``paths``, verifying each against
        ``crcs``. ``region`` starts on a ``BLOCK_BYTES`` boundary and has at least
        ``round_up(n, BLOCK_BYTES)`` writable bytes (a direct read fills whole blocks).
        ``what`` names the key in messages.

        Raises :class:`IntegrityError` (corrupt, truncated, misplaced) and lets
        ``FileNotFoundError`` (a missing chunk) and other OS errors through.
        """
        if self._compressor is not None:
            self._read_objects(io, paths, region, n, chunk, crcs, what)
        elif io.uses_direct_io and chunk >= DIRECT_MIN_CHUNK_BYTES:
            self._read_direct(io, paths, region, n, chunk, crcs, what)
        elif io.supports_direct_read:
            self._read_local(io, paths, region, n, chunk, crcs, what)
        else:
            self._read_objects(io, paths, region, n, chunk, crcs, what)

    def _read_direct(
        self,
        io: ChunkIO,
        paths: Sequence[str],
        region: memoryview,
        n: int,
        chunk: int,
        crcs: bytes,
        what: str,
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
            _verify(what, path, value, crcs, i)

    def _read_local(
        self,
        io: ChunkIO,
        paths: Sequence[str],
        region: memoryview,
        n: int,
        chunk: int,
        crcs: bytes,
        what: str,
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
            _verify(what, path, value, crcs, i)

    def _read_objects(
        self,
        io: ChunkIO,
        paths: Sequence[str],
        region: memoryview,
        n: int,
        chunk: int,
        crcs: bytes,
        what: str,
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
                _verify(what, path, crc(mv[:size]), crcs, i)
                region[lo : lo + size] = mv[:size]
                continue
            _verify(what, path, crc(mv), crcs, i)
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


def _verify(what: str, path: str, value: int, crcs: bytes, i: int) -> None:
    if crcs[4 * i : 4 * i + 4] != value.to_bytes(4, "little"):
        raise IntegrityError(
            f"{what}: chunk {path} is not this key's chunk {i}: its crc32c differs from the "
            "one the index recorded for this array and position (the chunk is corrupted, or "
            "a chunk file was swapped, moved or rewritten for another key)"
        )


def _compressor(name: str, level: int | None) -> Any:
    from numcodecs import Blosc, Zstd

    if name == "zstd":
        return Zstd(level=level)
    if name == "lz4":
        return Blosc(cname="lz4", clevel=5, shuffle=Blosc.NOSHUFFLE, blocksize=0)
    return None
