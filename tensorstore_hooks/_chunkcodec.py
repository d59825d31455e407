"""A tensor's chunks as bytes on a :class:`~tensorstore_hooks._chunkio.ChunkIO`:
codec, crc32c trailer, and the checksum list that binds each chunk to its place.

Each chunk object holds exactly what Zarr writes for it (payload slice, zero padding
of the last chunk, the optional compressor, then the 4-byte little-endian crc32c of
what precedes it: ``Crc32cCodec``), so plain ``zarr`` reads and verifies it.

NOTE [ Bound chunk checksums ]
A chunk's own crc32c says its bytes are intact, not that they belong where they are:
two valid chunk files swapped, a file moved to another index, or a chunk rewritten
for another key (a key resurrected by a lost delete record) all pass it. So
:meth:`ChunkCodec.write` returns the crc32c of every chunk of a tensor, and the
index entry stores them (``crc``: 4 little-endian bytes per chunk, in order). A read
checks each chunk twice: its trailer against its bytes (corruption), and its crc
against the one the entry recorded for that array and position (the chunk is this
key's chunk ``i``). A chunk that fails the second check holds some other valid chunk:
an :class:`~tensorstore_hooks.IntegrityError`, never another tensor's bytes. Plain
zarr checks only the first (the trailer); the index is what binds. Chunks whose bytes
are identical compare equal, and then the bytes read are the right ones anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from ._checksum import OVERLAP_BYTES, READ_PIECE_BYTES, RunningCrc, crc
from ._chunkio import ChunkIO
from ._zarr_options import parse_codec  # the one codec-spec parser (config uses it too)
from .errors import IntegrityError

__all__ = ["ChunkCodec", "parse_codec"]


class ChunkCodec:
    """Encodes, writes, reads and verifies the chunks of one namespace. Thread-safe."""

    def __init__(self, codec: str) -> None:
        self.name, self.level = parse_codec(codec)
        self._compressor = _compressor(self.name, self.level)
        self._zeros = b""

    @property
    def compressed(self) -> bool:
        return self._compressor is not None

    def zarr_compressors(self) -> list[Any]:
        """The codecs after ``bytes`` in the segment arrays' metadata."""
        out: list[Any] = [Crc32cCodec()]
        if self.name == "zstd":
            out.insert(0, ZstdCodec(level=self.level or 3))
        elif self.name == "lz4":
            out.insert(
                0, BloscCodec(cname="lz4", clevel=5, shuffle="noshuffle", typesize=1, blocksize=0)
            )
        return out

    # ------------------------------------------------------------------ write
    def write(self, io: ChunkIO, paths: Sequence[str], data: memoryview, chunk: int) -> bytes:
        """Write ``data`` as the chunks ``paths`` (``chunk`` bytes each, the last one
        padded); returns their crc32c values (NOTE [ Bound chunk checksums ])."""
        if self._compressor is None and io.supports_rewrite_in_place and chunk >= OVERLAP_BYTES:
            return self._write_overlapped(io, paths, data, chunk)
        items = []
        crcs = bytearray()
        for i, path in enumerate(paths):
            parts = self._encode(data[i * chunk : (i + 1) * chunk], chunk)
            value = 0
            for p in parts:
                value = crc(p, value)
            trailer = value.to_bytes(4, "little")
            crcs += trailer
            items.append((path, [*parts, trailer]))
        io.write_many(items)
        return bytes(crcs)

    def _zero_pad(self, n: int) -> memoryview:
        if len(self._zeros) < n:
            self._zeros = bytes(n)
        return memoryview(self._zeros)[:n]

    def _encode(self, data: memoryview, chunk: int) -> list[Any]:
        parts: list[Any] = [data]
        if chunk > len(data):
            parts.append(self._zero_pad(chunk - len(data)))
        if self._compressor is not None:
            joined = np.frombuffer(b"".join(parts), dtype=np.uint8)
            parts = [memoryview(self._compressor.encode(joined)).cast("B")]
        return parts

    def _write_overlapped(
        self, io: ChunkIO, paths: Sequence[str], data: memoryview, chunk: int
    ) -> bytes:
        """Local, uncompressed, large chunks: NOTE [ Overlapped checksums ]."""
        crcs = bytearray()
        for i, path in enumerate(paths):
            parts = self._encode(data[i * chunk : (i + 1) * chunk], chunk)
            running = RunningCrc(background=True)
            try:
                for part in parts:
                    running.feed(part)
                io.write_with_trailer(path, parts, running.trailer)
            finally:
                # Never leave the helper reading a buffer the caller may reuse.
                crcs += running.value().to_bytes(4, "little")
        return bytes(crcs)

    # ------------------------------------------------------------------- read
    def read(
        self,
        io: ChunkIO,
        paths: Sequence[str],
        out: np.ndarray,
        chunk: int,
        crcs: bytes,
        what: str,
    ) -> None:
        """Fill ``out`` from the chunks ``paths``, verifying each against its trailer
        and against ``crcs`` (its place). ``what`` names the key in messages.

        Raises :class:`IntegrityError` (corrupt, truncated, misplaced) and lets
        ``FileNotFoundError`` (a missing chunk) and other OS errors through.
        """
        if self._compressor is None and io.supports_direct_read:
            self._read_direct(io, paths, out, chunk, crcs, what)
        else:
            self._read_whole(io, paths, out, chunk, crcs, what)

    def _read_direct(
        self,
        io: ChunkIO,
        paths: Sequence[str],
        out: np.ndarray,
        chunk: int,
        crcs: bytes,
        what: str,
    ) -> None:
        view = memoryview(out.data)
        crc_buf = bytearray(4)
        background = chunk >= OVERLAP_BYTES  # NOTE [ Overlapped checksums ]
        for i, path in enumerate(paths):
            piece = view[i * chunk : (i + 1) * chunk]
            pad = chunk - len(piece)
            step = READ_PIECE_BYTES if background else chunk
            parts = [piece[lo : lo + step] for lo in range(0, len(piece), step)]
            if pad:
                parts.append(memoryview(bytearray(pad)))
            payload_parts = len(parts)
            parts.append(memoryview(crc_buf))
            running = RunningCrc(background)

            def filled(
                j: int,
                parts: list[memoryview] = parts,
                n: int = payload_parts,
                running: RunningCrc = running,
            ) -> None:
                if j < n:
                    running.feed(parts[j])

            try:
                size = io.readinto(path, parts, filled)
            finally:
                value = running.value()
            if size != chunk + 4:
                raise IntegrityError(
                    f"{what}: chunk {path} is truncated ({size} bytes, expected {chunk + 4})"
                )
            _verify(what, path, value, bytes(crc_buf), crcs, i)

    def _read_whole(
        self,
        io: ChunkIO,
        paths: Sequence[str],
        out: np.ndarray,
        chunk: int,
        crcs: bytes,
        what: str,
    ) -> None:
        blobs = io.read_many(paths)
        for i, (path, blob) in enumerate(zip(paths, blobs, strict=True)):
            mv = memoryview(blob).cast("B")
            if len(mv) < 4 or (self._compressor is None and len(mv) != chunk + 4):
                raise IntegrityError(f"{what}: chunk {path} is truncated ({len(mv)} bytes)")
            _verify(what, path, crc(mv[:-4]), bytes(mv[-4:]), crcs, i)
            body = mv[:-4]
            if self._compressor is not None:
                try:
                    body = memoryview(self._compressor.decode(body)).cast("B")
                except Exception as e:
                    raise IntegrityError(f"{what}: chunk {path} does not decompress: {e}") from e
                if len(body) != chunk:
                    raise IntegrityError(
                        f"{what}: chunk {path} decompressed to {len(body)} bytes, expected {chunk}"
                    )
            lo = i * chunk
            hi = min(lo + chunk, len(out))
            out[lo:hi] = np.frombuffer(body, dtype=np.uint8, count=hi - lo)


def _verify(what: str, path: str, value: int, stored: bytes, crcs: bytes, i: int) -> None:
    mine = value.to_bytes(4, "little")
    if mine != stored:
        raise IntegrityError(
            f"{what}: checksum mismatch in chunk {path}: the stored bytes are corrupted (crc32c)"
        )
    if crcs[4 * i : 4 * i + 4] != mine:
        raise IntegrityError(
            f"{what}: chunk {path} is intact but is not this key's chunk {i} (its crc32c "
            "differs from the one the index recorded for this array and position): a chunk "
            "file was swapped, moved or rewritten for another key"
        )


def _compressor(name: str, level: int | None) -> Any:
    from numcodecs import Blosc, Zstd

    if name == "zstd":
        return Zstd(level=level)
    if name == "lz4":
        return Blosc(cname="lz4", clevel=5, shuffle=Blosc.NOSHUFFLE, blocksize=0)
    return None
