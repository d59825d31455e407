"""``tsh.wrap`` / ``tsh.unwrap``: offload inside chosen modules' forward, no loop edits.

NOTE [ Wrap hooks ]
Hooks stored on a module (``register_forward_pre_hook``) live in its ``__dict__``:
``copy.deepcopy``, ``pickle`` and ``torch.save(model)`` would copy them, and with
them the pipeline and its locks (``cannot pickle '_thread.lock'``), and a copy
would offload into the original's store. So nothing of ours is stored on the
model. One pair of *global* module hooks
(``torch.nn.modules.module.register_module_forward_pre_hook`` and
``register_module_forward_hook(always_call=True)``), registered while at least one
model is wrapped, looks each running module up in a registry keyed by the module's
``id`` and checked against a weak reference to it (Rule 6 says why not a
``WeakKeyDictionary``). A copy is another object, absent from the registry: not
wrapped.
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
6. Under ``torch.compile`` (NOTE [ torch.compile ] in ``hooks/_compile.py``): a hook that
   dynamo traces does nothing unless its module is selected; a selected module's
   push and pop run outside the graph, and one traced inside a larger graph makes
   its forward raise a ``ConfigError``. So the registry is keyed by ``id`` (a
   plain dict dynamo can read; each entry's weak reference drops it when the
   module dies), and ``wrap(torch.compile(m))`` wraps ``m``.
7. With ``modules=`` globs, the root's first forward checks that a selected module
   ran its hooks, and warns once if none did (a graph compiled before ``wrap``).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Sequence

import torch
from torch.nn.modules import module as _nn_module
from torch.utils.hooks import RemovableHandle

from tensorstore_hooks._caller import names_caller
from tensorstore_hooks._warn import warn_user
from tensorstore_hooks.config import check_globs, outermost, select_modules
from tensorstore_hooks.errors import ConfigError
from tensorstore_hooks.hooks._compose import checkpoint_decides
from tensorstore_hooks.hooks._diagnose import after_forward
from tensorstore_hooks.hooks._offload import ConfigSource, OffloadHooks, make_pipeline
from tensorstore_hooks.hooks._scope import ModuleScope
from tensorstore_hooks.runtime import never_compiled, say_once
from tensorstore_hooks.storage import TensorStore

__all__ = ["WrapHooks", "is_wrapped", "unwrap", "wrap"]

_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_hooks_enabled = torch._C._autograd._saved_tensors_hooks_is_enabled  # type: ignore[attr-defined]


class _Depth(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        """Selected modules of one wrapped tree running on this thread (Rule 2)."""


class _Wrap:
    """State of one wrapped tree: its hooks, its scope, the per-thread depth."""

    __slots__ = (
        "__weakref__",
        "finalizer",
        "first_forward",
        "hooks",
        "local",
        "module_rules",
        "ran_selected",
        "refused",
        "root_name",
        "scope",
    )

    def __init__(
        self, hooks: WrapHooks, scope: ModuleScope | None, root_name: str, blocks: bool
    ) -> None:
        self.hooks = hooks
        self.scope = scope
        self.root_name = root_name
        self.local = _Depth()
        self.finalizer: weakref.finalize[[], torch.nn.Module] | None = None
        self.refused: str | None = None  # Rule 6: why forward must raise, once dynamo said so
        # Rule 7: the root's first forward checks that a selected submodule ran.
        self.first_forward = blocks
        # The policy has `module` rules: only then does a module path traced by dynamo
        # (where the scope sees nothing) change a decision, and warn.
        self.module_rules = False
        self.ran_selected = False


class _Entry:
    __slots__ = ("path", "ref", "selected", "wrap")

    def __init__(self, wrap: _Wrap, module: torch.nn.Module, path: str, selected: bool) -> None:
        self.wrap = wrap
        self.path = path
        self.selected = selected
        # Dropped from the registry when the module dies (Rule 1): an id is reused.
        self.ref = weakref.ref(module, functools.partial(_forget, id(module)))


class _Frames(threading.local):
    def __init__(self) -> None:
        # (module, entry, pushed) per module call that did something (Rule 3).
        self.stack: list[tuple[torch.nn.Module, _Entry, bool]] = []


_LOCK = threading.Lock()
_REGISTRY: dict[int, _Entry] = {}
"""Every module of a wrapped tree, by ``id`` (Rule 1; see :func:`_entry`)."""
_SELECTED: dict[int, _Entry] = {}
"""The selected modules only: what a compiled region looks up (Rule 6)."""
_SCOPED: dict[int, _Entry] = {}
"""The other modules of trees whose module rules track paths (Rule 6: they cannot)."""
_WATCHED: dict[int, _Entry] = {}
"""Roots whose first forward is still to be checked (Rule 7)."""
_TABLES = (_REGISTRY, _SELECTED, _SCOPED, _WATCHED)
_ROOTS: weakref.WeakKeyDictionary[torch.nn.Module, _Wrap] = weakref.WeakKeyDictionary()
_FRAMES = _Frames()
_global_handles: list[RemovableHandle] = []


# ------------------------------------------------------------------- hooks
def _entry(module: torch.nn.Module) -> _Entry | None:
    entry = _REGISTRY.get(id(module))
    return entry if entry is not None and entry.ref() is module else None


def _forget(key: int, ref: weakref.ref[torch.nn.Module]) -> None:
    """A registered module died: drop its entries (weakref callback; never raises)."""
    for table in _TABLES:
        entry = table.get(key)
        if entry is not None and entry.ref is ref:
            table.pop(key, None)


@never_compiled  # a frame of its own runs eagerly; inlined, the branch below (Rule 6)
def _pre_hook(module: torch.nn.Module, args: tuple[object, ...]) -> None:
    if torch.compiler.is_compiling():  # Rule 6
        key = id(module)
        if key in _SELECTED or key in _WATCHED:
            from tensorstore_hooks.hooks._compile import wrap_hook_traced

            wrap_hook_traced(key, module, enter_module, refuse_traced)
        elif key in _SCOPED and _SCOPED[key].wrap.module_rules:
            from tensorstore_hooks.hooks._compile import scope_traced

            scope_traced(_SCOPED[key].wrap.scope)
        return
    if _remove_pending:
        _remove_unused_hooks()
    enter_module(module)


@never_compiled
def _post_hook(module: torch.nn.Module, args: tuple[object, ...], output: object) -> None:
    if torch.compiler.is_compiling():  # Rule 6
        key = id(module)
        if key in _SELECTED or key in _WATCHED:
            from tensorstore_hooks.hooks._compile import wrap_hook_traced

            wrap_hook_traced(key, module, exit_module, refuse_traced)
        return
    exit_module(module)


def enter_module(module: torch.nn.Module) -> None:
    """The pre-hook's work for ``module`` (eager; see Rules 2-4)."""
    entry = _entry(module)
    if entry is None:
        return
    wrap = entry.wrap
    if entry.selected:
        wrap.ran_selected = True
        if wrap.refused is not None:  # Rule 6
            raise ConfigError(wrap.refused)
    scope = wrap.scope
    if scope is not None:
        scope.enter(entry.path)
    elif not entry.selected and not (wrap.first_forward and not entry.path):
        return
    pushed = False
    if entry.selected:
        depth = wrap.local.depth
        wrap.local.depth = depth + 1
        if depth == 0 and _hooks_enabled() and not checkpoint_decides():  # Rules 2, 4
            hooks = wrap.hooks
            _push_hooks(hooks.pack_hook, hooks.unpack_hook)
            pushed = True
            hooks._pipeline.forward_begin()
    _FRAMES.stack.append((module, entry, pushed))


