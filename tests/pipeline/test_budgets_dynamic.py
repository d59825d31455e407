"""device_budget with dynamic shapes, through real models: sizes that change from step
to step (dynamic padding, bucketed lengths, micro-batches of other lengths) keep the
budget working (DESIGN.md "Budgets and tiers"; NOTE [ Device budget plan ])."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks.cli._demo_model import GPT, config_for

KiB = 1 << 10


def _planned(hooks: Any) -> tuple[int, int]:
    route = hooks.stats.per_rule.get("device_budget")
    return (route.tensors, route.bytes) if route is not None else (0, 0)


# ------------------------------------------------------------------ the finding
def _llama(lengths: list[int], hooks_for: Callable[[Any], Any]) -> tuple[list[Any], list[int]]:
    """Train a tiny Llama (transformers) one step per length; per step, its gradients
    and the bytes the device_budget plan kept."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    hooks = hooks_for(model)
    grads, kept = [], []
    for step, length in enumerate(lengths):
        ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(step))
        before = _planned(hooks)[1] if hooks is not None else 0
        model(input_ids=ids, labels=ids).loss.backward()
        kept.append(_planned(hooks)[1] - before if hooks is not None else 0)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    if hooks is not None:
        tsh.unwrap(model)
    return grads, kept


def test_llama_with_a_new_length_every_step_keeps_within_budget() -> None:
    # The finding: tsh.wrap(model, modules="model.layers.*", device_budget=...) kept
    # nothing once every step had another sequence length (dynamic padding).
    lengths = [96, 128, 112, 80, 120, 104]
    want, _ = _llama(lengths, lambda m: None)
    got, kept = _llama(
        lengths,
        lambda m: tsh.wrap(m, modules="model.layers.*", device_budget="512KiB", min_bytes="16KiB"),
    )
    assert kept[0] == 0  # the first forward follows the rules and records
    # Every later step keeps its newest tensors, never past the plan's budget (the
    # budget less the derived windows: at most 512 KiB).
    assert all(0 < k <= 512 * KiB for k in kept[1:]), kept
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys() and all(torch.equal(g[n], w[n]) for n in w)


# ------------------------------------------------------ every budget, every schedule
MAX_SEQ = 48


def _schedule(name: str, steps: int) -> Iterator[list[int]]:
    """Per step, the sequence length of each micro-batch (forward + backward)."""
    rng = random.Random(7)
    for step in range(steps):
        if name == "fixed":
            yield [40]
        elif name == "bucketed":
            yield [(16, 32, 48)[step % 3]]
        elif name == "random":
            yield [rng.randint(24, MAX_SEQ)]
        else:  # accumulate: micro-batches of other lengths before one optimiser step
            yield [rng.randint(16, MAX_SEQ) for _ in range(3)]


def _gpt(
    schedule: str, hooks_for: Callable[[Any], Any], *, steps: int = 3, retain: bool = False
) -> tuple[list[dict[str, torch.Tensor]], Any, list[int]]:
    cfg = config_for("tiny", blocks=2, seq=MAX_SEQ, batch=2, d_model=64)
    model = GPT(cfg, seed=0)
    hooks = hooks_for(model)
    grads, kept = [], []
    gen = torch.Generator().manual_seed(0)
    for lengths in _schedule(schedule, steps):
        for length in lengths:
            tokens = torch.randint(0, cfg.vocab, (cfg.batch, length + 1), generator=gen)
            before = _planned(hooks)[1] if hooks is not None else 0
            with hooks if hooks is not None else contextlib.nullcontext():
                loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward(retain_graph=retain)
            if retain:
                loss.backward()
            del loss
            if hooks is not None:
                kept.append(_planned(hooks)[1] - before)
                budget = hooks.stats.effective_device_budget
                assert kept[-1] <= (budget if budget is not None else 0)  # never more
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    return grads, hooks, kept


_REFERENCE: dict[tuple[str, bool], list[dict[str, torch.Tensor]]] = {}


def _reference(schedule: str, *, retain: bool = False) -> list[dict[str, torch.Tensor]]:
    """The gradients without offloading (once per schedule: every budget compares)."""
    key = (schedule, retain)
    if key not in _REFERENCE:
        _REFERENCE[key] = _gpt(schedule, lambda m: None, retain=retain)[0]
    return _REFERENCE[key]


@pytest.mark.parametrize("budget", [0, "256KiB", "1GiB", "auto", "50%"])
@pytest.mark.parametrize("schedule", ["fixed", "bucketed", "random", "accumulate"])
def test_gradients_equal_under_every_budget_and_shape_schedule(budget: Any, schedule: str) -> None:
    want = _reference(schedule)
    got, hooks, kept = _gpt(
        schedule, lambda m: tsh.offload("memory://", min_bytes="1KiB", device_budget=budget)
    )
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        assert all(torch.equal(g[n], w[n]) for n in w)
    if budget != 0:  # every forward after the first keeps some of its newest tensors
        assert all(k > 0 for k in kept[1:]), kept
    else:
        assert not any(kept)
    assert len(hooks.store) == 0
    hooks.close()


@pytest.mark.parametrize("budget", ["256KiB", "auto"])
def test_gradients_equal_with_retain_graph_and_changing_lengths(budget: str) -> None:
    want = _reference("random", retain=True)
    got, hooks, kept = _gpt(
        "random",
        lambda m: tsh.offload("memory://", min_bytes="1KiB", device_budget=budget),
        retain=True,
    )
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(g[n], w[n]) for n in w)
    assert all(k > 0 for k in kept[1:])
    hooks.close()


# ------------------------------------------------------------------- the warning
def test_a_budget_that_keeps_nothing_warns_once_through_the_hooks() -> None:
    # Every forward's newest tensor (the logits, 2 x 48 x 256 x 4 = 96 KiB) is larger
    # than what the plan may spend: it keeps nothing, forward after forward.
    hooks = tsh.offload("memory://", min_bytes="1KiB", device_budget="64KiB")
    with pytest.warns(UserWarning, match="device_budget kept nothing in 3 forwards") as info:
        _gpt("fixed", lambda m: hooks, steps=6)
    assert len(info) == 1  # once
    assert "Raise device_budget" in str(info[0].message)
    assert info[0].filename == __file__  # at the user's line, not ours or torch's
    hooks.close()
