"""Listening: bind the TCP or Unix socket, accept connections, hand them on.

The daemon decides what to do with each accepted socket (the connection cap,
the handshake); this module only owns the listening sockets and their files.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import ssl
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from tensorstore_hooks.errors import ConfigError

from ._config import ServerConfig, parse_address

__all__ = ["Listener", "accept_loop", "bind", "remove_stale_socket", "server_tls_context"]

log = logging.getLogger("tensorstore_hooks.server")

Accepted = Callable[[socket.socket, object], None]
"""Called with each accepted socket and its peer address (``str()`` of it is logged)."""


@dataclass
class Listener:
    """The bound listening sockets and the URL clients use."""

    url: str
    sockets: list[socket.socket] = field(default_factory=list)
    unix_path: str | None = None
    """The Unix socket file this daemon created (removed at :meth:`close`)."""

    def close(self) -> None:
        for lsock in self.sockets:
            lsock.close()
        if self.unix_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)


def bind(cfg: ServerConfig) -> Listener:
    """Bind ``cfg.unix`` (a socket file created 0600) or ``cfg.listen``; raises OSError."""
    if cfg.unix is not None:
        path = os.path.abspath(cfg.unix)
        remove_stale_socket(path)
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)  # the socket file is created 0600: owner only
            try:
                lsock.bind(path)
            finally:
                os.umask(old)
            lsock.listen(128)
        except BaseException:
            lsock.close()
            raise
        lsock.setblocking(False)
        return Listener(f"tsh+unix://{path}", [lsock], unix_path=path)
    assert cfg.listen is not None
    host, port = parse_address(cfg.listen)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family = infos[0][0]
    lsock = socket.create_server((host, port), family=family, backlog=128)
    bound = lsock.getsockname()
    shown = f"[{bound[0]}]" if family == socket.AF_INET6 else bound[0]
    lsock.setblocking(False)
    scheme = "tsh+tls" if cfg.tls else "tsh"
    return Listener(f"{scheme}://{shown}:{bound[1]}", [lsock])


def cleartext_warning(listen: str) -> str:
    """What a non-loopback listener without TLS is told at start (and by ``--check``)."""
    return (
        f"listening on {listen} without TLS: tokens and tensors cross the network in "
        "clear; serve with --tls-cert/--tls-key (see docs/daemon.md, Security)"
    )


def server_tls_context(cfg: ServerConfig) -> ssl.SSLContext | None:
    """The daemon's TLS context (TLS 1.2+), or None without ``tls_cert``. Raises ConfigError."""
    if cfg.tls_cert is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(
            f"daemon config: tls_cert {cfg.tls_cert!r} / tls_key {cfg.tls_key!r}: cannot load "
            f"the certificate and key (PEM files, the key matching the certificate): {e}"
        ) from e
    if cfg.tls_client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=cfg.tls_client_ca)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                f"daemon config: tls_client_ca {cfg.tls_client_ca!r}: cannot load the CA "
                f"bundle (PEM): {e}"
            ) from e
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


async def accept_loop(lsock: socket.socket, accepted: Accepted) -> None:
    """Accept connections on ``lsock`` forever, calling ``accepted(sock, addr)`` for each."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            sock, addr = await loop.sock_accept(lsock)
        except OSError as e:
            # EMFILE and friends: back off instead of spinning.
            log.warning("accept failed: %s", e)
            await asyncio.sleep(0.1)
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        accepted(sock, addr)


def remove_stale_socket(path: str) -> None:
    """Remove a Unix socket left by a daemon that died; refuse to steal a live one."""
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return  # not a socket: bind() reports the conflict
    except FileNotFoundError:
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    except OSError:
        return
    finally:
        probe.close()
    owner = os.stat(path).st_uid
    whose = "" if owner == os.getuid() else f" (its socket belongs to uid {owner}, not you)"
    raise OSError(errno.EADDRINUSE, f"another daemon is listening on {path}{whose}")
