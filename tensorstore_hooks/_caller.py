"""Errors that name the function the user called.

``tsh.offload(42)`` fails deep inside (``open_store`` checks the URL's type); the user
called ``tsh.offload``, so the message must say ``tsh.offload: ...``. A public entry
point is decorated with :func:`names_caller`; a :class:`~tensorstore_hooks.TensorStoreError`
leaving it gets that name in front (an internal function's own name in front of the
message is replaced, never repeated), with its type, cause and traceback unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from tensorstore_hooks.errors import TensorStoreError

__all__ = ["name_caller", "names_caller"]

_P = ParamSpec("_P")
_R = TypeVar("_R")

# Internal functions whose name may lead a message; the user did not call them when
# they called a public entry point, so the entry point's name replaces theirs.
_INTERNAL = ("open_store", "make_pipeline", "offload", "wrap", "capture")


def name_caller(error: TensorStoreError, caller: str) -> None:
    """Put ``caller`` (``"tsh.offload"``) in front of ``error``'s message, in place."""
    if len(error.args) != 1 or not isinstance(error.args[0], str):
        return
    message: str = error.args[0]
    if message.startswith(caller):
        return
    for name in _INTERNAL:
        if message.startswith(name + ": "):
            message = message[len(name) + 2 :]
            break
        if message.startswith(name + "(") and caller.endswith("." + name):
            # "offload(model=...): ..." -> "tsh.offload(model=...): ..."
            error.args = (caller.removesuffix(name) + message,)
            return
    error.args = (f"{caller}: {message}",)


def names_caller(caller: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorate a public entry point: its errors name ``caller`` (see the module doc)."""

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def entry(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return fn(*args, **kwargs)
            except TensorStoreError as e:
                name_caller(e, caller)
                raise

        return entry

    return decorate
