"""Policy.decide: order of checks, rule conditions, labels; Rule validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tensorstore_hooks import ConfigError, Decision, Policy, Rule


def _t(nbytes: int, dtype: torch.dtype = torch.float32, ndim: int = 1) -> torch.Tensor:
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    shape = (n,) if ndim == 1 else (1,) * (ndim - 1) + (n,)
    return torch.zeros(shape, dtype=dtype)


def test_defaults() -> None:
    p = Policy()
    assert (p.min_bytes, p.skip_parameters, p.rules, p.default) == (65536, True, (), "store")
    assert p.decide(_t(65536), None) == Decision("store", "default")
    assert p.decide(_t(65532), None) == Decision("keep", "min_bytes")


def test_parameters_and_their_views_are_kept() -> None:
    w = torch.nn.Parameter(torch.zeros(256, 256))
    p = Policy(rules=(Rule("store", min_bytes=0),))
    assert p.decide(w, None) == Decision("keep", "parameter")
    assert p.decide(w.t(), None) == Decision("keep", "parameter")
    assert p.decide(w[:10], None) == Decision("keep", "parameter")
    # A computed tensor is not a parameter, even if it came from one.
    assert p.decide(w * 2, None).label == "rules[0] min_bytes=0"


def test_skip_parameters_false_routes_parameters_like_any_tensor() -> None:
    w = torch.nn.Parameter(torch.zeros(256, 256))
    p = Policy(skip_parameters=False, rules=(Rule("host", ndim=2),))
    assert p.decide(w, None) == Decision("host", "rules[0] ndim=2")
    assert p.decide(w.t(), None).action == "host"


def test_first_matching_rule_wins_and_rules_run_before_min_bytes() -> None:
    p = Policy(
        min_bytes=1 << 20,
        rules=(
            Rule("keep", module="*.lm_head"),
            Rule("host", dtype="bool"),
            Rule("store", min_bytes=4 << 20),
            Rule("keep", dtype=[torch.bool, torch.uint8]),  # shadowed for bool by rules[1]
        ),
        default="host",
    )
    mask = _t(1024, torch.bool)  # far below min_bytes: rules still see it
    assert p.decide(mask, "blocks.0") == Decision("host", "rules[1] dtype=bool")
    assert p.decide(mask, "model.lm_head") == Decision("keep", "rules[0] module=*.lm_head")
    assert p.decide(_t(4 << 20), None) == Decision("store", "rules[2] min_bytes=4MiB")
    assert p.decide(_t(1024, torch.uint8), None).label == "rules[3] dtype=bool,uint8"
    assert p.decide(_t(2 << 20), None) == Decision("host", "default")
    assert p.decide(_t(1024), None) == Decision("keep", "min_bytes")


@pytest.mark.parametrize(
    ("path", "matches"),
    [
        ("lm_head", True),  # top-level child: "*.lm_head" tries "." + path too
        ("model.lm_head", True),
        ("a.b.lm_head", True),
        ("lm_head.proj", False),
        ("my_lm_head", False),
        ("", False),
        (None, False),  # no scope known: module rules never match
    ],
)
def test_module_glob_suffix(path: str | None, matches: bool) -> None:
    p = Policy(min_bytes=0, rules=(Rule("keep", module="*.lm_head"),))
    assert (p.decide(_t(64), path).label != "default") is matches


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("blocks.*", "blocks.0", True),
        ("blocks.*", "blocks.11.attn.proj", True),  # "*" crosses dots (fnmatch)
        ("blocks.*", "blocks", False),
        ("blocks.[0-3].*", "blocks.2.mlp", True),
        ("blocks.[0-3].*", "blocks.7.mlp", False),
        ("blocks.?.attn", "blocks.3.attn", True),
        ("Blocks.*", "blocks.0", False),  # case-sensitive, like module names
        ("*", "", True),  # the root module
        ("encoder", "encoder", True),
    ],
)
def test_module_glob_patterns(pattern: str, path: str, matches: bool) -> None:
    p = Policy(min_bytes=0, rules=(Rule("host", module=pattern),))
    assert (p.decide(_t(64), path).action == "host") is matches


def test_size_bounds_are_inclusive_and_combine_with_and() -> None:
    rule = Rule("host", min_bytes=1024, max_bytes=4096, dtype="float32", ndim=[2, 3])
    p = Policy(min_bytes=0, rules=(rule,), default="keep")
    assert p.decide(_t(1024, ndim=2), None).action == "host"
    assert p.decide(_t(4096, ndim=3), None).action == "host"
    assert p.decide(_t(1020, ndim=2), None).action == "keep"
    assert p.decide(_t(4100, ndim=2), None).action == "keep"
    assert p.decide(_t(2048, ndim=1), None).action == "keep"
    assert p.decide(_t(2048, torch.float16, ndim=2), None).action == "keep"


def test_nbytes_counts_elements_not_storage() -> None:
    # An expanded (stride-0) view of 4 bytes of storage still counts numel * itemsize.
    t = torch.zeros(1).expand(100_000)
    assert Policy().decide(t, None).action == "store"


def test_dtype_spellings() -> None:
    for spelling in ("bfloat16", "torch.bfloat16", torch.bfloat16, ["bfloat16"]):
        rule = Rule("host", dtype=spelling)
        assert rule.dtype == (torch.bfloat16,)
    assert Rule("host", dtype="half").dtype == (torch.float16,)


def test_decisions_are_preallocated() -> None:
    # decide() runs for every saved tensor: it returns shared objects, never new ones.
    p = Policy(rules=(Rule("host", dtype="bool"),))
    a, b = torch.zeros(10, dtype=torch.bool), torch.ones(20, dtype=torch.bool)
    assert p.decide(a, None) is p.decide(b, "x")
    assert p.decide(_t(1 << 20), None) is p.decide(_t(2 << 20), None)


def test_labels_and_rule_names() -> None:
    p = Policy(rules=(Rule("keep", module="*.lm_head", name="head"), Rule("host", ndim=0)))
    assert p.labels == ("parameter", "rules[0] head", "rules[1] ndim=0", "min_bytes", "default")
    assert p.decide(torch.tensor(1.0), None).label == "rules[1] ndim=0"


def test_policy_is_frozen_and_comparable() -> None:
    p = Policy(min_bytes=10, rules=(Rule("keep", ndim=1),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.min_bytes = 5  # type: ignore[misc]
    assert p == Policy(min_bytes=10, rules=(Rule("keep", ndim=1),))
    q = dataclasses.replace(p, default="host")
    assert q.decide(_t(1 << 20, ndim=2), None) == Decision("host", "default")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"action": "stash", "ndim": 1}, "action: expected one of 'keep', 'host' or 'store'"),
        ({"action": "keep"}, "at least one condition"),
        ({"action": "keep", "module": "blocks.[0"}, "unclosed '['"),
        ({"action": "keep", "module": ""}, "empty module pattern"),
        ({"action": "keep", "module": "blocks. 0"}, "whitespace"),
        ({"action": "keep", "dtype": "float33"}, "unknown dtype 'float33'"),
        ({"action": "keep", "dtype": "Tensor"}, "unknown dtype 'Tensor'"),
        ({"action": "keep", "ndim": "two"}, "ndim: expected a non-negative int"),
        ({"action": "keep", "ndim": []}, "ndim: expected a non-negative int"),
        ({"action": "keep", "min_bytes": 2, "max_bytes": 1}, "never match"),
    ],
)
def test_bad_rules_raise_config_error(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match="Rule") as info:
        Rule(**kwargs)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_bad_policy_values() -> None:
    with pytest.raises(ConfigError, match="default 'offload'"):
        Policy(default="offload")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="min_bytes"):
        Policy(min_bytes=-1)
    with pytest.raises(ConfigError, match=r"rules\[0\] is a dict"):
        Policy(rules=({"action": "keep"},))  # type: ignore[arg-type]


def test_rule_accepts_size_strings_and_replace() -> None:
    rule = Rule("host", min_bytes="1KiB", max_bytes="1MiB")
    assert (rule.min_bytes, rule.max_bytes) == (1024, 1 << 20)
    other = dataclasses.replace(rule, action="keep")
    assert other.action == "keep" and other.min_bytes == 1024
    with pytest.raises(ConfigError, match="Rule: min_bytes"):
        Rule("host", min_bytes="lots")


def test_module_match_is_remembered_per_path() -> None:
    p = Policy(min_bytes=0, rules=(Rule("keep", module="*.lm_head"),))
    for _ in range(3):
        assert p.decide(_t(64), "lm_head").action == "keep"
        assert p.decide(_t(64), "blocks.0").action == "store"
    assert p.rules[0]._seen == {"lm_head": True, "blocks.0": False}
