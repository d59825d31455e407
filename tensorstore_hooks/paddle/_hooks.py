"""``offload()`` for PaddlePaddle: the torch pipeline, stores and policies under Paddle's hooks.

NOTE [ Paddle hook nesting ]
Paddle holds one pair of saved-tensor hooks per process: registering a second pair
raises ``ValueError``, and leaving any ``saved_tensors_hooks`` block resets to *no*
hooks rather than back to the enclosing pair. Our blocks keep a stack of their own:
entering one inside another registers the inner pair in place of the outer one
(innermost wins, as in torch) and leaving it registers the outer pair again. A plain
``paddle.autograd.saved_tensors_hooks`` block inside ours fails with Paddle's own
error; ours inside a plain one raises a ``RuntimeError`` that says so (Paddle has no
way to read the outer pair back, so it could not be restored).

NOTE [ Paddle grad mode after a hook error ]
Paddle (3.3) calls both hooks with grad mode switched off and switches it back on only
when the hook returns: an exception leaves grad mode *off for the whole process*, and
every later forward silently records no graph. Our hooks can raise (a saved tensor
modified in place, a store that fails a read), so they switch it back on before any
exception leaves them. "On" is the mode to restore: Paddle saves tensors only while
it records a graph, and backward runs in that mode too.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, TypeAlias

from tensorstore_hooks._caller import names_caller
from tensorstore_hooks._codec import DTYPES
from tensorstore_hooks.hooks import ConfigSource, HooksBase, make_pipeline
from tensorstore_hooks.paddle._bridge import (
    PaddleVersion,
    from_torch,
    paddle_unsupported_reason,
    place_of,
    to_place,
    to_torch,
)
from tensorstore_hooks.paddle._scope import LayerScope
from tensorstore_hooks.pipeline import Handle, Host, Kept, Pipeline
from tensorstore_hooks.storage import TensorStore

if TYPE_CHECKING:  # paddle is imported when offload() is called
    import paddle
    import torch

__all__ = ["OffloadHooks", "offload"]

# See NOTE [ Paddle hook nesting ]. Process-wide, like Paddle's own registry.
_STACK_LOCK = threading.RLock()
_ACTIVE: list[OffloadHooks] = []


class _Stored:
    """A tensor handed to the pipeline: its handle plus what the torch alias lacks."""

    __slots__ = ("handle", "place", "stop_gradient")

    def __init__(self, handle: Handle, place: str, stop_gradient: bool) -> None:
        self.handle = handle
        self.place = place
        self.stop_gradient = stop_gradient


_Packed: TypeAlias = "_Stored | Kept[paddle.Tensor] | Host[paddle.Tensor, str]"
"""What the pack hook returns: a paddle tensor's stand-in in Paddle's autograd graph."""


def _torch_dtype_of(t: paddle.Tensor) -> torch.dtype | None:
    name = str(t.dtype).removeprefix("paddle.")
    entry = DTYPES.get(name)
    return entry[0] if entry is not None else None


class OffloadHooks(HooksBase):
    """Saved-tensor hooks for Paddle that offload into a :class:`~tensorstore_hooks.TensorStore`.

    Same contract as :class:`tensorstore_hooks.OffloadHooks`: a context manager
    around forward (backward may run after it exits), ``stats``, ``flush()``,
    ``attach(layer)`` and ``close()``; stored bytes are deleted when the graph is
    freed, never on unpack. Nesting: see NOTE [ Paddle hook nesting ].

    Device tensors (GPU, XPU) are copied to host synchronously at pack and moved
    back at unpack; write-behind and prefetch then hide the store as for CPU ones.
    An error raised in a hook (a saved tensor modified in place, a store that fails a
    read) reaches the caller of ``backward`` the way Paddle passes hook errors on: as
    ``OSError("(External) RuntimeError: ...")`` with our message inside.
    """

    def __init__(self, pipeline: Pipeline) -> None:
        super().__init__(pipeline)
        self._scope: LayerScope | None = None  # made at the first attach()
        self._layers: list[paddle.nn.Layer] = []

    # ------------------------------------------------------------ context
    def __enter__(self) -> OffloadHooks:
        if self._pipeline.closed:
            raise RuntimeError(
                "these OffloadHooks were closed; make new ones with "
                "tensorstore_hooks.paddle.offload(...)"
            )
        _push(self)
        if self._scope is not None:
            for layer in self._layers:
                self._scope.attach(layer)
        return self

    def __exit__(self, *exc: object) -> None:
        _pop(self)
        if self._scope is not None:
            self._scope.detach()

    # ------------------------------------------------------------- hooks
    def pack_hook(self, t: paddle.Tensor) -> _Packed:
        """Paddle's pack hook: route ``t`` by the policy; returns its stand-in."""
        try:
            return self._pack(t)
        except BaseException:
            _grad_mode_back_on()  # see NOTE [ Paddle grad mode after a hook error ]
            raise

    def unpack_hook(self, packed: _Packed) -> paddle.Tensor:
        """Paddle's unpack hook: the saved tensor's content, on its original place."""
        try:
            return self._unpack(packed)
        except BaseException:
            _grad_mode_back_on()  # see NOTE [ Paddle grad mode after a hook error ]
            raise

    def _pack(self, t: paddle.Tensor) -> _Packed:
        router = self._pipeline.router
        router.emit_warning()
        reason = paddle_unsupported_reason(t)
        dtype = _torch_dtype_of(t)
        if reason is not None or dtype is None:
            router.keep_unsupported(reason or f"paddle dtype {t.dtype}")
            return router.keep(t, PaddleVersion(t))
        nbytes = t.size * t.element_size()
        on_host = t.place.is_cpu_place()
        if on_host:
            view = to_torch(t)  # zero-copy: the policy looks at it, the pipeline stores it
        else:
            import torch

            view = torch.empty(list(t.shape), dtype=dtype, device="meta")
        action = router.route(view, nbytes, parameter=bool(t.persistable))
        if action == "store":
            if on_host:
                handle = router.store(view, nbytes, guard=PaddleVersion(t))
            else:
                # A host copy taken now holds the values as saved: no guard needed.
                handle = router.store(to_torch(t), nbytes)
            return _Stored(handle, place_of(t), bool(t.stop_gradient))
        if action == "host" and not on_host:
            if router.host_tier:
                router.warn_once(
                    "paddle-host",
                    "tensorstore-hooks: host_budget does not cover Paddle tensors yet: a "
                    "`host` rule copies them to Paddle's own pinned memory, unbounded. Use "
                    "`store` rules for Paddle tensors to keep host memory bounded.",
                )
            return Host(t.pin_memory(), place_of(t))
        return router.keep(t, PaddleVersion(t))

    def _unpack(self, packed: _Packed) -> paddle.Tensor:
        router = self._pipeline.router
        if isinstance(packed, _Stored):
            t = router.load(packed.handle)
            return from_torch(t, packed.place, stop_gradient=packed.stop_gradient)
        router.emit_warning()
        if isinstance(packed, Kept):
            return router.unkeep(packed)
        return to_place(packed.tensor, packed.device)

    # ------------------------------------------------------------- public
    def attach(self, layer: paddle.nn.Layer) -> OffloadHooks:
        """Track ``layer``'s sublayer paths for ``module`` rules while the hooks are active."""
        if self._scope is None:
            self._scope = self._pipeline.scope = LayerScope()
        self._layers.append(layer)
        with _STACK_LOCK:
            active = self in _ACTIVE
        if active:
            self._scope.attach(layer)
        return self

    def __repr__(self) -> str:
        return f"paddle.OffloadHooks(store={self._pipeline.store.url!r}, {self.stats.summary()})"


