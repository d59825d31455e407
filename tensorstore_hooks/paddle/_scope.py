"""LayerScope: module paths of a ``paddle.nn.Layer`` for ``module`` policy rules."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from tensorstore_hooks.hooks import ModuleScope

if TYPE_CHECKING:
    from paddle import Tensor
    from paddle.nn import Layer

__all__ = ["LayerScope"]


class LayerScope(ModuleScope):
    """:class:`~tensorstore_hooks.hooks._scope.ModuleScope` over paddle Layers.

    Paths come from ``named_sublayers`` (root ``""``), pushed by a forward pre-hook
    and popped by a forward post-hook on every sublayer. Paddle has no
    ``always_call`` for post-hooks: when ``forward`` raises, the path stays pushed
    until the offload block exits (which clears it), so a rule may see the failed
    layer's path for the rest of that block.
    """

    def attach(self, model: Any) -> None:
        """Hook every sublayer of ``model``; attaching a layer twice is a no-op."""
        import paddle

        if not isinstance(model, paddle.nn.Layer):
            raise TypeError(f"LayerScope.attach: expected a paddle.nn.Layer, got {type(model)!r}")
        with self._lock:
            for path, layer in model.named_sublayers(include_self=True):
                if layer in self._handles:
                    continue
                # paddle's annotations say a hook maps Tensors; it gets the inputs tuple
                # and may return None, as ours do.
                pre_hook = cast("Callable[[Layer, Tensor], Tensor]", self._make_pre(path))
                post_hook = cast("Callable[[Layer, Tensor, Tensor], Tensor]", self._make_post(path))
                pre = layer.register_forward_pre_hook(pre_hook)
                post = layer.register_forward_post_hook(post_hook)
                self._handles[layer] = (pre, post)
