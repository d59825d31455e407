"""PaddlePaddle under offloading: Paddle's own documentation examples, training, stores.

Every test compares against the same code without offloading (``np.array_equal`` on
gradients: bit-identical). Paddle is an optional extra; ``.ci/run`` installs it and
sets ``TSH_REQUIRE_PADDLE=1``, which turns a missing paddle into a failure instead of a
skip, so CI can never pass these by skipping them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorstore_hooks as tsh

if os.environ.get("TSH_REQUIRE_PADDLE") == "1":
    import paddle
else:
    paddle = pytest.importorskip("paddle")

import tensorstore_hooks.paddle as tshp
from tensorstore_hooks.paddle import LayerScope
from tests.daemon_fixtures import Daemon, shared_daemon  # noqa: F401

PyLayer = paddle.autograd.PyLayer
# Paddle re-raises an exception from a hook as OSError("(External) RuntimeError: ...").
PADDLE_HOOK_ERRORS = (RuntimeError, OSError)


def _grads(params: list[Any]) -> list[np.ndarray | None]:
    return [None if p.grad is None else p.grad.numpy().copy() for p in params]


def _assert_same(got: list[np.ndarray | None], ref: list[np.ndarray | None]) -> None:
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert (g is None) == (r is None), f"gradient {i}: one is None"
        if g is not None:
            assert g.dtype == r.dtype and np.array_equal(g, r), f"gradient {i} differs"


def _run_both(
    build: Callable[[], tuple[list[Any], Callable[[], Any]]],
    hooks: tshp.OffloadHooks,
) -> None:
    """Build inputs twice; run forward with and without ``hooks``, backward, compare grads."""
    params, forward = build()
    forward().backward()
    ref = _grads(params)
    params, forward = build()
    with hooks:
        out = forward()
    out.backward()
    _assert_same(_grads(params), ref)


# ------------------------------------------------ Paddle's documentation examples
def test_docs_multiply(store_url: str) -> None:
    """``saved_tensors_hooks`` Example1: ``paddle.multiply`` saves both inputs."""

    def build() -> tuple[list[Any], Callable[[], Any]]:
        a = paddle.ones([3, 3])
        b = paddle.ones([3, 3]) * 2
        a.stop_gradient = False
        b.stop_gradient = False
        return [a, b], lambda: paddle.multiply(a, b).sum()

    hooks = tshp.offload(store_url, min_bytes=0)
    _run_both(build, hooks)
    assert hooks.stats.tensors_offloaded == 2


class CusTanh(PyLayer):  # type: ignore[misc]
    """``PyLayer`` / ``save_for_backward`` / ``saved_tensor`` example of Paddle's docs."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        y = paddle.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Any) -> Any:
        (y,) = ctx.saved_tensor()
        return dy * (1 - paddle.square(y))


def test_docs_pylayer_cus_tanh(store_url: str) -> None:
    def build() -> tuple[list[Any], Callable[[], Any]]:
        paddle.seed(2023)
        data = paddle.randn([2, 3], dtype="float64")
        data.stop_gradient = False
        return [data], lambda: CusTanh.apply(data).mean()

    hooks = tshp.offload(store_url, min_bytes=0)
    _run_both(build, hooks)
    # save_for_backward goes through the pack hook like any saved tensor
    assert hooks.stats.tensors_offloaded >= 1
    # The value printed in Paddle's docs for this example.
    paddle.seed(2023)
    data = paddle.randn([2, 3], dtype="float64")
    data.stop_gradient = False
    with tshp.offload(store_url, min_bytes=0):
        z = CusTanh.apply(data)
    z.mean().backward()
    documented = [[0.16604150, 0.05858341, 0.14051214], [0.15677770, 0.01564609, 0.02991660]]
    np.testing.assert_allclose(data.grad.numpy(), documented, atol=1e-8)


