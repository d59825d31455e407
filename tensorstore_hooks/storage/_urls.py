"""Store URLs: the one place that takes a store URL apart.

The registry (``open_store``), the config validator, ``ZarrStore`` (through
:func:`split_url`), ``FsspecIO`` (:func:`link_protocols`), ``DaemonStore``
(:func:`parse_daemon_url`) and the hooks ask here, so they cannot disagree about
what a URL means. Nothing here imports a store, opens a file or touches the network.

NOTE [ Store URL rules ]
Rule 1. ``None`` is a fresh temporary local directory. The empty string is refused:
        it would otherwise be the current directory.
Rule 2. A string with neither ``://`` nor ``::`` is a bare local path, unless it
        starts like a URL with too few slashes: ``tsh:/host:7077``, ``file:/x``,
        ``s3:bucket`` (a known scheme followed by a colon but not ``//``), any
        ``word:/...``, or a known scheme followed by ``//`` without its colon
        (``s3//bucket``). Those are refused with the two-slash form shown, never taken
        as a local directory named ``tsh:``.
Rule 3. ``file://PATH`` is the local path ``PATH`` (``file:///abs`` is ``/abs``);
        ``file://`` with no path is refused (never the current directory).
Rule 4. ``memory://[LABEL]``: a private in-memory store; the label only names it.
Rule 5. The daemon: ``tsh://HOST:PORT`` and ``tsh+tls://HOST:PORT`` (TCP, plain or
        TLS) with the port always given: there is no client-side default port, so a
        YAML file, ``open_store`` and ``offload`` accept exactly the same URLs;
        ``tsh+unix:///absolute/path.sock``. No user, path or query (the token goes in
        options or ``TSH_TOKEN``), and never chained with ``::``.
Rule 6. Anything else is an fsspec URL, possibly chained (``simplecache::s3://b/p``);
        the registry checks every link's protocol.
Schemes are case-insensitive (``S3://`` is ``s3://``): every link's scheme is taken
in lower case. A local path (bare or after ``file://``) starting with ``~`` is the
home directory, expanded as fsspec and the shell do (``~/acts``, ``~user/acts``); one
that cannot be expanded is refused, never a directory literally named ``~``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from tensorstore_hooks.errors import ConfigError

__all__ = [
    "DAEMON_SCHEMES",
    "DEFAULT_PORT",
    "BadURLError",
    "DaemonAddress",
    "check_not_one_slash",
    "is_bare_path",
    "link_protocols",
    "parse_daemon_url",
    "scheme_of",
    "split_url",
]

DEFAULT_PORT = 7077
"""The port ``tensorstore-hooks serve`` listens on when given none. Clients always
name the port (NOTE [ Store URL rules ] Rule 5); error messages suggest this one."""

DAEMON_SCHEMES: tuple[str, ...] = ("tsh", "tsh+tls", "tsh+unix")
"""URL schemes of the storage daemon: TCP, TCP with TLS, a Unix socket."""

# "word:" not followed by a second ":" (that is an fsspec chain, "simplecache::s3://").
_SCHEME_HEAD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(?!:)(.*)$", re.DOTALL)
# "s3//bucket/p": a known scheme and two slashes, the colon left out (Rule 2).
_NO_COLON = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)//([^/].*)$", re.DOTALL)


class BadURLError(ConfigError):
    """A store URL that breaks NOTE [ Store URL rules ]; ``reason`` says how to fix it."""

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = reason
        super().__init__(f"store URL {url!r}: {reason}")


def is_bare_path(url: str) -> bool:
    """Whether ``url`` is a plain local path (Rule 2), before the one-slash check."""
    return "://" not in url and "::" not in url


def scheme_of(url: str) -> str:
    """The lower-case scheme deciding the store kind: ``""`` for a bare path; the first
    link's protocol for a chained URL (``simplecache::s3://b`` -> ``simplecache``)."""
    if is_bare_path(url):
        return ""
    return link_protocols(url)[0]


def link_protocols(url: str) -> list[str]:
    """Every link's protocol of an fsspec URL, lower case: ``simplecache::s3://b`` ->
    ``["simplecache", "s3"]``; a link without ``://`` is its own name."""
    return [
        (link.split("://", 1)[0] if "://" in link else link).lower() for link in url.split("::")
    ]


def check_not_one_slash(url: str, is_known: Callable[[str], bool]) -> None:
    """Refuse a bare path that is a URL with too few slashes (Rule 2).

    ``is_known(scheme)`` says whether a scheme names a store kind (the registry's
    answer). Raises :class:`BadURLError` showing the two-slash form.
    """
    m = _NO_COLON.match(url)
    if m is not None and is_known(m.group(1).lower()):  # "s3//bucket/p": the colon left out
        fixed = f"{m.group(1).lower()}://{m.group(2)}"
        raise BadURLError(
            url,
            f"this looks like a URL without its colon; did you mean {fixed!r}? (a local "
            f"directory named {m.group(1)!r} must be written as ./{url})",
        )
    m = _SCHEME_HEAD.match(url)
    if m is None:
        return
    scheme, rest = m.group(1).lower(), m.group(2)
    if not (rest.startswith("/") or is_known(scheme)):
        return  # "run:3" is a directory name; "tsh:host:1" and "x:/y" are not
    if scheme == "file":
        fixed = "file://" + ("/" + rest.lstrip("/") if rest else "/ABSOLUTE/PATH")
    else:
        fixed = f"{scheme}://{rest.lstrip('/')}"
    raise BadURLError(
        url,
        f"a URL needs two slashes after '{scheme}:'; did you mean {fixed!r}? "
        "(a local directory whose name has a colon must be written as ./NAME or file:///PATH)",
    )


