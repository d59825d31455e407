"""A ``tensorstore-hooks plan`` entry: the README's model and a batch for it.

    tensorstore-hooks plan examples/plan_transformer.py:build --config configs/transformer.yaml

``build()`` returns ``(model, batch, loss_fn)``: the plan runs ``loss_fn(model(batch))``
and its backward under the config's policy and prints what each module saved, what
the policy decided for it and by which rule, and what each device_budget would keep.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def build() -> tuple[torch.nn.Module, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(512, 8)
    model = torch.nn.TransformerEncoder(layer, 8, enable_nested_tensor=False)
    batch = torch.randn(128, 4, 512)  # (sequence, batch, features)
    return model, batch, lambda out: out.pow(2).mean()
