"""``tsh.wrap`` / ``tsh.unwrap``: offloading switched on per module, without editing the loop."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import warnings

import pytest
import torch
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks import ConfigError


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 128)
        self.down = nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(32, 4)
        self.manual: tsh.OffloadHooks | None = None  # offload() around each block, by hand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            if self.manual is not None:
                with self.manual:
                    h = block(h)
            else:
                h = block(h)
        return torch.sigmoid(self.head(h)).pow(2).mean()


def _model() -> _Net:
    torch.manual_seed(0)
    return _Net()


X = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(X).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) and want
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_wrap_model_offloads_like_offload_and_unwrap_restores() -> None:
    model = _model()
    want = _grads(model)
    with tsh.offload("memory://", min_bytes=0) as ref:
        model(X)
    hooks = tsh.wrap(model, "memory://", min_bytes=0)
    assert isinstance(hooks, tsh.OffloadHooks)
    _assert_equal(_grads(model), want)
    assert hooks.stats.tensors_offloaded == ref.stats.tensors_offloaded > 0
    assert hooks.stats.bytes_offloaded == ref.stats.bytes_offloaded
    assert len(hooks.store) == 0  # graph freed: every key gone
    gc.collect()

    tsh.unwrap(model)
    before = hooks.stats.tensors_offloaded
    _assert_equal(_grads(model), want)
    assert hooks.stats.tensors_offloaded == before  # nothing offloaded any more
    with pytest.raises(RuntimeError, match="closed"):
        hooks.__enter__()
    with pytest.raises(ConfigError, match="not wrapped"):
        tsh.unwrap(model)
    hooks.remove()  # a second removal is harmless


def test_modules_glob_offloads_only_inside_the_selected_blocks() -> None:
    model = _model()
    want = _grads(model)
    manual = tsh.offload("memory://", min_bytes=0)
    model.manual = manual
    _assert_equal(_grads(model), want)
    model.manual = None

    hooks = tsh.wrap(model, "memory://", modules="blocks.*", min_bytes=0)
    _assert_equal(_grads(model), want)
    # Exactly what offload() around each block stores: nothing of inp/head.
    assert hooks.stats.tensors_offloaded == manual.stats.tensors_offloaded == 6
    assert hooks.stats.bytes_offloaded == manual.stats.bytes_offloaded
    hooks.remove()


def test_nested_selection_outermost_wins() -> None:
    model = _model()
    other = copy.deepcopy(model)
    hooks = tsh.wrap(model, "memory://", modules=["blocks.1", "blocks.1.up", "*.down"], min_bytes=0)
    ref = tsh.wrap(other, "memory://", modules=["blocks.1", "*.down"], min_bytes=0)
    _assert_equal(_grads(model), _grads(other))
    assert hooks.stats.tensors_offloaded == ref.stats.tensors_offloaded > 0
    assert hooks.stats.bytes_offloaded == ref.stats.bytes_offloaded
    hooks.remove()
    ref.remove()
    # No saved-tensor hooks left pushed on this thread.
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_glob_matching_nothing_is_a_config_error_naming_it_and_real_names() -> None:
    model = _model()
    with pytest.raises(ConfigError, match=r"'block\.\*'.*'blocks\.0'") as err:
        tsh.wrap(model, "memory://", modules=["blocks.*", "block.*"])
    assert "'inp'" in str(err.value)
    with pytest.raises(ConfigError, match="modules"):
        tsh.wrap(model, modules=[])
    # Nothing was wrapped by the failed calls.
    hooks = tsh.wrap(model, "memory://")
    hooks.remove()


def test_wrapping_twice_or_overlapping_is_refused() -> None:
    model = _model()
    hooks = tsh.wrap(model, "memory://")
    with pytest.raises(ConfigError, match=r"already wrapped.*unwrap"):
        tsh.wrap(model, "memory://")
    with pytest.raises(ConfigError, match="already wrapped"):
        tsh.wrap(model.blocks[0], "memory://")
    hooks.remove()
    tsh.wrap(model.blocks[0], "memory://").remove()


def test_wrapped_model_deepcopies_pickles_saves_and_copies_are_not_wrapped() -> None:
    model = _model()
    want = _grads(model)
    hooks = tsh.wrap(model, "memory://", min_bytes=0)
    _assert_equal(_grads(model), want)
    sd = model.state_dict()
    assert sd.keys() == _model().state_dict().keys()

    clone = copy.deepcopy(model)
    loaded = pickle.loads(pickle.dumps(model))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    offloaded = hooks.stats.tensors_offloaded
    for other in (clone, loaded, saved):
        _assert_equal(_grads(other), want)
        assert hooks.stats.tensors_offloaded == offloaded  # the copies do not offload
        tsh.wrap(other, "memory://").remove()  # ... and can be wrapped themselves
    _assert_equal(_grads(model), want)
    assert hooks.stats.tensors_offloaded == 2 * offloaded > 0
    hooks.remove()


def test_graph_built_before_unwrap_still_runs_backward() -> None:
    model = _model()
    want = _grads(model)
    hooks = tsh.wrap(model, "memory://", min_bytes=0)
    model.zero_grad(set_to_none=True)
    loss = model(X)
    hooks.flush()
    assert len(hooks.store) > 0
    tsh.unwrap(model)
    loss.backward()
    _assert_equal([p.grad.clone() for p in model.parameters()], want)
    del loss
    gc.collect()
    assert hooks.stats.bytes_read > 0


def test_exception_in_forward_leaves_no_hooks_pushed() -> None:
    model = _model()
    hooks = tsh.wrap(model, "memory://", modules="blocks.*", min_bytes=0)

    def boom(module: nn.Module, args: object, out: object) -> None:
        raise ValueError("boom")

    handle = model.blocks[1].up.register_forward_hook(boom)
    with pytest.raises(ValueError, match="boom"):
        model(X)
    handle.remove()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    want = _grads(_model())
    _assert_equal(_grads(model), want)
    hooks.remove()


def test_disabled_saved_tensor_hooks_leave_everything_to_autograd() -> None:
    model = _model()
    want = _grads(model)
    hooks = tsh.wrap(model, "memory://", min_bytes=0)
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        got = _grads(model)
    _assert_equal(got, want)
    assert hooks.stats.tensors_offloaded == 0
    hooks.remove()


def test_module_rules_use_paths_of_the_wrapped_module() -> None:
    model = _model()
    want = _grads(model)
    hooks = tsh.wrap(
        model,
        "memory://",
        min_bytes=0,
        rules=[{"module": "blocks.0.*", "action": "keep", "name": "first"}],
    )
    _assert_equal(_grads(model), want)
    assert hooks.stats.per_rule["rules[0] first"].tensors > 0
    assert hooks.stats.tensors_offloaded > 0
    hooks.remove()
    with pytest.raises(ConfigError, match="model="):
        tsh.wrap(model, model=model)


def test_module_rule_matching_nothing_warns_once_at_the_users_line() -> None:
    model = _model()
    hooks = tsh.wrap(model, "memory://", rules=[{"module": "blokcs.*", "action": "keep"}])
    match = r"module='blokcs\.\*'.*matched no module.*'blocks\.0'"
    with pytest.warns(UserWarning, match=match) as w:
        model(X)
    assert w[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(X)  # once per hooks object
    hooks.remove()


def test_offload_module_rules_without_model_warn_at_the_users_line() -> None:
    model = _model()
    hooks = tsh.offload("memory://", rules=[{"module": "blocks.*", "action": "keep"}])
    with pytest.warns(UserWarning, match="model=") as w, hooks:
        model(X)
    assert w[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hooks:
            model(X)
    hooks.close()


def test_offload_module_glob_matching_nothing_warns_with_existing_paths() -> None:
    model = _model()
    hooks = tsh.offload("memory://", model=model, rules=[{"module": "*.lm_head", "action": "keep"}])
    with pytest.warns(UserWarning, match=r"lm_head.*matched no module.*'head'") as w, hooks:
        model(X)
    assert w[0].filename == __file__
    hooks.close()
