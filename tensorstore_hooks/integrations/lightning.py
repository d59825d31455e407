"""``OffloadCallback`` for ``lightning.pytorch.Trainer``.

::

    from tensorstore_hooks.integrations.lightning import OffloadCallback

    trainer = L.Trainer(callbacks=[OffloadCallback(store="memory://", min_bytes="1MiB")])
    trainer.fit(module, loader)

Everything ``training_step`` saves is offloaded: the hooks are entered at
``on_train_batch_start`` and left at ``on_before_backward`` (backward runs after
the block, as with ``tsh.offload``), so no ``forward`` needs to be called by the
step. With ``modules=`` (globs over ``pl_module.named_modules()``) the
LightningModule is wrapped with :func:`tensorstore_hooks.wrap` instead, from
``setup`` to ``teardown``. Gradient accumulation, manual optimization
(``manual_backward``), ``bf16-mixed`` precision and checkpointing compose.

What offloading did is logged through the module's own logger: after every training
batch the figures of that batch under ``tsh/`` (bytes offloaded and read, tensors
offloaded and kept, fallbacks, pack and unpack stall seconds, bytes the
``device_budget`` plan kept, ...) with ``pl_module.log_dict(on_step=True)``, so they are
in ``trainer.logged_metrics``, ``trainer.callback_metrics`` and every logger
(written at ``log_every_n_steps``). Each rank logs its own figures and Lightning's
loggers write rank 0's, as for any metric logged without ``sync_dist``. One summary
line goes to Lightning's console log (rank 0) at the end of ``fit``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tensorstore_hooks.integrations import missing_framework

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.utilities.rank_zero import rank_zero_info
except ImportError as e:  # see test_missing_framework_names_the_pip_package
    raise missing_framework("lightning.pytorch", "lightning", "lightning", e) from e

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from tensorstore_hooks.hooks import ConfigSource, OffloadHooks
    from tensorstore_hooks.pipeline import OffloadStats
    from tensorstore_hooks.storage import TensorStore

__all__ = ["OffloadCallback"]

log = logging.getLogger("tensorstore_hooks")


class _WholeStep:
    """``modules`` not given: offload the whole training step (not a ``wrap``)."""


_WHOLE_STEP = _WholeStep()


class OffloadCallback(Callback):
    """Offload saved activations during ``Trainer.fit``.

    ``store``, ``config`` and ``options`` (the policy and pipeline keywords:
    ``min_bytes``, ``prefetch``, ``rules``, ...): what
    :func:`tensorstore_hooks.offload` takes; ``modules`` (given, even ``None``) wraps
    the LightningModule (:func:`tensorstore_hooks.wrap`: chosen submodules, or its
    whole ``forward`` for ``None``) instead of offloading the whole training step.
    ``module`` policy rules use the LightningModule's module paths. ``hooks`` is the live
    :class:`~tensorstore_hooks.OffloadHooks` (closed after ``teardown``, stats kept).
    Pickling or deep-copying the callback drops the hooks.
    """

    def __init__(
        self,
        *,
        store: str | os.PathLike[str] | TensorStore | None = None,
        modules: str | Sequence[str] | _WholeStep | None = _WHOLE_STEP,
        config: ConfigSource = None,
        log_prefix: str = "tsh/",
        **options: object,
    ) -> None:
        self.store = store
        self.modules = modules
        self.config = config
        model = options.pop("model", None)
        if model is not None and not isinstance(model, torch.nn.Module):
            from tensorstore_hooks.errors import ConfigError

            raise ConfigError(
                f"OffloadCallback: model= must be a torch.nn.Module, got {type(model).__name__}"
            )
        self.model = model
        """A model whose module paths ``module`` rules use besides the LightningModule's."""
        self.options = options
        """The policy and pipeline keywords passed on to ``offload``/``wrap``."""
        self.log_prefix = log_prefix
        """Prefix of the metric names logged with ``pl_module.log_dict``."""
        self.hooks: OffloadHooks | None = None
        self._since: OffloadStats | None = None  # stats at the last logged batch
        self._open = False  # hooks made by setup, not yet closed by teardown
        self._entered = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self._open:
            return
        if not isinstance(self.modules, _WholeStep):
            from tensorstore_hooks.hooks import wrap

            hooks: OffloadHooks = wrap(
                pl_module,
                self.store,
                modules=self.modules,
                config=self.config,
                # a model= goes on to wrap() as given (wrap says what it takes)
                **({"model": self.model} if self.model is not None else {}),
                **self.options,
            )
        else:
            from tensorstore_hooks.hooks import offload

            hooks = offload(self.store, config=self.config, model=self.model, **self.options)
            # Entered every step and closed at on_train_end: keep the pipeline open
            # between steps (NOTE [ Idle hooks ] rule 3).
            hooks.release_idle = False
            if any(r.module is not None for r in hooks.policy.rules):
                hooks.attach(pl_module)
        self.hooks = hooks
        self._open = True
        self._since = hooks.stats.snapshot()
        log.info("OffloadCallback: offloading to %s", hooks.store.url)

    def _step_mode(self) -> bool:
        return self._open and isinstance(self.modules, _WholeStep)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int
    ) -> None:
        if self._step_mode() and not self._entered and self.hooks is not None:
            self.hooks.__enter__()
            self._entered = True

    def _leave(self) -> None:
        if self._entered and self.hooks is not None:
            self._entered = False
            self.hooks.__exit__(None, None, None)

    def on_before_backward(
        self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor
    ) -> None:
        self._leave()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, *args: object
    ) -> None:
        self._leave()  # a step that returned no loss (skipped backward)
        if not self._open or self.hooks is None or self._since is None:
            return
        from tensorstore_hooks.hooks import step_figures

        stats = self.hooks.stats
        figures = step_figures(stats.since(self._since), self.log_prefix)
        self._since = stats.snapshot()
        # Floats: Lightning keeps metrics as tensors; int64 byte counts would reach
        # loggers as tensors of another dtype than every other metric.
        pl_module.log_dict({k: float(v) for k, v in figures.items()}, on_step=True, on_epoch=False)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        # Lightning calls no teardown after an exception: undo setup here (a later fit
        # sets up afresh), so the module is not left wrapped nor the hooks open.
        self._finish()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._finish()

    def _finish(self) -> None:
        if not self._open or self.hooks is None:
            return
        from tensorstore_hooks.hooks import WrapHooks

        self._leave()
        self._open = False
        if isinstance(self.hooks, WrapHooks):
            self.hooks.remove()
        else:
            self.hooks.close()
        rank_zero_info(f"OffloadCallback: {self.hooks.stats.summary()}")

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state["hooks"] = state["_since"] = None
        state["_open"] = state["_entered"] = False
        return state
