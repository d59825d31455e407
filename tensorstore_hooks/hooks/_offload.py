"""``OffloadHooks`` and ``offload()``: the public entry points.

``OffloadHooks`` only wires pack and unpack (like ``torch.autograd.graph.save_on_cpu``)
to its pipeline's :class:`~tensorstore_hooks.Router`; the work lives in the pipeline
(:mod:`tensorstore_hooks.pipeline._pipeline` wires its units) and the store. :class:`HooksBase`
is what both ``OffloadHooks`` (PyTorch and Paddle) give a caller over their pipeline.

NOTE [ Idle hooks ]
Hooks made by ``offload()`` are kept after their block, to read ``stats`` (``with
tsh.offload() as hooks`` per step, the hooks appended to a list). Kept hooks cost bytes,
never threads, stores or buffers that grow with the number kept:

1. When no block of the hooks is open and every graph they stored for is freed, the
   pipeline is idle (``Pipeline.park``): the I/O threads of its own store stop at once
   (they start again on use) and glibc's mmap threshold is given back (NOTE
   [ Process-wide effects ]): a plain step beside idle hooks pays nothing. An idle
   pipeline closes (its own store closes, a temporary one is removed; its host and
   read buffers go back) as soon as another pipeline is made in the process (the next
   step's ``offload()``), or when its hooks are collected: however many hooks are kept,
   at most the newest idle one holds a store. (Not at once: hooks reused every step
   would pay a store's opening and their first forward's written-through tensors
   again each step.) ``stats``, ``report()`` and ``store.url`` stay readable.
2. Entering idle hooks again costs nothing (the threads restart on the first write).
   Entering hooks whose idle pipeline was closed reopens them: a new pipeline from
   the same resolved config and store argument (a temporary store is a new
   directory), counting into the same ``stats``, planning from the same plan (NOTE
   [ Plan carry-over ]). A block entered while the last step's graphs are still alive
   keeps the open pipeline.
3. Not while a timeline is recording (``hooks.trace``), and not for hooks whose owner
   re-enters them every step and closes them itself (``release_idle = False``: the
   Lightning callback); ``wrap()`` hooks are entered per module call and
   close at ``unwrap``.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AbstractContextManager

import torch

from tensorstore_hooks._caller import names_caller
from tensorstore_hooks.config import EffectiveConfig, StoreSettings
from tensorstore_hooks.errors import ConfigError
from tensorstore_hooks.hooks._compose import block_abort, block_enter, block_exit
from tensorstore_hooks.hooks._diagnose import after_forward, before_forward
from tensorstore_hooks.hooks._report import Report
from tensorstore_hooks.hooks._scope import ModuleScope
from tensorstore_hooks.pipeline import OffloadStats, Pipeline, PlanMemory, Timeline
from tensorstore_hooks.runtime import shield_signals
from tensorstore_hooks.storage import (
    TensorStore,
    chain_from_settings,
    open_store,
    options_from_config,
)

__all__ = ["HooksBase", "OffloadHooks", "call_site", "make_pipeline", "offload", "plan_for"]

log = logging.getLogger("tensorstore_hooks")

ConfigSource = str | os.PathLike[str] | EffectiveConfig | Mapping[str, object] | None
"""What ``offload(config=...)`` takes: a YAML path, a loaded config, a dict, or nothing."""


class HooksBase:
    """What an ``OffloadHooks`` (PyTorch or Paddle) gives a caller over its pipeline.

    Attributes: ``stats`` (:class:`~tensorstore_hooks.OffloadStats`, live: readable
    during and after backward), ``store`` (the :class:`~tensorstore_hooks.TensorStore`
    saved tensors go to), ``policy`` (the :class:`~tensorstore_hooks.Policy` in force),
    ``settings`` (the config's ``pipeline:`` section, resolved) and ``router`` (the
    :class:`~tensorstore_hooks.Router` that packs and unpacks for these hooks).
    """

    _closed_by_user = False

    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline
        self.stats, self.store, self.policy = pipeline.stats, pipeline.store, pipeline.policy
        self.settings, self.router = pipeline.settings, pipeline.router
        # An owned store is closed when the hooks are collected and nothing is live.
        self._finalizer = weakref.finalize(self, pipeline.close)
        self._finalizer.atexit = False

    @property
    def live_records(self) -> int:
        """Saved tensors in the store or in flight whose graph is still alive (0 once freed)."""
        return self._pipeline.live_records

    def trace(self, path: str | os.PathLike[str]) -> AbstractContextManager[Timeline]:
        """Record a Chrome/Perfetto timeline of these hooks' work while the block runs.

        ``with hooks.trace("trace.json"): ...train steps...``: forward and backward
        spans, and every pack, unpack, unpack wait, write and read (with its thread),
        saved as Chrome trace JSON at ``path`` on exit (open it in
        https://ui.perfetto.dev). See NOTE [ Profiler ranges ] for torch.profiler.
        """
        return self._pipeline.trace(path)

    def report(
        self, budgets: Sequence[int | str] | None = None, *, depth: int | None = None
    ) -> Report:
        """What the policy decided in the last finished forward, per module path.

        A table of rows (module path, tensors saved, bytes, action, the rule that
        decided) and the ``device_budget`` curve: for each budget, what would stay on
        the device and what would move per step (``budgets``: sizes such as
        ``"64MiB"``; default 0, 25, 50, 100 and 200% of what the rules move). Call it
        after a step (forward and backward). ``print(hooks.report())`` for text,
        ``hooks.report().to_json()`` for tools. ``depth``: count submodules under
        their path's first ``depth`` parts (``2``: ``layers.3.linear1`` as ``layers.3``;
        ``None``: whole paths). Module paths need a model
        (``tsh.offload(model=...)``, ``hooks.attach(model)`` or ``tsh.wrap``).
        See NOTE [ Report ledger ].
        """
        from tensorstore_hooks.hooks._report import report_from_settings

        if depth is not None and (
            isinstance(depth, bool) or not isinstance(depth, int) or depth < 1
        ):
            raise ConfigError(
                f"OffloadHooks.report: depth must be an int >= 1 or None, got {depth!r}"
            )

        points = None if budgets is None else [_budget_point(b) for b in budgets]
        pipeline = self._pipeline
        return report_from_settings(
            pipeline.router.ledger,
            scoped=pipeline.scope is not None,
            policy=self.policy,
            settings=self.settings,
            stats=self.stats,
            budgets=points,
            depth=depth,
        )

    def flush(self) -> None:
        """Block until every pending write has reached the store.

        Leaving the ``with`` block does not wait: backward wants the newest tensors
        first and may take them straight from memory.
        """
        self._pipeline.flush()

    def close(self) -> None:
        """Stop offloading; an owned store is closed once backward has freed every key.

        A fallback warning still pending (a write refused after the last hook
        call) is issued here, so a refusal is never silent.
        """
        self._closed_by_user = True
        self._pipeline.close()
        self._pipeline.emit_warning()


class OffloadHooks(HooksBase, torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that offload what autograd saves into a :class:`TensorStore`.

    Use as a context manager around forward; backward may run after the block has
    exited. Nests like the torch original (the innermost active hooks win) and
    composes with ``torch.utils.checkpoint(use_reentrant=False)``. Made by
    :func:`offload`; the object can be entered again for the next step, and inside
    its own block (module tracking lasts until the outermost block exits).
    Entering is all or nothing: if it fails, no hooks are left installed.
    """

    release_idle = True
    """Close the pipeline when no block is open and every graph is freed; re-entering
    reopens it (NOTE [ Idle hooks ]). Set ``False`` for hooks re-entered every step
    and closed by their owner."""

    def __init__(self, pipeline: Pipeline, reopen: Callable[[], Pipeline] | None = None) -> None:
        HooksBase.__init__(self, pipeline)
        self._reopen = reopen  # NOTE [ Idle hooks ] rule 2; None: hooks made without offload()
        self._scope: ModuleScope | None = None  # made at the first attach()
        self._models: list[torch.nn.Module] = []
        self._depth = 0  # open ``with`` blocks of this object (nested re-entry)
        self._depth_lock = threading.Lock()
        self._refused: str | None = None  # NOTE [ torch.compile ], rule 2
        torch.autograd.graph.saved_tensors_hooks.__init__(
            self, pipeline.router.pack, pipeline.router.unpack
        )

    # ------------------------------------------------------------ context
    def __enter__(self) -> OffloadHooks:  # type: ignore[override]
        if torch.compiler.is_compiling():  # entered in traced code: NOTE [ torch.compile ]
            from tensorstore_hooks.hooks._compile import offload_block_traced

            offload_block_traced(self)
        if self._refused is not None:
            raise ConfigError(self._refused)
        if self._closed_by_user or not self._pipeline.unpark():
            self._reopened()
        shield_signals()  # NOTE [ Signals and finalizers ], NOTE [ Process-wide effects ]
        if not block_enter():  # NOTE [ Checkpoint composition ]: push nothing
            return self
        pushed = counted = outermost = False
        try:
            super().__enter__()  # may refuse (disable_saved_tensors_hooks): attach nothing
            pushed = True
            with self._depth_lock:
                self._depth += 1
                counted = True
                outermost = self._depth == 1
            if outermost:  # nested re-entry: tracking lasts until the outermost exit
                self._pipeline.forward_begin()
                has_scope = self._scope is not None and bool(self._models)
                before_forward(self, self.policy, has_scope)
                if self._scope is not None:
                    for model in self._models:
                        self._scope.attach(model)
        except BaseException:
            # All or nothing: a failed enter leaves no hooks and no module tracking.
            if counted:
                with self._depth_lock:
                    self._depth -= 1
            if outermost and self._scope is not None:
                self._scope.detach()
            if pushed:
                super().__exit__(None, None, None)
            block_abort()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if not block_exit():
            return
        super().__exit__(*exc)
        with self._depth_lock:
            self._depth -= 1
            last = self._depth == 0
        if not last:
            return
        self._pipeline.forward_end()
        if self._scope is not None:
            self._scope.detach()
            after_forward(self, self.policy, self._scope.visible_paths())
        if self._reopen is not None and self.release_idle:
            self._pipeline.park()  # NOTE [ Idle hooks ] rule 1

    def trace(self, path: str | os.PathLike[str]) -> AbstractContextManager[Timeline]:
        """As :meth:`HooksBase.trace`; hooks closed while idle reopen first (NOTE [ Idle
        hooks ] rule 2), so the timeline is that of the pipeline the next block uses."""
        if self._pipeline.closed and self._reopen is not None and not self._closed_by_user:
            self._reopened()
        return super().trace(path)

    def _reopened(self) -> None:
        """NOTE [ Idle hooks ] rule 2: a new pipeline for hooks closed while idle."""
        if self._reopen is None or self._closed_by_user:
            raise RuntimeError(
                "these OffloadHooks were closed; make new ones with tsh.offload(...)"
            )
        pipeline = self._reopen()
        self._finalizer.detach()
        HooksBase.__init__(self, pipeline)
        self.pack_hook, self.unpack_hook = pipeline.router.pack, pipeline.router.unpack
        if self._scope is not None:
            pipeline.scope = self._scope

    # ------------------------------------------------------------- public
    def attach(self, model: torch.nn.Module) -> OffloadHooks:
        """Track ``model``'s module paths for ``module`` rules while the hooks are active.

        Forward hooks are added on entering the ``with`` block and removed on leaving it.
        Raises :class:`ConfigError` if ``model`` is not a ``torch.nn.Module``.
        """
        _check_model(model, "OffloadHooks.attach(model)")
        if self._scope is None:
            self._scope = self._pipeline.scope = ModuleScope()
        self._models.append(model)
        if self._is_active():
            self._scope.attach(model)
        return self

    def _is_active(self) -> bool:
        stack = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return stack is not None and stack[0] is self.pack_hook

    def __repr__(self) -> str:
        return f"OffloadHooks(store={self._pipeline.store.url!r}, {self.stats.summary()})"


