"""The daemon's configuration: a pydantic model, loaded from YAML and command-line flags.

YAML keys are the long flag names with ``_`` (``memory_quota``, ``lease``); the
model's attributes carry their unit (``memory_quota_bytes``, ``lease_s``). Every
problem is a :class:`~tensorstore_hooks.errors.ConfigError` naming the source (the
file, or "command line") and the field path.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from collections.abc import Mapping
from typing import NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

# The library's unit types: one parser of "512MiB" and "30s" for library and daemon.
from tensorstore_hooks._units import Duration as Seconds
from tensorstore_hooks._units import Size
from tensorstore_hooks.config import LineOf, format_validation_error, line_finder, read_yaml
from tensorstore_hooks.errors import ConfigError
from tensorstore_hooks.storage import DEFAULT_PORT

__all__ = [
    "Address",
    "LimitsConfig",
    "ServerConfig",
    "is_loopback",
    "load_config",
    "parse_address",
    "read_token",
]


class LimitsConfig(BaseModel):
    """Resource limits; the defaults suit one training job per daemon."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    max_connections: int = Field(256, ge=1, le=65536)
    """Authenticated connections (HELLO done); more are refused with BUSY."""
    max_unauthenticated: int = Field(64, ge=1, le=65536)
    """Connections still in their handshake; a new one beyond this drops the oldest."""
    handshake_timeout_s: Seconds = Field(5.0, alias="handshake_timeout", gt=0)
    """A connection must finish TLS and HELLO within this time."""
    idle_timeout_s: Seconds = Field(600.0, alias="idle_timeout", gt=0)
    """An authenticated connection silent this long is closed (its session lives on)."""
    read_timeout_s: Seconds = Field(30.0, alias="read_timeout", gt=0)
    """Once a frame starts, all of it (at most 16 MiB) must arrive within this time."""
    max_tensor_bytes: Size = Field(4 << 30, alias="max_tensor")
    """Larger PUTs are refused with TOO_LARGE before their payload is read."""
    put_buffer_bytes: Size = Field(256 << 20, alias="put_buffer")
    """Memory for payloads of PUTs that go straight to disk, in total, counted as their
    bytes arrive (one PUT always proceeds). NOTE [ Payload bytes as they arrive ]."""
    get_buffer_bytes: Size = Field(256 << 20, alias="get_buffer")
    """Memory for GET answers read from disk, in total (NOTE [ Answers read from disk ])."""
    session_get_buffer_bytes: Size = Field(32 << 20, alias="session_get_buffer")
    """Memory for GET answers read from disk, per session: a client that does not read
    its answers holds at most this much (NOTE [ Answers read from disk ])."""
    disk_bookkeeping_bytes: Size = Field(256 << 20, alias="disk_bookkeeping")
    """RAM for the bookkeeping of disk-tier tensors, about 1 KiB each (their keys,
    metadata, index entries): past it, writes that would add one are refused
    (QUOTA_EXCEEDED). NOTE [ Disk-tier bookkeeping ]."""
    drain_timeout_s: Seconds = Field(10.0, alias="drain_timeout", ge=0)
    """On SIGTERM, in-flight requests get this long to finish."""


