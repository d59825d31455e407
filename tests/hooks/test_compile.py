"""torch.compile with offloading: the same training as the compiled model without it.

NOTE [ torch.compile ] (``tensorstore_hooks/hooks/_compile.py``) says which combinations
are exact and which are refused. The matrix trains two copies of one seeded model
for a few SGD steps, one compiled as the case says and offloading, the other
compiled the same way without offloading, and compares every parameter's gradient
at every step with ``torch.equal`` (every parameter must get one). Refused
combinations raise a ``ConfigError`` at the first forward, naming what works.
Inductor cases are few and the models tiny: a cold inductor compile takes seconds.
"""

from __future__ import annotations

import copy
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks import ConfigError

pytestmark = [
    # torch warns on every compiled-module call while global module hooks exist
    # (tsh.wrap's): ours skip the compiled wrapper, so the extra call does nothing.
    pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning"),
    # dynamo reads .grad of a compiled block's non-leaf input (its own filter does not
    # win over pytest's "error"): torch's, with or without offloading.
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
]

STEPS = 3
Setup = Callable[[nn.Module, str], tuple[Callable[[torch.Tensor], torch.Tensor], Any]]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.ln(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(32, 4)
        self.inner: tsh.OffloadHooks | None = None  # an offload() block inside forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            if self.inner is not None:
                with self.inner:
                    h = block(h)
            else:
                h = block(h)
        return torch.sigmoid(self.head(h)).pow(2).mean()


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


BATCHES = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not torch.nn.modules.module._has_any_global_hook()  # every wrap undone


def _train(setup: Setup, backend: str) -> tuple[list[dict[str, torch.Tensor]], Any]:
    """Train a fresh ``_Net`` for STEPS SGD steps; every step's gradients, and the hooks."""
    torch._dynamo.reset()
    model = _net()
    call, hooks = setup(model, backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    try:
        for x in BATCHES:
            opt.zero_grad(set_to_none=True)
            call(x).backward()
            missing = [n for n, p in model.named_parameters() if p.grad is None]
            assert not missing, f"parameters without a gradient: {missing}"
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
    except BaseException:
        _dispose(hooks)
        raise
    return grads, hooks


def _dispose(hooks: Any) -> None:
    """Unwrap (wrap's hooks) or close: no global module hooks outlive a test."""
    if hooks is None:
        return
    if hasattr(hooks, "remove"):
        hooks.remove()
    else:
        hooks.close()


def _assert_same_training(
    got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]
) -> None:
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys()
        for name in w:
            assert torch.equal(g[name], w[name]), f"step {step}: gradient of {name} differs"


# ------------------------------------------------------------ compiled as ...
def _whole(model: nn.Module, backend: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return torch.compile(model, backend=backend)


def _method(model: nn.Module, backend: str) -> Callable[[torch.Tensor], torch.Tensor]:
    model.compile(backend=backend)
    return model


def _per_block(model: nn.Module, backend: str) -> Callable[[torch.Tensor], torch.Tensor]:
    for block in model.blocks:  # type: ignore[union-attr]
        block.compile(backend=backend)
    return model


# ----------------------------------------------------------- ... offloading as
def _offload_around(compile_: Callable[..., Any]) -> Setup:
    """``with tsh.offload():`` around the call: one compiled graph, or an eager model
    whose blocks are compiled graphs (hooks around every compiled call, either way)."""

    def setup(model: nn.Module, backend: str) -> tuple[Any, Any]:
        compiled = compile_(model, backend)
        hooks = tsh.offload("memory://", min_bytes=0)

        def call(x: torch.Tensor) -> torch.Tensor:
            with hooks:
                return compiled(x)

        return call, hooks

    return setup


def _wrap_then(compile_: Callable[..., Any], **wrap_args: Any) -> Setup:
    def setup(model: nn.Module, backend: str) -> tuple[Any, Any]:
        hooks = tsh.wrap(model, "memory://", min_bytes=0, **wrap_args)
        return compile_(model, backend), hooks

    return setup


def _compile_then_wrap(compile_: Callable[..., Any], **wrap_args: Any) -> Setup:
    def setup(model: nn.Module, backend: str) -> tuple[Any, Any]:
        call = compile_(model, backend)
        hooks = tsh.wrap(call, "memory://", min_bytes=0, **wrap_args)  # the compiled one
        return call, hooks

    return setup


def _run_compiled_then_wrap(model: nn.Module, backend: str) -> tuple[Any, Any]:
    call = _whole(model, backend)
    call(BATCHES[0]).backward()  # a graph compiled while nothing was wrapped
    model.zero_grad(set_to_none=True)
    return call, tsh.wrap(model, "memory://", min_bytes=0)


# name: (offloading setup, the compiled setup it must equal)
CASES: dict[str, tuple[Setup, Callable[..., Any]]] = {
    "offload_around_compiled": (_offload_around(_whole), _whole),
    "offload_around_block_compiled_model": (_offload_around(_per_block), _per_block),
    "wrap_model_then_torch_compile": (_wrap_then(_whole), _whole),
    "wrap_model_then_model_compile": (_wrap_then(_method), _method),
    "torch_compile_then_wrap_it": (_compile_then_wrap(_whole), _whole),
    "model_compile_then_wrap_it": (_compile_then_wrap(_method), _method),
    "compiled_step_then_wrap": (_run_compiled_then_wrap, _whole),
    "wrap_blocks_then_block_compile": (_wrap_then(_per_block, modules="blocks.*"), _per_block),
    "block_compile_then_wrap_blocks": (
        _compile_then_wrap(_per_block, modules="blocks.*"),
        _per_block,
    ),
}
INDUCTOR = (
    "offload_around_compiled",
    "wrap_model_then_torch_compile",
    "wrap_blocks_then_block_compile",
)


@pytest.mark.parametrize(
    ("case", "backend"),
    [(c, "aot_eager") for c in CASES] + [(c, "inductor") for c in INDUCTOR],
)
def test_compiled_training_with_offloading_is_bit_identical(case: str, backend: str) -> None:
    setup, compiled = CASES[case]
    want, _ = _train(lambda m, b: (compiled(m, b), None), backend)
    got, hooks = _train(setup, backend)
    _assert_same_training(got, want)
    stats = hooks.stats
    assert stats.tensors_offloaded > 0 and stats.bytes_read > 0
    assert hooks.live_records == 0 and len(hooks.store) == 0  # graphs freed
    _dispose(hooks)


# ---------------------------------------------------------------- refusals
def _refused(setup: Setup, *match: str) -> None:
    with pytest.raises(ConfigError) as info:
        _train(setup, "aot_eager")
    for text in match:
        assert text in str(info.value)


@pytest.mark.parametrize(
    "order", [_wrap_then, _compile_then_wrap], ids=["wrap_first", "compile_first"]
)
@pytest.mark.parametrize("compile_", [_whole, _method], ids=["torch_compile", "model_compile"])
def test_wrap_of_blocks_inside_one_compiled_graph_is_refused(
    compile_: Callable[..., Any], order: Callable[..., Setup]
) -> None:
    # The case: block hooks traced inside the model's graph pushed and popped
    # in the wrong places, and blocks got no gradient, silently. Refused whichever of
    # wrap and compile comes first (nothing ran compiled before the wrap).
    _refused(
        order(compile_, modules="blocks.*"),
        "tsh.wrap(_Net, modules=...)",
        "'blocks.0'",
        "block.compile()",
        "tsh.wrap(model)",
        "with tsh.offload()",
    )


def test_wrap_of_blocks_after_a_compiled_run_warns_then_refuses_after_a_reset() -> None:
    # Dynamo does not guard on module hooks: the graph traced before wrap() stays in
    # use and the blocks' hooks never run. Said once; after torch._dynamo.reset()
    # dynamo traces the hooks and the combination is refused as above.
    model = _net()
    call = _whole(model, "aot_eager")
    call(BATCHES[0])
    hooks = tsh.wrap(model, "memory://", modules="blocks.*", min_bytes=0)
    try:
        with pytest.warns(UserWarning, match=r"none of the selected modules ran.*reset\(\)"):
            call(BATCHES[0]).backward()
        assert hooks.stats.tensors_offloaded == 0
        torch._dynamo.reset()
        with pytest.raises(ConfigError, match=r"'blocks\.0'"):
            call(BATCHES[0])
    finally:
        hooks.remove()


def test_offload_block_inside_compiled_forward_is_refused() -> None:
    def setup(model: nn.Module, backend: str) -> tuple[Any, Any]:
        model.inner = tsh.offload("memory://", min_bytes=0)  # type: ignore[assignment]
        return _whole(model, backend), model.inner

    _refused(setup, "inside torch.compile'd code", "around the compiled call")


RULES = [{"module": "*.up", "action": "keep"}]


def _rules_offload(model: nn.Module) -> tuple[Any, Any]:
    hooks = tsh.offload("memory://", min_bytes=0, model=model, rules=RULES)
    compiled = _whole(model, "aot_eager")

    def call(x: torch.Tensor) -> torch.Tensor:
        with hooks:
            return compiled(x)

    return call, hooks


def _rules_wrap(model: nn.Module) -> tuple[Any, Any]:
    hooks = tsh.wrap(model, "memory://", min_bytes=0, modules="blocks.*", rules=RULES)
    return _per_block(model, "aot_eager"), hooks


@pytest.mark.parametrize("setup", [_rules_offload, _rules_wrap], ids=["offload", "wrap"])
def test_module_rules_under_compile_say_once_they_cannot_see_inside(
    setup: Callable[[nn.Module], tuple[Any, Any]],
) -> None:
    call, hooks = setup(_net())
    with pytest.warns(UserWarning, match=r"cannot see the modules that run inside torch\.comp"):
        call(BATCHES[0]).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per OffloadHooks
        call(BATCHES[1]).backward()
    assert hooks.stats.tensors_offloaded > 0
    _dispose(hooks)


# ------------------------------------------------------- trainer callbacks
@pytest.fixture(scope="module")
def llama() -> Callable[[], nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM

    def make() -> nn.Module:
        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=128,
            use_cache=False,
        )
        return LlamaForCausalLM(config)

    return make


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf_train(model: nn.Module, callbacks: list[Any]) -> None:
    from transformers import Trainer, TrainingArguments

    torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=2,
            max_steps=STEPS,
            learning_rate=0.05,
            optim="sgd",
            lr_scheduler_type="constant",
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
            torch_compile=True,
            torch_compile_backend="aot_eager",
        )
        Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=callbacks).train()


