"""Gradients with offloading are bit-identical to gradients without.

Every test runs the same step twice from the same seed on two copies of the same
model, once plainly and once under ``tsh.offload(...)``, and compares with
``torch.equal``: the loss, every parameter gradient and the input gradient.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import tensorstore_hooks as tsh
from tensorstore_hooks import OffloadHooks, OffloadStats, StoreUnavailableError, TensorStore
from tensorstore_hooks.testing import WrappedStore

Step = Callable[[nn.Module, torch.Tensor], torch.Tensor]

OPTIONS: dict[str, dict[str, Any]] = {
    "defaults": {"min_bytes": 0},
    "no_prefetch": {"min_bytes": 0, "prefetch": 0},
    "small_prefetch": {"min_bytes": 0, "prefetch": "4KiB"},
    "large_prefetch": {"min_bytes": 0, "prefetch": "1GiB"},
    "small_inflight": {"min_bytes": 0, "max_inflight": "16KiB"},
}


# ------------------------------------------------------------------- models
class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout)
        )
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        att = F.dropout(att, self.dropout, self.training)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(
        self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2, seq: int = 16
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(GPTBlock(d, heads, dropout=0.1) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _gpt_step(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


class Elementwise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.sin() * self.w.exp()
        h = torch.tanh(h) + h.sigmoid() * x.cos()
        h = h.pow(2).log1p() / (1 + h.abs())
        return h.sum()


def _sum_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if out.dim() == 0 else out.float().pow(2).mean()


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], Step]] = {
    "elementwise": (Elementwise, lambda: torch.randn(8, 64, requires_grad=True), _sum_step),
    "transformer_layer": (
        lambda: nn.TransformerEncoderLayer(
            32, 4, dim_feedforward=64, dropout=0.0, batch_first=True
        ),
        lambda: torch.randn(4, 16, 32, requires_grad=True),
        _sum_step,
    ),
    "gpt": (TinyGPT, lambda: torch.randint(0, 64, (4, 17)), _gpt_step),
}


# ------------------------------------------------------------------ harness
def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if x.grad is not None:
        out["<input>"] = x.grad.clone()
    return out


def _assert_grads_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    assert want, "nothing to compare"
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), f"gradient of {name} differs"


def run_step(
    model: nn.Module,
    x: torch.Tensor,
    step: Step,
    hooks: OffloadHooks | None = None,
    *,
    seed: int = 1234,
    flush: bool = False,
    retain: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward+backward from ``seed``; forward under ``hooks`` if given."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    if hooks is None:
        loss = step(model, x)
    else:
        with hooks:
            loss = step(model, x)
        if flush:
            hooks.flush()
    loss.backward(retain_graph=retain)
    if retain:
        loss.backward()
    return loss.detach(), _grads(model, x)


def check_equivalent(
    make_model: Callable[[], nn.Module],
    x: torch.Tensor,
    step: Step,
    hooks: OffloadHooks,
    **kwargs: Any,
) -> OffloadStats:
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    want_loss, want = run_step(ref, x, step, **kwargs)
    got_loss, got = run_step(model, x, step, hooks, **kwargs)
    assert torch.equal(got_loss, want_loss)
    _assert_grads_equal(got, want)
    stats = hooks.stats
    assert stats.tensors_offloaded > 0, "nothing was offloaded: the test would prove nothing"
    return stats


# -------------------------------------------------------------------- tests
@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_models(store_url: str, model_name: str, options: str) -> None:
    make_model, make_input, step = MODELS[model_name]
    hooks = tsh.offload(store_url, **OPTIONS[options])
    stats = check_equivalent(make_model, make_input(), step, hooks)
    assert stats.fallbacks == 0
    assert len(hooks.store) == 0  # backward freed the graph: every key is gone
    hooks.close()


@pytest.mark.parametrize("model_name", list(MODELS))
def test_models_flushed_before_backward(model_name: str) -> None:
    """Everything comes back from the store (no tensor is still in memory)."""
    make_model, make_input, step = MODELS[model_name]
    hooks = tsh.offload("memory://", min_bytes=0)
    stats = check_equivalent(make_model, make_input(), step, hooks, flush=True)
    assert stats.tail_hits == 0
    assert stats.bytes_read > 0
    assert stats.prefetch_hits + stats.prefetch_misses > 0


def test_default_temporary_store() -> None:
    make_model, make_input, step = MODELS["transformer_layer"]
    hooks = tsh.offload(min_bytes=0)
    check_equivalent(make_model, make_input(), step, hooks, flush=True)


# ------------------------------------------------------ custom autograd.Function
class MulExp(torch.autograd.Function):
    """Saves inputs and its output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = x * w.exp()
        ctx.save_for_backward(x, w, out)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w, out = ctx.saved_tensors
        # (out - x * exp(w)) is exactly zero iff every saved tensor came back exactly.
        return g * w.exp(), (g * out).sum(0) + (out - x * w.exp()).sum(0)


