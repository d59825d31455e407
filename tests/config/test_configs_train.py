"""Training under the example configs: gradients bit-identical, rules routed, no hooks left."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorstore_hooks as tsh

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
VOCAB, D, HEADS, T, BATCH = 256, 64, 4, 64, 4


class Attention(nn.Module):
    causal: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        # A bool buffer: masked_fill saves it for backward (the "masks" rule's target).
        self.register_buffer("causal", torch.ones(T, T, dtype=torch.bool).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, D // HEADS).transpose(1, 3).unbind(2)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D // HEADS)
        scores = scores.masked_fill(self.causal[:t, :t], float("-inf"))
        y = F.dropout(scores.softmax(-1), 0.1, self.training) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, D))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """The module layout configs/transformer.yaml is written for."""

    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_always_called)
        for m in model.modules()
    )


def _train(config: Any, steps: int = 3) -> list[tsh.OffloadStats]:
    """Train TinyLM with and without offloading; assert bit-identical grads and params."""
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    stats = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, VOCAB, (BATCH, T + 1), generator=gen)
        grads = []
        for net, optimizer, offloading in ((ref, ref_opt, False), (model, opt, True)):
            hooks = tsh.offload(config=config, model=net) if offloading else None
            torch.manual_seed(1000 + step)  # same dropout masks in both runs
            with hooks if hooks is not None else contextlib.nullcontext():
                logits = net(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            assert _hook_count(net) == 0  # module-scope hooks are gone after the block
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grads.append(
                {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
            )
            optimizer.step()
            if hooks is not None:
                del loss, logits
                stats.append(hooks.stats)
                hooks.close()
        ref_grads, grads_off = grads
        assert ref_grads.keys() == grads_off.keys()
        for name, g in ref_grads.items():
            assert torch.equal(g, grads_off[name]), f"step {step}: gradient of {name} differs"
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), f"parameter {name} differs after training"
    return stats


def test_local_disk_config(tmp_path: Path) -> None:
    cfg = tsh.load_config(CONFIGS / "local-disk.yaml")
    # Same config, but the root goes under pytest's tmp_path instead of /var/tmp.
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, url=str(tmp_path)))
    for stats in _train(cfg):
        assert stats.tensors_offloaded > 0
        assert stats.fallbacks == 0


def test_memory_config() -> None:
    for stats in _train(str(CONFIGS / "memory.yaml")):
        assert stats.tensors_offloaded > 0
        assert stats.fallbacks == 0


def test_transformer_config_routes_as_written() -> None:
    """configs/transformer.yaml on the README's nn.TransformerEncoder: every module rule hits."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64)
    model = nn.TransformerEncoder(layer, 8, enable_nested_tensor=False)
    ref = copy.deepcopy(model)
    x = torch.randn(12, 2, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    ref(x).pow(2).mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a glob matching no module would warn
        hooks = tsh.offload(config=CONFIGS / "transformer.yaml", model=model)
        torch.manual_seed(5)  # the same dropout masks
        with hooks:
            loss = model(x).pow(2).mean()
    loss.backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), f"gradient of {name} differs"
    per_rule = {label: route.tensors for label, route in hooks.stats.per_rule.items()}
    assert per_rule.get("rules[0] last-layer", 0) >= 10  # layers.7 and its modules: kept
    assert per_rule.get("rules[2] layers", 0) >= 7 * 10  # layers 0..6: stored
    assert hooks.stats.tensors_offloaded >= per_rule["rules[2] layers"]
    assert hooks.stats.fallbacks == 0
    hooks.close()


def test_module_hooks_removed_when_forward_raises() -> None:
    model = TinyLM(n_blocks=1)
    with pytest.raises(IndexError), tsh.offload(config=CONFIGS / "memory.yaml", model=model):
        model(torch.full((1, 4), VOCAB))  # token id out of range: the embedding raises
    assert _hook_count(model) == 0
