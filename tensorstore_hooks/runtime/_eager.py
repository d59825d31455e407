"""The library's frames that dynamo must never compile (NOTE [ torch.compile ], rule 3).

While compiled code runs, dynamo compiles every Python frame it meets, and torch
calls our saved-tensor hooks, module hooks and finalizers from inside compiled
regions: the pack hook from the compiled graph's ``save_for_backward``, a module
hook from an eagerly run ``_call_impl``. Compiled, such a frame would run the
``is_compiling()`` branch for good and trace our bookkeeping (locks, ``os.getpid``,
thread-locals) into graph breaks. :func:`never_compiled` marks a function's code
so that dynamo runs it, and everything it calls, eagerly; it stays traceable when
dynamo inlines it into a graph it is building (that case is rule 2's). This needs
no ``torch._dynamo`` import, only torch's C hook; a torch without it leaves the
function as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["never_compiled"]

F = TypeVar("F", bound=Callable[..., object])


def never_compiled(fn: F) -> F:
    """Mark ``fn``'s code: dynamo skips its frames and the frames they call."""
    try:
        from torch._C._dynamo import eval_frame

        skip = eval_frame._FrameAction.SKIP
        eval_frame.set_code_exec_strategy(fn.__code__, eval_frame._FrameExecStrategy(skip, skip))
    except (ImportError, AttributeError, TypeError, RuntimeError):  # pragma: no cover
        pass
    return fn