class ServerConfig(BaseModel):
    """Everything ``tensorstore-hooks serve`` needs. Build with :func:`load_config`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    listen: str | None = f"127.0.0.1:{DEFAULT_PORT}"
    """``HOST:PORT`` (port 0 picks a free one). Ignored when ``unix`` is set."""
    unix: str | None = None
    """Path of a Unix socket to listen on instead of TCP."""
    root: str | None = None
    """Disk tier URL (``file:///path`` or a bare path). None: RAM tier only."""
    memory_quota_bytes: Size = Field(1 << 30, alias="memory_quota")
    disk_quota_bytes: Size = Field(16 << 30, alias="disk_quota")
    session_quota_bytes: Size | None = Field(None, alias="session_quota")
    """What one session may hold, RAM + disk (payload + per-tensor overhead). None: no cap."""
    token_file: str | None = None
    lease_s: Seconds = Field(60.0, alias="lease", gt=0)
    """A session without traffic for this long is ended and its tensors freed."""
    metrics: str | None = None
    """``HOST:PORT`` for a Prometheus text endpoint (needs prometheus-client)."""
    tls_cert: str | None = None
    """PEM certificate chain: serve TLS (``tsh+tls://``) with it. Needs ``tls_key``."""
    tls_key: str | None = None
    """PEM private key of ``tls_cert``."""
    tls_client_ca: str | None = None
    """PEM CA bundle: refuse clients without a certificate signed by it (mutual TLS)."""
    log_level: str = "INFO"
    limits: LimitsConfig = Field(default_factory=lambda: LimitsConfig.model_validate({}))

    @field_validator("listen", "metrics")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None:
            parse_address(v)
        return v

    @model_validator(mode="after")
    def _check(self) -> ServerConfig:
        if self.listen is None and self.unix is None:
            raise ValueError("one of 'listen' or 'unix' is required")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(
                f"log_level must be DEBUG, INFO, WARNING or ERROR, not {self.log_level!r}"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both (or neither)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key (a TLS listener)")
        if self.tls_cert is not None and self.unix is not None:
            raise ValueError(
                "TLS applies to TCP listeners; a Unix socket is protected by file "
                "permissions: drop tls_* or use listen"
            )
        if self.root is None and self.memory_quota_bytes == 0:
            raise ValueError(
                "memory_quota is 0 and there is no 'root': the daemon could store nothing"
            )
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def disk_enabled(self) -> bool:
        return self.root is not None and self.disk_quota_bytes > 0


class Address(NamedTuple):
    """``(host, port)`` parsed from ``HOST:PORT`` / ``[v6]:PORT``."""

    host: str
    port: int


def parse_address(text: str) -> Address:
    """Parse ``HOST:PORT``; raises ``ValueError`` with the expected form."""
    host, sep, port_s = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:7077), got {text!r}")
    return Address(host, int(port_s))


def is_loopback(host: str) -> bool:
    """True if every address ``host`` resolves to is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def read_token(path: str) -> str:
    """Read a token file (surrounding whitespace stripped). Raises ConfigError."""
    try:
        with open(path, encoding="utf-8") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise OSError("not a regular file")
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"daemon config: token_file {path!r} cannot be read: {e}") from e
    if not token:
        raise ConfigError(f"daemon config: token_file {path!r} is empty; put a secret in it")
    return token


DAEMON_KEYS: frozenset[str] = frozenset(
    {f.alias or name for name, f in ServerConfig.model_fields.items()}
)
"""The top-level keys of a daemon config (``check-config`` tells it from a library one)."""


def load_config(path: str | os.PathLike[str] | None = None, **overrides: object) -> ServerConfig:
    """Build a :class:`ServerConfig` from a YAML file and keyword overrides.

    ``overrides`` use YAML key names (``memory_quota="2GiB"``); ``None`` values are
    ignored, so argparse results can be passed straight through. Setting ``unix``
    clears a ``listen`` from the file and vice versa. Also refuses, with a
    ConfigError saying so, a non-loopback ``listen`` without a ``token_file``.
    """
    source = os.fspath(path) if path is not None else "command line"
    data: dict[str, object] = {}
    line_of: LineOf | None = None
    if path is not None:
        try:
            loaded, node = read_yaml(source)
        except ConfigError as e:
            raise ConfigError(f"daemon config {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                f"daemon config {source}:1: top level must be a mapping of settings, "
                f"got a {type(loaded).__name__}"
            )
        line_of = line_finder(node)
        data = dict(loaded or {})
        if "unix" in data and data.get("unix") is not None and "listen" not in data:
            data["listen"] = None
    given = {k: v for k, v in overrides.items() if v is not None}
    if given.get("unix") is not None:
        data["listen"] = None
    if given.get("listen") is not None:
        data["unix"] = None
    cli_fields = set(given)
    limits = given.pop("limits", None)
    data.update(given)
    if limits:
        base = data.get("limits") or {}
        if not isinstance(base, Mapping):
            pass  # the file's limits are not a map: validation says so
        elif isinstance(limits, Mapping):
            data["limits"] = {**base, **limits}
        else:
            data["limits"] = limits  # validation says what is wrong with it

    def from_flags(loc: tuple[int | str, ...]) -> str | None:
        return "command line" if loc and loc[0] in cli_fields else None

    try:
        cfg = ServerConfig.model_validate(data)
    except ValidationError as e:
        message = format_validation_error(
            e, source=source, root=ServerConfig, line_of=line_of, source_of=from_flags
        )
        raise ConfigError(f"daemon config {message}") from None
    if cfg.unix is None and cfg.listen is not None and cfg.token_file is None:
        host = parse_address(cfg.listen).host
        if not is_loopback(host):
            raise ConfigError(
                f"daemon config {source}: refusing to listen on non-loopback address "
                f"{cfg.listen!r} without a token: pass --token-file FILE (token_file:) "
                "or listen on 127.0.0.1"
            )
    return cfg