class SortWithIndices(torch.autograd.Function):
    """Returns a non-differentiable index tensor and saves it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, idx = x.sort(dim=-1)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(idx)
        return values, idx

    @staticmethod
    def backward(ctx: Any, gv: torch.Tensor, gi: torch.Tensor | None) -> torch.Tensor:
        (idx,) = ctx.saved_tensors
        return torch.zeros_like(gv).scatter_(-1, idx, gv)


class SinCosLazy(torch.autograd.Function):
    """``set_materialize_grads(False)``: the unused output's gradient arrives as None."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x)
        return x.sin(), x.cos()

    @staticmethod
    def backward(ctx: Any, ga: torch.Tensor | None, gb: torch.Tensor | None) -> torch.Tensor | None:
        (x,) = ctx.saved_tensors
        grad = None
        if ga is not None:
            grad = ga * x.cos()
        if gb is not None:
            grad = -gb * x.sin() if grad is None else grad - gb * x.sin()
        return grad


class SquareInPlace(torch.autograd.Function):
    """``mark_dirty``: squares its input in place and saves the result."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        orig = x.clone()
        x.mul_(orig)
        ctx.mark_dirty(x)
        ctx.save_for_backward(orig, x)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        orig, out = ctx.saved_tensors
        # The second term is exactly zero iff the saved output came back exactly.
        return g * 2 * orig + (out - orig * orig)


class CustomNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(16, 32)
        self.w = nn.Parameter(torch.randn(32) * 0.1)
        self.lin2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = MulExp.apply(self.lin1(x), self.w)
        values, idx = SortWithIndices.apply(h)
        assert not idx.requires_grad
        a, _unused = SinCosLazy.apply(values + idx.float() * 1e-3)
        y = SquareInPlace.apply(a * 1.0)
        return self.lin2(y).sum()


@pytest.mark.parametrize("flush", [False, True], ids=["tail", "flushed"])
def test_custom_functions(store_url: str, flush: bool) -> None:
    hooks = tsh.offload(store_url, min_bytes=0)
    stats = check_equivalent(
        CustomNet, torch.randn(8, 16, requires_grad=True), _sum_step, hooks, flush=flush
    )
    # The int64 index tensor went to the store too (nothing special about non-floats).
    assert stats.per_action["store"].tensors >= 5


# ----------------------------------------------------------------- dtypes
class DtypeMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(32, 64)
        self.ln = nn.LayerNorm(64)
        self.l2 = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.ln(self.l1(x)))
        h = h.softmax(dim=-1) * h
        return self.l2(h).float().pow(2).mean()


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str
)
def test_dtypes(store_url: str, dtype: torch.dtype) -> None:
    hooks = tsh.offload(store_url, min_bytes=0)
    x = torch.randn(8, 32, dtype=dtype, requires_grad=True)
    check_equivalent(lambda: DtypeMLP().to(dtype), x, _sum_step, hooks, flush=True)
    assert all(k == "store" or k == "keep" for k in hooks.stats.per_action)


def test_channels_last_conv(store_url: str) -> None:
    def make() -> nn.Module:
        m = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3),
            nn.Flatten(),
            nn.Linear(8 * 14 * 14, 4),
        )
        return m.to(memory_format=torch.channels_last)

    x = torch.randn(2, 3, 16, 16).contiguous(memory_format=torch.channels_last).requires_grad_()
    hooks = tsh.offload(store_url, min_bytes=0)
    stats = check_equivalent(make, x, _sum_step, hooks, flush=True)
    assert stats.bytes_read > 0


# ------------------------------------------------------ graph re-use shapes
def test_retain_graph_backward_twice(store_url: str) -> None:
    make_model, make_input, step = MODELS["transformer_layer"]
    hooks = tsh.offload(store_url, min_bytes=0)
    check_equivalent(make_model, make_input(), step, hooks, flush=True, retain=True)
    assert len(hooks.store) == 0


def test_retain_graph_keeps_keys_until_graph_dies(store_url: str) -> None:
    model = DtypeMLP()
    with tsh.offload(store_url, min_bytes=0) as hooks:
        loss = model(torch.randn(4, 32))
    hooks.flush()
    stored = len(hooks.store)
    assert stored > 0
    loss.backward(retain_graph=True)
    assert len(hooks.store) == stored  # unpack never deletes
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(first, model.parameters(), strict=True))
    del loss
    assert len(hooks.store) == 0


class PenaltyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 32)
        self.l2 = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)) * F.softplus(self.l1(x)))


def _penalty_step_factory(hooks: OffloadHooks | None) -> Step:
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model(x).sum()
        # The gradient graph is built under the same hooks (re-entered if offloading).
        if hooks is not None:
            with hooks:
                (g,) = torch.autograd.grad(out, x, create_graph=True)
        else:
            (g,) = torch.autograd.grad(out, x, create_graph=True)
        return out + g.pow(2).sum()

    return step


@pytest.mark.parametrize("flush", [False, True], ids=["tail", "flushed"])
def test_double_backward_gradient_penalty(store_url: str, flush: bool) -> None:
    hooks = tsh.offload(store_url, min_bytes=0)
    torch.manual_seed(0)
    model = PenaltyNet()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 16, requires_grad=True)
    want_loss, want = run_step(ref, x, _penalty_step_factory(None))
    got_loss, got = run_step(model, x, _penalty_step_factory(hooks), hooks, flush=flush)
    assert torch.equal(got_loss, want_loss)
    _assert_grads_equal(got, want)
    assert hooks.stats.tensors_offloaded > 0
    assert len(hooks.store) == 0


class CheckpointedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh())
        self.b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        h = checkpoint(self.block, h, use_reentrant=False)
        return self.b(h.sigmoid()).pow(2).sum()


@pytest.mark.parametrize("flush", [False, True], ids=["tail", "flushed"])
def test_checkpoint_inside_offload(store_url: str, flush: bool) -> None:
    hooks = tsh.offload(store_url, min_bytes=0)
    check_equivalent(
        CheckpointedNet, torch.randn(8, 16, requires_grad=True), _sum_step, hooks, flush=flush
    )
    assert len(hooks.store) == 0


def test_nested_offload_innermost_wins(store_url: str) -> None:
    torch.manual_seed(0)
    model = DtypeMLP()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    outer = tsh.offload("memory://", min_bytes=0)
    inner = tsh.offload(store_url, min_bytes=0)
    with outer:
        with inner:
            loss = model(x)
        inner.flush()
        assert inner.stats.tensors_offloaded > 0 and len(inner.store) > 0
        assert outer.stats.tensors_offloaded == 0 and len(outer.store) == 0
        assert outer.stats.tensors_kept == 0
        # After the inner block the outer hooks are active again.
        n_inner = inner.stats.tensors_offloaded
        loss = loss + (x.exp() * 2).sin().sum()
    outer.flush()
    assert outer.stats.tensors_offloaded > 0 and len(outer.store) > 0
    assert inner.stats.tensors_offloaded == n_inner
    loss.backward()
    ref_loss = ref(x_ref) + (x_ref.exp() * 2).sin().sum()
    ref_loss.backward()
    assert torch.equal(loss.detach(), ref_loss.detach())
    assert torch.equal(x.grad, x_ref.grad)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    del loss
    assert len(inner.store) == 0 and len(outer.store) == 0


def test_nested_same_hooks_reentered() -> None:
    """Entering the hooks again for the next step keeps working."""
    hooks = tsh.offload("memory://", min_bytes=0)
    torch.manual_seed(0)
    model = DtypeMLP()
    ref = copy.deepcopy(model)
    for step in range(3):
        x = torch.randn(4, 32)
        want_loss, want = run_step(ref, x, _sum_step, seed=step)
        got_loss, got = run_step(model, x, _sum_step, hooks, seed=step)
        assert torch.equal(got_loss, want_loss)
        _assert_grads_equal(got, want)
    assert len(hooks.store) == 0


# ---------------------------------------------------------------- lifetime
@pytest.mark.parametrize("backward", [False, True])
def test_every_key_gone_after_del_loss(store_url: str, backward: bool) -> None:
    store = tsh.open_store(store_url)
    model = MODELS["gpt"][0]()
    with tsh.offload(store, min_bytes=0) as hooks:
        loss = _gpt_step(model, torch.randint(0, 64, (2, 17)))
    hooks.flush()
    assert len(store) > 0 and store.nbytes > 0
    if backward:
        loss.backward(retain_graph=True)
    del loss
    hooks.flush()
    assert len(store) == 0
    assert store.nbytes == 0
    store.close()


def test_keys_gone_without_flush(store_url: str) -> None:
    """Dropping the graph while writes are still in flight leaves nothing behind."""
    store = tsh.open_store(store_url)
    model = MODELS["transformer_layer"][0]()
    with tsh.offload(store, min_bytes=0) as hooks:
        loss = model(torch.randn(4, 16, 32)).sum()
    del loss
    hooks.flush()
    assert len(store) == 0
    store.close()


# ------------------------------------------------------------- in-place
class GatedStore(WrappedStore):
    """``put`` waits until ``gate`` is set (bounded, so a bug fails instead of hanging)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def put(self, tensor: torch.Tensor) -> str:
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        return super().put(tensor)


