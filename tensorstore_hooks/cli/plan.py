"""``tensorstore-hooks plan [ENTRY] [--config FILE]``: what a policy does to a model.

ENTRY is ``module:factory`` or ``path/to/file.py:factory``; the factory (called with no
arguments) returns ``(model, batch)`` or ``(model, batch, loss_fn)``, or a dict with
``model``, ``batch`` and optionally ``loss``. The command runs that many training steps
(forward and backward, no optimizer) under ``tsh.offload(config=FILE, model=model)`` on
a ``memory://`` store (``--store`` for another) and prints ``hooks.report()``: per
module path the tensors saved, their bytes, the action and the rule that decided, and
what each ``device_budget`` would keep. Without ENTRY it plans the demo's GPT.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["demo_gpt", "register", "run"]

DEMO_ENTRY = "tensorstore_hooks.cli.plan:demo_gpt"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plan`` subcommand."""
    parser = subparsers.add_parser(
        "plan",
        help="show what a config's policy offloads for a model, per module, and each budget",
        description=(
            "Run a model's training step (forward and backward) under the offload hooks "
            "and print, per module path, the tensors autograd saved, their bytes, what "
            "the policy decided and by which rule, and the device_budget curve (each "
            "budget -> what stays on the device and what moves per step). ENTRY is "
            "module:factory or file.py:factory; the factory returns (model, batch), "
            "(model, batch, loss_fn) or {'model', 'batch', 'loss'}; the batch is passed "
            "as model(**batch) for a dict, model(*batch) for a tuple, else model(batch); "
            "the loss is loss_fn(output), else output.loss, else the output (summed). "
            "Default ENTRY: the demo's small GPT."
        ),
    )
    parser.add_argument(
        "entry",
        nargs="?",
        default=DEMO_ENTRY,
        metavar="ENTRY",
        help=f"module:factory or file.py:factory (default {DEMO_ENTRY})",
    )
    parser.add_argument("--config", metavar="FILE", help="a YAML config (docs/config.md)")
    parser.add_argument(
        "--store",
        metavar="URL",
        default="memory://",
        help="where the step's tensors go (default memory://: the config's store is not "
        "touched; the decisions do not depend on the store)",
    )
    parser.add_argument(
        "--budget",
        metavar="SIZE",
        action="append",
        help="a device_budget for the curve (repeatable; default 0, 25, 50, 100 and 200%% "
        "of the bytes the rules move)",
    )
    parser.add_argument("--min-bytes", metavar="SIZE", help="override policy.min_bytes")
    parser.add_argument("--device-budget", metavar="SIZE", help="override policy.device_budget")
    parser.add_argument(
        "--steps",
        type=int,
        metavar="N",
        help="training steps to run (default 1; 2 with a device_budget, whose plan acts "
        "from the second forward on); the report describes the last",
    )
    parser.add_argument(
        "--depth",
        type=int,
        metavar="N",
        help="count submodules under their path's first N parts (2: layers.3.linear1 as "
        "layers.3); default: whole paths",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=run)


def demo_gpt() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The demo's tiny GPT and one synthetic batch: ``model(tokens, targets)`` is the loss."""
    from tensorstore_hooks.cli._demo_model import GPT, config_for, synthetic_batch

    cfg = config_for("tiny")
    return GPT(cfg, seed=0), synthetic_batch(cfg, 0)


