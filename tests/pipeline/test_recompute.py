"""Parameter casts recomputed at unpack, never moved: NOTE [ Parameter casts ].

Autocast saves the low-precision casts of the weights; storing them moved bytes no
backward needs. Each test compares gradients with ``torch.equal`` against the same
step without hooks, and counts what moved.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks.pipeline import _recompute
from tensorstore_hooks.pipeline._iopool import shutdown_pool
from tensorstore_hooks.pipeline._recompute import CAST_LABEL, Recomputed, recomputable
from tensorstore_hooks.testing import WrappedStore
from tests.fake_accelerator import CpuAsAccelerator, on_fake_accelerator


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64)
    )


X = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))


def _casts(model: nn.Module, dtype: torch.dtype) -> tuple[int, int]:
    """(tensors, bytes) autograd saves that are casts of a leaf (the weights, and the
    input: a leaf that needs grad), in one autocast forward, found by a plain counting
    hook (no tensorstore-hooks)."""
    n = nbytes = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal n, nbytes
        base = t if t._base is None else t._base
        fn = base.grad_fn
        if fn is not None and fn.name() == "ToCopyBackward0":
            leaf = getattr(fn.next_functions[0][0], "variable", None)
            if isinstance(leaf, torch.Tensor):
                n += 1
                nbytes += t.numel() * t.element_size()
        return t

    with torch.autocast("cpu", dtype=dtype), torch.autograd.graph.saved_tensors_hooks(
        pack, lambda t: t
    ):
        model(X.clone().requires_grad_(True))
    return n, nbytes


def _step(
    model: nn.Module, hooks: Any, dtype: torch.dtype, *, inside: bool = False, flush: bool = False
) -> Any:
    """One autocast step (``inside``: backward inside the autocast block; ``flush``: every
    write done before backward); the grads."""
    model.zero_grad(set_to_none=True)
    x = X.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=dtype):
        if hooks is None:
            out = model(x)
        else:
            with hooks:
                out = model(x)
            if flush:
                hooks.flush()
        if inside:
            out.float().pow(2).sum().backward()
    if not inside:
        out.float().pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("inside", [False, True], ids=["backward-after", "backward-inside"])
def test_autocast_weight_casts_are_recomputed_not_moved(dtype: torch.dtype, inside: bool) -> None:
    model = _mlp()
    want = _step(model, None, dtype, inside=inside)
    casts, cast_bytes = _casts(model, dtype)
    assert casts == 4  # every Linear's weight cast, and the input's
    store = WrappedStore()
    hooks = tsh.offload(store, min_bytes=0)
    got = _step(model, hooks, dtype, inside=inside, flush=True)
    assert _equal(got, want)
    stats = hooks.stats
    assert stats.recomputed == casts and stats.bytes_recomputed == cast_bytes
    assert stats.per_action["recompute"].tensors == casts
    assert stats.per_rule[CAST_LABEL].bytes == cast_bytes
    # What moved is what is left: not one byte of a cast.
    assert stats.bytes_written == stats.bytes_offloaded
    saves = stats.tensors_offloaded + stats.tensors_kept + stats.dedup_hits + casts
    assert stats.tensors_saved == saves
    shutdown_pool(store)


def test_the_cast_itself_is_returned_while_autocast_caches_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Backward inside the autocast block: its cache still holds each cast, so nothing is
    made again (rule 3); after the block it is made again."""
    made = []
    real = Recomputed._remake

    def remake(self: Recomputed) -> torch.Tensor:
        made.append(self.base_shape)
        return real(self)

    monkeypatch.setattr(Recomputed, "_remake", remake)
    model = _mlp()
    hooks = tsh.offload("memory://", min_bytes=0)
    _step(model, hooks, torch.bfloat16, inside=True)
    assert hooks.stats.recomputed == 4 and made == []
    _step(model, hooks, torch.bfloat16, inside=False)
    assert len(made) == 4


def test_to_dtype_of_a_parameter_in_user_code_is_recomputed() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(128, 128))
    x = torch.randn(16, 128, requires_grad=True)

    def step(hooks: Any) -> list[torch.Tensor]:
        w.grad = x.grad = None
        if hooks is None:
            loss = (x.double() @ w.to(torch.float64).t()).sum()
        else:
            with hooks:
                loss = (x.double() @ w.to(torch.float64).t()).sum()
        loss.backward()
        return [w.grad.clone(), x.grad.clone()]

    want = step(None)
    hooks = tsh.offload("memory://", min_bytes=0)
    assert _equal(step(hooks), want)
    # w's cast, and x's (a leaf too): nothing moved at all.
    assert hooks.stats.recomputed == 2 and hooks.stats.tensors_offloaded == 0
    assert hooks.stats.bytes_recomputed == (128 * 128 + 16 * 128) * 8