@pytest.mark.parametrize("when", ["kept", "queued", "tail", "stored"])
def test_inplace_after_save_never_silently_wrong(when: str) -> None:
    """A saved tensor changed in place: backward raises, or uses the values as saved.

    kept: left in memory (large min_bytes) · queued: changed before its write ran ·
    tail: changed while its write waits and backward comes first · stored: changed
    after its bytes reached the store (then the saved values are still there).
    """
    x = torch.randn(64, 64, requires_grad=True)
    (want,) = torch.autograd.grad((x * 2).sin().sum(), x)
    gated = GatedStore() if when in ("queued", "tail") else None
    hooks = tsh.offload(
        gated if gated is not None else "memory://", min_bytes=1 << 30 if when == "kept" else 0
    )
    with hooks:
        a = x * 2
        loss = a.sin().sum()  # sin saves a
    if when == "stored":
        hooks.flush()
    with torch.no_grad():
        a.add_(1.0)
    if gated is not None and when == "queued":
        gated.gate.set()
        hooks.flush()  # the writer sees the new version before it copies
    try:
        (got,) = torch.autograd.grad(loss, x)
    except RuntimeError as e:
        assert "inplace" in str(e), str(e)
    else:
        assert when == "stored", "the saved values were lost, yet backward did not raise"
        assert torch.equal(got, want), "backward used values changed after the save"
    if gated is not None:
        gated.gate.set()
        hooks.flush()
    del loss
    assert len(hooks.store) == 0