def _same_weights(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys() and pa
    for name in pa:
        assert torch.equal(pa[name], pb[name]), f"parameter {name} differs"


def test_transformers_trainer_torch_compile_with_callback_is_bit_identical(
    llama: Callable[[], nn.Module],
) -> None:
    from tensorstore_hooks.integrations.transformers import OffloadCallback

    ref, off = llama(), llama()
    start = copy.deepcopy(ref)
    _hf_train(ref, [])
    cb = OffloadCallback(store="memory://", min_bytes=0)
    _hf_train(off, [cb])
    _same_weights(ref, off)
    pairs = zip(start.parameters(), ref.parameters(), strict=True)
    assert any(not torch.equal(p, q) for p, q in pairs)
    assert cb.hooks.stats.tensors_offloaded > 0 and cb.hooks.stats.bytes_read > 0


def test_transformers_trainer_torch_compile_with_block_modules_is_refused(
    llama: Callable[[], nn.Module],
) -> None:
    from tensorstore_hooks.integrations.transformers import OffloadCallback

    cb = OffloadCallback(store="memory://", min_bytes=0, modules="model.layers.*")
    try:
        with pytest.raises(ConfigError, match=r"'model\.layers\.0' runs inside a torch\.comp"):
            _hf_train(llama(), [cb])
    finally:
        cb.hooks.remove()  # the Trainer has no exception event: the model stays wrapped


def test_wrap_of_llama_blocks_under_torch_compile_is_refused_not_wrong(
    llama: Callable[[], nn.Module],
) -> None:
    # The reproduction (hidden 256 and 4 layers there): layer 1 got no gradient.
    model = llama()
    hooks = tsh.wrap(model, "memory://", modules="model.layers.*", default="keep")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend="aot_eager")
    try:
        with pytest.raises(ConfigError, match=r"model\.layers\.0"):
            compiled(input_ids=ids, labels=ids)
    finally:
        hooks.remove()


