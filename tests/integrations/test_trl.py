"""TRL's trainers with the Hugging Face callback, for real (issue 38, item 6).

``SFTTrainer``, ``GRPOTrainer`` and ``DPOTrainer`` subclass ``transformers.Trainer``, so
:class:`~tensorstore_hooks.integrations.transformers.OffloadCallback` plugs in as is.
Each test trains a tiny Llama-config model (built from a config, with a word-level
tokenizer made here: no downloads) for two steps with SGD, once with the callback and
once without, and compares every parameter with ``torch.equal``; the callback's
figures are in the trainer's own logs (``tsh/...``). TRL is in the ``test`` extra.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

trl = pytest.importorskip("trl")  # in the test extra: runs (never skips) in CI
from datasets import Dataset  # noqa: E402  (TRL's own dependency)
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from tensorstore_hooks.integrations.transformers import OffloadCallback  # noqa: E402

WORDS = [
    "the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "log", "big", "small", "red",
    "blue",
]  # fmt: skip
STEPS = 2


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for w in WORDS:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
        unk_token="<unk>",
    )  # fmt: skip


def _model(tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _texts(n: int, seed: int = 3) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = 3 + int(torch.randint(0, 6, (1,), generator=g))
        out.append(" ".join(WORDS[int(j)] for j in torch.randint(0, len(WORDS), (k,), generator=g)))
    return out


def _args(out: Path) -> dict[str, Any]:
    return {
        "output_dir": str(out), "per_device_train_batch_size": 4, "max_steps": STEPS,
        "learning_rate": 0.05, "optim": "sgd", "lr_scheduler_type": "constant",
        "warmup_steps": 0, "weight_decay": 0.0, "report_to": [], "save_strategy": "no",
        "logging_steps": 1, "use_cpu": True, "disable_tqdm": True,
        "dataloader_num_workers": 0, "seed": 0,
    }  # fmt: skip


Train = Callable[[Path, list[OffloadCallback]], tuple[nn.Module, Any]]


def _sft(out: Path, callbacks: list[OffloadCallback]) -> tuple[nn.Module, Any]:
    tok = _tokenizer()
    model = _model(tok)
    args = trl.SFTConfig(**_args(out), max_length=16)
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"text": _texts(8)}),
        processing_class=tok, callbacks=callbacks,
    )  # fmt: skip
    trainer.train()
    return model, trainer


def _length_reward(completions: list[str], **_: object) -> list[float]:
    return [len(c) / 10 for c in completions]


def _grpo(out: Path, callbacks: list[OffloadCallback]) -> tuple[nn.Module, Any]:
    tok = _tokenizer()
    model = _model(tok)
    args = trl.GRPOConfig(
        **_args(out), num_generations=2, max_completion_length=4, generation_batch_size=4,
        beta=0.0,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=_length_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": _texts(8)}), processing_class=tok,
        callbacks=callbacks,
    )  # fmt: skip
    trainer.train()
    return model, trainer


def _dpo(out: Path, callbacks: list[OffloadCallback]) -> tuple[nn.Module, Any]:
    tok = _tokenizer()
    model = _model(tok)
    data = {
        "prompt": _texts(8),
        "chosen": [" " + t for t in _texts(8, seed=4)],  # a word boundary after the prompt
        "rejected": [" " + t for t in _texts(8, seed=5)],
    }
    args = trl.DPOConfig(**_args(out), max_length=24)
    trainer = trl.DPOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=args,
        train_dataset=Dataset.from_dict(data), processing_class=tok, callbacks=callbacks,
    )  # fmt: skip
    trainer.train()
    return model, trainer


@pytest.mark.parametrize("train", [_sft, _grpo, _dpo], ids=["sft", "grpo", "dpo"])
def test_trl_trainer_is_bit_identical_and_logs_figures(tmp_path: Path, train: Train) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's own notes about the tiny setup
        ref, _ = train(tmp_path / "ref", [])
        cb = OffloadCallback(store="memory://", min_bytes=0)
        off, trainer = train(tmp_path / "off", [cb])
    pa, pb = dict(ref.named_parameters()), dict(off.named_parameters())
    assert pa.keys() == pb.keys() and pa
    for name in pa:
        assert torch.equal(pa[name], pb[name]), f"parameter {name} differs"
    assert cb.hooks is not None and cb.hooks.stats.tensors_offloaded > 0
    assert cb.hooks.stats.bytes_read > 0 and cb.hooks.stats.fallbacks == 0
    steps = [log for log in trainer.state.log_history if "loss" in log]
    assert len(steps) == STEPS
    for log in steps:  # the figures of each step, in the trainer's own logs
        assert log["tsh/tensors_offloaded"] > 0 and log["tsh/bytes_read"] > 0