def _grad_mode_back_on() -> None:
    from paddle.base import core

    core._set_has_grad(True)  # type: ignore[attr-defined]  # what paddle.set_grad_enabled calls


def _register(hooks: OffloadHooks) -> None:
    from paddle.base import core

    core.eager.register_saved_tensors_hooks(hooks.pack_hook, hooks.unpack_hook)


def _push(hooks: OffloadHooks) -> None:
    from paddle.base import core

    with _STACK_LOCK:
        if _ACTIVE:
            core.eager.reset_saved_tensors_hooks()
        try:
            _register(hooks)
        except ValueError as e:
            if _ACTIVE:
                _register(_ACTIVE[-1])
            raise RuntimeError(
                "tensorstore_hooks.paddle.offload: another pair of paddle saved-tensor hooks "
                "is active, and paddle allows one pair at a time; leave that "
                "paddle.autograd.saved_tensors_hooks block first (tensorstore-hooks blocks "
                "nest among themselves)"
            ) from e
        _ACTIVE.append(hooks)


def _pop(hooks: OffloadHooks) -> None:
    from paddle.base import core

    with _STACK_LOCK:
        for i in range(len(_ACTIVE) - 1, -1, -1):
            if _ACTIVE[i] is hooks:
                del _ACTIVE[i]
                break
        else:
            return
        core.eager.reset_saved_tensors_hooks()
        if _ACTIVE:
            _register(_ACTIVE[-1])


@names_caller("tensorstore_hooks.paddle.offload")
def offload(
    store: str | os.PathLike[str] | TensorStore | None = None,
    *,
    config: ConfigSource = None,
    model: paddle.nn.Layer | None = None,
    **overrides: object,
) -> OffloadHooks:
    """Offload the tensors Paddle saves for backward into a store.

    Arguments as :func:`tensorstore_hooks.offload` takes them (``model`` is a
    ``paddle.nn.Layer``); the same stores, configs and policies apply. Raises
    :class:`~tensorstore_hooks.ConfigError` for bad options before anything changes,
    and ``ImportError`` naming the extra to install when paddle is missing.
    """
    try:
        import paddle  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "tensorstore_hooks.paddle needs PaddlePaddle: pip install 'tensorstore-hooks[paddle]'"
        ) from e
    hooks = OffloadHooks(make_pipeline(store, config, overrides))
    if model is not None:
        hooks.attach(model)
    return hooks