def exit_module(module: torch.nn.Module) -> None:
    """The post-hook's work for ``module`` (eager; Rule 3)."""
    stack = _FRAMES.stack
    if not stack or stack[-1][0] is not module:
        return
    _, entry, pushed = stack.pop()
    wrap = entry.wrap
    if pushed:
        _pop_hooks()
        wrap.hooks._pipeline.forward_end()
    if wrap.scope is not None:
        wrap.scope.exit(entry.path)
    if not entry.path and wrap.first_forward:  # Rule 7
        wrap.first_forward = False
        _WATCHED.pop(id(module), None)
        if not wrap.ran_selected:
            _warn_no_selected_ran(wrap)
    if entry.selected:
        wrap.local.depth -= 1
        if pushed:
            hooks = wrap.hooks
            seen = wrap.scope.visible_paths() if wrap.scope is not None else None
            after_forward(hooks, hooks.policy, seen)
            hooks._pipeline.emit_warning()


def _refuse_containers(
    root: torch.nn.Module, names: dict[str, torch.nn.Module], selected: set[str]
) -> None:
    """A selected module with no forward of its own (``nn.ModuleList``, ``nn.ModuleDict``)
    never runs: the model calls its children. Refused, naming them (never silently
    nothing offloaded)."""
    for name in sorted(selected):
        sub = names[name]
        if type(sub).forward is not torch.nn.Module.forward:
            continue
        children = [f"{name}.{child}" if name else child for child, _ in sub.named_children()]
        shown = ", ".join(children[:4]) + (", ..." if len(children) > 4 else "")
        fix = (
            f"select its children instead: modules={(name + '.*') if name else '*'!r} "
            f"({shown})"
            if children
            else "it has no children either: select the modules the model calls"
        )
        raise ConfigError(
            f"wrap({type(root).__name__}, modules=...): {name or 'the module'!r} is a "
            f"{type(sub).__name__}, whose forward never runs (the model calls its children "
            f"one by one), so nothing would be offloaded; {fix}"
        )


