"""``offload()`` together with the other things that touch saved tensors.

* ``torch.utils.checkpoint(use_reentrant=False)`` inside ``offload()``: the
  checkpoint's own hooks take what its region saves (it recomputes that), and
  ``offload()`` gets the rest, including each checkpointed block's *inputs* (the
  checkpoint boundaries, saved before the checkpoint's hooks are pushed).
* ``torch.compile(backend="aot_eager")``: the compiled autograd function saves its
  activations through ``ctx.save_for_backward``, so the pack hook runs for them.
  Measured here (torch 2.13): the gradients are bit-identical to the compiled model
  without offloading *and* to eager mode, so both are checked with ``torch.equal``.
* ``torch.autograd.graph.disable_saved_tensors_hooks``: torch raises its own
  ``RuntimeError`` (with the caller's message) when ``offload()`` is entered inside
  the region, and when the region is begun while ``offload()`` is active; nothing
  is offloaded inside such a region, and the hooks work again outside it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import tensorstore_hooks as tsh
from tensorstore_hooks.testing import WrappedStore


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.gelu(self.up(self.norm(x))), 0.1, self.training)
        return x + self.down(h)


class _Net(nn.Module):
    """Blocks optionally wrapped in non-reentrant checkpoints."""

    def __init__(self, d: int = 32, blocks: int = 3, *, ckpt: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(blocks))
        self.out = nn.Linear(d, 4)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.ckpt else block(h)
        return self.out(h).pow(2).mean()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    params: nn.Module,
    x: torch.Tensor,
    hooks: tsh.OffloadHooks | None = None,
) -> dict[str, torch.Tensor]:
    params.zero_grad(set_to_none=True)
    torch.manual_seed(11)  # dropout masks: the same in every run
    if hooks is None:
        loss = model(x)
    else:
        with hooks:
            loss = model(x)
        hooks.flush()  # everything comes back from the store
    loss.backward()
    return _grads(params)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    for name in want:
        assert torch.equal(got[name], want[name]), f"gradient of {name} differs"


class _Recording(WrappedStore):
    """A user-style store that keeps a copy of every tensor put (to see what was offloaded)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def put(self, tensor: torch.Tensor) -> str:
        self.seen.append(tensor.detach().clone())
        return super().put(tensor)


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(5))


# --------------------------------------------------------------- checkpoint
def test_checkpoint_inside_offload(x: torch.Tensor) -> None:
    torch.manual_seed(0)
    plain = _Net()
    ckpt = copy.deepcopy(plain)
    ckpt.ckpt = True
    offloaded = copy.deepcopy(ckpt)
    want = _run(plain, plain, x)
    _assert_equal(_run(ckpt, ckpt, x), want)  # checkpointing alone changes nothing

    store = _Recording()
    hooks = tsh.offload(store, min_bytes=0)
    inputs: list[torch.Tensor] = []
    handles = [
        b.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].detach().clone()))
        for b in offloaded.blocks
    ]
    got = _run(offloaded, offloaded, x, hooks)
    for h in handles:
        h.remove()
    _assert_equal(got, want)

    stats = hooks.stats
    assert stats.fallbacks == 0 and stats.bytes_read > 0
    # The boundaries went to the store: every checkpointed block's input was put.
    block_inputs = inputs[: len(offloaded.blocks)]  # the forward pass, not the recompute
    for i, t in enumerate(block_inputs):
        assert any(s.shape == t.shape and torch.equal(s, t) for s in store.seen), f"block {i}"
    # ... and little else: the checkpointed regions' activations were recomputed.
    full = tsh.offload("memory://", min_bytes=0)
    _run(plain, plain, x, full)
    assert stats.tensors_offloaded < full.stats.tensors_offloaded
    hooks.close()
    full.close()
    store.close()


def test_offload_inside_checkpointed_region(x: torch.Tensor) -> None:
    """``offload()`` entered inside a checkpointed function: the checkpoint decides
    (NOTE [ Checkpoint composition ]), in the forward and in the recompute; nothing it
    recomputes is stored, and gradients still match."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    hooks = tsh.offload("memory://", min_bytes=0)

    def block_with_offload(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        with hooks:
            return block(h)

    def forward(inp: torch.Tensor) -> torch.Tensor:
        h = model.inp(inp)
        for block in model.blocks:
            h = checkpoint(block_with_offload, block, h, use_reentrant=False)
        return model.out(h).pow(2).mean()

    _assert_equal(_run(forward, model, x), _run(ref, ref, x))
    assert hooks.stats.tensors_offloaded == 0
    hooks.close()


# ------------------------------------------------------------------ compile
def test_compile_aot_eager_under_offload(x: torch.Tensor) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _Net()
    eager.eval()  # no dropout: compiled RNG differs from eager RNG by design
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="aot_eager")
    hooks = tsh.offload("memory://", min_bytes=0)
    got = _run(compiled, model, x, hooks)
    assert hooks.stats.tensors_offloaded > 0 and hooks.stats.fallbacks == 0
    assert hooks.stats.bytes_read > 0
    without = _run(compiled, model, x)
    _assert_equal(got, without)  # the same compiled graph with and without offloading
    _assert_equal(got, _run(eager, eager, x))  # aot_eager keeps eager's float ops here
    hooks.close()
    torch._dynamo.reset()


# ------------------------------------------------------- disabled hooks
def test_disable_saved_tensors_hooks_refuses_entering(x: torch.Tensor) -> None:
    model = _Net()
    hooks = tsh.offload("memory://", min_bytes=0)
    with (
        torch.autograd.graph.disable_saved_tensors_hooks("offloading is off in here"),
        pytest.raises(RuntimeError, match="offloading is off in here"),
        hooks,
    ):
        pass
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    # Outside the region the same hooks work.
    with hooks:
        loss = model(x)
    loss.backward()
    assert hooks.stats.tensors_offloaded > 0
    hooks.close()


def test_refused_enter_leaves_no_module_hooks() -> None:
    model = _Net()
    hooks = tsh.offload("memory://", min_bytes=0, model=model)
    with (
        torch.autograd.graph.disable_saved_tensors_hooks("offloading is off in here"),
        pytest.raises(RuntimeError, match="offloading is off in here"),
        hooks,
    ):
        pass
    hooks.close()
    leftover = [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert not leftover, "module hooks left attached after torch refused the hooks"


def test_disable_saved_tensors_hooks_inside_active_offload(x: torch.Tensor) -> None:
    """torch refuses to *begin* a disabled region while saved-tensor hooks are active."""
    model = _Net()
    hooks = tsh.offload("memory://", min_bytes=0)
    with hooks, pytest.raises(RuntimeError, match="no saving here"):  # noqa: SIM117
        with torch.autograd.graph.disable_saved_tensors_hooks("no saving here"):
            pytest.fail("torch began a disabled region under active hooks")
    assert hooks.stats.tensors_offloaded == 0
    # The refusal left nothing behind: the same hooks still work.
    with hooks:
        loss = model(x)
    loss.backward()
    assert hooks.stats.tensors_offloaded > 0
    hooks.close()
