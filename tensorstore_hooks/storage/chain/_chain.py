"""TierChain: one :class:`TensorStore` over several stores, fastest first.

``tsh.open_store(["file:///nvme/acts", "s3://bucket/acts"], budgets=["64GiB"])`` makes
one (``_registry`` opens the tiers); ``TierChain([store, store], budgets=[...])`` makes
one from store objects. Puts land in the first tier; when a tier is over its budget,
background movers take its oldest tensors down to the next one. Backward reads the
newest tensors first, so they are the ones the fast tiers keep.

The rules: NOTE [ Tier chain ] in ``storage/chain/_core.py``.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Iterator, Sequence

import torch

from tensorstore_hooks._units import format_bytes, parse_bytes
from tensorstore_hooks.errors import ConfigError, StoreUnavailableError
from tensorstore_hooks.runtime import foreign
from tensorstore_hooks.storage._store import TensorStore
from tensorstore_hooks.storage.chain._core import Core
from tensorstore_hooks.storage.chain._ledger import Tier
from tensorstore_hooks.storage.chain._stats import ChainStats

__all__ = ["ChainStats", "TierChain", "check_budgets", "check_chain_options"]


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
    ``tensorstore_hooks/storage/chain/_core.py``. Thread-safe.
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
        threads, wait_s, timeout_s = check_chain_options(move_threads, put_wait_s, close_timeout_s)
        self._core = Core(
            [
                Tier(store, store.url, budget, own)
                for store, budget, own in zip(tiers, [*sizes, None], flags, strict=True)
            ],
            move_threads=threads,
            put_wait_s=wait_s,
            close_timeout_s=timeout_s,
            plan=bool(plan),
        )
        self._pid = os.getpid()  # NOTE [ Fork safety ]: the movers are this process's
        # Dropped without close(): the movers stop and the owned tiers close.
        self._finalizer = weakref.finalize(self, _close, self._core, self._pid)

    # ------------------------------------------------------------ TensorStore
    def put(self, tensor: torch.Tensor) -> str:
        self._check_writer("put")
        return self._core.put(tensor)

    def get(self, key: str, *, device: torch.device | str | None = None) -> torch.Tensor:
        return self._core.get(key, device)

    def delete(self, key: str) -> None:
        self._check_writer("delete")
        self._core.delete_many([key], strict=True)

    def delete_many(self, keys: Iterable[str]) -> None:
        self._check_writer("delete")
        self._core.delete_many(list(keys), strict=False)

    def _check_writer(self, what: str) -> None:
        # A forked child has none of the movers' threads and may inherit the chain's
        # lock held: it must not touch the parent's tiers (NOTE [ Fork safety ]).
        if foreign(self._pid):
            raise StoreUnavailableError(
                f"TierChain({self.url}): cannot {what} here: this chain was opened by "
                f"process {self._pid} and this process ({os.getpid()}) is a fork of it, "
                "which must leave the parent's tiers alone (NOTE [ Fork safety ]); "
                "open a store of this process's own with tsh.open_store(...)"
            )

    def keys(self) -> Iterator[str]:
        with self._core.ledger.cond:
            return iter(list(self._core.ledger.map))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._core.ledger.map

    def __len__(self) -> int:
        return len(self._core.ledger.map)

    @property
    def nbytes(self) -> int:
        return self._core.ledger.nbytes

    @property
    def url(self) -> str:
        """The tiers' URLs, fastest first, joined by ``" -> "``."""
        return self._core.ledger.url

    @property
    def temporary(self) -> bool:
        """True if every tier is a temporary store (all removed at close)."""
        return all(t.store.temporary for t in self._core.ledger.tiers)

    def close(self) -> None:
        """Stop the movers (waiting for moves in flight), then close the owned tiers.
        Idempotent (NOTE [ Tier chain ] Rule 7). In a forked child of the process that
        opened it, nothing: the tiers and the movers are the parent's."""
        self._finalizer()

    # ------------------------------------------------------------------ chain
    @property
    def tiers(self) -> tuple[TensorStore, ...]:
        """The stores, fastest first."""
        return tuple(t.store for t in self._core.ledger.tiers)

    @property
    def budgets(self) -> tuple[int, ...]:
        """Bytes each tier but the last may hold."""
        return tuple(self._core.ledger.budgets())

    @property
    def stats(self) -> ChainStats:
        """Per tier: tensors, bytes held (and peak), puts, moves in and out; moves,
        failed moves, puts that waited and puts that went past a tier."""
        return self._core.stats()

    def tier_of(self, key: str) -> int:
        """Index of the tier holding ``key`` now (it may move right after)."""
        ledger = self._core.ledger
        with ledger.cond:
            p = ledger.map.get(key)
            if p is None:
                raise ledger.missing(key)
            return p.tier

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Block until no tier is over its budget and no move is in flight; False if
        that did not happen within ``timeout_s`` (e.g. moves keep failing)."""
        return self._core.movers.wait_idle(timeout_s)

    def flush(self) -> None:
        """Persist each tier's index where it needs it (object stores)."""
        for t in self._core.ledger.tiers:
            t.store.flush()

    def __repr__(self) -> str:
        budgets = ", ".join(format_bytes(b) for b in self.budgets)
        return f"TierChain({self.url!r}, budgets=[{budgets}])"


def check_budgets(budgets: object, tiers: int) -> list[int]:
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


def check_chain_options(
    move_threads: object, put_wait_s: object, close_timeout_s: object
) -> tuple[int, float, float]:
    """A chain's ``move_threads`` (1..64), ``put_wait_s`` and ``close_timeout_s``
    (seconds >= 0), checked: a bad one is a :class:`ConfigError` naming it."""
    if not (isinstance(move_threads, int) and 1 <= move_threads <= 64):
        raise ConfigError(f"TierChain: move_threads must be 1..64, got {move_threads!r}")
    wait_s = _seconds("put_wait_s", put_wait_s)
    return move_threads, wait_s, _seconds("close_timeout_s", close_timeout_s)


def _seconds(name: str, value: object) -> float:
    if not (isinstance(value, int | float) and value >= 0):
        raise ConfigError(f"TierChain: {name} must be seconds >= 0, got {value!r}")
    return float(value)


def _close(core: Core, pid: int) -> None:
    if not foreign(pid):  # a forked child's close or exit: NOTE [ Fork safety ]
        core.close()
