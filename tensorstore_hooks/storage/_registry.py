"""``open_store(url)``: the store kinds, one registry entry per URL scheme.

Like fsspec's registry: each scheme maps to a :class:`StoreKind` (a lazily imported
factory, its URL parser, the options it takes, an install hint); an unknown scheme
is a :class:`ConfigError` listing the known ones, and a known scheme whose package
is missing names the ``pip install`` that fixes it. Every other fsspec protocol
(``s3``, ``gs``, ...) is a Zarr store through fsspec.

The config validator (:func:`check_url`), ``open_store`` and the hooks
(:func:`options_from_config`) all ask :func:`kind_of`; URLs are taken apart only in
``_urls`` (NOTE [ Store URL rules ]). :func:`register_store` refuses to replace an
entry unless ``clobber=True``; :func:`store_kinds` is a read-only view.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol, TypeAlias

from tensorstore_hooks.errors import ConfigError
from tensorstore_hooks.storage._store import TensorStore
from tensorstore_hooks.storage._urls import (
    BadURLError,
    check_not_one_slash,
    link_protocols,
    parse_daemon_url,
    scheme_of,
    split_url,
)
from tensorstore_hooks.storage.chain import TierChain, check_budgets, check_chain_options

__all__ = [
    "ChainSpec",
    "StoreKind",
    "TierSpec",
    "TierURL",
    "check_packages",
    "check_url",
    "kind_of",
    "known_schemes",
    "open_store",
    "options_from_config",
    "register_store",
    "store_kinds",
]

StoreFactory = Callable[..., TensorStore]
UrlParser = Callable[[str], object]
TierURL: TypeAlias = "str | os.PathLike[str] | TensorStore | None"
"""What ``open_store`` opens (a URL, a path, a store object, ``None``: a temporary
directory); a list of them is a tier chain."""


@dataclass(frozen=True, slots=True)
class StoreKind:
    """One store kind: how ``scheme://...`` URLs are checked and opened."""

    scheme: str
    """Lower-case URL scheme (``"file"``, ``"tsh+unix"``)."""
    factory: str | StoreFactory
    """``factory(url, **options) -> TensorStore``, or ``"module:attribute"`` imported on
    first use (so checking a config never imports a backend)."""
    parse_url: UrlParser | None = None
    """Checks a URL of this kind without I/O; raises :class:`ConfigError` naming the fix.
    ``None``: anything after ``scheme://`` is accepted."""
    option_keys: frozenset[str] | None = None
    """Keyword options the factory accepts; others are a :class:`ConfigError` listing
    these. ``None``: not declared, everything is passed on."""
    config_options: tuple[str, ...] = ()
    """The ``store:`` config fields passed to the factory as keywords by ``offload()``
    (``codec``, ``chunk_bytes``, ``storage_options``, ``direct_io``)."""
    chainable: bool = False
    """Whether the scheme may be a link of an fsspec chain (``simplecache::file://``):
    only Zarr kinds, which fsspec opens; a daemon URL is never chained."""
    spread_storage_options: bool = False
    """``offload()`` passes ``store.storage_options``' items as keywords (daemon client
    options such as ``token``) instead of as ``storage_options=`` (fsspec's)."""
    install: str | None = None
    """What to install when the factory cannot be imported (``"pip install s3fs"``)."""


_ZARR = "tensorstore_hooks.storage.zarr._store:ZarrStore"
_DAEMON = "tensorstore_hooks.storage.daemon._client:DaemonStore"
_ZARR_OPTIONS = frozenset(
    {
        "storage_options",
        "chunk_bytes",
        "codec",
        "namespace",
        "retry_deadline_s",
        "spare_bytes",
        "direct_io",
        "buffer_pool_bytes",
    }
)
_ZARR_CONFIG_OPTIONS = ("codec", "chunk_bytes", "storage_options", "direct_io")


def _check_zarr_url(url: str) -> None:
    split_url(url)


def _zarr_kind(scheme: str) -> StoreKind:
    return StoreKind(
        scheme=scheme,
        factory=_ZARR,
        parse_url=_check_zarr_url,
        option_keys=_ZARR_OPTIONS,
        config_options=_ZARR_CONFIG_OPTIONS,
        chainable=True,
    )


def _daemon_kind(scheme: str) -> StoreKind:
    # Options are the DaemonStore constructor's (token, connections, TLS files, ...):
    # left undeclared so the client alone says which it takes.
    return StoreKind(
        scheme=scheme, factory=_DAEMON, parse_url=parse_daemon_url, spread_storage_options=True
    )


