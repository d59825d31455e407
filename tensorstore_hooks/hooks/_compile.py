"""torch.compile and the offload hooks: what runs outside a compiled graph, what is refused.

Our hooks import this module only while dynamo traces them (``from ._compile
import ...`` inside their ``torch.compiler.is_compiling()`` branch, which dynamo runs
at trace time), so a process that never compiles never imports ``torch._dynamo``
because of us.

NOTE [ torch.compile ]
Compiled code (AOTAutograd, whatever the backend: ``aot_eager``, ``inductor``, ...)
runs each graph as one autograd ``Function``: the tensors the graph saves for
backward are packed together when the graph returns, by the saved-tensor hooks
active at that moment. So:

1. Hooks pushed *around* a compiled call see every tensor its graph saves, and the
   graph is the one the model has without offloading: ``with tsh.offload():
   loss = compiled(x)``, ``tsh.wrap(model)`` of the module that is compiled
   (``torch.compile(model)``, ``model.compile()``), ``tsh.wrap(model,
   modules=...)`` with each selected block compiled on its own
   (``block.compile()``), and both trainer callbacks in those shapes. Exact.
2. Hooks cannot be pushed in the *middle* of a graph. Dynamo would have to break
   the graph there: other graphs, so other kernels and fusions (not the same bits
   with inductor), and a break inside a loop makes dynamo run the whole frame
   eagerly. So a ``wrap`` selected module that dynamo traces *inside* a larger
   graph (``tsh.wrap(model, modules="layers.*")`` with ``torch.compile(model)``)
   and an ``offload()`` block entered in traced code are refused: a
   :class:`~tensorstore_hooks.ConfigError` at the first forward, naming what
   works instead; never a model that trains differently (pushes and pops traced
   into the wrong places leave layers without a gradient).
3. Torch calls some of our code from inside compiled regions: the pack hook from a
   graph's ``save_for_backward``, a compiled module's own forward hooks (run by
   ``_call_impl`` outside its graph), finalizers. Dynamo would compile each such
   frame on its own, and any work it skips under ``is_compiling()`` would be
   skipped for good; so those functions are marked :func:`~tensorstore_hooks.runtime._eager.
   never_compiled` (dynamo runs them, and what they call, eagerly). When dynamo
   *inlines* a selected module's hook into a graph it builds for that module alone
   (``block.compile()``: the hook at the graph's first instruction), the hook's
   work runs through :func:`outside_graph` (``torch._dynamo.disable``): a break
   before any tensor work, which changes no graph. Whether the hook was traced
   for its module alone or inside a larger graph (rule 2) is read from dynamo's
   tracer at trace time (``comptime``).
4. Every other module's hook does nothing in traced code (no graph break), so
   models that are not wrapped, and the unselected parts of wrapped ones, compile
   as they would without us. Hence ``module`` policy rules cannot see modules
   that run inside compiled code: their tensors are decided as if saved by the
   innermost module that runs eagerly; this is said once, as a warning.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import ParamSpec, Protocol, TypeVar, runtime_checkable

import torch
import torch._dynamo
from torch._dynamo.comptime import ComptimeContext, comptime

from tensorstore_hooks._warn import warn_user
from tensorstore_hooks.errors import ConfigError

__all__ = [
    "offload_block_traced",
    "outside_graph",
    "scope_traced",
    "traced_inside_graph",
    "wrap_hook_traced",
]

@runtime_checkable
class Refusable(Protocol):
    """Hooks whose eager ``__enter__`` raises ``_refused`` once it is set (``OffloadHooks``)."""

    _refused: str | None


@runtime_checkable
class WarnsOnce(Protocol):
    """A module scope that says once that compiled code hides its modules (``ModuleScope``)."""

    compiled_warned: bool


P = ParamSpec("P")
T = TypeVar("T")
A = TypeVar("A")

_lock = threading.Lock()


def outside_graph(fn: Callable[P, T]) -> Callable[P, T]:
    """``fn`` made opaque to dynamo: traced code breaks the graph and calls it eagerly."""
    return torch._dynamo.disable(fn, reason="tensorstore-hooks works outside compiled graphs")


# Frames that may sit above a module's own hooks in a graph that compiles just that
# module: ours, torch's module call machinery, dynamo's wrapper of a compiled module.
_MACHINERY = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.abspath(torch.nn.modules.module.__file__),
    os.path.abspath(torch._dynamo.external_utils.__file__),
)


def traced_inside_graph(ctx: ComptimeContext) -> bool:
    """At trace time: whether ``comptime``'s caller is traced inside a graph that holds
    code other than one module's call machinery (rule 2): user code (a parent's
    ``forward``, a compiled function) called the module. Cannot tell: ``True``."""
    tx = getattr(ctx, "_ComptimeContext__tx", None)
    if tx is None or not hasattr(tx, "parent"):
        return True
    while tx is not None:
        if not os.path.abspath(tx.f_code.co_filename).startswith(_MACHINERY):
            return True
        tx = tx.parent
    return False


def _python_value(ctx: ComptimeContext, name: str) -> object:
    """The Python object local ``name`` of the traced frame holds (``None``: not known)."""
    var = ctx.get_local(name)
    try:
        return var.as_python_constant()
    except Exception:  # a user object: dynamo keeps the real one
        tracker = getattr(var, "_ComptimeVar__variable", None)
        return getattr(tracker, "value", None)


@outside_graph
def _call_eagerly(fn: Callable[[A], None], arg: A) -> None:
    fn(arg)


# ----------------------------------------------------------------- tsh.wrap
def _note_wrap_edge(ctx: ComptimeContext) -> None:
    # Runs at trace time, in wrap_hook_traced's frame.
    if traced_inside_graph(ctx):
        refuse, key = _python_value(ctx, "refuse"), _python_value(ctx, "key")
        if callable(refuse) and isinstance(key, int):
            refuse(key)


def wrap_hook_traced(
    key: int,
    module: torch.nn.Module,
    eager: Callable[[torch.nn.Module], None],
    refuse: Callable[[int], None],
) -> None:
    """A ``tsh.wrap`` global hook of selected module ``module`` (``id`` ``key``) traced
    by dynamo (rules 2, 3): ``eager(module)`` (its push or pop) runs outside the graph;
    if the module is traced inside a larger graph, ``refuse(key)`` runs at trace time."""
    comptime(_note_wrap_edge)
    _call_eagerly(eager, module)


# ----------------------------------------------------------- offload() blocks
def _note_offload_block(ctx: ComptimeContext) -> None:
    hooks = _python_value(ctx, "hooks")
    if not isinstance(hooks, Refusable):
        # No handle on the object: refuse while tracing (dynamo wraps this error).
        raise _offload_block_error()
    hooks._refused = str(_offload_block_error())


def _offload_block_error() -> Exception:
    return ConfigError(
        "tsh.offload(): an offload block entered inside torch.compile'd code is not "
        "supported: compiled code saves a whole graph's tensors when the graph returns, "
        "so a block inside it would need a graph break there, and the model would no "
        "longer be the one compiled without offloading (NOTE [ torch.compile ]). Enter "
        "the block around the compiled call instead (`with tsh.offload(): loss = "
        "compiled_model(x)`), or use tsh.wrap(model) on the module you compile."
    )


def _raise_refused(hooks: Refusable) -> None:
    raise ConfigError(hooks._refused)


def offload_block_traced(hooks: Refusable) -> None:
    """``OffloadHooks.__enter__`` traced by dynamo: refuse (rule 2), at once and after.

    Records the refusal on ``hooks`` at trace time (dynamo may then run the frame
    eagerly: the eager ``__enter__`` raises it) and raises it at run time.
    """
    comptime(_note_offload_block)
    _call_eagerly(_raise_refused, hooks)


# ------------------------------------------------------------- module scope
def _note_scope(ctx: ComptimeContext) -> None:
    scope = _python_value(ctx, "scope")
    with _lock:
        if isinstance(scope, WarnsOnce):
            if scope.compiled_warned:
                return
            scope.compiled_warned = True
    warn_user(
        "tensorstore-hooks: `module` policy rules cannot see the modules that run inside "
        "torch.compile'd code: tensors saved there are decided as if saved by the innermost "
        "module that runs eagerly (NOTE [ torch.compile ]). Compile smaller parts (each "
        "block with block.compile()) or use rules without `module`."
    )


def scope_traced(scope: WarnsOnce | None) -> None:
    """A module-path hook of ``scope`` traced by dynamo: it tracks
    nothing there (rule 4); the scope warns once."""
    comptime(_note_scope)
