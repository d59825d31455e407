"""TierChain: one :class:`TensorStore` over several stores, fastest first.

``tsh.open_store(["file:///nvme/acts", "s3://bucket/acts"], budgets=["64GiB"])`` makes
one (``_registry`` opens the tiers); ``TierChain([store, store], budgets=[...])`` makes
one from store objects. Puts land in the first tier; when a tier is over its budget,
background movers take its oldest tensors down to the next one. Backward reads the
newest tensors first, so they are the ones the fast tiers keep.

The rules: NOTE [ Tier chain ] in ``_chain_core.py``.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from ._chain_core import ChainStats, Core, Tier
from ._store import TensorStore
from ._units import format_bytes, parse_bytes
from .errors import ConfigError

__all__ = ["ChainStats", "TierChain", "check_budgets", "open_chain"]


# --------------------------------------------------------------------------- public
class TierChain(TensorStore):
    """Several stores as one, fastest first: puts land in the first tier, and while a
    tier is over its budget its oldest tensors move down in the background.

    ``tiers``: the stores, fastest first. ``budgets``: one per tier but the last, a
    size (int bytes or ``"64GiB"``): the bytes that tier may hold, counted as it
    actually holds them (a tensor being moved counts in both tiers). ``owned``: one
    flag per tier, whether ``close()`` closes it (default: all; ``open_store`` passes
    what it opened). ``move_threads``: how many tensors move at once (each move reads
    one tensor from a tier and writes it to the next). ``put_wait_s``: how long a put
    waits for room in a full tier before it goes to the next one (0: at once).
    ``close_timeout_s``: how long ``close()`` waits for moves in flight. ``plan``:
    from the second cycle (empty to empty: a training step) on, write the tensors the
    last cycle says will be the oldest straight to the tier they would be moved to.

    Keys are the chain's own. Gets read from the tier that holds the key; stats per
    tier and of the moves: :attr:`stats`. The rules: NOTE [ Tier chain ] in
    ``tensorstore_hooks/_chain_core.py``. Thread-safe.
    """

    def __init__(
        self,
        tiers: Sequence[TensorStore],
        budgets: Sequence[int | str],
        *,
        owned: Sequence[bool] | None = None,
        move_threads: int = 2,
        put_wait_s: float = 60.0,
        close_timeout_s: float = 60.0,
        plan: bool = True,
    ) -> None:
        tiers = list(tiers)
        if len(tiers) < 2 or not all(isinstance(t, TensorStore) for t in tiers):
            raise ConfigError(
                "TierChain: tiers must be two or more TensorStores (fastest first), got "
                f"{[type(t).__name__ for t in tiers]}; for one store use it directly"
            )
        sizes = check_budgets(budgets, len(tiers))
        flags = [True] * len(tiers) if owned is None else list(owned)
        if len(flags) != len(tiers):
            raise ConfigError(f"TierChain: owned needs {len(tiers)} flags, got {len(flags)}")
        if not (isinstance(move_threads, int) and 1 <= move_threads <= 64):
            raise ConfigError(f"TierChain: move_threads must be 1..64, got {move_threads!r}")
        for name, value in (("put_wait_s", put_wait_s), ("close_timeout_s", close_timeout_s)):
            if not (isinstance(value, int | float) and value >= 0):
                raise ConfigError(f"TierChain: {name} must be seconds >= 0, got {value!r}")
        self._core = Core(
            [
                Tier(store, store.url, budget, own)
                for store, budget, own in zip(tiers, [*sizes, None], flags, strict=True)
            ],
            move_threads=move_threads,
            put_wait_s=float(put_wait_s),
            close_timeout_s=float(close_timeout_s),
            plan=bool(plan),
        )
        # Dropped without close(): the movers stop and the owned tiers close.
        self._finalizer = weakref.finalize(self, self._core.close)

    # ------------------------------------------------------------ TensorStore
    def put(self, tensor: torch.Tensor) -> str:
        return self._core.put(tensor)

    def get(self, key: str, *, device: torch.device | str | None = None) -> torch.Tensor:
        return self._core.get(key, device)

    def delete(self, key: str) -> None:
        self._core.delete_many([key], strict=True)

    def delete_many(self, keys: Iterable[str]) -> None:
        self._core.delete_many(list(keys), strict=False)

    def keys(self) -> Iterator[str]:
        with self._core.cond:
            return iter(list(self._core.map))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._core.map

    def __len__(self) -> int:
        return len(self._core.map)

    @property
    def nbytes(self) -> int:
        return self._core.nbytes

    @property
    def url(self) -> str:
        """The tiers' URLs, fastest first, joined by ``" -> "``."""
        return self._core.url

    @property
    def temporary(self) -> bool:
        """True if every tier is a temporary store (all removed at close)."""
        return all(getattr(t.store, "temporary", False) for t in self._core.tiers)

    def close(self) -> None:
        """Stop the movers (waiting for moves in flight), then close the owned tiers.
        Idempotent (NOTE [ Tier chain ] Rule 7)."""
        self._finalizer()

    # ------------------------------------------------------------------ chain
    @property
    def tiers(self) -> tuple[TensorStore, ...]:
        """The stores, fastest first."""
        return tuple(t.store for t in self._core.tiers)

    @property
    def budgets(self) -> tuple[int, ...]:
        """Bytes each tier but the last may hold."""
        return tuple(t.budget for t in self._core.tiers if t.budget is not None)

    @property
    def stats(self) -> ChainStats:
        """Per tier: tensors, bytes held (and peak), puts, moves in and out; moves,
        failed moves, puts that waited and puts that went past a tier."""
        return self._core.stats()

    def tier_of(self, key: str) -> int:
        """Index of the tier holding ``key`` now (it may move right after)."""
        with self._core.cond:
            p = self._core.map.get(key)
            if p is None:
                raise self._core.missing(key)
            return p.tier

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Block until no tier is over its budget and no move is in flight; False if
        that did not happen within ``timeout_s`` (e.g. moves keep failing)."""
        return self._core.wait_idle(timeout_s)

    def flush(self) -> None:
        """Persist each tier's index where it needs it (object stores)."""
        for t in self._core.tiers:
            flush = getattr(t.store, "flush", None)
            if callable(flush):
                flush()

    def __repr__(self) -> str:
        budgets = ", ".join(format_bytes(b) for b in self.budgets)
        return f"TierChain({self.url!r}, budgets=[{budgets}])"