# ------------------------------------------------------------- failures
class FlakyStore(WrappedStore):
    """Fails every other write, like a store running out of space now and then."""

    def put(self, tensor: torch.Tensor) -> str:
        with self.lock:
            self.calls = getattr(self, "calls", 0) + 1
            fail = self.calls % 2 == 0
        if fail:
            raise StoreUnavailableError("FlakyStore: disk full (injected)")
        return super().put(tensor)


@pytest.mark.parametrize("flush", [False, True], ids=["tail", "flushed"])
def test_failing_writes_lose_nothing(flush: bool) -> None:
    store = FlakyStore()
    hooks = tsh.offload(store, min_bytes=0)
    with pytest.warns(UserWarning) as record:
        stats = check_equivalent(
            TinyGPT, torch.randint(0, 64, (4, 17)), _gpt_step, hooks, flush=flush
        )
        hooks.flush()
    ours = [w for w in record if "tensorstore-hooks" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in record]
    assert "FlakyStore" in str(ours[0].message) or "disk full" in str(ours[0].message)
    assert stats.fallbacks > 0
    assert stats.tensors_offloaded > 0  # the other half did go to the store
    assert store.puts > 0
    assert len(store) == 0


def test_user_store_subclass() -> None:
    class DictStore(TensorStore):
        """A from-scratch user store: clones into a dict."""

        def __init__(self) -> None:
            self.data: dict[str, torch.Tensor] = {}
            self.lock = threading.Lock()
            self.counter = 0
            self.closed = False

        def put(self, tensor: torch.Tensor) -> str:
            with self.lock:
                self.counter += 1
                key = f"k{self.counter}"
                self.data[key] = tensor.detach().clone()
            return key

        def get(self, key: str, *, device: Any = None) -> torch.Tensor:
            with self.lock:
                if key not in self.data:
                    raise tsh.KeyNotFoundError(key)
                t = self.data[key].clone()
            return t if device is None else t.to(device)

        def delete(self, key: str) -> None:
            with self.lock:
                if self.data.pop(key, None) is None:
                    raise tsh.KeyNotFoundError(key)

        def keys(self) -> Iterator[str]:
            with self.lock:
                return iter(list(self.data))

        def __contains__(self, key: object) -> bool:
            return key in self.data

        def __len__(self) -> int:
            return len(self.data)

        @property
        def nbytes(self) -> int:
            return sum(t.numel() * t.element_size() for t in self.data.values())

        def close(self) -> None:
            self.closed = True

    store = DictStore()
    make_model, make_input, step = MODELS["transformer_layer"]
    hooks = tsh.offload(store, min_bytes=0)
    assert hooks.store is store
    stats = check_equivalent(make_model, make_input(), step, hooks, flush=True)
    assert store.counter == stats.tensors_offloaded
    assert len(store) == 0
    hooks.close()
    assert not store.closed  # a store handed in is the caller's to close


