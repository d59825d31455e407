"""Policy mistakes that would otherwise do nothing, silently: warned once per hooks object.

* A policy with ``module`` rules and no model to take module paths from
  (``model=`` forgotten): no module rule can ever match.
* A ``module`` glob that matched none of the module paths that ran during a whole
  forward: the warning lists paths that do exist, so the typo is plain to see.

Each is checked once per hooks object (the first forward), so a training loop pays
nothing after its first step.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

from tensorstore_hooks._warn import warn_user
from tensorstore_hooks.config import Policy, glob_matches, sample_names

__all__ = ["after_forward", "before_forward"]


def _module_globs(policy: Policy) -> list[tuple[int, str]]:
    """``(index, module glob)`` of each rule that has one."""
    return [(i, r.module) for i, r in enumerate(policy.rules) if r.module is not None]


class _Checked:
    __slots__ = ("forward", "missing_model")

    def __init__(self) -> None:
        self.missing_model = False
        self.forward = False


_LOCK = threading.Lock()
_CHECKED: weakref.WeakKeyDictionary[object, _Checked] = weakref.WeakKeyDictionary()


def _state(owner: object) -> _Checked:
    with _LOCK:
        state = _CHECKED.get(owner)
        if state is None:
            state = _CHECKED[owner] = _Checked()
        return state


def before_forward(owner: object, policy: Policy, has_scope: bool) -> None:
    """At the start of a forward under ``owner`` (the hooks; only its identity is used,
    weakly): warn if module rules cannot match."""
    if has_scope:
        return
    state = _state(owner)
    if state.missing_model:
        return
    state.missing_model = True
    rules = _module_globs(policy)
    if rules:
        globs = ", ".join(f"rules[{i}] module={glob!r}" for i, glob in rules)
        warn_user(
            f"tensorstore-hooks: the policy has module rules ({globs}) but no model to take "
            "module paths from, so they can never match. Pass model=your_model to "
            "tsh.offload(...), call hooks.attach(model), or use tsh.wrap(model, ...)."
        )


def after_forward(owner: object, policy: Policy, seen: Iterable[str] | None) -> None:
    """After the first forward: warn about ``module`` rules no running module matched.

    ``seen``: the module paths that ran (``None``: no module scope, nothing to check).
    """
    if seen is None:
        return
    state = _state(owner)
    if state.forward:
        return
    paths = set(seen)
    if not paths:
        return  # nothing of the model ran under these hooks yet
    state.forward = True
    unmatched = [
        f"rules[{i}] module={glob!r}"
        for i, glob in _module_globs(policy)
        if not any(glob_matches(glob, p) for p in paths)
    ]
    if unmatched:
        warn_user(
            f"tensorstore-hooks: {', '.join(unmatched)} matched no module during a whole "
            f"forward. Module paths that ran: {sample_names(paths)} (the root module is ''). "
            "Fix the glob (fnmatch; '*' also crosses dots)."
        )
