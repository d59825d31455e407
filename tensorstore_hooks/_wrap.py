"""``tsh.wrap`` / ``tsh.unwrap``: offload inside chosen modules' forward, no loop edits.

NOTE [ Wrap hooks ]
Hooks stored on a module (``register_forward_pre_hook``) live in its ``__dict__``:
``copy.deepcopy``, ``pickle`` and ``torch.save(model)`` would copy them, and with
them the pipeline and its locks (``cannot pickle '_thread.lock'``), and a copy
would offload into the original's store. So nothing of ours is stored on the
model. One pair of *global* module hooks
(``torch.nn.modules.module.register_module_forward_pre_hook`` and
``register_module_forward_hook(always_call=True)``), registered while at least one
model is wrapped, looks each running module up in a registry keyed weakly by the
module object. A copy is another object, absent from the registry: not wrapped.
The cost while anything is wrapped: every module call in the process takes torch's
hook path and one dictionary lookup.

Rules:

1. Every module of a wrapped tree is in the registry with its dotted path (for
   ``module`` policy rules) and whether a ``modules`` glob selected it.
2. When selected modules nest, the outermost wins: a per-thread depth counter per
   wrap pushes our saved-tensor hooks when it goes 0 -> 1 and pops them at 1 -> 0.
3. Each module call that did anything leaves a frame on a per-thread stack; the
   post-hook undoes the frame of *its* module only (``always_call`` runs it even
   when forward raised, or when a pre-hook before ours raised and ours never ran).
   Undoing never consults the registry, so ``unwrap`` during a forward stays balanced.
4. No push where a checkpoint decides (NOTE [ Checkpoint composition ]) or where
   saved-tensor hooks are disabled (``disable_saved_tensors_hooks``): tensors are
   left to autograd there.
5. A module belongs to at most one wrapped tree: wrapping it again, or a tree that
   shares a module with a wrapped one, is a ``ConfigError``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.modules import module as _nn_module

from ._caller import names_caller
from ._compose import checkpoint_decides
from ._diagnose import after_forward, glob_matches, sample_names
from ._hooks import OffloadHooks, make_pipeline
from ._policy import compile_module_glob
from ._scope import ModuleScope
from ._store import TensorStore
from ._trace import forward_begin, forward_end
from .errors import ConfigError

__all__ = ["WrapHooks", "is_wrapped", "unwrap", "wrap"]

_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_hooks_enabled = torch._C._autograd._saved_tensors_hooks_is_enabled  # type: ignore[attr-defined]


class _Wrap:
    """State of one wrapped tree: its hooks, its scope, the per-thread depth."""

    __slots__ = ("__weakref__", "finalizer", "hooks", "local", "root_name", "scope")

    def __init__(self, hooks: WrapHooks, scope: ModuleScope | None, root_name: str) -> None:
        self.hooks = hooks
        self.scope = scope
        self.root_name = root_name
        self.local = threading.local()  # .depth: selected modules running on this thread
        self.finalizer: weakref.finalize[Any, Any] | None = None


class _Entry:
    __slots__ = ("path", "selected", "wrap")

    def __init__(self, wrap: _Wrap, path: str, selected: bool) -> None:
        self.wrap = wrap
        self.path = path
        self.selected = selected


class _Frames(threading.local):
    def __init__(self) -> None:
        # (module, entry, pushed) per module call that did something (Rule 3).
        self.stack: list[tuple[torch.nn.Module, _Entry, bool]] = []


_LOCK = threading.Lock()
_REGISTRY: weakref.WeakKeyDictionary[torch.nn.Module, _Entry] = weakref.WeakKeyDictionary()
_ROOTS: weakref.WeakKeyDictionary[torch.nn.Module, _Wrap] = weakref.WeakKeyDictionary()
_FRAMES = _Frames()
_global_handles: list[Any] = []


# ------------------------------------------------------------------- hooks
def _pre_hook(module: torch.nn.Module, args: Any) -> None:
    entry = _REGISTRY.get(module)
    if entry is None:
        return
    wrap = entry.wrap
    scope = wrap.scope
    if scope is not None:
        scope.enter(entry.path)
    elif not entry.selected:
        return
    pushed = False
    if entry.selected:
        depth = getattr(wrap.local, "depth", 0)
        wrap.local.depth = depth + 1
        if depth == 0 and _hooks_enabled() and not checkpoint_decides():  # Rules 2, 4
            hooks = wrap.hooks
            _push_hooks(hooks.pack_hook, hooks.unpack_hook)
            pushed = True
            forward_begin(hooks._pipeline)
    _FRAMES.stack.append((module, entry, pushed))


def _post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
    stack = _FRAMES.stack
    if not stack or stack[-1][0] is not module:
        return
    _, entry, pushed = stack.pop()
    wrap = entry.wrap
    if pushed:
        _pop_hooks()
        forward_end(wrap.hooks._pipeline)
    if wrap.scope is not None:
        wrap.scope.exit(entry.path)
    if entry.selected:
        wrap.local.depth -= 1
        if pushed:
            hooks = wrap.hooks
            seen = wrap.scope.seen if wrap.scope is not None else None
            after_forward(hooks, hooks.policy, seen)
            hooks._pipeline.emit_warning()


def _install_global_hooks() -> None:
    if not _global_handles:
        pre = _nn_module.register_module_forward_pre_hook(_pre_hook)
        post = _nn_module.register_module_forward_hook(_post_hook, always_call=True)
        _global_handles.extend((pre, post))


def _remove_global_hooks() -> None:
    while _global_handles:
        _global_handles.pop().remove()


_live_roots = 0  # wrapped trees not yet unwrapped or collected; guarded by _LOCK


def _root_gone() -> None:
    """A wrapped tree was unwrapped or collected: drop the global hooks after the last."""
    global _live_roots
    with _LOCK:
        _live_roots -= 1
        if _live_roots == 0:
            _remove_global_hooks()


# ------------------------------------------------------------------ public
class WrapHooks(OffloadHooks):
    """The :class:`OffloadHooks` that :func:`wrap` returns; :meth:`remove` unwraps."""

    _wrap_root: weakref.ref[torch.nn.Module] | None = None

    def remove(self) -> None:
        """Take the module hooks off (like :func:`unwrap`); safe to call twice.

        The pipeline closes once backward has freed what it stored.
        """
        root = self._wrap_root() if self._wrap_root is not None else None
        if root is not None:
            _unregister(root)
        self.close()

    @property
    def wrapped(self) -> bool:
        """Whether the module is still wrapped by these hooks."""
        root = self._wrap_root() if self._wrap_root is not None else None
        state = _ROOTS.get(root) if root is not None else None
        return state is not None and state.hooks is self


def is_wrapped(module: torch.nn.Module) -> bool:
    """Whether ``module`` is the root of a :func:`wrap` (copies of it never are)."""
    return module in _ROOTS


def _normalise_globs(modules: str | Sequence[str] | None) -> list[str] | None:
    if modules is None:
        return None
    globs = [modules] if isinstance(modules, str) else list(modules)
    if not globs or not all(isinstance(g, str) for g in globs):
        raise ConfigError(
            f"wrap: modules must be a glob or a non-empty list of globs (fnmatch over the "
            f"names of model.named_modules()), got {modules!r}"
        )
    for glob in globs:
        try:
            compile_module_glob(glob)
        except ValueError as e:
            raise ConfigError(f"wrap: modules: {e}") from e
    return globs


def _select(names: dict[str, torch.nn.Module], globs: list[str] | None) -> set[str]:
    """Names selected by ``globs``, outermost only (Rule 2); every glob must match."""
    if globs is None:
        return {""}
    chosen: set[str] = set()
    for glob in globs:
        hits = {n for n in names if n and glob_matches(glob, n)}
        if not hits:
            raise ConfigError(
                f"wrap: modules glob {glob!r} matches no module of the model. Some names "
                f"that exist: {sample_names(n for n in names if n)}"
            )
        chosen |= hits

    def nested(name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:i]) in chosen for i in range(1, len(parts)))

    return {n for n in chosen if not nested(n)}


@names_caller("tsh.wrap")
def wrap(
    module: torch.nn.Module,
    store: str | os.PathLike[str] | TensorStore | None = None,
    *,
    modules: str | Sequence[str] | None = None,
    config: Any = None,
    **overrides: Any,
) -> OffloadHooks:
    """Offload what autograd saves while ``module`` (or chosen submodules) runs forward.

    ``store``, ``config`` and ``overrides``: as :func:`~tensorstore_hooks.offload`.
    ``modules``: fnmatch globs over the names of ``module.named_modules()``
    (``"transformer.h.*"``, ``["layers.*"]``; ``None``: the module itself). Tensors
    saved while a selected module's forward runs are offloaded exactly as under
    ``offload()``; others are left to autograd; nested selections: the outermost
    wins. Inside a checkpointed region the checkpoint decides what is saved.

    The model stays a plain model: ``copy.deepcopy``, ``pickle``/``torch.save`` and
    ``state_dict()`` work, and a copy is not wrapped. Undo with :func:`unwrap` or
    ``hooks.remove()``; the pipeline closes once backward has freed what it stored.

    Raises :class:`ConfigError` for a glob that matches nothing (naming it and
    showing names that exist), a module already wrapped (or sharing a module with
    a wrapped tree), and every bad option :func:`offload` refuses; nothing is
    changed then.
    """
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"wrap: expected a torch.nn.Module, got {type(module).__name__}")
    if "model" in overrides:
        raise ConfigError(
            "wrap: model= is not needed (module rules use the paths of the wrapped module)"
        )
    globs = _normalise_globs(modules)
    names = dict(module.named_modules())
    selected = _select(names, globs)
    with _LOCK:
        for name, sub in names.items():
            if sub in _REGISTRY:
                other = _REGISTRY[sub].wrap.root_name
                where = "this module" if not name else f"its submodule {name!r}"
                raise ConfigError(
                    f"wrap: {where} is already wrapped (by tsh.wrap of a {other}); "
                    "call tsh.unwrap(model) (or hooks.remove()) first"
                )
    pipeline = make_pipeline(store, config, overrides)
    # Module paths for ``module`` rules and for hooks.report() (NOTE [ Report ledger ]).
    scope = ModuleScope()
    pipeline.scope = scope
    hooks = WrapHooks(pipeline)
    hooks._wrap_root = weakref.ref(module)
    state = _Wrap(hooks, scope, type(module).__name__)
    with _LOCK:
        if any(sub in _REGISTRY for sub in names.values()):  # lost a race with another wrap
            pipeline.close()
            raise ConfigError("wrap: the module was wrapped concurrently; unwrap it first")
        for name, sub in names.items():
            _REGISTRY[sub] = _Entry(state, name, name in selected)
        _ROOTS[module] = state
        global _live_roots
        _live_roots += 1
        _install_global_hooks()
    # A model dropped without unwrap: its registry entries vanish with it; this drops
    # the global hooks (and the hooks' own finalizer closes the pipeline).
    state.finalizer = weakref.finalize(module, _root_gone)
    state.finalizer.atexit = False
    return hooks


def _unregister(module: torch.nn.Module) -> _Wrap | None:
    with _LOCK:
        state = _ROOTS.pop(module, None)
        if state is None:
            return None
        for sub in list(_REGISTRY.keys()):
            entry = _REGISTRY.get(sub)
            if entry is not None and entry.wrap is state:
                del _REGISTRY[sub]
    if state.finalizer is not None:
        state.finalizer()  # -> _root_gone(), once
    return state


def unwrap(module: torch.nn.Module) -> None:
    """Undo :func:`wrap`: take the module hooks off and close the pipeline.

    The pipeline's store closes once backward has freed every tensor it stored, so a
    graph built before ``unwrap`` still runs backward. Raises :class:`ConfigError` if
    ``module`` is not wrapped (a copy of a wrapped model never is).
    """
    state = _unregister(module)
    if state is None:
        raise ConfigError(
            f"unwrap: this {type(module).__name__} is not wrapped (tsh.wrap(model) returns "
            "the hooks; copies of a wrapped model are not wrapped)"
        )
    state.hooks.close()
