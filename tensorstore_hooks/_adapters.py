"""Framework adapters: how another framework's tensors enter the torch codec.

The codec (``_codec.py``) knows torch only. A tensor of another framework (Paddle)
is encoded and decoded by that framework's adapter, found here by the top-level
module of the tensor's type (``paddle.Tensor`` -> ``"paddle"``) or, reading a
store back, by the ``framework`` field of the tensor's metadata. Entries are lazy
``"module:attr"`` strings, imported on first use, so ``import tensorstore_hooks``
imports no other framework and no adapter module at all.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Protocol

__all__ = ["FrameworkAdapter", "adapter_for", "adapter_named", "frameworks", "register_adapter"]


class FrameworkAdapter(Protocol):
    """What an adapter provides (a module or any object with these attributes)."""

    name: str
    """The ``framework`` written into a stored tensor's metadata."""

    def is_tensor(self, obj: object) -> bool:
        """True for a tensor of this framework (checked without importing it)."""

    def encode(self, t: Any) -> tuple[Any, Any]:
        """``(TensorMeta, numpy uint8 payload)`` as ``_codec.encode`` returns them."""

    def decode(
        self, meta: Any, payload: Any, *, device: Any = None, requires_grad: bool | None = None
    ) -> Any:
        """The framework's tensor rebuilt from what :meth:`encode` returned."""


_ENTRIES: dict[str, str] = {"paddle": "tensorstore_hooks.paddle._bridge:ADAPTER"}
"""framework name (also the top-level module of its tensor type) -> ``"module:attr"``."""
_LOADED: dict[str, FrameworkAdapter] = {}
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


def adapter_named(name: str) -> FrameworkAdapter:
    """The adapter of framework ``name`` (imported now if need be); ``KeyError`` if none."""
    adapter = _LOADED.get(name)
    if adapter is not None:
        return adapter
    target = _ENTRIES[name]
    module, _, attr = target.partition(":")
    adapter = getattr(importlib.import_module(module), attr)
    with _LOCK:
        _LOADED[name] = adapter
    return adapter


def adapter_for(obj: object) -> FrameworkAdapter | None:
    """The adapter whose framework ``obj`` is a tensor of, or ``None``."""
    root = type(obj).__module__.split(".", 1)[0]
    if root not in _ENTRIES:
        return None
    adapter = adapter_named(root)
    return adapter if adapter.is_tensor(obj) else None