def test_stats_are_sane() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
    x = torch.randn(16, 32)
    with tsh.offload("memory://", min_bytes=0) as hooks:
        loss = model(x).pow(2).sum()
    stats = hooks.stats
    # Linear saves its weight (a Parameter view): kept with skip_parameters.
    assert stats.per_rule["parameter"].tensors >= 1  # x needs no grad: only the 2nd weight
    assert stats.tensors_kept >= stats.per_rule["parameter"].tensors
    assert stats.bytes_kept >= 64 * 32 * 4
    # Saved: x (by the first Linear), tanh's output (by tanh and, the same tensor, by
    # the second Linear: one record), the input of pow.
    assert stats.tensors_offloaded == 3 and stats.dedup_hits == 1
    assert stats.bytes_offloaded == (16 * 32 + 16 * 64 + 16 * 32) * 4
    store_route = stats.per_action["store"]
    assert store_route.tensors == stats.tensors_offloaded + stats.dedup_hits
    assert stats.fallbacks == 0
    hooks.flush()
    assert hooks.store.nbytes == stats.bytes_offloaded
    assert stats.bytes_read == 0
    loss.backward()
    # Every stored tensor was read once; the deduplicated one's second unpack got what
    # the first brought back (rule 8 of NOTE [ Record lifecycle ]).
    assert stats.bytes_read == stats.bytes_offloaded
    assert stats.prefetch_hits + stats.prefetch_misses + stats.reuse_hits == store_route.tensors
    assert stats.reuse_hits == 1
    assert stats.unpack_stall_s >= 0 and stats.pack_stall_s >= 0
    assert "offloaded" in stats.summary()
    # skip_parameters=False stores the weights too.
    with tsh.offload("memory://", min_bytes=0, skip_parameters=False) as h2:
        loss2 = model(x).pow(2).sum()
    assert "parameter" not in h2.stats.per_rule
    assert h2.stats.tensors_offloaded == stats.tensors_offloaded + 1
    assert h2.stats.bytes_offloaded == stats.bytes_offloaded + 32 * 64 * 4
    del loss2


def test_min_bytes_keeps_small_tensors() -> None:
    model = DtypeMLP()
    with tsh.offload("memory://", min_bytes="1MiB") as hooks:
        model(torch.randn(4, 32)).backward()
    assert hooks.stats.tensors_offloaded == 0
    assert hooks.stats.per_rule["min_bytes"].tensors > 0


