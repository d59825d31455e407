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
from typing import Any

from tensorstore_hooks.integrations import missing_framework

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.utilities.rank_zero import rank_zero_info
except ImportError as e:  # see test_missing_framework_names_the_pip_package
    raise missing_framework("lightning.pytorch", "lightning", "lightning", e) from e

__all__ = ["OffloadCallback"]

log = logging.getLogger("tensorstore_hooks")


class OffloadCallback(Callback):
    """Offload saved activations during ``Trainer.fit``.

    ``offload_args``: what :func:`tensorstore_hooks.offload` takes (``store``,
    ``config``, policy and pipeline keywords), plus ``modules`` to wrap chosen
    submodules instead of the whole training step. ``module`` policy rules use the
    LightningModule's module paths. ``hooks`` is the live
    :class:`~tensorstore_hooks.OffloadHooks` (closed after ``teardown``, stats kept).
    Pickling or deep-copying the callback drops the hooks.
    """

    def __init__(self, *, log_prefix: str = "tsh/", **offload_args: Any) -> None:
        self.offload_args = offload_args
        self.log_prefix = log_prefix
        """Prefix of the metric names logged with ``pl_module.log_dict``."""
        self.hooks: Any = None
        self._since: Any = None  # stats at the last logged batch
        self._open = False  # hooks made by setup, not yet closed by teardown
        self._entered = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self._open:
            return
        args = dict(self.offload_args)
        store = args.pop("store", None)
        if "modules" in args:
            from tensorstore_hooks.hooks import wrap

            self.hooks = wrap(pl_module, store, **args)
        else:
            from tensorstore_hooks.hooks import offload

            self.hooks = offload(store, **args)
            if any(r.module is not None for r in self.hooks.policy.rules):
                self.hooks.attach(pl_module)
        self._open = True
        self._since = self.hooks.stats.snapshot()
        log.info("OffloadCallback: offloading to %s", self.hooks.store.url)

    def _step_mode(self) -> bool:
        return self._open and "modules" not in self.offload_args

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        if self._step_mode() and not self._entered:
            self.hooks.__enter__()
            self._entered = True

    def _leave(self) -> None:
        if self._entered:
            self._entered = False
            self.hooks.__exit__(None, None, None)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._leave()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self._leave()  # a step that returned no loss (skipped backward)
        if not self._open:
            return
        from tensorstore_hooks.hooks import step_figures

        stats = self.hooks.stats
        figures = step_figures(stats.since(self._since), self.log_prefix)
        self._since = stats.snapshot()
        # Floats: Lightning keeps metrics as tensors; int64 byte counts would reach
        # loggers as tensors of another dtype than every other metric.
        pl_module.log_dict({k: float(v) for k, v in figures.items()}, on_step=True, on_epoch=False)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning calls no teardown after an exception: undo setup here (a later fit
        # sets up afresh), so the module is not left wrapped nor the hooks open.
        self._finish()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._finish()

    def _finish(self) -> None:
        if not self._open:
            return
        self._leave()
        self._open = False
        if hasattr(self.hooks, "remove"):
            self.hooks.remove()
        else:
            self.hooks.close()
        rank_zero_info(f"OffloadCallback: {self.hooks.stats.summary()}")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["hooks"] = state["_since"] = None
        state["_open"] = state["_entered"] = False
        return state