def _budget_point(value: int | str) -> int:
    from tensorstore_hooks._units import parse_bytes

    try:
        return parse_bytes(value, what="OffloadHooks.report: budgets")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_model(model: object, where: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"{where}: expected a torch.nn.Module whose module paths `module` rules "
            f"match, got {type(model).__name__} {model!r:.60}; pass the model itself"
        )


def _store_options(url: object, store_cfg: StoreSettings) -> dict[str, object]:
    # The store kind (registry) says which store: settings its factory takes.
    return options_from_config(
        url,
        store_cfg.codec,
        store_cfg.chunk_bytes,
        store_cfg.storage_options,
        store_cfg.direct_io,
    )


@names_caller("tsh.offload")
def offload(
    store: str | os.PathLike[str] | TensorStore | None = None,
    *,
    config: ConfigSource = None,
    model: torch.nn.Module | None = None,
    **overrides: object,
) -> OffloadHooks:
    """Offload the tensors autograd saves during forward into a store.

    ``store``: a URL (``"file:///scratch/acts"``, ``"memory://"``, ``"s3://b/p"``,
    ``"tsh://127.0.0.1:7077"``), a :class:`TensorStore`, or ``None`` for the config's
    store, else a fresh temporary local Zarr store removed at close/exit.
    ``config``: a YAML file (or ``tsh.load_config(...)`` result); the ``TSH_CONFIG``
    environment variable names a default. Keyword overrides win over the file:
    ``min_bytes``, ``skip_parameters``, ``recompute_casts``, ``prefetch``, ``max_inflight``,
    ``rules``, ``default``, ``writer_threads``, ``read_deadline_s``, ``release_heap_every``,
    ``codec``, ``chunk_bytes``, ``storage_options``, ``direct_io``.
    ``model``: track its module paths for ``module`` rules (or ``hooks.attach(model)``).

    Raises :class:`ConfigError` for bad options, before anything is changed.
    """
    if model is not None:
        _check_model(model, "offload(model=...)")
    from tensorstore_hooks.config import resolve_config

    site = ("model", id(model)) if model is not None else call_site()
    cfg = resolve_config(config, overrides)  # once: a reopening reads no file again
    hooks = OffloadHooks(make_pipeline(store, cfg, {}, site=site))
    hooks._reopen = functools.partial(_reopen, store, cfg, site, weakref.ref(hooks))
    if model is not None:
        hooks.attach(model)
    return hooks


