"""``OffloadCallback`` for the Hugging Face ``Trainer``.

::

    from tensorstore_hooks.integrations.transformers import OffloadCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[OffloadCallback(store="file:///scratch/acts", min_bytes="1MiB")])
    trainer.train()

At ``on_train_begin`` the model is wrapped with :func:`tensorstore_hooks.wrap`
(``modules=`` selects blocks, e.g. ``"transformer.h.*"``; default: the whole
model's forward, which computes the loss when labels are given); at
``on_train_end`` it is unwrapped. Evaluation runs under ``no_grad`` and saves
nothing. Gradient accumulation, autocast (``bf16=True``) and gradient
checkpointing compose (NOTE [ Checkpoint composition ]).
"""

from __future__ import annotations

import logging
from typing import Any

from . import missing_framework

try:
    from transformers import TrainerCallback
except ImportError as e:  # see test_missing_framework_names_the_pip_package
    raise missing_framework("transformers", "transformers accelerate", "transformers", e) from e

__all__ = ["OffloadCallback"]

log = logging.getLogger("tensorstore_hooks")


class OffloadCallback(TrainerCallback):
    """Offload saved activations during ``Trainer.train()``.

    ``offload_args``: what :func:`tensorstore_hooks.wrap` takes besides the model:
    ``store``, ``modules``, ``config`` and the policy/pipeline keywords. ``hooks``
    is the live :class:`~tensorstore_hooks.OffloadHooks` (``None`` before training;
    kept after it, closed, so ``hooks.stats`` stays readable). Pickling or
    deep-copying the callback drops the hooks (a copy wraps afresh when it trains).
    """

    def __init__(self, **offload_args: Any) -> None:
        self.offload_args = offload_args
        self.hooks: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from .._wrap import wrap

        model = kwargs.get("model")
        if model is None:
            raise RuntimeError("OffloadCallback: the Trainer passed no model to on_train_begin")
        if self.hooks is not None and getattr(self.hooks, "wrapped", False):
            return  # train() called again without on_train_end (resumed after an error)
        args_ = dict(self.offload_args)
        store = args_.pop("store", None)
        self.hooks = wrap(model, store, **args_)
        log.info("OffloadCallback: %s offloads to %s", type(model).__name__, self.hooks.store.url)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.hooks is not None and getattr(self.hooks, "wrapped", False):
            self.hooks.remove()
            log.info("OffloadCallback: %s", self.hooks.stats.summary())

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["hooks"] = None
        return state
