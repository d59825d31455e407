"""The demo's small GPT in Paddle, and the reference/offloaded pair that trains it.

Same architecture as :mod:`tensorstore_hooks.cli._demo_model` (written-out causal
attention, 4x GELU MLP, pre-norm blocks, untied head), with its weights copied from the
torch model of the same config and seed, and the same synthetic batches: both
frameworks' demos train the same model on the same data.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager

import numpy as np
import paddle
import torch
from paddle import nn
from paddle.nn import functional as F

from tensorstore_hooks.cli._demo_model import GPT as TorchGPT
from tensorstore_hooks.cli._demo_model import Block as TorchBlock
from tensorstore_hooks.cli._demo_model import GPTConfig, synthetic_batch
from tensorstore_hooks.paddle import OffloadHooks, offload

__all__ = ["GPT", "PaddlePair"]


class _Attention(nn.Layer):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        mask = paddle.triu(paddle.ones([cfg.seq, cfg.seq]), diagonal=1).astype("bool")
        self.register_buffer("mask", mask, persistable=False)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = paddle.split(self.qkv(x), 3, axis=2)
        q, k, v = (z.reshape([b, t, self.heads, hd]).transpose([0, 2, 1, 3]) for z in (q, k, v))
        att = paddle.matmul(q, k, transpose_y=True) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(self.mask[:t, :t], float("-inf"))
        att = F.softmax(att, axis=-1)
        y = paddle.matmul(att, v).transpose([0, 2, 1, 3]).reshape([b, t, d])
        return self.proj(y)


class _Block(nn.Layer):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = _Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Layer):
    """``forward(tokens, targets)`` -> mean cross-entropy; weights from the torch GPT(cfg, seed)."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.LayerList([_Block(cfg) for _ in range(cfg.blocks)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias_attr=False)
        self._copy_from(TorchGPT(cfg, seed=seed))

    def _copy_from(self, ref: TorchGPT) -> None:
        pairs: list[tuple[nn.Layer, torch.nn.Module]] = [
            (self.tok, ref.tok),
            (self.pos, ref.pos),
            (self.ln_f, ref.ln_f),
        ]
        pairs.append((self.lm_head, ref.lm_head))
        theirs_blocks = [b for b in ref.blocks if isinstance(b, TorchBlock)]  # all: zip is strict
        for mine, theirs in zip(self.blocks, theirs_blocks, strict=True):
            pairs += [
                (mine.ln1, theirs.ln1),
                (mine.attn.qkv, theirs.attn.qkv),
                (mine.attn.proj, theirs.attn.proj),
                (mine.ln2, theirs.ln2),
                (mine.fc, theirs.mlp.fc),
                (mine.out, theirs.mlp.out),
            ]
        for layer, module in pairs:
            for name, value in module.named_parameters(recurse=False):
                array = value.detach().numpy()
                if isinstance(module, torch.nn.Linear) and name == "weight":
                    array = array.T  # torch stores (out, in), paddle (in, out)
                getattr(layer, name).set_value(np.ascontiguousarray(array))

    def forward(self, tokens: paddle.Tensor, targets: paddle.Tensor) -> paddle.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(paddle.arange(t))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape([-1, logits.shape[-1]]), targets.reshape([-1]))


class PaddlePair:
    """Two identical Paddle GPTs trained side by side: ``ref`` plain, ``off`` under hooks.

    The demo drives it like the torch pair: ``step(which, step, hooks)``, then
    ``mismatches(step)``, then ``optimizer_step()``.
    """

    framework = "paddle"

    def __init__(self, cfg: GPTConfig) -> None:
        self.cfg = cfg
        self.models = {"ref": GPT(cfg, seed=0), "off": GPT(cfg, seed=0)}
        self.opts = {
            which: paddle.optimizer.SGD(learning_rate=0.05, parameters=m.parameters())
            for which, m in self.models.items()
        }
        self.n_params = len(self.models["ref"].parameters())

    @staticmethod
    def offload(store: str | None, *, prefetch: str, max_inflight: str) -> OffloadHooks:
        return offload(store, prefetch=prefetch, max_inflight=max_inflight)

    def step(self, which: str, step: int, hooks: AbstractContextManager[object] | None) -> None:
        tokens, targets = (paddle.to_tensor(z.numpy()) for z in synthetic_batch(self.cfg, step))
        if hooks is None:
            loss = self.models[which](tokens, targets)
        else:
            with hooks:
                loss = self.models[which](tokens, targets)
        loss.backward()

    def mismatches(self, step: int) -> list[str]:
        out = []
        ref, off = self.models["ref"], self.models["off"]
        for (name, p_ref), p_off in zip(ref.named_parameters(), off.parameters(), strict=True):
            g_ref, g_off = p_ref.grad, p_off.grad
            if g_ref is None or g_off is None or not np.array_equal(g_ref.numpy(), g_off.numpy()):
                out.append(f"step {step}: {name}")
        return out

    def optimizer_step(self) -> None:
        for opt in self.opts.values():
            opt.step()
            opt.clear_grad(set_to_zero=True)