class NonDiff(PyLayer):  # type: ignore[misc]
    """``mark_non_differentiable`` example, saving its input so the hook has work."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        a = x + x
        b = x + x + x
        ctx.mark_non_differentiable(a)
        ctx.save_for_backward(x)
        return a, b

    @staticmethod
    def backward(ctx: Any, grad_a: Any, grad_b: Any) -> Any:
        (x,) = ctx.saved_tensor()
        assert np.array_equal(grad_a.numpy(), np.zeros(grad_a.shape, grad_a.numpy().dtype))
        return grad_b * 3 * paddle.ones_like(x)


def test_docs_mark_non_differentiable(store_url: str) -> None:
    def build() -> tuple[list[Any], Callable[[], Any]]:
        x = paddle.ones([1], dtype="float64")
        x.stop_gradient = False
        return [x], lambda: NonDiff.apply(x)[1].sum()

    hooks = tshp.offload(store_url, min_bytes=0)
    _run_both(build, hooks)
    assert hooks.stats.tensors_offloaded >= 1


class NoMaterialize(PyLayer):  # type: ignore[misc]
    """``set_materialize_grads(False)`` example: the unused output's grad is None."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x)
        return x + x + x, x + x

    @staticmethod
    def backward(ctx: Any, grad: Any, grad2: Any) -> Any:
        assert grad2 is None
        (x,) = ctx.saved_tensor()
        return grad * paddle.exp(x)


def test_docs_set_materialize_grads(store_url: str) -> None:
    def build() -> tuple[list[Any], Callable[[], Any]]:
        x = paddle.ones([1], dtype="float64")
        x.stop_gradient = False
        return [x], lambda: NoMaterialize.apply(x)[0].sum()

    hooks = tshp.offload(store_url, min_bytes=0)
    _run_both(build, hooks)
    assert hooks.stats.tensors_offloaded >= 1


