"""ModuleScope: which module of the model is running, so policy rules can match on it.

A forward pre-hook pushes the module's dotted path (``"blocks.0.attn"``; the root
module is ``""``) on a per-thread stack and a forward hook pops it, so the pack hook
can ask ``current()`` for the innermost module that saved a tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol, TypeAlias

import torch

from tensorstore_hooks.runtime import never_compiled

__all__ = ["ModuleScope"]

PreHook: TypeAlias = Callable[[object, tuple[object, ...]], None]
"""A forward pre-hook: ``(module, args)``; torch's and paddle's modules take it."""
PostHook: TypeAlias = Callable[[object, tuple[object, ...], object], None]
"""A forward post-hook: ``(module, args, output)``."""


class Removable(Protocol):
    """A hook's handle (torch's ``RemovableHandle``, paddle's ``HookRemoveHelper``)."""

    def remove(self) -> None: ...


class _Stack(threading.local):
    # threading.local subclass: each thread starts with its own empty list.
    def __init__(self) -> None:
        self.paths: list[str] = []


_SEEN_LIMIT = 4096  # paths remembered for diagnostics (models have far fewer)


class ModuleScope:
    """Tracks the dotted path of the innermost running module, per thread.

    * ``attach(model)`` adds one forward pre-hook and one forward hook to every
      submodule (a module shared by two parents is hooked once, under its first
      path); attaching the same module again is a no-op, so several models (or a
      model and one of its parts) can be attached.
    * ``detach()`` removes every hook this scope added: nothing is left on the model.
    * Re-entrant (a module calling itself pushes twice) and thread-safe (each thread
      has its own stack; ``attach``/``detach`` are locked). The forward hook is
      registered with ``always_call=True``, so an exception in ``forward`` still pops
      the path and the stack stays correct for the next step.
    """

    def __init__(self) -> None:
        self._local = _Stack()
        self._lock = threading.Lock()
        # Strong references until detach(): the handles need their module alive anyway.
        # Keys are modules (or paddle Layers, see tensorstore_hooks.paddle).
        self._handles: dict[object, tuple[Removable, Removable]] = {}
        # Every path that ran forward, for the "glob matched nothing" check
        # (tensorstore_hooks.hooks._diagnose); a set add per module call, bounded.
        self.seen: set[str] = set()
        self.compiled_warned = False  # said that compiled code hides its modules

    def attach(self, model: torch.nn.Module) -> None:
        """Hook every submodule of ``model``; paths are relative to ``model`` (root ``""``)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ModuleScope.attach: expected a torch.nn.Module, got {type(model)!r}")
        with self._lock:
            for path, module in model.named_modules():
                if module in self._handles:
                    continue
                # The pre-hook goes first and the post-hook last, so work done by other
                # hooks of this module is attributed to it too.
                pre = module.register_forward_pre_hook(self._make_pre(path), prepend=True)
                post = module.register_forward_hook(self._make_post(path), always_call=True)
                self._handles[module] = (pre, post)

    def detach(self) -> None:
        """Remove every hook added by ``attach``; safe to call twice."""
        with self._lock:
            handles, self._handles = self._handles, {}
        for pre, post in handles.values():
            pre.remove()
            post.remove()
        # Entries left by a forward that is still running on this thread are stale now.
        self._local.paths.clear()

    def enter(self, path: str) -> None:
        """Push ``path`` (a module's forward starts); for callers that hook modules themselves."""
        self._local.paths.append(path)
        if len(self.seen) < _SEEN_LIMIT:
            self.seen.add(path)

    def exit(self, path: str) -> None:
        """Pop ``path`` if it is the innermost entry (its forward ended, or raised)."""
        paths = self._local.paths
        if paths and paths[-1] == path:
            paths.pop()

    def current(self) -> str | None:
        """Dotted path of the innermost module running forward on this thread.

        ``""`` is the root module of an attached model; ``None`` means no attached
        module is running (or nothing is attached).
        """
        paths = self._local.paths
        return paths[-1] if paths else None

    def visible_paths(self) -> set[str] | None:
        """The paths that ran, for the "module rule matched nothing" check; ``None`` once
        compiled code ran modules this scope could not see (NOTE [ torch.compile ])."""
        return None if self.compiled_warned else self.seen

    @property
    def attached(self) -> int:
        """Number of modules currently hooked."""
        return len(self._handles)

    def _make_pre(self, path: str) -> PreHook:
        enter = self.enter
        scope = self

        @never_compiled  # NOTE [ torch.compile ], rule 3 (one code object for all)
        def pre_hook(module: object, args: tuple[object, ...]) -> None:
            if torch.compiler.is_compiling():  # NOTE [ torch.compile ], rule 4
                from tensorstore_hooks.hooks._compile import scope_traced

                scope_traced(scope)
                return
            enter(path)

        return pre_hook

    def _make_post(self, path: str) -> PostHook:
        # exit() pops only our own entry: with always_call=True this hook also runs
        # when a global pre-hook raised before ours pushed anything.
        exit_ = self.exit

        @never_compiled
        def post_hook(module: object, args: tuple[object, ...], output: object) -> None:
            if torch.compiler.is_compiling():  # rule 4: tracks nothing in traced code
                return
            exit_(path)

        return post_hook
