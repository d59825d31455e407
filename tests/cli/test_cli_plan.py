"""``tensorstore-hooks plan`` with a factory whose loss function is not usable."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ENTRY = """
import torch
from torch import nn

def float_loss():
    model = nn.Linear(8, 8)
    return model, torch.randn(4, 8), lambda y: 0.5
"""


def test_plan_refuses_a_loss_that_is_not_a_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tensorstore_hooks.cli import main

    (tmp_path / "plan_entry_loss.py").write_text(ENTRY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "plan_entry_loss", raising=False)
    assert main(["plan", "plan_entry_loss:float_loss"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tensorstore-hooks plan: ") and "returned a float, not a tensor" in err
