"""A small GPT-like model and synthetic data, shared by the demo, benchmarks and tests.

Token embedding + learned positions, ``blocks`` pre-norm transformer blocks (causal
self-attention, then a 4x GELU MLP), a final LayerNorm and an untied ``lm_head``.
Attention is written out (``q @ k^T``, mask, softmax, ``@ v``) rather than calling
``scaled_dot_product_attention``: the explicit form saves the ``T x T`` score and
probability matrices for backward, which is what makes activation memory grow with
sequence length in real training and what offloading is for. Everything is seeded,
so two models built with the same config and seed hold identical weights and see
identical batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["SIZES", "GPT", "GPTConfig", "Block", "config_for", "synthetic_batch"]


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """Shape of a :class:`GPT` and of the batches it trains on."""

    vocab: int = 256
    """Vocabulary size (token ids are ``0 .. vocab-1``)."""
    d_model: int = 128
    """Width of the residual stream; must be divisible by ``heads``."""
    heads: int = 4
    """Attention heads."""
    blocks: int = 2
    """Transformer blocks."""
    seq: int = 128
    """Tokens per sequence (also the number of learned positions)."""
    batch: int = 8
    """Sequences per batch."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``d_model``."""

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} is not divisible by heads={self.heads}"
            )
        for name in ("vocab", "d_model", "heads", "blocks", "seq", "batch", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig: {name} must be >= 1, got {getattr(self, name)}")


SIZES: dict[str, GPTConfig] = {
    # Few weights and little arithmetic (under a second a step on two CPU cores), but
    # attention-heavy: ~200 MiB saved per step, mostly 8 MiB score matrices, so the
    # memory that offloading saves stands out from allocator noise.
    "tiny": GPTConfig(vocab=256, d_model=128, heads=8, blocks=4, seq=256, batch=8),
    # About 4x the arithmetic and 3x the saved bytes of tiny.
    "small": GPTConfig(vocab=512, d_model=256, heads=8, blocks=6, seq=512, batch=4),
    # The train-step benchmark of DESIGN.md: 8 blocks, d=512, 8 heads, 8 x 512 tokens.
    "bench": GPTConfig(vocab=256, d_model=512, heads=8, blocks=8, seq=512, batch=8),
}


def config_for(size: str, **changes: int) -> GPTConfig:
    """The named size (``tiny``, ``small``, ``bench``), with fields replaced by ``changes``.

    Raises ``KeyError`` naming the known sizes for an unknown one.
    """
    try:
        base = SIZES[size]
    except KeyError:
        raise KeyError(f"unknown model size {size!r}; known: {', '.join(SIZES)}") from None
    return replace(base, **changes) if changes else base


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with the score matrix written out."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        # A buffer, not a parameter: moves with .to(device), is never trained.
        self.mask: torch.Tensor
        self.register_buffer(
            "mask", torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).triu(1), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        hd = d // self.heads
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(self.mask[:t, :t], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, d)
        return self.proj(y)


class MLP(nn.Module):
    """``Linear -> GELU -> Linear`` with a ``mlp_ratio`` x hidden width."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT: ``forward(tokens, targets)`` returns the mean cross-entropy loss.

    ``tokens`` and ``targets`` are int64 ``(batch, seq)`` tensors. Weights come from
    ``torch.manual_seed(seed)``, so equal ``(cfg, seed)`` give bit-identical models.
    """

    def __init__(self, cfg: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
            self.pos = nn.Embedding(cfg.seq, cfg.d_model)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.blocks))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(
    cfg: GPTConfig, step: int, *, seed: int = 0, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` of a deterministic synthetic corpus: ``(tokens, targets)``.

    Targets are the tokens shifted by one, as in language modelling. The same
    ``(cfg, step, seed)`` always gives the same batch, without touching the global RNG.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    data = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
    data = data.to(device)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()
