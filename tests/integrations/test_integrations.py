"""The trainer callbacks, for real: Hugging Face ``Trainer`` and Lightning, tiny models.

Each run trains two copies of one seeded model for a few steps with SGD, one with
the callback and one without, and compares every parameter with ``torch.equal``
(so every gradient was identical too). No downloads: models are built from configs.
The frameworks are in the ``test`` extra, so these tests run (never skip) in CI.
"""

from __future__ import annotations

import copy
import importlib
import logging
import pickle
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import tensorstore_hooks as tsh
from tensorstore_hooks.integrations.lightning import OffloadCallback as LightningOffload
from tensorstore_hooks.integrations.transformers import OffloadCallback as HFOffload

SEQ = 16
STEPS = 2  # optimizer steps per run


def _params_equal(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys() and pa
    for name in pa:
        assert torch.equal(pa[name], pb[name]), f"parameter {name} differs"


def _trained_away(before: nn.Module, after: nn.Module) -> bool:
    pairs = zip(before.parameters(), after.parameters(), strict=True)
    return any(not torch.equal(p, q) for p, q in pairs)


# ----------------------------------------------------------------- transformers
class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 8) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, 64, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int | slice) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _gpt2() -> GPT2LMHeadModel:
    cfg = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def _hf_train(model: nn.Module, out: Path, callbacks: list[Any], **extra: Any) -> Trainer:
    settings: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 2,
        "max_steps": STEPS,
        "learning_rate": 0.05,
        "optim": "sgd",
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "report_to": [],
        "save_strategy": "no",
        "logging_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    settings.update(extra)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**settings),
        train_dataset=_Tokens(),
        callbacks=callbacks,
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize(
    "extra",
    [{}, {"gradient_accumulation_steps": 2}, {"bf16": True}],
    ids=["plain", "accumulate", "bf16"],
)
def test_transformers_trainer_is_bit_identical(tmp_path: Path, extra: dict[str, Any]) -> None:
    ref, off = _gpt2(), _gpt2()
    start = copy.deepcopy(ref)
    _hf_train(ref, tmp_path / "ref", [], **extra)
    cb = HFOffload(store="memory://", min_bytes=0)
    _hf_train(off, tmp_path / "off", [cb], **extra)
    _params_equal(ref, off)
    assert _trained_away(start, ref)
    stats = cb.hooks.stats
    assert stats.tensors_offloaded > 0 and stats.bytes_read > 0
    assert not cb.hooks.wrapped  # unwrapped at on_train_end
    assert len(cb.hooks.store) == 0 or cb.hooks.store is None  # graphs freed
    # The callback pickles (spawned workers, trainer state) without its hooks.
    assert pickle.loads(pickle.dumps(cb)).hooks is None


def test_transformers_gradient_checkpointing_stores_only_what_it_keeps(tmp_path: Path) -> None:
    with tsh.offload("memory://", min_bytes=0) as everything:  # one step, no checkpoint
        _gpt2()(**_Tokens()[:2])
    ref, off, blocks = _gpt2(), _gpt2(), _gpt2()
    for m in (ref, off, blocks):
        m.activation_checkpointing_enable()
    _hf_train(ref, tmp_path / "ref", [])
    cb = HFOffload(store="memory://", min_bytes=0)
    _hf_train(off, tmp_path / "off", [cb])
    inner = HFOffload(store="memory://", min_bytes=0, modules="transformer.h.*")
    _hf_train(blocks, tmp_path / "blocks", [inner])
    _params_equal(ref, off)
    _params_equal(ref, blocks)
    # The checkpointed layers keep only their inputs: what is stored is the rest of
    # the model (embeddings, final norm, head, loss), well under everything.
    per_step = cb.hooks.stats.bytes_offloaded / STEPS
    assert 0 < per_step < everything.stats.bytes_offloaded / 2
    # Inside the layers only the checkpoint's own boundary (its input hidden states,
    # saved before its hooks are pushed) reaches us: one per layer and step.
    hidden_bytes = 2 * SEQ * 32 * 4
    assert inner.hooks.stats.tensors_offloaded == 2 * STEPS
    assert inner.hooks.stats.bytes_offloaded == 2 * STEPS * hidden_bytes


