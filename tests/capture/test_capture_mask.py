"""Capture of padded batches (issue 38, item 5): ``mask=`` keeps only the real tokens,
one array per module and kind whatever the padding, each row's step, sample and
position recorded beside it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from torch import nn

import tensorstore_hooks as tsh

VOCAB, D = 50, 8


class Tiny(nn.Module):
    """What a HF causal LM looks like to capture: keyword inputs, a dict output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return {"logits": self.head(h), "pooled": h.mean(1)}


def padded_batches(n: int, batch: int = 3) -> list[dict[str, torch.Tensor]]:
    """Batches padded to their longest sample (a new length each batch), right padding
    but for batch 1, padded on the left (as generation does)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        lengths = torch.randint(
            2, D, (batch,), generator=g
        )  # seq < D: no (batch, D) leaf looks masked
        seq = int(lengths.max())
        ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        if i == 1:
            mask = mask.flip(1)
        out.append({"input_ids": ids * mask, "attention_mask": mask})
    return out


def loss_of(out: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    return (out["logits"].pow(2).sum(-1) * mask).sum()


def reference(
    data: list[dict[str, torch.Tensor]],
) -> tuple[dict[str, list[torch.Tensor]], dict[str, torch.Tensor]]:
    """The real tokens' outputs and output gradients of each layer, by hand-written
    hooks, and the parameter gradients of a run without capture."""
    model = Tiny()
    got: dict[str, list[torch.Tensor]] = {}
    current: list[torch.Tensor] = []
    for i, layer in enumerate(model.layers):

        def hook(m: nn.Module, a: object, out: torch.Tensor, i: int = i) -> None:
            keep = current[0].bool()
            got.setdefault(f"layers.{i}/output", []).append(out.detach()[keep])
            out.register_hook(
                lambda g, keep=keep: got.setdefault(f"layers.{i}/grad_output", []).append(g[keep])
            )

        layer.register_forward_hook(hook)
    for batch in data:
        current[:] = [batch["attention_mask"]]
        loss_of(model(**batch), batch["attention_mask"]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return got, grads


def test_only_real_tokens_become_rows_of_one_array_per_module_and_kind(tmp_path: Path) -> None:
    data = padded_batches(5)
    ref, ref_grads = reference(data)
    model = Tiny()
    with tsh.capture(
        model,
        str(tmp_path),
        modules="layers.*",
        what=("output", "grad_output"),
        mask="attention_mask",
        chunk_bytes="4KiB",
    ) as cap:
        for batch in data:
            loss_of(model(**batch), batch["attention_mask"]).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())  # gradients unchanged
    names = [f"layers.{i}/{k}" for i in range(2) for k in ("grad_output", "output")]
    assert sorted(cap.arrays) == sorted([*names, *(n + "~tokens" for n in names)])  # no @
    for name, values in ref.items():
        arr = cap.arrays[name]
        assert torch.equal(torch.from_numpy(arr[:]), torch.cat(values)), name
        assert arr.attrs["masked"] == name + "~tokens"
    real = sum(int(b["attention_mask"].sum()) for b in data)
    where = cap.arrays["layers.1/output~tokens"][:]
    assert where.shape == (real, 3) and where.dtype == np.int64
    want = np.concatenate(
        [
            np.c_[np.full(int(b["attention_mask"].sum()), step), b["attention_mask"].nonzero()]
            for step, b in enumerate(data)
        ]
    )
    assert np.array_equal(where, want)
    assert np.array_equal(cap.arrays["layers.1/grad_output~tokens"][:], want)
    # Join rows back to the text: row i is token input_ids[step][sample, position].
    tokens = [int(data[s]["input_ids"][b, p]) for s, b, p in where]
    assert all(t > 0 for t in tokens)  # never a pad position
    ds = tsh.CaptureDataset(str(tmp_path), "layers.0/output", batch_size=16, seed=2)
    assert ds.num_rows == real and ds.row_shape == (D,)
    assert sorted(map(tuple, torch.cat(list(ds)).tolist())) == sorted(
        map(tuple, torch.cat(ref["layers.0/output"]).tolist())
    )


def test_a_mask_set_per_batch_or_read_from_a_dict_batch(tmp_path: Path) -> None:
    data = padded_batches(3)
    model = Tiny()
    with (
        torch.no_grad(),
        tsh.capture(model, str(tmp_path / "a"), modules=None, what=("input", "output")) as cap,
    ):
        for batch in data:
            cap.mask = batch["attention_mask"]  # the model is called without it
            model(batch["input_ids"])
    ids = cap.arrays["root/input"][:]  # token ids: the masked (batch, seq) input
    assert np.array_equal(
        ids, np.concatenate([b["input_ids"][b["attention_mask"].bool()] for b in data])
    )
    assert cap.arrays["root/output.logits"].shape == (len(ids), VOCAB)
    assert cap.arrays["root/output.pooled"].shape == (9, D)  # (batch, d): not masked
    assert "root/output.pooled~tokens" not in cap.arrays

    class DictModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Tiny()

        def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return self.inner(**batch)

    wrapped = DictModel()
    with (
        torch.no_grad(),
        tsh.capture(
            wrapped,
            str(tmp_path / "b"),
            modules="inner.layers.0",
            what="output",
            mask="attention_mask",
        ) as dcap,
    ):
        for batch in data:
            wrapped(batch)
    assert dcap.arrays["inner.layers.0/output"].shape == (len(ids), D)


def test_mask_mistakes_are_clear_errors(tmp_path: Path) -> None:
    model = Tiny()
    batch = padded_batches(1)[0]
    with pytest.raises(
        tsh.ConfigError, match=r"mask=: expected a \(batch, seq\) mask.*\(3, 4, 5\)"
    ):
        tsh.capture(model, str(tmp_path), modules=None, what="output", mask=torch.ones(3, 4, 5))
    with tsh.capture(
        model, str(tmp_path), modules=None, what="output", mask="attention_mask"
    ) as cap:
        with pytest.raises(
            tsh.ConfigError,
            match=r"called without attention_mask= \(its keyword arguments: input_ids\)",
        ):
            model(input_ids=batch["input_ids"])
        with pytest.raises(tsh.ConfigError, match="attention_mask=None"):
            model(batch["input_ids"], attention_mask=None)
        with pytest.raises(tsh.ConfigError, match=r"cap\.mask: expected a"):
            cap.mask = "attention_mask"  # type: ignore[assignment]


def test_masked_rows_never_share_an_array_with_unmasked_ones(tmp_path: Path) -> None:
    layer = nn.Sequential(nn.Linear(D, D))
    with torch.no_grad():
        with tsh.capture(layer, str(tmp_path), modules="0", what="output"):
            layer(torch.ones(4, D))  # rows of (D,), not masked
        mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
        with tsh.capture(layer, str(tmp_path), modules="0", what="output", mask=mask) as cap:
            layer(torch.ones(2, 3, D))  # real tokens: rows of (D,) too
    group = zarr.open_group(str(tmp_path / "capture/0"), mode="r")
    assert sorted(group.array_keys()) == [
        "output",
        f"output@{D}_float32_masked",
        f"output@{D}_float32_masked~tokens",
    ]
    assert group["output"].shape == (4, D) and group[f"output@{D}_float32_masked"].shape == (3, D)
    assert cap.names == [f"0/output@{D}_float32_masked", f"0/output@{D}_float32_masked~tokens"]


def test_an_array_and_its_tokens_that_no_longer_pair_take_no_more_rows(tmp_path: Path) -> None:
    layer = nn.Sequential(nn.Linear(D, D))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    with torch.no_grad():
        with tsh.capture(layer, str(tmp_path), modules="0", what="output", mask=mask):
            layer(torch.ones(2, 3, D))
        import shutil

        shutil.rmtree(tmp_path / "capture/0/output~tokens")  # the join is gone
        with (
            pytest.warns(UserWarning, match=r"0/output holds 3 rows but capture/0/output~tokens 0"),
            tsh.capture(layer, str(tmp_path), modules="0", what="output", mask=mask) as cap,
        ):
            layer(torch.ones(2, 3, D))
    assert cap.stats.rows_dropped == 3
    assert zarr.open_array(str(tmp_path / "capture/0/output"), mode="r").shape == (3, D)


@pytest.mark.cuda
def test_masks_on_cuda_capture_the_real_tokens(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    data = padded_batches(3)
    ref, _ = reference(data)
    model = Tiny().cuda()
    with tsh.capture(
        model, str(tmp_path), modules="layers.*", what="output", mask="attention_mask"
    ) as cap:
        for batch in data:
            model(**{k: v.cuda() for k, v in batch.items()})
    for i in range(2):
        got = torch.from_numpy(cap.arrays[f"layers.{i}/output"][:])
        assert torch.allclose(got, torch.cat(ref[f"layers.{i}/output"]), atol=1e-5)
