"""``open_store(url)``: choose a store implementation by URL scheme.

Like fsspec's registry: each scheme maps to a lazily imported factory, an unknown
scheme is a :class:`ConfigError` listing the known ones, and a known scheme whose
package is missing names the ``pip install`` that fixes it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

from ._store import TensorStore
from .errors import ConfigError

__all__ = ["known_schemes", "open_store", "register_store"]

StoreFactory = Callable[..., TensorStore]

# scheme -> "module:attribute" (imported on first use) or a factory.
_REGISTRY: dict[str, str | StoreFactory] = {
    "file": "tensorstore_hooks._zarr_store:ZarrStore",
    "memory": "tensorstore_hooks._zarr_store:ZarrStore",
    "tsh": "tensorstore_hooks._daemon_client:DaemonStore",
    "tsh+unix": "tensorstore_hooks._daemon_client:DaemonStore",
    "tsh+tls": "tensorstore_hooks._daemon_client:DaemonStore",
}
_FSSPEC_FACTORY = "tensorstore_hooks._zarr_store:ZarrStore"


def register_store(scheme: str, factory: str | StoreFactory) -> None:
    """Route ``scheme://...`` URLs to ``factory(url, **options)``.

    ``factory`` is a callable or a ``"module:attribute"`` string imported on first use.
    """
    _REGISTRY[scheme.lower()] = factory


def known_schemes() -> list[str]:
    """Schemes ``open_store`` accepts: ours plus every fsspec protocol."""
    from fsspec.registry import known_implementations

    return sorted(set(_REGISTRY) | set(known_implementations))


def _scheme(url: str) -> str:
    # For chained fsspec URLs ("simplecache::s3://b/k") every link must be known;
    # the first decides the factory (fsspec handles the chain).
    first = url.split("::", 1)[0]
    return first.split("://", 1)[0].lower() if "://" in first else first.lower()


def _resolve(target: str | StoreFactory) -> StoreFactory:
    if callable(target):
        return target
    module, _, attr = target.partition(":")
    factory: StoreFactory = getattr(importlib.import_module(module), attr)
    return factory


def _check_fsspec_protocol(protocol: str, url: str) -> None:
    from fsspec.registry import get_filesystem_class, known_implementations

    if protocol not in known_implementations:
        try:
            get_filesystem_class(protocol)  # a package may have registered it itself
            return
        except (ValueError, ImportError):
            pass
        raise ConfigError(
            f"open_store: unknown URL scheme {protocol!r} in {url!r}. Known: bare paths, "
            f"{', '.join(sorted(_REGISTRY))}, and fsspec protocols "
            f"({', '.join(sorted(known_implementations)[:12])}, ...). "
            "Install the fsspec implementation for your storage, e.g. pip install s3fs"
        )
    try:
        get_filesystem_class(protocol)
    except ImportError as e:
        impl = known_implementations[protocol]
        hint = impl.get("err") or str(e)
        package = impl["class"].split(".", 1)[0]
        if package != "fsspec":  # fsspec's own classes name their extra package in "err"
            hint = f"{hint} (pip install {package})"
        raise ConfigError(
            f"open_store: scheme {protocol!r} in {url!r} needs a package that is not "
            f"installed: {hint}"
        ) from e


def open_store(
    url: str | os.PathLike[str] | TensorStore | None = None, **options: Any
) -> TensorStore:
    """Open the store for ``url``.

    * ``None``: a fresh temporary local Zarr store, removed on ``close()`` and at exit.
    * a bare path or ``file://``: a local Zarr store; ``memory://``: a private
      in-memory Zarr store; ``tsh://HOST:PORT`` / ``tsh+unix:///path``: the daemon;
      any other fsspec URL (``s3://bucket/prefix``): a Zarr store through fsspec,
      with ``storage_options=`` passed to it.
    * a :class:`TensorStore`: returned as is (``options`` must then be empty).

    ``options`` go to the store's constructor (``chunk_bytes``, ``codec``,
    ``storage_options``, ``token``, ...). Raises :class:`ConfigError` for unknown
    schemes, missing packages and bad options.
    """
    if isinstance(url, TensorStore):
        if options:
            raise ConfigError(
                f"open_store: options {sorted(options)} cannot apply to an existing store object"
            )
        return url
    if url is None:
        return _resolve(_REGISTRY["file"])(None, **options)
    if not isinstance(url, str | os.PathLike):
        raise ConfigError(
            "open_store: expected a URL string, a path, a TensorStore or None, "
            f"got {type(url).__name__}"
        )
    s = os.fspath(url)
    if "://" not in s and "::" not in s:
        target: str | StoreFactory = _REGISTRY["file"]
    else:
        scheme = _scheme(s)
        if scheme in _REGISTRY:
            target = _REGISTRY[scheme]
        else:
            for link in s.split("::"):
                proto = link.split("://", 1)[0].lower() if "://" in link else link.lower()
                _check_fsspec_protocol(proto, s)
            target = _FSSPEC_FACTORY
    try:
        return _resolve(target)(s, **options)
    except TypeError as e:
        raise ConfigError(f"open_store({s!r}): bad options {sorted(options)}: {e}") from e