def check_budgets(budgets: Any, tiers: int) -> list[int]:
    """``budgets`` as byte counts: exactly one size per tier but the last."""
    if isinstance(budgets, str | int) or not isinstance(budgets, Sequence):
        raise ConfigError(
            f"tier chain: budgets must be a list of {tiers - 1} size(s), one per tier but "
            f"the last (e.g. budgets=['64GiB']), got {budgets!r}"
        )
    if len(budgets) != tiers - 1:
        raise ConfigError(
            f"tier chain: {tiers} tiers need {tiers - 1} budget(s), one per tier but the last "
            f"(the last takes what the others cannot hold), got {len(budgets)}: {list(budgets)!r}"
        )
    out = []
    for i, b in enumerate(budgets):
        try:
            out.append(parse_bytes(b, what=f"tier chain: budgets[{i}]"))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return out


# --------------------------------------------------------------------------- opening
_CHAIN_KEYWORDS = (
    "budgets", "storage_options", "move_threads", "put_wait_s", "close_timeout_s", "plan"
)


def open_chain(
    urls: Sequence[Any],
    *,
    budgets: Any = None,
    storage_options: Any = None,
    move_threads: int = 2,
    put_wait_s: float = 60.0,
    close_timeout_s: float = 60.0,
    plan: bool = True,
    **options: Any,
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
    from ._registry import kind_of, open_store, store_kinds

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
    kinds: list[Any] = []
    for i, url in enumerate(urls):
        if isinstance(url, TensorStore):
            kinds.append(None)
        elif url is None:
            kinds.append(store_kinds()["file"])
        elif isinstance(url, str | os.PathLike):
            kinds.append(kind_of(os.fspath(url)))
        else:
            raise ConfigError(
                f"open_store: tier {i} of the chain must be a URL, a path, None or a "
                f"TensorStore, got {type(url).__name__} {url!r}"
            )
    if "namespace" not in options:
        from ._zarr_store import _default_namespace

        options = {**options, "namespace": _default_namespace()}
    taken = {k for kind in kinds if kind is not None and kind.option_keys for k in kind.option_keys}
    unknown = sorted(set(options) - taken - {"namespace"})
    if unknown:
        raise ConfigError(
            f"open_store({urls!r}): no tier of the chain takes option(s) {', '.join(unknown)}; "
            f"the tiers take: {', '.join(sorted(taken)) or 'none'} "
            f"(chain options: {', '.join(_CHAIN_KEYWORDS)})"
        )
    stores: list[TensorStore] = []
    owned: list[bool] = []
    try:
        for url, kind, so in zip(urls, kinds, per_tier, strict=True):
            if kind is None:
                if so:
                    raise ConfigError(
                        "open_store: storage_options cannot apply to a tier given as a store "
                        f"object ({url!r}); pass None for it in the list"
                    )
                stores.append(url)
                owned.append(False)
                continue
            if kind.spread_storage_options:
                opts = dict(so or {})
            else:
                keys = kind.option_keys or frozenset()
                opts = {k: v for k, v in options.items() if k in keys}
                if so:
                    opts["storage_options"] = dict(so)
            stores.append(open_store(url, **opts))
            owned.append(True)
        return TierChain(
            stores,
            sizes,
            owned=owned,
            move_threads=move_threads,
            put_wait_s=put_wait_s,
            close_timeout_s=close_timeout_s,
            plan=plan,
        )
    except BaseException:
        for store, own in zip(stores, owned, strict=False):
            if own:
                with contextlib.suppress(Exception):
                    store.close()
        raise


def _per_tier_options(storage_options: Any, tiers: int) -> list[dict[str, Any] | None]:
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


def chain_from_settings(store: Any) -> TierChain:
    """The chain a config's ``store: {tiers: [...]}`` section describes (``StoreSettings``):
    each tier's ``storage_options`` or else the section's; ``codec`` and ``chunk_bytes``
    for every Zarr tier."""
    from ._registry import kind_of

    tiers = store.tiers
    # As for one store (options_from_config): only the settings some tier's kind takes.
    wanted = {k for t in tiers for k in kind_of(t.url).config_options}
    given = {"codec": store.codec, "chunk_bytes": store.chunk_bytes}
    return open_chain(
        [t.url for t in tiers],
        budgets=[t.budget for t in tiers[:-1]],
        storage_options=[
            dict(t.storage_options if t.storage_options is not None else store.storage_options)
            for t in tiers
        ],
        **{k: v for k, v in given.items() if k in wanted},
    )