_BUILTIN: dict[str, StoreKind] = {
    "file": _zarr_kind("file"),
    "memory": _zarr_kind("memory"),
    "tsh": _daemon_kind("tsh"),
    "tsh+tls": _daemon_kind("tsh+tls"),
    "tsh+unix": _daemon_kind("tsh+unix"),
}
_FSSPEC_KIND = StoreKind(
    scheme="fsspec",
    factory=_ZARR,
    parse_url=_check_zarr_url,
    option_keys=_ZARR_OPTIONS,
    config_options=_ZARR_CONFIG_OPTIONS,
    chainable=True,
)
_LOCAL_KIND = _BUILTIN["file"]

_lock = threading.Lock()
_kinds: dict[str, StoreKind] = dict(_BUILTIN)
_view: Mapping[str, StoreKind] = MappingProxyType(_kinds)


def store_kinds() -> Mapping[str, StoreKind]:
    """The registered kinds by scheme: a read-only live view (fsspec protocols that are
    not registered here are opened as Zarr stores and are not listed)."""
    return _view


def register_store(
    scheme: str,
    factory: str | StoreFactory,
    *,
    parse_url: UrlParser | None = None,
    option_keys: frozenset[str] | set[str] | None = None,
    install: str | None = None,
    clobber: bool = False,
) -> StoreKind:
    """Route ``scheme://...`` URLs to ``factory(url, **options)``.

    ``factory``: a callable or a ``"module:attribute"`` string imported on first use.
    ``parse_url(url)``: optional check run by ``open_store`` and the config validator
    (raise :class:`ConfigError`). ``option_keys``: the options the factory takes.
    ``install``: the hint shown when the factory's module is missing. With
    ``offload()``, the config's ``store.storage_options`` items become the factory's
    keywords. A scheme already registered with another factory is a
    :class:`ConfigError` unless ``clobber=True`` (the same factory again replaces the
    entry), as in fsspec. Returns the new entry.
    """
    if not isinstance(scheme, str) or not scheme or "://" in scheme or ":" in scheme:
        raise ConfigError(
            f"register_store: scheme must be a name such as 'mystore' (no ':'), got {scheme!r}"
        )
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise ConfigError(
            "register_store: factory must be a callable or a 'module:attribute' string, "
            f"got {factory!r}"
        )
    key = scheme.lower()
    kind = StoreKind(
        scheme=key,
        factory=factory,
        parse_url=parse_url,
        option_keys=None if option_keys is None else frozenset(option_keys),
        spread_storage_options=True,
        install=install,
    )
    with _lock:
        old = _kinds.get(key)
        if old is not None and old.factory != factory and not clobber:
            raise ConfigError(
                f"register_store: scheme {key!r} is already registered to {old.factory!r}; "
                "pass clobber=True to replace it"
            )
        _kinds[key] = kind
    return kind


def known_schemes() -> list[str]:
    """Schemes ``open_store`` accepts: the registered ones plus every fsspec protocol."""
    return sorted(set(_kinds) | _fsspec_protocols())


def _fsspec_protocols() -> set[str]:
    from fsspec.registry import known_implementations, registry

    return set(known_implementations) | set(registry)


def _is_known(scheme: str) -> bool:
    return scheme in _kinds or scheme in _fsspec_protocols()


def kind_of(url: str) -> StoreKind:
    """The :class:`StoreKind` for a URL string, after checking it without I/O or imports.

    Raises :class:`ConfigError` for ``""``, one-slash URLs, unknown schemes, chained
    daemon URLs and URLs the kind's parser refuses (NOTE [ Store URL rules ]).
    """
    if not url.strip():
        raise BadURLError(
            url, "empty; pass None (or leave store.url out) for a temporary directory"
        )
    if "://" not in url:
        check_not_one_slash(url, _is_known)
    scheme = scheme_of(url)
    if not scheme:
        kind = _LOCAL_KIND
    elif scheme in _kinds and ("::" not in url or not _kinds[scheme].chainable):
        # Only Zarr kinds chain; after a daemon's "tsh://", "::" is an IPv6 host.
        kind = _kinds[scheme]
    else:
        for proto in link_protocols(url):
            if proto in _kinds and not _kinds[proto].chainable:
                raise BadURLError(url, f"{proto}:// cannot be chained with other protocols")
            if proto not in _kinds and proto not in _fsspec_protocols():
                raise BadURLError(url, _unknown_scheme(proto))
        kind = _FSSPEC_KIND
    if kind.parse_url is not None:
        kind.parse_url(url)
    return kind