class _Reporter(TrainerCallback):
    """Stands in for a ``report_to`` integration: a callback listed before ours."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        self.seen.append(dict(logs))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


_FIGURES = (
    "tsh/bytes_offloaded",
    "tsh/bytes_read",
    "tsh/tensors_offloaded",
    "tsh/tensors_kept",
    "tsh/fallbacks",
    "tsh/pack_stall_s",
    "tsh/unpack_stall_s",
    "tsh/budget_kept_bytes",
)


def test_transformers_figures_reach_the_trainers_logs(tmp_path: Path) -> None:
    reporter = _Reporter()
    cb = HFOffload(store="memory://", min_bytes=0, device_budget="64KiB")
    trainer_log = logging.getLogger("transformers.trainer")
    lines, level = _Lines(), trainer_log.level
    trainer_log.addHandler(lines)
    trainer_log.setLevel(logging.INFO)
    try:
        trainer = _hf_train(
            _gpt2(), tmp_path, [reporter, cb], logging_strategy="steps", logging_steps=1
        )
    finally:
        trainer_log.removeHandler(lines)
        trainer_log.setLevel(level)
    history = trainer.state.log_history
    steps = [h for h in history if "loss" in h]
    assert len(steps) == STEPS
    for h in steps:
        assert set(_FIGURES) <= set(h), sorted(h)
        assert h["tsh/bytes_offloaded"] > 0 and h["tsh/bytes_read"] > 0
    # Per logging period, adding up to the run's totals; the final log has the totals.
    stats = cb.hooks.stats
    assert sum(h["tsh/bytes_offloaded"] for h in steps) == stats.bytes_offloaded
    assert sum(h["tsh/budget_kept_bytes"] for h in steps) > 0  # the plan kept some
    assert steps[-1]["tsh/effective_device_budget"] == 64 * 1024  # the budget in force
    final = history[-1]
    assert "train_runtime" in final
    assert final["tsh/total/bytes_offloaded"] == stats.bytes_offloaded
    # A report_to integration (listed before us) sees the figures too.
    assert any("tsh/bytes_offloaded" in logs for logs in reporter.seen if "loss" in logs)
    assert any(
        line.startswith("OffloadCallback: saved ") and "offloaded" in line for line in lines.lines
    ), lines.lines


def test_transformers_modules_glob_is_checked_at_train_begin(tmp_path: Path) -> None:
    from tensorstore_hooks import ConfigError

    with pytest.raises(ConfigError, match=r"'transformer\.blocks\.\*'.*'transformer\.h'"):
        _hf_train(_gpt2(), tmp_path, [HFOffload(modules="transformer.blocks.*")])


# -------------------------------------------------------------------- lightning
class _LitMLP(pl.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh())
        self.head = nn.Linear(64, 4)
        self.automatic_optimization = not manual

    def training_step(self, batch: Any, idx: int) -> torch.Tensor | None:
        x, y = batch
        # The loss is computed here, not in forward(): the callback must see it too.
        loss = nn.functional.mse_loss(self.head(self.net(x)), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(3)
    ds = torch.utils.data.TensorDataset(
        torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)
    )
    return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)


def _pl_fit(module: pl.LightningModule, callbacks: list[Any], **extra: Any) -> pl.Trainer:
    settings: dict[str, Any] = {
        "max_steps": STEPS,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "callbacks": callbacks,
    }
    settings.update(extra)
    trainer = pl.Trainer(**settings)
    with warnings.catch_warnings():
        # Lightning's advice about dataloader workers and log intervals on a tiny run.
        warnings.filterwarnings("ignore", module="lightning")
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*log_every_n_steps.*")
        trainer.fit(module, _loader())
    return trainer


@pytest.mark.parametrize(
    ("extra", "manual", "args"),
    [
        ({}, False, {}),
        ({"accumulate_grad_batches": 2}, False, {}),
        ({"precision": "bf16-mixed"}, False, {}),
        ({}, True, {}),
        ({}, False, {"modules": "net"}),
    ],
    ids=["plain", "accumulate", "bf16", "manual", "modules"],
)
def test_lightning_fit_is_bit_identical(
    extra: dict[str, Any], manual: bool, args: dict[str, Any]
) -> None:
    ref, off = _LitMLP(manual), _LitMLP(manual)
    start = copy.deepcopy(ref)
    _pl_fit(ref, [], **extra)
    cb = LightningOffload(store="memory://", min_bytes=0, **args)
    _pl_fit(off, [cb], **extra)
    _params_equal(ref, off)
    assert _trained_away(start, ref)
    assert cb.hooks.stats.tensors_offloaded > 0 and cb.hooks.stats.bytes_read > 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert pickle.loads(pickle.dumps(cb)).hooks is None


def test_lightning_step_scope_covers_the_training_step_loss() -> None:
    module = _LitMLP()
    cb = LightningOffload(store="memory://", min_bytes=0)
    wrapped = LightningOffload(store="memory://", min_bytes=0, modules="net")
    _pl_fit(module, [cb])
    _pl_fit(_LitMLP(), [wrapped])
    # The whole step (head and loss included) against the net's forward only.
    assert cb.hooks.stats.tensors_offloaded > wrapped.hooks.stats.tensors_offloaded > 0


def test_lightning_figures_reach_the_modules_logger(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning.pytorch.loggers import CSVLogger

    cb = LightningOffload(store="memory://", min_bytes=0)
    logger = CSVLogger(str(tmp_path), name="run", version=0)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer = _pl_fit(_LitMLP(), [cb], logger=logger, log_every_n_steps=1)
    for metrics in (trainer.logged_metrics, trainer.callback_metrics):
        assert set(_FIGURES) <= set(metrics), sorted(metrics)
        assert float(metrics["tsh/bytes_offloaded"]) > 0
        assert float(metrics["tsh/bytes_read"]) > 0
    # Per batch: the last step's figure is one step's share of the run's total.
    assert float(trainer.logged_metrics["tsh/bytes_offloaded"]) == (
        cb.hooks.stats.bytes_offloaded / STEPS
    )
    header = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert "tsh/bytes_offloaded" in header and "tsh/unpack_stall_s" in header
    assert any(m.startswith("OffloadCallback: saved ") for m in caplog.messages), caplog.messages
    renamed = LightningOffload(store="memory://", min_bytes=0, log_prefix="offload/")
    metrics = _pl_fit(_LitMLP(), [renamed]).callback_metrics
    assert "offload/bytes_offloaded" in metrics and "tsh/bytes_offloaded" not in metrics


# ------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("integration", "framework", "pip"),
    [
        ("transformers", "transformers", "transformers accelerate"),
        ("lightning", "lightning", "lightning"),
    ],
)
def test_missing_framework_names_the_pip_package(
    monkeypatch: pytest.MonkeyPatch, integration: str, framework: str, pip: str
) -> None:
    name = f"tensorstore_hooks.integrations.{integration}"
    for mod in [m for m in sys.modules if m == framework or m.startswith(framework + ".")]:
        monkeypatch.setitem(sys.modules, mod, None)  # type: ignore[arg-type]
    monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=f"pip install {pip}"):
        importlib.import_module(name)


@pytest.fixture(autouse=True)
def _no_hooks_left() -> Iterator[None]:
    yield
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