def _reopen(
    store: str | os.PathLike[str] | TensorStore | None,
    cfg: EffectiveConfig,
    site: Hashable,
    hooks: weakref.ref[OffloadHooks] | None,
) -> Pipeline:
    # Weakly: the hooks' own attribute must not keep the hooks alive (their finalizer).
    owner = hooks() if hooks is not None else None
    return make_pipeline(
        store, cfg, {}, site=site, stats=owner.stats if owner is not None else None
    )


def make_pipeline(
    store: str | os.PathLike[str] | TensorStore | None,
    config: ConfigSource,
    overrides: Mapping[str, object],
    *,
    site: Hashable = None,
    stats: OffloadStats | None = None,
) -> Pipeline:
    """Resolve the config, open (or adopt) the store and build the pipeline behind the hooks.

    Shared by the torch and paddle ``offload()``; arguments as :func:`offload` takes them.
    ``site``: what identifies the step (the model, or the line that called ``offload()``):
    with the configuration it keys the budget plan carried from one pipeline to the
    next (NOTE [ Plan carry-over ]); ``None``: a plan of its own. ``stats``: count into
    these (hooks reopened: NOTE [ Idle hooks ]).
    """
    from tensorstore_hooks.config import resolve_config

    cfg = resolve_config(config, overrides)
    if isinstance(store, TensorStore):
        st, owned = store, False
    elif store is None and cfg.store.tiers:
        st, owned = chain_from_settings(cfg.store), True
    else:
        url = store if store is not None else cfg.store.url
        # open_store checks the URL's type too: offload(42) is a ConfigError like open_store(42).
        st, owned = open_store(url, **_store_options(url, cfg.store)), True
    plan = None if site is None else plan_for(cfg, site)
    pipeline = Pipeline(
        st, policy=cfg.policy, settings=cfg.pipeline, owns_store=owned, plan=plan, stats=stats
    )
    log.info("%s", pipeline.describe())
    return pipeline


_PLANS: OrderedDict[Hashable, PlanMemory] = OrderedDict()
_PLANS_KEPT = 64  # the configurations and steps of a process; the least recent goes first
_PLANS_LOCK = threading.Lock()


def plan_for(cfg: EffectiveConfig, site: Hashable) -> PlanMemory | None:
    """The plan memory of ``cfg`` at ``site`` (NOTE [ Plan carry-over ]); ``None`` without a
    ``device_budget`` (nothing to plan)."""
    if cfg.policy.device_budget is None:
        return None
    key = (repr(cfg.policy), repr(cfg.pipeline), site)
    with _PLANS_LOCK:
        plan = _PLANS.pop(key, None) or PlanMemory()
        _PLANS[key] = plan
        while len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    return plan


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call_site() -> tuple[str, str, int]:
    """The first frame outside this package: the user's line that asked for the hooks."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    return ("site", frame.f_code.co_filename, frame.f_lineno)