def check_url(url: str) -> str:
    """The config validator's check of ``store.url``: :func:`kind_of`, returning ``url``."""
    kind_of(url)
    return url


def check_packages(url: str) -> None:
    """Raise :class:`ConfigError` naming what to install when ``url``'s store needs a
    package this Python lacks (``s3://`` without s3fs); imports, never any I/O."""
    kind = kind_of(url)
    if kind is _FSSPEC_KIND:
        _check_fsspec_importable(url)
    else:
        _resolve(kind)


def _unknown_scheme(proto: str) -> str:
    from fsspec.registry import known_implementations

    return (
        f"unknown URL scheme {proto!r}; use a bare path or one of "
        f"{', '.join(sorted(_kinds))}, or an fsspec protocol such as s3, gs, az, http, sftp "
        f"({len(known_implementations)} known; chains like 'simplecache::s3://b/p' work too). "
        "Install the fsspec implementation for your storage, e.g. pip install s3fs"
    )


def options_from_config(
    url: object,
    codec: str,
    chunk_bytes: int,
    storage_options: Mapping[str, object],
    direct_io: str = "auto",
) -> dict[str, object]:
    """The ``open_store`` options that the config's ``store:`` section gives ``url``'s kind.

    ``url``: what ``offload()`` will pass to ``open_store`` (``None``, a string, a path);
    for anything else ``{}``, and ``open_store`` refuses it with a :class:`ConfigError`.
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if url is not None and not isinstance(url, str):
        return {}
    kind = _LOCAL_KIND if url is None else kind_of(url)
    if kind.spread_storage_options:
        return dict(storage_options)
    given: dict[str, object] = {
        "codec": codec,
        "chunk_bytes": chunk_bytes,
        "storage_options": storage_options,
        "direct_io": direct_io,
    }
    opts = {k: given[k] for k in kind.config_options}
    if not opts.get("storage_options"):
        opts.pop("storage_options", None)
    else:
        opts["storage_options"] = dict(storage_options)
    return opts


def _resolve(kind: StoreKind) -> StoreFactory:
    if callable(kind.factory):
        return kind.factory
    module, _, attr = kind.factory.partition(":")
    try:
        factory: StoreFactory = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        hint = kind.install or f"the package that provides {module}"
        raise ConfigError(
            f"open_store: scheme {kind.scheme!r} needs {module}, which cannot be imported "
            f"({e}); install it: {hint}"
        ) from e
    return factory


def _check_fsspec_importable(url: str) -> None:
    from fsspec.registry import get_filesystem_class, known_implementations

    for protocol in link_protocols(url):
        if protocol in _kinds:
            continue
        try:
            get_filesystem_class(protocol)
        except ImportError as e:
            impl = known_implementations.get(protocol, {})
            hint = impl.get("err") or str(e)
            package = impl.get("class", "fsspec").split(".", 1)[0]
            if package != "fsspec":  # fsspec's own classes name their extra package in "err"
                hint = f"{hint} (pip install {package})"
            raise ConfigError(
                f"open_store: scheme {protocol!r} in {url!r} needs a package that is not "
                f"installed: {hint}"
            ) from e
        except ValueError as e:
            raise BadURLError(url, _unknown_scheme(protocol)) from e


def open_store(
    url: TierURL | Sequence[TierURL] = None, **options: object
) -> TensorStore:
    """Open the store for ``url``.

    * ``None``: a fresh temporary local Zarr store, removed on ``close()`` and at exit.
    * a bare path or ``file:///path``: a local Zarr store; ``memory://``: a private
      in-memory Zarr store; ``tsh://HOST:PORT`` (port required), ``tsh+tls://HOST:PORT``
      or ``tsh+unix:///path``: the daemon; any other fsspec URL
      (``s3://bucket/prefix``): a Zarr store through fsspec, with ``storage_options=``
      passed to it. ``""``, ``file://`` and one-slash URLs (``tsh:/host:7077``) are
      refused (NOTE [ Store URL rules ]).
    * a :class:`TensorStore`: returned as is (``options`` must then be empty).
    * a list of the above, fastest first, with ``budgets=[...]`` (one size per tier but
      the last): a :class:`~tensorstore_hooks.TierChain`; ``storage_options`` is then one
      dict for every tier or a list, one per tier (:func:`open_chain`).

    ``options`` go to the store's constructor (``chunk_bytes``, ``codec``,
    ``storage_options``, ``token``, ...). Raises :class:`ConfigError` for unknown
    schemes, missing packages and bad options, naming the fix.
    """
    if isinstance(url, TensorStore):
        if options:
            raise ConfigError(
                f"open_store: options {sorted(options)} cannot apply to an existing store object"
            )
        return url
    if url is None:
        return _open(_LOCAL_KIND, None, options)
    if isinstance(url, list | tuple):
        return open_chain(url, **options)
    if not isinstance(url, str | os.PathLike):
        raise ConfigError(
            "open_store: expected a URL string, a path, a TensorStore, None, or a list of "
            f"those (a tier chain), got {type(url).__name__} {url!r}"
        )
    s = os.fspath(url)
    if not isinstance(s, str):
        raise ConfigError(f"open_store: expected a str path, got {type(s).__name__} {s!r}")
    kind = kind_of(s)
    if kind is _FSSPEC_KIND:
        _check_fsspec_importable(s)
    return _open(kind, s, options)


def _open(kind: StoreKind, url: str | None, options: Mapping[str, object]) -> TensorStore:
    shown = "open_store()" if url is None else f"open_store({url!r})"
    if kind.option_keys is not None:
        unknown = sorted(set(options) - kind.option_keys)
        if unknown:
            raise ConfigError(
                f"{shown}: unknown option(s) {', '.join(unknown)} for {kind.scheme} stores; "
                f"allowed: {', '.join(sorted(kind.option_keys))}"
            )
    factory = _resolve(kind)
    try:
        return factory(url, **options)
    except TypeError as e:
        raise ConfigError(f"{shown}: bad options {sorted(options)}: {e}") from e


# ------------------------------------------------------------------ tier chains
_CHAIN_KEYWORDS = (
    "budgets", "storage_options", "move_threads", "put_wait_s", "close_timeout_s", "plan"
)


def open_chain(
    urls: Sequence[TierURL],
    *,
    budgets: object = None,
    storage_options: object = None,
    move_threads: object = 2,
    put_wait_s: object = 60.0,
    close_timeout_s: object = 60.0,
    plan: object = True,
    **options: object,
) -> TierChain:
    """``open_store([url, url, ...], budgets=[...], ...)``: open each tier, then chain them.

    ``urls``: two or more of what ``open_store`` takes (a URL, a path, ``None`` for a
    temporary directory, or a :class:`TensorStore`, which the chain then does not
    close), fastest first. ``storage_options``: one dict for every tier, or a list
    with one dict (or ``None``) per tier. Other ``options`` (``chunk_bytes``,
    ``codec``, ``retry_deadline_s``, ...) go to every tier whose kind takes them; one
    that no tier takes is a :class:`ConfigError`. The Zarr tiers share one namespace
    name (unless ``namespace=`` is given), so ``inspect`` can pair their contents.
    """
    urls = list(urls)
    if len(urls) < 2:
        raise ConfigError(
            "open_store: a list is a tier chain and needs two or more URLs (fastest first), "
            f"got a list of {len(urls)}: {urls!r}; for one store pass its URL alone"
        )
    if budgets is None:
        raise ConfigError(
            f"open_store({urls!r}): a tier chain needs budgets=[...], one size per tier but "
            "the last (e.g. budgets=['64GiB']): the bytes each tier may hold"
        )
    sizes = check_budgets(budgets, len(urls))
    per_tier = _per_tier_options(storage_options, len(urls))
    options = _chain_options(urls, options)
    threads, wait_s, timeout_s = check_chain_options(move_threads, put_wait_s, close_timeout_s)
    stores: list[TensorStore] = []
    owned: list[bool] = []
    try:
        for i, (url, so) in enumerate(zip(urls, per_tier, strict=True)):
            store, own = _open_tier(i, url, so, options)
            stores.append(store)
            owned.append(own)
        return TierChain(
            stores,
            sizes,
            owned=owned,
            move_threads=threads,
            put_wait_s=wait_s,
            close_timeout_s=timeout_s,
            plan=bool(plan),
        )
    except BaseException:
        for store, own in zip(stores, owned, strict=False):
            if own:
                with contextlib.suppress(Exception):
                    store.close()
        raise


def _tier_kind(i: int, url: object) -> StoreKind:
    """The kind tier ``i`` of a chain opens as (``url`` is not a store object)."""
    if url is None:
        return store_kinds()["file"]
    if isinstance(url, str | os.PathLike):
        return kind_of(os.fspath(url))
    raise ConfigError(
        f"open_store: tier {i} of the chain must be a URL, a path, None or a "
        f"TensorStore, got {type(url).__name__} {url!r}"
    )


def _chain_options(urls: Sequence[TierURL], options: dict[str, object]) -> dict[str, object]:
    """``options`` with the chain's shared ``namespace`` default; an option that no
    tier's kind takes is a :class:`ConfigError`. Checks every tier's URL first."""
    kinds = [None if isinstance(u, TensorStore) else _tier_kind(i, u) for i, u in enumerate(urls)]
    if "namespace" not in options:
        from tensorstore_hooks.storage.zarr import default_namespace

        options = {**options, "namespace": default_namespace()}
    taken = {k for kind in kinds if kind is not None and kind.option_keys for k in kind.option_keys}
    unknown = sorted(set(options) - taken - {"namespace"})
    if unknown:
        raise ConfigError(
            f"open_store({urls!r}): no tier of the chain takes option(s) {', '.join(unknown)}; "
            f"the tiers take: {', '.join(sorted(taken)) or 'none'} "
            f"(chain options: {', '.join(_CHAIN_KEYWORDS)})"
        )
    return options


def _open_tier(
    i: int, url: TierURL, so: Mapping[str, object] | None, options: Mapping[str, object]
) -> tuple[TensorStore, bool]:
    """Open tier ``i`` of a chain with its ``storage_options`` ``so`` and the ``options``
    its kind takes: ``(store, owned)``; a store object is used as it is, not owned."""
    if isinstance(url, TensorStore):
        if so:
            raise ConfigError(
                "open_store: storage_options cannot apply to a tier given as a store "
                f"object ({url!r}); pass None for it in the list"
            )
        return url, False
    kind = _tier_kind(i, url)
    if kind.spread_storage_options:
        opts = dict(so or {})
    else:
        keys = kind.option_keys or frozenset()
        opts = {k: v for k, v in options.items() if k in keys}
        if so:
            opts["storage_options"] = dict(so)
    return open_store(url, **opts), True


def _per_tier_options(storage_options: object, tiers: int) -> list[Mapping[str, object] | None]:
    if storage_options is None:
        return [None] * tiers
    if isinstance(storage_options, dict):
        return [storage_options] * tiers
    if (
        isinstance(storage_options, list | tuple)
        and len(storage_options) == tiers
        and all(so is None or isinstance(so, dict) for so in storage_options)
    ):
        return list(storage_options)
    raise ConfigError(
        f"open_store: storage_options of a {tiers}-tier chain must be one dict for every "
        f"tier or a list of {tiers} dicts (or None), one per tier; got {storage_options!r}"
    )


class TierSpec(Protocol):
    """One tier of a :class:`ChainSpec` (the config's ``store.tiers`` entries)."""

    @property
    def url(self) -> str: ...
    @property
    def budget(self) -> int | None:
        """Bytes the tier may hold; ``None`` for the last tier."""
    @property
    def storage_options(self) -> Mapping[str, object] | None:
        """This tier's options; ``None``: the chain's."""


class ChainSpec(Protocol):
    """What :func:`chain_from_settings` reads: a tier chain described as settings (the
    config's ``StoreSettings`` is one)."""

    @property
    def tiers(self) -> Sequence[TierSpec]:
        """The tiers, fastest first."""
    @property
    def codec(self) -> str: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def storage_options(self) -> Mapping[str, object]:
        """Options for every tier that has none of its own."""


def chain_from_settings(spec: ChainSpec) -> TierChain:
    """The chain a config's ``store: {tiers: [...]}`` section describes: each tier's
    ``storage_options`` or else the section's; ``codec`` and ``chunk_bytes`` for every
    Zarr tier."""
    tiers = spec.tiers
    # As for one store (options_from_config): only the settings some tier's kind takes.
    wanted = {k for t in tiers for k in kind_of(t.url).config_options}
    given: dict[str, object] = {"codec": spec.codec, "chunk_bytes": spec.chunk_bytes}
    return open_chain(
        [t.url for t in tiers],
        budgets=[t.budget for t in tiers[:-1]],
        storage_options=[
            dict(t.storage_options if t.storage_options is not None else spec.storage_options)
            for t in tiers
        ],
        **{k: v for k, v in given.items() if k in wanted},
    )