def _warn_no_selected_ran(wrap: _Wrap) -> None:
    warn_user(
        f"tensorstore-hooks: tsh.wrap({wrap.root_name}, modules=...): none of the selected "
        "modules ran their hooks during the model's first forward, so nothing of theirs was "
        "offloaded. If the model was run torch.compile'd before tsh.wrap(), dynamo keeps the "
        "graph it traced without the hooks (it does not look for hooks added later: "
        "torch._dynamo.config.skip_nnmodule_hook_guards); wrap before the first compiled "
        "call, or call torch._dynamo.reset() after tsh.wrap() (NOTE [ torch.compile ])."
    )


def refuse_traced(key: int) -> None:
    """At trace time: dynamo traced selected module ``key`` inside a larger graph
    (NOTE [ torch.compile ], rule 2); its next forward raises the ConfigError."""
    entry = _SELECTED.get(key)
    if entry is None:
        return
    wrap = entry.wrap
    root = wrap.root_name
    wrap.refused = (
        f"tsh.wrap({root}, modules=...): the selected module {entry.path!r} runs inside a "
        "torch.compile'd graph of a larger module or function. Compiled code saves a whole "
        "graph's tensors when the graph returns, so offloading cannot be limited to the "
        "selected modules without breaking the graph at each of them, and the model would "
        "no longer be the one compiled without offloading (NOTE [ torch.compile ]). What "
        f"works: compile each selected module on its own (e.g. `for block in ...: "
        f"block.compile()`), or wrap the module you compile as a whole (tsh.wrap(model), "
        "no modules=), or offload around the compiled call (`with tsh.offload(): loss = "
        "compiled_model(x)`)."
    )


def _install_global_hooks() -> None:
    if not _global_handles:
        pre = _nn_module.register_module_forward_pre_hook(_pre_hook)
        post = _nn_module.register_module_forward_hook(_post_hook, always_call=True)
        _global_handles.extend((pre, post))
        say_once(
            "module hooks",
            "tensorstore-hooks: global module forward hooks registered while a model is "
            "wrapped (NOTE [ Process-wide effects ]; removed after the last tsh.unwrap)",
        )


def _remove_global_hooks() -> None:
    while _global_handles:
        _global_handles.pop().remove()


_live_roots = 0  # wrapped trees not yet unwrapped or collected; guarded by _LOCK
_remove_pending = False  # the last tree was collected: remove the hooks at a safe point


def _root_gone() -> None:
    """A wrapped tree was unwrapped or collected: the global hooks go after the last.

    NOTE: a finalizer runs wherever the collector happens to run, dynamo's tracing
    included, which reads the global hook dicts to build its guards; so a collected
    tree only marks the hooks for removal, and the next module call (a pre-hook:
    torch iterates a copy of the hook dict there) or wrap/unwrap removes them.
    """
    global _live_roots, _remove_pending
    with _LOCK:
        _live_roots -= 1
        _remove_pending = _live_roots == 0


