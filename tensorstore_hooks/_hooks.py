"""``OffloadHooks`` and ``offload()``: the public entry points.

``OffloadHooks`` only wires pack and unpack (like ``torch.autograd.graph.save_on_cpu``)
to the session's :class:`~tensorstore_hooks.Router`; the work lives in the pipeline
(:mod:`tensorstore_hooks._pipeline` wires its units) and the store.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch

from ._compose import block_abort, block_enter, block_exit
from ._diagnose import after_forward, before_forward
from ._effects import shield_signals
from ._pipeline import OffloadSession
from ._registry import open_store, options_from_config
from ._session_api import SessionAPI
from ._store import TensorStore
from ._trace import describe_session, forward_begin, forward_end
from .errors import ConfigError

__all__ = ["OffloadHooks", "make_session", "offload"]

log = logging.getLogger("tensorstore_hooks")


class OffloadHooks(SessionAPI, torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that offload what autograd saves into a :class:`TensorStore`.

    Use as a context manager around forward; backward may run after the block has
    exited. Nests like the torch original (the innermost active hooks win) and
    composes with ``torch.utils.checkpoint(use_reentrant=False)``. Made by
    :func:`offload`; the object can be entered again for the next step, and inside
    its own block (module tracking lasts until the outermost block exits).
    Entering is all or nothing: if it fails, no hooks are left installed.
    """

    def __init__(self, session: OffloadSession) -> None:
        self._bind(session)
        self._scope = session.scope
        self._models: list[torch.nn.Module] = []
        self._depth = 0  # open ``with`` blocks of this object (nested re-entry)
        self._depth_lock = threading.Lock()
        self._refused: str | None = None  # NOTE [ torch.compile ], rule 2
        super().__init__(session.router.pack, session.router.unpack)

    # ------------------------------------------------------------ context
    def __enter__(self) -> OffloadHooks:  # type: ignore[override]
        if torch.compiler.is_compiling():  # entered in traced code: NOTE [ torch.compile ]
            from ._compile import offload_block_traced

            offload_block_traced(self)
        if self._refused is not None:
            raise ConfigError(self._refused)
        if self._session.closed:
            raise RuntimeError(
                "these OffloadHooks were closed; make new ones with tsh.offload(...)"
            )
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
                forward_begin(self._session)
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
        forward_end(self._session)
        if self._scope is not None:
            self._scope.detach()
            after_forward(self, self.policy, self._scope.visible_paths())

    # ------------------------------------------------------------- public
    def attach(self, model: torch.nn.Module) -> OffloadHooks:
        """Track ``model``'s module paths for ``module`` rules while the hooks are active.

        Forward hooks are added on entering the ``with`` block and removed on leaving it.
        Raises :class:`ConfigError` if ``model`` is not a ``torch.nn.Module``.
        """
        _check_model(model, "OffloadHooks.attach(model)")
        if self._scope is None:
            from ._scope import ModuleScope

            self._scope = self._session.scope = ModuleScope()
        self._models.append(model)
        if self._is_active():
            self._scope.attach(model)
        return self

    def _is_active(self) -> bool:
        stack = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return stack is not None and stack[0] is self.pack_hook

    def __repr__(self) -> str:
        return f"OffloadHooks(store={self._session.store.url!r}, {self.stats.summary()})"


def _check_model(model: Any, where: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"{where}: expected a torch.nn.Module whose module paths `module` rules "
            f"match, got {type(model).__name__} {model!r:.60}; pass the model itself"
        )


def _store_options(url: object, store_cfg: Any) -> dict[str, Any]:
    # The store kind (registry) says which store: settings its factory takes.
    return options_from_config(
        url, store_cfg.codec, store_cfg.chunk_bytes, store_cfg.storage_options
    )


def offload(
    store: str | os.PathLike[str] | TensorStore | None = None,
    *,
    config: Any = None,
    model: torch.nn.Module | None = None,
    **overrides: Any,
) -> OffloadHooks:
    """Offload the tensors autograd saves during forward into a store.

    ``store``: a URL (``"file:///scratch/acts"``, ``"memory://"``, ``"s3://b/p"``,
    ``"tsh://127.0.0.1:7077"``), a :class:`TensorStore`, or ``None`` for the config's
    store, else a fresh temporary local Zarr store removed at close/exit.
    ``config``: a YAML file (or ``tsh.load_config(...)`` result); the ``TSH_CONFIG``
    environment variable names a default. Keyword overrides win over the file:
    ``min_bytes``, ``skip_parameters``, ``prefetch``, ``max_inflight``, ``rules``,
    ``default``, ``writer_threads``, ``read_deadline_s``, ``release_heap_every``, ``codec``,
    ``chunk_bytes``, ``storage_options``.
    ``model``: track its module paths for ``module`` rules (or ``hooks.attach(model)``).

    Raises :class:`ConfigError` for bad options, before anything is changed.
    """
    if model is not None:
        _check_model(model, "offload(model=...)")
    hooks = OffloadHooks(make_session(store, config, overrides))
    if model is not None:
        hooks.attach(model)
    return hooks


def make_session(
    store: str | os.PathLike[str] | TensorStore | None, config: Any, overrides: dict[str, Any]
) -> OffloadSession:
    """Resolve the config, open (or adopt) the store and build the session behind the hooks.

    Shared by the torch and paddle ``offload()``; arguments as :func:`offload` takes them.
    """
    from ._config import resolve_config

    cfg = resolve_config(config, overrides)
    if isinstance(store, TensorStore):
        st, owned = store, False
    else:
        url = store if store is not None else cfg.store.url
        # open_store checks the URL's type too: offload(42) is a ConfigError like open_store(42).
        st, owned = open_store(url, **_store_options(url, cfg.store)), True
    session = OffloadSession(st, policy=cfg.policy, settings=cfg.pipeline, owns_store=owned)
    log.info("%s", describe_session(session))
    return session
