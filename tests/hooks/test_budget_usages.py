"""A ``device_budget`` acts whichever way offloading is written (issue 38, item 1).

The README's three usages: a fresh ``with tsh.offload(...)`` block per step (usage 1
in a loop), ``tsh.wrap`` and the Hugging Face callback. Each keeps what the budget
says from the second step on, and every gradient is bit-identical to training without
offloading (NOTE [ Plan carry-over ]).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks.hooks import _offload

KiB = 1 << 10
# Windows given as 0: the plan spends the whole budget (NOTE [ Windows ] rule 3).
OPTS: dict[str, object] = {"min_bytes": "1KiB", "max_inflight": 0, "prefetch": 0}


@pytest.fixture(autouse=True)
def _fresh_plans() -> Iterator[None]:
    _offload._PLANS.clear()  # each test starts as a fresh process would
    yield
    _offload._PLANS.clear()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(32, 64, generator=torch.Generator().manual_seed(step))


def _planned(stats: tsh.OffloadStats) -> int:
    route = stats.per_rule.get("device_budget")
    return route.bytes if route is not None else 0


def _grads(model: nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out


def _reference(steps: int) -> list[list[torch.Tensor]]:
    model = _model()
    out = []
    for step in range(steps):
        model(_batch(step)).sum().backward()
        out.append(_grads(model))
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_fresh_block_per_step_keeps_what_the_budget_says() -> None:
    # Usage 1 in a loop: each step's block is new hooks; the plan carries over.
    steps, want = 4, _reference(4)
    model, kept = _model(), []
    for step in range(steps):
        with tsh.offload("memory://", device_budget="24KiB", **OPTS) as hooks:
            loss = model(_batch(step)).sum()
        loss.backward()
        del loss
        kept.append(_planned(hooks.stats))
        assert _same(_grads(model), want[step])
    assert kept[0] == 0  # the first step follows the rules: nothing learnt yet
    assert all(0 < k <= 24 * KiB for k in kept[1:]), kept
    assert len(set(kept[1:])) == 1  # the same plan each step
    assert hooks.stats.replans == 0


def test_fresh_blocks_at_two_sites_or_configs_plan_apart() -> None:
    model = _model()
    for budget in ("24KiB", "8KiB"):  # another configuration: a plan of its own
        with tsh.offload("memory://", device_budget=budget, **OPTS) as hooks:
            loss = model(_batch(0)).sum()
        loss.backward()
        assert _planned(hooks.stats) == 0
    with tsh.offload("memory://", device_budget="24KiB", **OPTS) as hooks:  # another line
        loss = model(_batch(0)).sum()
    loss.backward()
    assert _planned(hooks.stats) == 0


def test_offload_with_model_carries_the_plan_across_call_sites() -> None:
    model = _model()
    with tsh.offload("memory://", model=model, device_budget="24KiB", **OPTS) as first:
        loss = model(_batch(0)).sum()
    loss.backward()
    with tsh.offload("memory://", model=model, device_budget="24KiB", **OPTS) as second:
        loss = model(_batch(1)).sum()
    loss.backward()
    assert _planned(first.stats) == 0 and 0 < _planned(second.stats) <= 24 * KiB


def test_wrap_keeps_what_the_budget_says_from_the_second_step() -> None:
    steps, want = 3, _reference(3)
    model = _model()
    hooks = tsh.wrap(model, "memory://", modules="*", device_budget="24KiB", **OPTS)
    kept = []
    for step in range(steps):
        before = _planned(hooks.stats)
        model(_batch(step)).sum().backward()
        kept.append(_planned(hooks.stats) - before)
        assert _same(_grads(model), want[step])
    tsh.unwrap(model)
    assert kept[0] == 0 and all(0 < k <= 24 * KiB for k in kept[1:]), kept
    # Wrapped again (a trainer's second train()): planned from its first step.
    again = tsh.wrap(model, "memory://", modules="*", device_budget="24KiB", **OPTS)
    model(_batch(0)).sum().backward()
    tsh.unwrap(model)
    assert _planned(again.stats) == kept[1]


def test_hf_callback_keeps_what_the_budget_says_from_the_second_step(tmp_path: object) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from tensorstore_hooks.integrations.transformers import OffloadCallback

    class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": _batch(i)[0]}

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _model()

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": self.body(x).sum()}

    class PerStep(TrainerCallback):
        def __init__(self, cb: OffloadCallback) -> None:
            self.cb, self.kept = cb, [0]

        def on_step_end(self, *args: object, **kwargs: object) -> None:
            assert self.cb.hooks is not None
            self.kept.append(_planned(self.cb.hooks.stats))

    def train(callbacks: list[TrainerCallback]) -> nn.Module:
        torch.manual_seed(0)
        net = Net()
        args = TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3,
            learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", report_to=[],
            save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
            dataloader_num_workers=0, seed=0,
        )  # fmt: skip
        Trainer(model=net, args=args, train_dataset=Data(), callbacks=callbacks).train()
        return net

    ref = train([])
    cb = OffloadCallback(store="memory://", device_budget="6KiB", **OPTS)
    per_step = PerStep(cb)
    off = train([cb, per_step])
    for p, q in zip(ref.parameters(), off.parameters(), strict=True):
        assert torch.equal(p, q)
    steps = [b - a for a, b in zip(per_step.kept, per_step.kept[1:], strict=False)]
    assert steps[0] == 0 and all(0 < k <= 6 * KiB for k in steps[1:]), steps
