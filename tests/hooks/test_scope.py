"""ModuleScope: module paths during forward, re-entrancy, threads, exceptions, cleanup."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from tensorstore_hooks import Policy, Rule
from tensorstore_hooks.hooks._scope import ModuleScope


class Probe(nn.Module):
    """Records scope.current() when its forward runs."""

    def __init__(self, scope: ModuleScope, seen: list[str | None]) -> None:
        super().__init__()
        self.scope, self.seen = scope, seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.scope.current())
        return x


class Block(nn.Module):
    def __init__(self, scope: ModuleScope, seen: list[str | None]) -> None:
        super().__init__()
        self.attn = Probe(scope, seen)
        self.mlp = Probe(scope, seen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))


class Net(nn.Module):
    def __init__(self, scope: ModuleScope, seen: list[str | None]) -> None:
        super().__init__()
        self.scope, self.seen = scope, seen
        self.blocks = nn.ModuleList([Block(scope, seen) for _ in range(2)])
        self.lm_head = Probe(scope, seen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.scope.current())
        for block in self.blocks:
            x = block(x)
        x = self.lm_head(x)
        self.seen.append(self.scope.current())  # back in the root after the children
        return x


def _hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_always_called)
        for m in model.modules()
    )


@pytest.fixture
def scope() -> Iterator[ModuleScope]:
    s = ModuleScope()
    yield s
    s.detach()


def test_paths_during_forward(scope: ModuleScope) -> None:
    seen: list[str | None] = []
    net = Net(scope, seen)
    scope.attach(net)
    assert scope.current() is None
    net(torch.zeros(1))
    assert seen == [
        "",
        "blocks.0.attn",
        "blocks.0.mlp",
        "blocks.1.attn",
        "blocks.1.mlp",
        "lm_head",
        "",
    ]
    assert scope.current() is None


def test_detach_leaves_no_hook_behind(scope: ModuleScope) -> None:
    seen: list[str | None] = []
    net = Net(scope, seen)
    before = _hook_count(net)
    scope.attach(net)
    assert scope.attached == len(list(net.modules()))
    assert _hook_count(net) > before
    scope.detach()
    assert _hook_count(net) == before == 0
    assert scope.attached == 0
    scope.detach()  # twice is fine
    net(torch.zeros(1))
    assert set(seen) == {None}


def test_foreign_hooks_survive_detach(scope: ModuleScope) -> None:
    net = nn.Sequential(nn.Linear(2, 2))
    calls: list[str] = []
    handle = net[0].register_forward_hook(lambda *_: calls.append("mine"))
    scope.attach(net)
    scope.detach()
    net(torch.zeros(1, 2))
    assert calls == ["mine"]
    handle.remove()


def test_attach_is_idempotent_per_module(scope: ModuleScope) -> None:
    seen: list[str | None] = []
    net = Net(scope, seen)
    scope.attach(net)
    count = _hook_count(net)
    scope.attach(net)
    scope.attach(net.blocks[0])  # a part of an attached model keeps its full path
    assert _hook_count(net) == count
    net(torch.zeros(1))
    assert seen[1] == "blocks.0.attn"


def test_several_models(scope: ModuleScope) -> None:
    seen: list[str | None] = []
    a, b = Net(scope, seen), Block(scope, seen)
    scope.attach(a)
    scope.attach(b)
    b(torch.zeros(1))
    assert seen == ["attn", "mlp"]  # paths are relative to the model attached
    scope.detach()
    assert _hook_count(a) == _hook_count(b) == 0


def test_shared_module_is_hooked_once_under_its_first_path(scope: ModuleScope) -> None:
    seen: list[str | None] = []
    shared = Probe(scope, seen)
    net = nn.Sequential(nn.Sequential(shared), nn.Sequential(shared))
    scope.attach(net)
    net(torch.zeros(1))
    assert seen == ["0.0", "0.0"]


def test_exception_in_forward_does_not_corrupt_the_stack(scope: ModuleScope) -> None:
    seen: list[str | None] = []

    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    net = Net(scope, seen)
    net.blocks[1].mlp = Boom()
    scope.attach(net)
    with pytest.raises(RuntimeError, match="boom"):
        net(torch.zeros(1))
    assert scope.current() is None
    net.blocks[1].mlp = Probe(scope, seen)
    scope.attach(net)  # the new child gets hooked; the others are already
    seen.clear()
    net(torch.zeros(1))
    assert seen[-3:] == ["blocks.1.mlp", "lm_head", ""]


def test_failing_global_pre_hook_does_not_pop_a_parent(scope: ModuleScope) -> None:
    seen: list[str | None] = []
    net = Net(scope, seen)
    scope.attach(net)

    def veto(module: nn.Module, args: object) -> None:
        if module is net.lm_head:
            seen.append(scope.current())  # global hooks run before ours: still the root
            raise ValueError("veto")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(veto)
    try:
        with pytest.raises(ValueError, match="veto"):
            net(torch.zeros(1))
    finally:
        handle.remove()
    assert seen[-1] == ""
    assert scope.current() is None


def test_reentrant_module(scope: ModuleScope) -> None:
    seen: list[str | None] = []

    class Recursive(nn.Module):
        def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
            seen.append(scope.current())
            if depth:
                x = self(x, depth - 1)
                seen.append(scope.current())
            return x

    net = nn.Sequential(Recursive())
    scope.attach(net)
    net(torch.zeros(1))
    assert seen == ["0", "0", "0", "0", "0"]
    assert scope.current() is None


def test_threads_have_their_own_stack(scope: ModuleScope) -> None:
    barrier = threading.Barrier(2)
    results: dict[str, list[str | None]] = {}

    class Wait(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            barrier.wait(timeout=10)  # both threads inside a module at once
            results[self.name] = [scope.current()]
            barrier.wait(timeout=10)
            results[self.name].append(scope.current())
            return x

    net = nn.ModuleDict({"left": Wait("left"), "right": Wait("right")})
    scope.attach(net)
    threads = [
        threading.Thread(target=net[name], args=(torch.zeros(1),)) for name in ("left", "right")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == {"left": ["left", "left"], "right": ["right", "right"]}
    assert scope.current() is None


def test_attach_rejects_non_modules(scope: ModuleScope) -> None:
    with pytest.raises(TypeError, match=r"nn\.Module"):
        scope.attach(object())  # type: ignore[arg-type]


def test_policy_routes_saved_tensors_by_module(scope: ModuleScope) -> None:
    """Scope + policy inside saved-tensor hooks route by module, as the rules are written."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(8, 32))
    model.add_module("blocks", nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)))
    model.add_module("lm_head", nn.Linear(32, 4))
    policy = Policy(
        min_bytes=0,
        rules=(
            Rule("keep", module="*.lm_head", name="head"),
            Rule("store", module="blocks.*", name="blocks"),
        ),
        default="host",
    )
    routed: list[tuple[str | None, str]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        d = policy.decide(t, scope.current())
        routed.append((scope.current(), d.label))
        return t

    scope.attach(model)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randn(3, 8)).sum().backward()
    labels = {label for _, label in routed}
    assert {"parameter", "rules[0] head", "rules[1] blocks"} <= labels
    for path, label in routed:
        if label == "rules[1] blocks":
            assert path is not None and path.startswith("blocks.")
        if label == "rules[0] head":
            assert path == "lm_head"
        if label == "default":
            assert path in ("embed", "blocks", None)