class _Lit:
    """A LightningModule whose forward is compiled (imported lazily: lightning is heavy)."""

    @staticmethod
    def make() -> Any:
        import lightning.pytorch as pl

        class Lit(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64))
                self.head = nn.Linear(64, 4)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(torch.tanh(self.net(x)))

            def training_step(self, batch: Any, idx: int) -> torch.Tensor:
                x, y = batch
                return nn.functional.mse_loss(self(x), y)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=0.1)

        return Lit()


def _pl_fit(module: Any, callbacks: list[Any]) -> None:
    import lightning.pytorch as pl

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(
        torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)
    )
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(
            torch.compile(module, backend="aot_eager"),
            torch.utils.data.DataLoader(data, batch_size=4),
        )


def test_lightning_compiled_module_with_callback_is_bit_identical() -> None:
    from tensorstore_hooks.integrations.lightning import OffloadCallback

    ref, off = _Lit.make(), _Lit.make()
    _pl_fit(ref, [])
    cb = OffloadCallback(store="memory://", min_bytes=0)
    _pl_fit(off, [cb])
    _same_weights(ref, off)
    assert cb.hooks.stats.tensors_offloaded > 0 and cb.hooks.stats.bytes_read > 0


def test_lightning_compiled_module_with_block_modules_is_refused() -> None:
    from tensorstore_hooks.integrations.lightning import OffloadCallback

    cb = OffloadCallback(store="memory://", min_bytes=0, modules="net")
    with pytest.raises(ConfigError, match=r"'net' runs inside a torch\.compile'd graph"):
        _pl_fit(_Lit.make(), [cb])


def test_model_compile_of_a_wrapped_model_does_not_warn() -> None:
    # docs/compile.md: only torch.compile(module) warns about global module hooks.
    model = _net()
    hooks = tsh.wrap(model, "memory://", min_bytes=0)
    model.compile(backend="aot_eager")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(BATCHES[0]).backward()
        assert hooks.stats.tensors_offloaded > 0
    finally:
        hooks.remove()
