"""Offloading with activation checkpointing, whichever wraps which.

Inside a checkpointed region the checkpoint decides what is saved: offloading never
stores what the checkpoint will recompute (NOTE [ Checkpoint composition ]). Each
test counts what was stored (``hooks.stats``) and checks gradients with
``torch.equal`` against the model without either.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

import tensorstore_hooks as tsh


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 256)
        self.down = nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Net(nn.Module):
    """``around`` (if set) wraps each block call: a checkpoint, offload inside one, ..."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.around: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.around(block, x) if self.around is not None else block(x)
        return x.pow(2).mean()


X = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
REENTRANT = pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])


def _model() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _grads(model: nn.Module, hooks: tsh.OffloadHooks | None = None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = X.clone().requires_grad_()  # reentrant checkpoints need an input that requires grad
    if hooks is None:
        loss = model(x)
    else:
        with hooks:
            loss = model(x)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) and want
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@REENTRANT
def test_offload_inside_a_checkpointed_function_stores_nothing(reentrant: bool) -> None:
    model = _model()
    want = _grads(model)
    hooks = tsh.offload("memory://", min_bytes=0)

    def inner(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with hooks:  # in the forward and again in the recompute
            return block(x)

    model.around = lambda block, x: checkpoint(inner, block, x, use_reentrant=reentrant)
    _assert_equal(_grads(model), want)
    # Without composition: 6 activations (ReLU outputs, inputs of up) in forward
    # (non-reentrant) or in the recompute during backward (reentrant).
    assert hooks.stats.tensors_offloaded == 0
    assert hooks.stats.bytes_offloaded == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    hooks.close()


@pytest.mark.parametrize("impl", [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT])
def test_checkpoint_wrapper_of_a_wrapped_block_keeps_checkpointing(impl: CheckpointImpl) -> None:
    model = _model()
    want = _grads(model)
    hooks = tsh.wrap(model, "memory://", modules="blocks.*", min_bytes=0)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=impl)
    _assert_equal(_grads(model), want)
    assert hooks.stats.tensors_offloaded == 0  # the checkpoint recomputes the blocks
    hooks.remove()


@REENTRANT
def test_wrap_around_checkpointed_blocks_stores_only_the_boundaries(reentrant: bool) -> None:
    plain = _model()
    want = _grads(plain)
    everything = tsh.offload("memory://", min_bytes=0)
    _grads(plain, everything)  # no checkpoint: every activation

    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    model = copy.deepcopy(plain)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=impl)
    outside = tsh.offload("memory://", min_bytes=0)
    _assert_equal(_grads(model, outside), want)
    hooks = tsh.wrap(model, "memory://", min_bytes=0)
    _assert_equal(_grads(model), want)
    # What the checkpoint keeps (its boundaries, the loss), the same as offload()
    # around the forward, and a fraction of the activations.
    assert hooks.stats.tensors_offloaded == outside.stats.tensors_offloaded
    assert hooks.stats.bytes_offloaded == outside.stats.bytes_offloaded
    assert 0 < hooks.stats.bytes_offloaded * 4 < everything.stats.bytes_offloaded
    hooks.remove()
    everything.close()
    outside.close()


@REENTRANT
def test_wrap_of_a_module_inside_a_checkpointed_block_stores_nothing(reentrant: bool) -> None:
    model = _model()
    want = _grads(model)
    hooks = tsh.wrap(model, "memory://", modules="blocks.*.up", min_bytes=0)
    model.around = lambda block, x: checkpoint(block, x, use_reentrant=reentrant)
    _assert_equal(_grads(model), want)
    assert hooks.stats.tensors_offloaded == 0
    model.around = None
    _assert_equal(_grads(model), want)
    assert hooks.stats.tensors_offloaded > 0  # outside a checkpoint the glob offloads
    hooks.remove()


@REENTRANT
def test_recompute_under_hooks_still_active_in_backward_is_not_stored(reentrant: bool) -> None:
    model = _model()
    want = _grads(model)
    model.around = lambda block, x: checkpoint(block, x, use_reentrant=reentrant)
    outside = tsh.offload("memory://", min_bytes=0)
    _grads(model, outside)  # backward after the block: the boundaries only
    hooks = tsh.offload("memory://", min_bytes=0)
    model.zero_grad(set_to_none=True)
    with hooks:  # backward inside the block: the recompute runs under our hooks
        loss = model(X.clone().requires_grad_())
        loss.backward()
    _assert_equal([p.grad.clone() for p in model.parameters()], want)
    assert hooks.stats.tensors_offloaded == outside.stats.tensors_offloaded
    assert hooks.stats.bytes_offloaded == outside.stats.bytes_offloaded
    hooks.close()
    outside.close()
