"""What the daemon checks about its surroundings before it serves: files, directories.

Each check returns warnings (strings) or raises :class:`ConfigError`; ``serve``
logs the warnings at start, ``serve --check`` prints them without starting.
"""

from __future__ import annotations

import os
import stat

from tensorstore_hooks.errors import ConfigError

from ._config import ServerConfig, is_loopback, parse_address, read_token

__all__ = ["check_config", "check_socket_dir", "token_file_warning"]


def token_file_warning(path: str) -> str | None:
    """A warning if users other than the owner may read the token file."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # read_token reports it
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (
            f"token file {path!r} is readable by other users (mode {stat.S_IMODE(mode):o}): "
            "chmod 600 it"
        )
    return None


def check_socket_dir(path: str) -> list[str]:
    """Check the directory a Unix socket goes in (see NOTE [ Unix socket directory ]).

    Raises ConfigError for a directory other users may write without the sticky
    bit (they could move the socket aside and listen in its place); warns for a
    shared sticky directory such as ``/tmp`` (another user may take the name
    first while the daemon is down).
    """
    # NOTE [ Unix socket directory ]
    # The socket file is 0600, so only its owner can connect, but the *name* belongs
    # to the directory. In a directory others can write, another user can rename our
    # socket and bind their own under its name: the next client sends its token to
    # them. The sticky bit stops the rename (only the owner may move a file), but
    # not a squatter who binds the name while no daemon runs. Clients therefore also
    # check who listens (SO_PEERCRED) before sending the token; the daemon refuses
    # the first case and warns about the second.
    parent = os.path.dirname(os.path.abspath(path)) or "/"
    try:
        st = os.stat(parent)
    except OSError as e:
        raise ConfigError(f"daemon config: unix {path!r}: directory {parent!r}: {e}") from e
    mode = stat.S_IMODE(st.st_mode)
    shared = mode & (stat.S_IWGRP | stat.S_IWOTH)
    if shared and not mode & stat.S_ISVTX:
        raise ConfigError(
            f"daemon config: unix {path!r}: directory {parent!r} is writable by other users "
            f"(mode {mode:o}, no sticky bit): they could replace the socket and collect "
            "clients' tokens. Put the socket in a private directory (mode 700), e.g. "
            "$XDG_RUNTIME_DIR"
        )
    warnings = []
    if shared:
        warnings.append(
            f"unix socket {path!r} is in a shared directory {parent!r} (mode {mode:o}): "
            "another user may take the name while the daemon is down; prefer a private "
            "directory such as $XDG_RUNTIME_DIR (clients check the listener's uid)"
        )
    if st.st_uid not in (os.getuid(), 0):
        warnings.append(
            f"unix socket directory {parent!r} belongs to uid {st.st_uid}, not to this user"
        )
    return warnings


def check_config(cfg: ServerConfig) -> list[str]:
    """Everything ``serve`` checks before binding; returns the warnings. Raises ConfigError."""
    from ._listen import cleartext_warning, server_tls_context

    warnings: list[str] = []
    if cfg.token_file is not None:
        read_token(cfg.token_file)
        w = token_file_warning(cfg.token_file)
        if w:
            warnings.append(w)
    server_tls_context(cfg)
    if cfg.unix is not None:
        warnings += check_socket_dir(cfg.unix)
    elif cfg.listen is not None and not cfg.tls and not is_loopback(parse_address(cfg.listen).host):
        warnings.append(cleartext_warning(cfg.listen))
    return warnings
