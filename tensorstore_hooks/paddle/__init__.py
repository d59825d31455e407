"""PaddlePaddle support: the same stores and policies under ``paddle.autograd.saved_tensors_hooks``.

Imported only when used (``import tensorstore_hooks`` does not import paddle)::

    import tensorstore_hooks.paddle as tshp

    with tshp.offload() as hooks:          # a temporary local Zarr store
        loss = model(x).mean()             # saved tensors go to the store
    loss.backward()                        # and come back, prefetched
    print(hooks.stats.summary())

Stores take paddle tensors too: ``store.put(paddle_tensor)`` / ``store.get(key)``
returns a ``paddle.Tensor`` with the same dtype, shape, values, place and
``stop_gradient``. Install with ``pip install 'tensorstore-hooks[paddle]'``.
"""

from __future__ import annotations

from tensorstore_hooks.paddle._hooks import OffloadHooks, offload
from tensorstore_hooks.paddle._scope import LayerScope

__all__ = ["LayerScope", "OffloadHooks", "offload"]