def run(args: argparse.Namespace) -> int:
    """Run the steps and print the report; exit 0, or 1 with the error on stderr."""
    import json

    from tensorstore_hooks.hooks import offload

    model, batch, loss_fn = load_entry(args.entry)
    overrides: dict[str, object] = {}
    if args.min_bytes is not None:
        overrides["min_bytes"] = args.min_bytes
    if args.device_budget is not None:
        overrides["device_budget"] = args.device_budget
    hooks = offload(args.store, config=args.config, model=model, **overrides)
    try:
        steps = args.steps
        if steps is None:
            steps = 2 if hooks.policy.device_budget is not None else 1
        if steps < 1:
            print("plan: --steps must be >= 1", file=sys.stderr)
            return 2
        for _ in range(steps):
            with hooks:
                loss = _loss(_call(model, batch), loss_fn)
            loss.backward()
            del loss
        hooks.flush()
        report = hooks.report(args.budget, depth=args.depth)
        store_url = hooks.store.url
    finally:
        hooks.close()
        model.zero_grad(set_to_none=True)  # the plan's gradients are not the user's
    where = f"{steps} step{'s' if steps > 1 else ''} of {args.entry}"
    config = args.config or "(defaults)"
    if args.json:
        out = {"entry": args.entry, "config": args.config, "steps": steps, "store": store_url}
        out["report"] = report.as_dict()
        print(json.dumps(out, indent=2))
        return 0
    print(f"plan: {where}, config {config}, on {store_url}")
    print(report.text())
    return 0


# ----------------------------------------------------------------------- entry
def load_entry(entry: str) -> tuple[torch.nn.Module, object, Callable[[object], object] | None]:
    """``module:factory`` or ``file.py:factory`` -> (model, batch, loss_fn or None).

    The batch is whatever the factory made (the model takes it, see :func:`_call`); the
    loss function takes the model's output and returns a tensor.

    Raises :class:`~tensorstore_hooks.ConfigError` naming the entry and what is wrong.
    """
    from tensorstore_hooks.errors import ConfigError

    target, sep, name = entry.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ConfigError(
            f"plan: ENTRY {entry!r} must be module:factory or path/to/file.py:factory "
            "(e.g. mypkg.models:make_plan_example)"
        )
    try:
        module = _import(target)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"plan: cannot import {target!r} for ENTRY {entry!r}: {e}") from e
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ConfigError(f"plan: {target!r} has no callable {name!r} (ENTRY {entry!r})")
    made = factory()
    loss_fn = None
    if isinstance(made, Mapping) and "model" in made and "batch" in made:
        model, batch, loss_fn = made["model"], made["batch"], made.get("loss")
    elif isinstance(made, tuple) and len(made) in (2, 3):
        model, batch = made[0], made[1]
        loss_fn = made[2] if len(made) == 3 else None
    else:
        raise ConfigError(
            f"plan: {entry} returned a {type(made).__name__}; return (model, batch), "
            "(model, batch, loss_fn) or {'model': ..., 'batch': ..., 'loss': ...}"
        )
    import torch

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"plan: {entry} returned a {type(model).__name__} as the model; "
            "expected a torch.nn.Module"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"plan: {entry}: the loss must be callable (output -> scalar tensor)")
    return model, batch, loss_fn


def _import(target: str) -> ModuleType:
    from tensorstore_hooks.errors import ConfigError

    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise ConfigError(f"plan: no file {target!r}")
        spec = importlib.util.spec_from_file_location("_tsh_plan_entry", target)
        if spec is None or spec.loader is None:
            raise ConfigError(f"plan: cannot load {target!r} as Python")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: the working directory
    return importlib.import_module(target)


def _call(model: torch.nn.Module, batch: object) -> object:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, tuple | list):
        return model(*batch)
    return model(batch)


def _loss(output: object, loss_fn: Callable[[object], object] | None) -> torch.Tensor:
    import torch

    from tensorstore_hooks.errors import ConfigError

    if loss_fn is not None:
        loss = loss_fn(output)
        if not isinstance(loss, torch.Tensor):
            raise ConfigError(
                f"plan: the loss function returned a {type(loss).__name__}, not a tensor"
            )
        return loss
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.sum()
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return _loss(output[0], None)
    if isinstance(output, Mapping):
        for value in output.values():
            if isinstance(value, torch.Tensor):
                return _loss(value, None)
    raise ConfigError(
        f"plan: the model returned a {type(output).__name__}, not a tensor or an object "
        "with .loss; return (model, batch, loss_fn) from the factory"
    )