def test_a_parameter_changed_before_backward_raises_torchs_error() -> None:
    model = _mlp()
    hooks = tsh.offload("memory://", min_bytes=0)
    x = X.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16), hooks:
        out = model(x)
    with torch.no_grad():
        model[2].weight.add_(1.0)  # an optimiser step between forward and backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()


def test_the_cast_changed_in_place_raises_torchs_error() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64, 64))
    x = torch.randn(8, 64, requires_grad=True)
    hooks = tsh.offload("memory://", min_bytes=0)
    with hooks:
        cast = w.to(torch.float64)
        loss = (x.double() @ cast).sum()
    assert hooks.stats.recomputed == 2  # the cast of w, and of x
    with torch.no_grad():
        cast.mul_(2)  # the cast itself, still alive, changed after it was saved
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_recompute_casts_off_sends_casts_through_the_rules() -> None:
    """``recompute_casts: false``: the casts are stored like any tensor, and a rule can
    keep them instead (rule 2)."""
    model = _mlp()
    want = _step(model, None, torch.bfloat16)
    casts, cast_bytes = _casts(model, torch.bfloat16)
    stored = tsh.offload("memory://", min_bytes=0, recompute_casts=False)
    assert _equal(_step(model, stored, torch.bfloat16), want)
    assert stored.stats.recomputed == 0
    on = tsh.offload("memory://", min_bytes=0)
    _step(model, on, torch.bfloat16)
    assert stored.stats.bytes_offloaded == on.stats.bytes_offloaded + cast_bytes
    kept = tsh.offload(
        "memory://",
        min_bytes=0,
        recompute_casts=False,
        rules=[tsh.Rule("keep", dtype="bfloat16", ndim=2, min_bytes=64 * 256 * 2)],
    )
    assert _equal(_step(model, kept, torch.bfloat16), want)
    # The three weight casts (the input's, 4 KiB, is below the rule's size: stored).
    assert kept.stats.recomputed == 0 and kept.stats.tensors_kept == casts - 1


def test_a_rule_that_keeps_a_cast_keeps_it() -> None:
    """Only what the rules would move is recomputed: a cast below ``min_bytes`` stays."""
    model = _mlp()
    hooks = tsh.offload("memory://", min_bytes=1 << 30)
    _step(model, hooks, torch.bfloat16)
    assert hooks.stats.recomputed == 0 and hooks.stats.per_rule["min_bytes"].tensors > 0


def test_what_is_recognised() -> None:
    w = nn.Parameter(torch.randn(8, 4))
    leaf = torch.randn(8, 4, requires_grad=True)
    assert recomputable(w.to(torch.float16)) is not None
    assert recomputable(w.to(torch.float16).t()) is not None  # a view of the cast
    assert recomputable(leaf.to(torch.float64)) is not None  # any leaf autograd feeds
    assert recomputable(w.to(torch.float64).to(torch.float16)) is None  # a chain
    assert recomputable(w * 2) is None
    assert recomputable((w * 2).to(torch.float16)) is None  # a cast of a non-leaf
    with torch.no_grad():
        assert recomputable(w.to(torch.float16)) is None  # no history: nothing says whose
    t = w.t().to(torch.float16)  # the leaf's transpose: a non-leaf again
    assert recomputable(t) is None
    cast = w.to(torch.float16)
    r = recomputable(cast[2:, 1:3])
    assert r is not None and torch.equal(r.unpack(), cast[2:, 1:3])
    del cast
    assert torch.equal(r.unpack(), w.detach().to(torch.float16)[2:, 1:3])


def test_recomputed_under_the_cuda_fake() -> None:
    """Over the fake accelerator: casts never reach the stager, the rest moves, grads
    are exact and no stream rule is broken (the conftest fixture checks)."""
    model = _mlp()
    want = _step(model, None, torch.bfloat16)
    casts, cast_bytes = _casts(model, torch.bfloat16)
    hooks = tsh.offload("memory://", min_bytes=0)
    ops = CpuAsAccelerator(lazy=True)
    on_fake_accelerator(hooks, ops)
    got = _step(model, hooks, torch.bfloat16, flush=True)
    assert _equal(got, want)
    stats = hooks.stats
    assert stats.recomputed == casts and stats.bytes_recomputed == cast_bytes
    assert stats.bytes_to_host == stats.bytes_written == stats.bytes_offloaded
    assert stats.bytes_to_device == stats.bytes_read == stats.bytes_offloaded
    assert ops.to_host_calls == stats.tensors_offloaded


def test_the_note_names_the_module() -> None:
    doc = _recompute.__doc__ or ""
    assert "NOTE [ Parameter casts ]" in doc