def _remove_unused_hooks() -> None:
    global _remove_pending
    with _LOCK:
        if _remove_pending and _live_roots == 0:
            _remove_global_hooks()
        _remove_pending = False


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
        else:
            _remove_unused_hooks()  # the model was collected: a safe point to drop them
        self.close()

    @property
    def wrapped(self) -> bool:
        """Whether the module is still wrapped by these hooks."""
        root = self._wrap_root() if self._wrap_root is not None else None
        state = _ROOTS.get(root) if root is not None else None
        return state is not None and state.hooks is self


def is_wrapped(module: torch.nn.Module) -> bool:
    """Whether ``module`` is the root of a :func:`wrap` (copies of it never are)."""
    return _uncompiled(module) in _ROOTS


def _uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile(module)`` wrapper runs (Rule 6), else ``module``."""
    inner = getattr(module, "_orig_mod", None)
    if isinstance(inner, torch.nn.Module) and type(module).__name__ == "OptimizedModule":
        return inner
    return module


@names_caller("tsh.wrap")
def wrap(
    module: torch.nn.Module,
    store: str | os.PathLike[str] | TensorStore | None = None,
    *,
    modules: str | Sequence[str] | None = None,
    config: ConfigSource = None,
    **overrides: object,
) -> WrapHooks:
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
    module = _uncompiled(module)  # Rule 6: names and hooks are the compiled module's own
    if "model" in overrides:
        raise ConfigError(
            "wrap: model= is not needed (module rules use the paths of the wrapped module)"
        )
    globs = check_globs(modules, "wrap")
    names = dict(module.named_modules())
    # NOTE [ Module globs ] rule 3: a selected module inside another adds nothing.
    selected = outermost(select_modules(names, globs, "wrap"))
    _refuse_containers(module, names, selected)
    with _LOCK:
        for name, sub in names.items():
            found = _entry(sub)
            if found is not None:
                other = found.wrap.root_name
                where = "this module" if not name else f"its submodule {name!r}"
                raise ConfigError(
                    f"wrap: {where} is already wrapped (by tsh.wrap of a {other}); "
                    "call tsh.unwrap(model) (or hooks.remove()) first"
                )
    pipeline = make_pipeline(store, config, overrides, site=("model", id(module)))
    # Module paths for ``module`` rules and for hooks.report() (NOTE [ Report ledger ]).
    scope = ModuleScope()
    pipeline.scope = scope
    hooks = WrapHooks(pipeline)
    hooks._wrap_root = weakref.ref(module)
    state = _Wrap(hooks, scope, type(module).__name__, blocks=selected != {""})
    state.module_rules = any(r.module is not None for r in pipeline.policy.rules)
    with _LOCK:
        if any(_entry(sub) is not None for sub in names.values()):  # lost a race
            pipeline.close()
            raise ConfigError("wrap: the module was wrapped concurrently; unwrap it first")
        for name, sub in names.items():
            entry = _REGISTRY[id(sub)] = _Entry(state, sub, name, name in selected)
            if entry.selected:
                _SELECTED[id(sub)] = entry
            elif scope is not None:
                _SCOPED[id(sub)] = entry
            if not name and state.first_forward:
                _WATCHED[id(sub)] = entry
        _ROOTS[module] = state
        global _live_roots, _remove_pending
        _live_roots += 1
        _remove_pending = False
        _install_global_hooks()
    # A model dropped without unwrap: its registry entries vanish with it; this drops
    # the global hooks (and the hooks' own finalizer closes the pipeline).
    state.finalizer = weakref.finalize(module, _root_gone)
    state.finalizer.atexit = False
    return hooks


def _unregister(module: torch.nn.Module) -> _Wrap | None:
    with _LOCK:
        state = _ROOTS.pop(_uncompiled(module), None)
        if state is None:
            return None
        for table in _TABLES:
            for key, entry in list(table.items()):
                if entry.wrap is state:
                    table.pop(key, None)
    if state.finalizer is not None:
        state.finalizer()  # -> _root_gone(), once
    _remove_unused_hooks()  # an explicit call: a safe point
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
