"""The Zarr store kind's options: chunk size bounds and the codec spec, checked once.

``ZarrStore``'s constructor and the config validator (``store.codec``,
``store.chunk_bytes``) both call these, so a value one accepts the other accepts.
Errors are :class:`ConfigError` (a ``ValueError``) saying what is allowed; callers
add where the value came from and the value itself.
"""

from __future__ import annotations

from tensorstore_hooks._units import check_size
from tensorstore_hooks.errors import ConfigError

__all__ = [
    "CODEC_HELP",
    "DIRECT_IO_HELP",
    "DEFAULT_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "ZSTD_DEFAULT_LEVEL",
    "check_chunk_bytes",
    "parse_codec",
    "parse_direct_io",
]

DEFAULT_CHUNK_BYTES = 8 << 20
"""Default Zarr chunk size (``store.chunk_bytes``)."""
MIN_CHUNK_BYTES = 4 << 10
"""Smallest chunk size (also the smallest size class a tensor's run can use)."""

ZSTD_DEFAULT_LEVEL = 3
"""The level ``zstd`` without ``:LEVEL`` means (zstd's own default)."""
_ZSTD_MIN_LEVEL = -131072  # ZSTD_minCLevel(): numcodecs documents -131072..22
_ZSTD_MAX_LEVEL = 22  # ZSTD_maxCLevel(); zarr's ZstdCodec refuses 23 and above

CODEC_HELP = (
    "'none', 'lz4', 'zstd' (level 3) or 'zstd:LEVEL' with LEVEL in 1..22 "
    "(higher: smaller, slower) or -131072..-1 (faster, larger); zstd:0 is refused: "
    "zstd reads 0 as its default level 3, so write 'zstd' or 'zstd:3'"
)


def parse_codec(codec: object) -> tuple[str, int | None]:
    """``"none"``, ``"lz4"``, ``"zstd"`` or ``"zstd:LEVEL"`` -> ``(name, level)``.

    ``level`` is ``None`` except for zstd (``"zstd"`` -> 3). The accepted levels are
    exactly those zstd gives distinct meanings to: 1..22 and the fast levels
    -131072..-1. Level 0 is refused rather than stored as a silent 3. ``None`` and
    other non-strings are refused too (write ``"none"`` for no compression).
    """
    if isinstance(codec, str):
        name, sep, level = codec.partition(":")
        if name in ("none", "lz4") and not sep:
            return name, None
        if name == "zstd":
            if not sep:
                return name, ZSTD_DEFAULT_LEVEL
            digits = level.removeprefix("-")
            if digits.isascii() and digits.isdigit():
                n = int(level)
                if n != 0 and _ZSTD_MIN_LEVEL <= n <= _ZSTD_MAX_LEVEL:
                    return name, n
    raise ConfigError(f"expected {CODEC_HELP}")


DIRECT_IO_HELP = (
    "'auto' (O_DIRECT where the filesystem allows it), 'on' (required: an error where it "
    "cannot be had) or 'off' (through the page cache); YAML's on/off/true/false mean on/off"
)


def parse_direct_io(value: object) -> str:
    """``store.direct_io``: ``"auto"``, ``"on"`` or ``"off"``.

    Booleans are taken as ``on``/``off``: YAML 1.1 (PyYAML) reads an unquoted
    ``direct_io: on`` as ``True``. Anything else is refused.
    """
    if value is True:
        return "on"
    if value is False:
        return "off"
    if isinstance(value, str) and value.strip().lower() in ("auto", "on", "off"):
        return value.strip().lower()
    raise ConfigError(f"expected {DIRECT_IO_HELP}")


def check_chunk_bytes(value: object) -> int:
    """A chunk size: a size (see ``_units``) that is a power of two >= 4 KiB."""
    try:
        n = check_size(value)
    except ValueError as e:
        raise ConfigError(f"{e}, a power of two >= 4KiB") from None
    if n < MIN_CHUNK_BYTES or n & (n - 1):
        raise ConfigError("expected a power of two of at least 4KiB (e.g. 1MiB, 8MiB, 64MiB)")
    return n
