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

What offloading did reaches the trainer's own logs: every training log (each
``logging_steps``) gets the figures of its period under ``tsh/`` (bytes offloaded and
read, tensors offloaded and kept, fallbacks, pack and unpack stall seconds, bytes the
``device_budget`` plan kept, ...), so they are in ``trainer.state.log_history``, the
console and every ``report_to`` backend; the final log (``train_runtime`` ...) gets the
run's totals under ``tsh/total/``; and one summary line goes to the trainer's logger
at train end. NOTE [ Trainer log order ].

TRL's trainers (``SFTTrainer``, ``GRPOTrainer``, ``DPOTrainer``) subclass ``Trainer``:
pass the callback in ``callbacks=[...]`` as above (``tests/integrations/test_trl.py``
trains each exactly as without it). What they run under ``no_grad`` (generation, a
reference model's log-probabilities) saves nothing and is not offloaded.

NOTE [ Trainer log order ]
``Trainer.log`` appends its dict to ``state.log_history`` and then calls every
callback's ``on_log`` with it, in list order: the ``report_to`` integrations first,
user callbacks after them, the console printer last. So:

1. ``on_log`` adds the figures to the dict (the printer and later callbacks see them)
   and to ``log_history``'s newest entry when it is this log's record.
2. At ``on_train_begin`` the callback moves itself to the front of the trainer's
   callback list, before the ``report_to`` integrations, so they see the figures too.
   The list is reached through the handler that calls the event (the only caller of
   callback events); where that is not a ``CallbackHandler`` nothing is moved, and
   the figures still reach ``log_history`` and the printer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

import torch

from tensorstore_hooks.integrations import missing_framework

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import CallbackHandler
    from transformers.utils import logging as hf_logging
except ImportError as e:  # see test_missing_framework_names_the_pip_package
    raise missing_framework("transformers", "transformers accelerate", "transformers", e) from e

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from tensorstore_hooks.hooks import ConfigSource, WrapHooks
    from tensorstore_hooks.pipeline import OffloadStats
    from tensorstore_hooks.storage import TensorStore

__all__ = ["OffloadCallback"]


class OffloadCallback(TrainerCallback):
    """Offload saved activations during ``Trainer.train()``.

    ``store``, ``modules``, ``config`` and ``options`` (the policy and pipeline
    keywords: ``min_bytes``, ``prefetch``, ``rules``, ...): what
    :func:`tensorstore_hooks.wrap` takes besides the model. ``hooks`` is the live
    :class:`~tensorstore_hooks.OffloadHooks` (``None`` before training; kept after it,
    closed, so ``hooks.stats`` stays readable). Pickling or deep-copying the callback
    drops the hooks (a copy wraps afresh when it trains).
    """

    def __init__(
        self,
        *,
        store: str | os.PathLike[str] | TensorStore | None = None,
        modules: str | Sequence[str] | None = None,
        config: ConfigSource = None,
        log_prefix: str = "tsh/",
        **options: object,
    ) -> None:
        self.store = store
        self.modules = modules
        self.config = config
        self.options = options
        """The policy and pipeline keywords passed on to :func:`tensorstore_hooks.wrap`."""
        self.log_prefix = log_prefix
        """Prefix of the keys added to the trainer's logs (NOTE [ Trainer log order ])."""
        self.hooks: WrapHooks | None = None
        self._since: OffloadStats | None = None  # stats at the last training log

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: object,
    ) -> None:
        from tensorstore_hooks.hooks import wrap

        model = kwargs.get("model")
        if not isinstance(model, torch.nn.Module):
            what = "no model" if model is None else f"a {type(model).__name__} as the model"
            raise RuntimeError(f"OffloadCallback: the Trainer passed {what} to on_train_begin")
        if self.hooks is not None and self.hooks.wrapped:
            return  # train() called again without on_train_end (resumed after an error)
        self.hooks = wrap(
            model, self.store, modules=self.modules, config=self.config, **self.options
        )
        self._since = self.hooks.stats.snapshot()
        self._log_first()
        _trainer_info(
            "OffloadCallback: %s offloads to %s", type(model).__name__, self.hooks.store.url
        )

    def _log_first(self) -> None:
        """Rule 2 of NOTE [ Trainer log order ]: run before the ``report_to`` callbacks."""
        frame: FrameType | None = sys._getframe(1)
        for _ in range(8):  # on_train_begin (or a subclass's) <- CallbackHandler.call_event
            if frame is None:
                return
            handler = frame.f_locals.get("self")
            if isinstance(handler, CallbackHandler):
                if self in handler.callbacks:
                    handler.callbacks.remove(self)
                    handler.callbacks.insert(0, self)
                return
            frame = frame.f_back

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: object,
    ) -> None:
        if self.hooks is None or self._since is None or not isinstance(logs, dict):
            return
        from tensorstore_hooks.hooks import step_figures

        stats = self.hooks.stats
        if "loss" in logs:  # a training log: the figures of its period
            figures = step_figures(stats.since(self._since), self.log_prefix)
            self._since = stats.snapshot()
        elif "train_runtime" in logs:  # the final log of train(): the run's totals
            figures = step_figures(stats, self.log_prefix + "total/")
        else:
            return  # evaluation and other logs: nothing was offloaded for them
        record = state.log_history[-1] if state.log_history else None
        if isinstance(record, dict) and all(record.get(k) is v for k, v in logs.items()):
            record.update(figures)  # rule 1: this log's record
        logs.update(figures)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: object,
    ) -> None:
        if self.hooks is not None and self.hooks.wrapped:
            self.hooks.remove()
            _trainer_info("OffloadCallback: %s", self.hooks.stats.summary())

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state["hooks"] = state["_since"] = None
        return state


def _trainer_info(message: str, *args: object) -> None:
    """Log ``message % args`` at INFO through the ``Trainer``'s own logger: its handler,
    level and replica settings apply."""
    hf_logging.get_logger("transformers.trainer").info(message, *args)
