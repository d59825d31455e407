"""Framework adapters: how another framework's tensors enter the torch codec.

The codec (``_codec.py``) knows torch only. A tensor of another framework (Paddle)
is encoded and decoded by that framework's adapter, found here by the top-level
module of the tensor's type (``paddle.Tensor`` -> ``"paddle"``) or, reading a
store back, by the ``framework`` field of the tensor's metadata. Entries are lazy
``"module:attr"`` strings, imported on first use, so ``import tensorstore_hooks``
imports no other framework and no adapter module at all. What an adapter provides
is ``_codec.FrameworkAdapter`` (it speaks of the codec's metadata, so it lives there).
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, TypeAlias

__all__ = ["ForeignTensor", "adapter_named", "framework_of", "frameworks", "register_adapter"]

ForeignTensor: TypeAlias = Any
"""Another framework's tensor (a ``paddle.Tensor``). Those frameworks are optional and
untyped here, so this is the one name their tensors have: only their own adapter
looks inside one (``_codec.FrameworkAdapter``), after its ``is_tensor`` said yes."""

_ENTRIES: dict[str, str] = {"paddle": "tensorstore_hooks.paddle._bridge:ADAPTER"}
"""framework name (also the top-level module of its tensor type) -> ``"module:attr"``."""
_LOADED: dict[str, object] = {}
_LOCK = threading.Lock()


def register_adapter(name: str, target: str, *, clobber: bool = False) -> None:
    """Register the adapter at ``target`` (``"module:attr"``) for framework ``name``.

    ``name`` is also the top-level module of the framework's tensor type. Refuses to
    replace an existing entry unless ``clobber`` (raises ``ValueError``).
    """
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"register_adapter: target must be 'module:attr', got {target!r}")
    with _LOCK:
        if name == "torch" or (name in _ENTRIES and not clobber):
            raise ValueError(
                f"register_adapter: an adapter for {name!r} is already registered; "
                "pass clobber=True to replace it"
            )
        _ENTRIES[name] = target
        _LOADED.pop(name, None)


def frameworks() -> tuple[str, ...]:
    """Every framework a stored tensor may name: ``"torch"`` and the registered ones."""
    return ("torch", *_ENTRIES)


def adapter_named(name: str) -> object:
    """The object registered for framework ``name`` (imported now if need be);
    ``KeyError`` if none. The codec checks it is a ``FrameworkAdapter``."""
    adapter = _LOADED.get(name)
    if adapter is not None:
        return adapter
    target = _ENTRIES[name]
    module, _, attr = target.partition(":")
    adapter = getattr(importlib.import_module(module), attr)
    with _LOCK:
        _LOADED[name] = adapter
    return adapter


def framework_of(obj: object) -> str | None:
    """The registered framework whose top-level module ``obj``'s type comes from, or
    ``None`` (its adapter's ``is_tensor`` has the last word)."""
    root = type(obj).__module__.split(".", 1)[0]
    return root if root in _ENTRIES else None
