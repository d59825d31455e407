"""Warnings that point at the user's line, not at torch's or ours.

Our warnings are raised from hooks that torch calls (pack, module forward hooks)
or from training frameworks' loops, so a fixed ``stacklevel`` lands in torch
internals. On Python 3.12+ ``warnings.warn(skip_file_prefixes=...)`` skips those
frames; on 3.11 the same stack level is computed by walking the frames.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["internal_prefixes", "warn_user"]

# Packages whose frames sit between the user's code and our hooks. Only those already
# imported are looked up (a warning never imports a framework).
_FRAMEWORKS = ("torch", "transformers", "accelerate", "lightning", "pytorch_lightning", "paddle")


def internal_prefixes() -> tuple[str, ...]:
    """Directory prefixes (with a trailing separator) of frames that are not the user's."""
    prefixes = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    for name in _FRAMEWORKS:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            prefixes.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(prefixes)


def _user_stacklevel(prefixes: tuple[str, ...]) -> int:
    # Level 1 is warn_user itself; count from its caller outwards.
    frame = sys._getframe(2)
    level = 2
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(prefixes) or name.startswith("<frozen ")):
            return level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return 2


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside torch, frameworks and us."""
    prefixes = internal_prefixes()
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=prefixes)
    else:
        warnings.warn(message, category, stacklevel=_user_stacklevel(prefixes))