class NotInplaceExp(PyLayer):  # type: ignore[misc]
    """``mark_not_inplace`` example: forward returns its input unchanged."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        ctx.mark_not_inplace(x)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad_output: Any) -> Any:
        (x,) = ctx.saved_tensor()
        return grad_output.exp() * paddle.cos(x)


def test_docs_mark_not_inplace(store_url: str) -> None:
    def run(hooks: tshp.OffloadHooks | None) -> list[np.ndarray | None]:
        paddle.seed(2023)
        x = paddle.randn((1, 1))
        x.stop_gradient = False
        layers = [NotInplaceExp(), NotInplaceExp()]
        for _ in range(2):  # two steps, as in the docs
            with hooks if hooks is not None else _null():
                a = x
                for j in range(2):
                    a = layers[j].apply(x)
            a.backward()
        return _grads([x])

    hooks = tshp.offload(store_url, min_bytes=0)
    _assert_same(run(hooks), run(None))
    assert hooks.stats.tensors_offloaded >= 4


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# ------------------------------------------------------------------- training
def _mlp(seed: int = 0) -> Any:
    paddle.seed(seed)
    return paddle.nn.Sequential(
        paddle.nn.Linear(64, 256),
        paddle.nn.ReLU(),
        paddle.nn.Linear(256, 256),
        paddle.nn.GELU(),
        paddle.nn.LayerNorm(256),
        paddle.nn.Linear(256, 10),
    )


def _train(model: Any, hooks: tshp.OffloadHooks | None, steps: int = 3) -> list[np.ndarray]:
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    loss_fn = paddle.nn.CrossEntropyLoss()
    paddle.seed(1)
    for _ in range(steps):
        x = paddle.randn([32, 64])
        y = paddle.randint(0, 10, [32])
        with hooks if hooks is not None else _null():
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        del loss
    return [p.numpy().copy() for p in model.parameters()]


def test_mlp_training_steps_identical(store_url: str) -> None:
    ref = _train(_mlp(), None)
    hooks = tshp.offload(store_url, min_bytes=0)
    got = _train(_mlp(), hooks)
    for g, r in zip(got, ref, strict=True):
        assert np.array_equal(g, r)
    st = hooks.stats
    assert st.tensors_offloaded > 0 and st.fallbacks == 0
    assert st.per_rule["parameter"].tensors > 0  # weights stay where they are
    hooks.flush()
    assert len(hooks.store) == 0  # every key freed once each step's graph died


def test_training_through_the_daemon(shared_daemon: Daemon) -> None:  # noqa: F811
    ref = _train(_mlp(), None, steps=2)
    hooks = tshp.offload(shared_daemon.url, min_bytes=0)
    got = _train(_mlp(), hooks, steps=2)
    for g, r in zip(got, ref, strict=True):
        assert np.array_equal(g, r)
    assert hooks.stats.tensors_offloaded > 0 and hooks.stats.fallbacks == 0
    hooks.close()


def test_every_key_freed_after_backward_and_prefetch_reads(store_url: str) -> None:
    model = _mlp()
    x = paddle.randn([32, 64])
    hooks = tshp.offload(store_url, min_bytes=0, prefetch="64KiB")
    with hooks:
        loss = model(x).square().mean()
    hooks.flush()  # everything written: backward must read it back from the store
    assert len(hooks.store) == hooks.stats.tensors_offloaded > 0
    loss.backward()
    assert hooks.stats.bytes_read > 0
    assert hooks.stats.prefetch_hits + hooks.stats.prefetch_misses > 0
    del loss
    assert len(hooks.store) == 0


def test_retain_graph_unpacks_twice(store_url: str) -> None:
    def build() -> tuple[list[Any], Callable[[], Any]]:
        paddle.seed(3)
        x = paddle.randn([16, 16])
        x.stop_gradient = False
        return [x], lambda: paddle.tanh(paddle.matmul(x, x)).exp().sum()

    params, fwd = build()
    out = fwd()
    out.backward(retain_graph=True)
    out.backward()
    ref = _grads(params)
    params, fwd = build()
    hooks = tshp.offload(store_url, min_bytes=0)
    with hooks:
        out = fwd()
    hooks.flush()
    out.backward(retain_graph=True)
    out.backward()  # unpack runs again: nothing was deleted by the first backward
    _assert_same(_grads(params), ref)
    del out
    assert len(hooks.store) == 0


def test_same_number_of_packs_as_paddle_itself() -> None:
    """Paddle calls pack only for tensors with a needed buffer; ours sees exactly those."""
    packs = []

    def count(t: Any) -> Any:
        packs.append(list(t.shape))
        return t.detach()

    x = paddle.randn([8, 8])
    x.stop_gradient = False

    def forward() -> Any:
        # expand and reshape need only shapes in backward (no-need-buffer inputs)
        return (paddle.expand(x.reshape([1, 64]), [4, 64]) * 2).tanh().sum()

    with paddle.autograd.saved_tensors_hooks(count, lambda t: t):
        forward()
    hooks = tshp.offload("memory://", min_bytes=0)
    with hooks:
        out = forward()
    st = hooks.stats
    assert st.tensors_offloaded + st.tensors_kept + st.tensors_host == len(packs) > 0
    out.backward()


# ---------------------------------------------------------------- in-place
def test_inplace_after_save_raises_for_kept_tensors() -> None:
    x = paddle.ones([4])
    x.stop_gradient = False
    with tshp.offload("memory://", min_bytes="1GiB"):  # everything kept in place
        y = paddle.exp(x * 2)  # exp saves its output
    y.add_(paddle.ones([4]))
    with pytest.raises(PADDLE_HOOK_ERRORS, match="modified by an inplace operation"):
        y.sum().backward()


def test_grad_mode_survives_errors_raised_in_our_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Paddle leaves grad mode off when a hook raises; ours must turn it back on."""
    x = paddle.ones([4])
    x.stop_gradient = False
    with tshp.offload("memory://", min_bytes="1GiB"):
        y = paddle.exp(x * 2)
    y.add_(paddle.ones([4]))
    with pytest.raises(PADDLE_HOOK_ERRORS, match="modified by an inplace operation"):
        y.sum().backward()  # the unpack hook raises
    assert paddle.is_grad_enabled()

    hooks = tshp.offload("memory://", min_bytes=0)

    def broken_route(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("policy exploded")

    monkeypatch.setattr(tsh.Router, "route", broken_route)
    with pytest.raises(PADDLE_HOOK_ERRORS, match="policy exploded"), hooks:
        paddle.exp(x)  # the pack hook raises
    assert paddle.is_grad_enabled()
    # and training goes on recording graphs
    x.clear_gradient()
    paddle.exp(x).sum().backward()
    assert x.grad is not None


class _GatedStore(tsh.ZarrStore):
    """``put`` waits for ``gate``: the test modifies a tensor while its write is queued."""

    def __init__(self) -> None:
        super().__init__("memory://")
        self.gate = threading.Event()

    def put(self, tensor: Any) -> str:
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        return super().put(tensor)


def test_inplace_before_write_raises_for_stored_tensors() -> None:
    """Paddle drops its own version check under hooks; ours must catch the change."""
    store = _GatedStore()
    x = paddle.ones([1024])
    x.stop_gradient = False
    hooks = tshp.offload(store, min_bytes=0)
    with hooks:
        y = paddle.exp(x * 2)
        loss = y.sum()
    y.add_(paddle.ones([1024]))  # modified while its write waits at the gate
    store.gate.set()
    hooks.flush()
    with pytest.raises(PADDLE_HOOK_ERRORS, match="modified by an inplace operation"):
        loss.backward()
    del loss, y
    hooks.close()
    store.close()


# ------------------------------------------------------------------ nesting
def test_nested_blocks_innermost_wins_then_outer_is_restored() -> None:
    outer = tshp.offload("memory://", min_bytes=0)
    inner = tshp.offload("memory://", min_bytes=0)
    x = paddle.randn([64])
    x.stop_gradient = False
    with outer:
        a = paddle.exp(x)
        with inner:
            b = paddle.exp(x)
        c = paddle.exp(x)  # Paddle alone would have no hooks here (it resets, not pops)
    d = paddle.exp(x)  # no hooks at all
    assert outer.stats.tensors_offloaded == 2
    assert inner.stats.tensors_offloaded == 1
    (a + b + c + d).sum().backward()
    got = x.grad.numpy().copy()
    x.clear_gradient()
    (paddle.exp(x) + paddle.exp(x) + paddle.exp(x) + paddle.exp(x)).sum().backward()
    assert np.array_equal(got, x.grad.numpy())


def test_our_block_inside_a_plain_paddle_block_is_refused_clearly() -> None:
    with (
        paddle.autograd.saved_tensors_hooks(lambda t: t.detach(), lambda t: t),
        pytest.raises(RuntimeError, match="one pair at a time"),
        tshp.offload("memory://"),
    ):
        pass
    # and nothing is left registered: a new block works
    with tshp.offload("memory://", min_bytes=0) as hooks:
        x = paddle.randn([8])
        x.stop_gradient = False
        paddle.exp(x).sum().backward()
    assert hooks.stats.tensors_offloaded == 1


def test_nested_block_when_the_outer_refuses_keeps_state_consistent() -> None:
    outer = tshp.offload("memory://", min_bytes=0)
    with outer:
        with (
            pytest.raises(ValueError, match="only one pair of hooks"),
            paddle.autograd.saved_tensors_hooks(lambda t: t, lambda t: t),
        ):
            pass
        # Paddle refused the plain block; ours is still the registered pair.
        x = paddle.randn([8])
        x.stop_gradient = False
        y = paddle.exp(x)
    assert outer.stats.tensors_offloaded == 1
    y.sum().backward()


# ------------------------------------------------------------ policy, scope
def test_module_rules_route_by_layer_path() -> None:
    model = _mlp()
    rules = [
        {"module": "0", "action": "keep"},  # the first Linear's saved input
        {"module": "5", "action": "keep"},  # the head
        {"dtype": ["int64"], "action": "keep"},
    ]
    hooks = tshp.offload("memory://", min_bytes=0, rules=rules, model=model)
    with hooks:
        loss = paddle.nn.functional.cross_entropy(
            model(paddle.randn([4, 64])), paddle.randint(0, 10, [4])
        )
    loss.backward()
    per_rule = hooks.stats.per_rule
    assert per_rule["rules[0] module=0"].tensors >= 1
    assert per_rule["rules[1] module=5"].tensors >= 1
    assert hooks.stats.tensors_offloaded >= 1  # the other layers went to the store
    # no hook is left on any layer once the block has exited
    for _, layer in model.named_sublayers(include_self=True):
        assert not layer._forward_pre_hooks and not layer._forward_post_hooks


def test_layer_scope_paths() -> None:
    model = _mlp()
    scope = LayerScope()
    seen: list[str | None] = []
    scope.attach(model)
    # registered after the scope's own pre-hook, so it runs after the path is pushed
    handle = model[2].register_forward_pre_hook(lambda *a: seen.append(scope.current()))
    model(paddle.randn([2, 64]))
    handle.remove()
    scope.detach()
    assert seen == ["2"] and scope.current() is None and scope.attached == 0
    with pytest.raises(TypeError, match=r"paddle\.nn\.Layer"):
        scope.attach(object())


# ------------------------------------------------------------------ stores
PADDLE_DTYPES = [
    "bool", "uint8", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64",
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
]  # fmt: skip


def _sample(dtype: str) -> Any:
    rng = np.random.default_rng(0)
    base = paddle.to_tensor(rng.standard_normal((5, 7)).astype("float32") * 50)
    if dtype == "bool":
        return base > 0
    if dtype.startswith("complex"):
        return paddle.complex(base, -base).astype(dtype)
    return base.astype(dtype)


def _bits(t: Any) -> np.ndarray:
    """The raw bits (so NaN and -0.0 compare exactly, and dtypes numpy lacks work)."""
    import torch

    from tensorstore_hooks.paddle._bridge import to_torch

    return to_torch(t).contiguous().view(torch.uint8).numpy().copy()


@pytest.mark.parametrize("dtype", PADDLE_DTYPES)
def test_store_roundtrips_every_paddle_dtype(store_url: str, dtype: str) -> None:
    with tsh.open_store(store_url) as store:
        t = _sample(dtype)
        t.stop_gradient = dtype not in ("float32", "float64")
        key = store.put(t)
        got = store.get(key)
        assert type(got) is paddle.Tensor
        assert got.dtype == t.dtype and got.shape == t.shape
        assert got.stop_gradient == t.stop_gradient
        assert got.place.is_cpu_place()
        assert np.array_equal(_bits(got), _bits(t))
        meta = store.meta(key)
        assert meta.framework == "paddle" and meta.device == "cpu"
        assert meta.requires_grad == (not t.stop_gradient)


def test_store_keeps_strides_and_views(store_url: str) -> None:
    with tsh.open_store(store_url) as store:
        base = paddle.arange(24, dtype="float32").reshape([4, 6])
        for t in (base.transpose([1, 0]), base[:, 1:4], paddle.to_tensor(3.5), base[:0]):
            got = store.get(store.put(t))
            assert got.shape == t.shape
            assert np.array_equal(got.numpy(), t.numpy())
        got = store.get(store.put(base.transpose([1, 0])))
        assert got.strides == [1, 6]  # the layout, not just the values


def test_store_get_to_a_place_and_bad_places(store_url: str) -> None:
    with tsh.open_store(store_url) as store:
        key = store.put(paddle.ones([3]))
        assert store.get(key, device="cpu").place.is_cpu_place()
        assert store.get(key, device=paddle.CPUPlace()).place.is_cpu_place()
        torch_key = store.put(__import__("torch").ones(3))
        assert type(store.get(torch_key)).__module__.startswith("torch")


def test_inspect_reads_a_tensor_saved_by_paddle(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = tsh.open_store(str(root))
    key = store.put(paddle.ones([6, 2], dtype="bfloat16"))
    store.close()  # a named root keeps its namespace and keys
    cmd = [sys.executable, "-m", "tensorstore_hooks.cli", "inspect", str(root)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "bfloat16" in proc.stdout and "(6, 2)" in proc.stdout
    assert "cpu (paddle)" in proc.stdout
    listing = json.loads(
        subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120).stdout
    )
    [entry] = listing["namespaces"][0]["keys"]
    assert entry["key"] == key and entry["framework"] == "paddle"
    # and the store object reads it back as paddle
    [ns] = [n["name"] for n in listing["namespaces"]]
    with tsh.ZarrStore(str(root), namespace=ns) as again:
        back = again.get(key)
        assert type(back) is paddle.Tensor and back.dtype == paddle.bfloat16


def test_demo_with_paddle(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "tensorstore_hooks.cli", "demo", "--framework", "paddle"]
    proc = subprocess.run(
        [*cmd, "--steps", "2", "--store", f"file://{tmp_path / 'store'}"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "paddle GPT tiny" in proc.stdout
    assert "gradients: identical" in proc.stdout and "DIFFER" not in proc.stdout


def test_paddle_gpt_copies_the_torch_weights() -> None:
    import torch

    from tensorstore_hooks.cli._demo_model import GPT as TorchGPT
    from tensorstore_hooks.cli._demo_model import config_for, synthetic_batch
    from tensorstore_hooks.cli._paddle_demo import GPT

    cfg = config_for("tiny", blocks=1, seq=16, batch=2)
    tokens, targets = synthetic_batch(cfg, 0)
    with torch.no_grad():
        ref = float(TorchGPT(cfg, seed=0)(tokens, targets))
    model = GPT(cfg, seed=0)
    got = float(model(paddle.to_tensor(tokens.numpy()), paddle.to_tensor(targets.numpy())))
    assert abs(got - ref) < 1e-4  # same weights, same data: the same loss up to kernels


def test_offload_without_paddle_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "paddle", None)  # import paddle -> ImportError
    with pytest.raises(ImportError, match=r"tensorstore-hooks\[paddle\]"):
        tshp.offload("memory://")