# ------------------------------------------- only the bytes that must move (issue 39)
class RMSNorm(nn.Module):
    """HF's ``LlamaRMSNorm``: saves its input under several ops (one record, one read)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class LlamaBlock(nn.Module):
    """Fused qkv cut into q, k, v for SDPA; SwiGLU's gate and up halves of one projection."""

    def __init__(self, d: int = 32, heads: int = 4, ff: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for z in self.qkv(self.norm1(x)).split(d, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(LlamaBlock(d) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _autocast_step(dtype: torch.dtype) -> Step:
    def step(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype):
            logits = model(idx[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, 64), idx[:, 1:].reshape(-1))

    return step


@pytest.mark.parametrize("options", ["defaults", "small_prefetch", "small_inflight"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_llama_under_autocast_moves_no_cast_and_no_gap(
    store_url: str, dtype: torch.dtype, options: str
) -> None:
    hooks = tsh.offload(store_url, **OPTIONS[options])
    idx = torch.randint(0, 64, (4, 17))
    stats = check_equivalent(TinyLlama, idx, _autocast_step(dtype), hooks, flush=True)
    assert stats.recomputed >= 2 * 4 + 1  # every block's four weight casts, the head's
    # Each saved element once each way: no cast, no view's gap, one read per record.
    assert stats.bytes_written == stats.bytes_read == stats.bytes_offloaded
    assert stats.reuse_hits > 0
    hooks.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_llama_under_autocast_over_the_cuda_fake(dtype: torch.dtype) -> None:
    """The same over the fake accelerator (``tests/fake_accelerator.py``): copies to the
    host and back carry each saved element once; no stream rule broken (the conftest
    fixture checks)."""
    from tests.fake_accelerator import CpuAsAccelerator, on_fake_accelerator

    for host_budget in (0, "64KiB"):
        hooks = tsh.offload("memory://", min_bytes=0, host_budget=host_budget)
        on_fake_accelerator(hooks, CpuAsAccelerator(lazy=True))
        idx = torch.randint(0, 64, (4, 17))
        stats = check_equivalent(TinyLlama, idx, _autocast_step(dtype), hooks, flush=True)
        assert stats.recomputed >= 9
        assert stats.bytes_to_host == stats.bytes_offloaded
        # Back: each element backward asked for, once (a saved scalar it never reads
        # stays behind).
        assert stats.bytes_offloaded - 64 <= stats.bytes_to_device <= stats.bytes_offloaded
        hooks.close()


_FSDP2_MIXED_PRECISION = r"""
import copy, json, os, socket, torch, torch.distributed as dist
from torch import nn
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
import tensorstore_hooks as tsh

torch.manual_seed(0)
base = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
x = torch.randn(32, 64)

def make():
    m = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    return fully_shard(m, mesh=mesh, mp_policy=mp)

def step(m, hooks):
    xx = x.clone().requires_grad_()
    if hooks is None:
        loss = m(xx).float().pow(2).sum()
    else:
        with hooks:
            loss = m(xx).float().pow(2).sum()
        hooks.flush()
    loss.backward()
    return [p.grad.to_local().clone() for p in m.parameters()] + [xx.grad.clone()]

want = step(make(), None)
hooks = tsh.offload("memory://", min_bytes=0)
got = step(make(), hooks)
s = hooks.stats
print(json.dumps({
    "equal": all(torch.equal(a, b) for a, b in zip(got, want)),
    "parameter_bytes": s.per_rule["parameter"].bytes,
    "recomputed": s.recomputed,
    "offloaded": s.bytes_offloaded,
}))
dist.destroy_process_group()
"""


def test_fsdp2_mixed_precision_casts_never_move() -> None:
    """FSDP2's ``param_dtype`` casts are the unsharded parameters themselves: kept (it
    frees and gathers them again), never stored; the input's cast is recomputed."""
    import json
    import subprocess
    import sys

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with the gloo backend")
    done = subprocess.run(
        [sys.executable, "-c", _FSDP2_MIXED_PRECISION],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["equal"]
    assert r["parameter_bytes"] == 2 * 64 * 256 * 2  # both bf16 weights, kept
    assert r["recomputed"] == 1
    # What moved: the activations only (two 32 x 256 bf16, the 32 x 64 fp32 output).
    assert r["offloaded"] == 2 * 32 * 256 * 2 + 32 * 64 * 4