def split_url(url: str | os.PathLike[str] | None) -> tuple[str, str]:
    """Classify a Zarr store URL: ``(kind, location)``, kind ``local|memory|fsspec``.

    ``local``: location is the directory (``""`` for ``None``: the caller makes a
    temporary one); ``memory``: the URL itself; ``fsspec``: the URL itself. Raises
    :class:`BadURLError` for ``""``, ``file://`` without a path and one-slash URLs
    of the Zarr schemes (Rules 1-3); the registry checks other schemes.
    """
    if url is None:
        return "local", ""
    s = os.fspath(url)
    if not s.strip():
        raise BadURLError(s, "empty; pass None (or leave store.url out) for a temporary directory")
    if "://" not in s:
        check_not_one_slash(s, lambda scheme: scheme in ("file", "memory"))
    if is_bare_path(s):
        return "local", _home(s, s)
    s = _lower_schemes(s)
    scheme = scheme_of(s)
    if scheme == "file" and "::" not in s:
        path = s.split("://", 1)[1]
        if not path.strip():
            raise BadURLError(
                s, "file:// needs a path, e.g. file:///scratch/acts (never the current directory)"
            )
        return "local", _home(path, s)
    if scheme == "memory" and "::" not in s:
        return "memory", s
    return "fsspec", s


def _lower_schemes(url: str) -> str:
    """``S3://b/P`` -> ``s3://b/P``: each link's scheme in lower case, the rest as given."""
    links = url.split("::")
    for i, link in enumerate(links):
        scheme, sep, rest = link.partition("://")
        links[i] = scheme.lower() + sep + rest if sep else link.lower()
    return "::".join(links)


def _home(path: str, url: str) -> str:
    """A local path with its leading ``~`` expanded (as fsspec does); refused if it cannot be."""
    if not path.startswith("~"):
        return path
    expanded = os.path.expanduser(path)
    if expanded.startswith("~"):
        raise BadURLError(
            url,
            f"cannot expand {path.split('/', 1)[0]!r} (no such user, or HOME is not set); "
            "give an absolute path, e.g. file:///home/me/acts (a directory literally named "
            "'~' must be written as ./~)",
        )
    return expanded


@dataclass(frozen=True, slots=True)
class DaemonAddress:
    """Where a daemon listens: a TCP ``(host, port)`` (``tls``: ``tsh+tls://``) or a
    Unix socket ``path``. ``url`` is the normalised form, for messages and stats."""

    url: str
    host: str = ""
    port: int = 0
    path: str | None = None
    tls: bool = False


def parse_daemon_url(url: str) -> DaemonAddress:
    """Parse ``tsh://HOST:PORT``, ``tsh+tls://HOST:PORT`` or ``tsh+unix:///path`` (Rule 5).

    The port is required (1..65535); IPv6 hosts go in brackets (``tsh://[::1]:7077``).
    Raises :class:`BadURLError` naming the URL and the form that works.
    """
    if not isinstance(url, str):
        raise ConfigError(f"store URL: expected a tsh:// string, got {type(url).__name__}")
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in DAEMON_SCHEMES:
        raise BadURLError(
            url,
            "expected tsh://HOST:PORT, tsh+tls://HOST:PORT or tsh+unix:///path/to/socket",
        )
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise BadURLError(
            url, "a daemon URL takes no query; pass token=... to open_store or set TSH_TOKEN"
        )
    if scheme == "tsh+unix":
        path = parts.netloc + parts.path
        if parts.netloc or not path.startswith("/"):
            raise BadURLError(url, "expected tsh+unix:///absolute/path/to/socket (three slashes)")
        return DaemonAddress(url=f"tsh+unix://{path}", path=path)
    example = f"{scheme}://127.0.0.1:{DEFAULT_PORT}"
    if parts.path not in ("", "/") or parts.username or parts.password:
        raise BadURLError(
            url,
            f"expected {scheme}://HOST:PORT with no path or user, e.g. {example} "
            "(pass token=... to open_store or set TSH_TOKEN)",
        )
    host = parts.hostname
    if not host:
        raise BadURLError(url, f"missing host; expected {scheme}://HOST:PORT, e.g. {example}")
    try:
        port = parts.port
    except ValueError:
        port = -1
    shown = f"[{host}]" if ":" in host else host
    if port is None:
        raise BadURLError(
            url,
            f"the port is missing: expected {scheme}://HOST:PORT, e.g. "
            f"{scheme}://{shown}:{DEFAULT_PORT} ({DEFAULT_PORT} is the daemon's default; "
            "'tensorstore-hooks serve' prints its URL)",
        )
    if not 0 < port < 65536:
        raise BadURLError(
            url, f"the port must be 1..65535; expected {scheme}://HOST:PORT, e.g. {example}"
        )
    return DaemonAddress(
        url=f"{scheme}://{shown}:{port}", host=host, port=port, tls=scheme == "tsh+tls"
    )
