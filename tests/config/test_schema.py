"""Each setting is declared once (NOTE [ One declaration per setting ]): the YAML loader,
the ``offload()`` keywords, ``dump_config`` and the settings objects all follow from the
fields of the settings classes, section by section."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import pytest
import yaml

from tensorstore_hooks import ConfigError, EffectiveConfig, Policy, Rule
from tensorstore_hooks.config._schema import SETTING
from tensorstore_hooks.config._settings import (
    OVERRIDE_KEYS,
    PipelineSettings,
    StoreSettings,
    TierSettings,
    config_from_dict,
    dump_config,
    resolve_config,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

RULE: dict[str, object] = {
    "name": "masks",
    "module": "blocks.*",
    "dtype": "bool",
    "min_bytes": "1KiB",
    "max_bytes": "1MiB",
    "ndim": 2,
    "action": "host",
}
TIER: dict[str, object] = {"url": "memory://", "budget": "64MiB", "storage_options": {"anon": True}}
# Every setting with a value other than its default (a chain's store is below).
FULL: dict[str, object] = {
    "store": {
        "url": "memory://",
        "storage_options": {"anon": True},
        "codec": "lz4",
        "chunk_bytes": "16MiB",
        "direct_io": "off",
    },
    "pipeline": {
        "max_inflight": "1MiB",
        "prefetch": "2MiB",
        "writer_threads": 3,
        "read_deadline_s": "5s",
        "release_heap_every": "64MiB",
        "mmap_threshold": "2MiB",
        "host_budget": "60%",
        "memory_headroom": "1GiB",
    },
    "policy": {
        "min_bytes": "1KiB",
        "skip_parameters": False,
        "recompute_casts": False,
        "rules": [RULE],
        "default": "host",
        "device_budget": "auto",
    },
}
CHAIN: dict[str, object] = {"store": {"tiers": [TIER, {"url": "memory://"}]}}

# (where in the YAML, its settings class, configs that write every key there between them)
SECTIONS: list[tuple[tuple[str | int, ...], type[DataclassInstance], list[dict[str, object]]]] = [
    ((), EffectiveConfig, [FULL]),
    (("store",), StoreSettings, [FULL, CHAIN]),
    (("store", "tiers", 0), TierSettings, [CHAIN]),
    (("pipeline",), PipelineSettings, [FULL]),
    (("policy",), Policy, [FULL]),
    (("policy", "rules", 0), Rule, [FULL]),
]
NOT_YAML: dict[type, set[str]] = {EffectiveConfig: {"source"}}  # attributes that are not YAML keys


def _declared(cls: type[DataclassInstance]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if SETTING in f.metadata]


def _at(data: object, where: tuple[str | int, ...]) -> dict[str, object]:
    for part in where:
        if isinstance(part, int):
            assert isinstance(data, list)
            data = data[part]
        else:
            assert isinstance(data, dict)
            data = data[part]
    assert isinstance(data, dict)
    return data


def _allowed_by_loader(where: tuple[str | int, ...]) -> list[str]:
    """The keys the YAML loader allows at ``where``, from its unknown-key error."""
    data = yaml.safe_load(yaml.safe_dump(CHAIN if "tiers" in where else FULL))
    _at(data, where)["no_such_key"] = 1
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    allowed = str(info.value).split("allowed keys here: ")[1]
    return allowed.split(", ")


@pytest.mark.parametrize(
    ("where", "cls", "configs"), SECTIONS, ids=[c.__name__ for _, c, _ in SECTIONS]
)
def test_declared_settings_are_what_every_side_uses(
    where: tuple[str | int, ...], cls: type[DataclassInstance], configs: list[dict[str, object]]
) -> None:
    declared = _declared(cls)
    assert declared, cls
    # The YAML loader accepts exactly these keys, in this order (its errors list them).
    assert _allowed_by_loader(where) == declared
    # dump_config writes every one of them, and nothing else.
    written: set[str] = set()
    for data in configs:
        assert set(_at(data, where)) <= set(declared)  # the fixtures use real keys only
        cfg = config_from_dict(data)
        written |= set(_at(yaml.safe_load(dump_config(cfg, redact=False)), where))
    assert written == set(declared)
    # The settings objects hold them (and, apart from a config's source, nothing else).
    public = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    assert public == set(declared) | NOT_YAML.get(cls, set())


def test_keywords_are_the_declared_settings_of_the_sections() -> None:
    sections = {"store": StoreSettings, "pipeline": PipelineSettings, "policy": Policy}
    declared = [name for cls in sections.values() for name in _declared(cls)]
    # store.url and store.tiers are offload()'s store argument, not keywords.
    assert list(OVERRIDE_KEYS) == [k for k in declared if k not in ("url", "tiers")]
    full = config_from_dict(FULL)
    for section, cls in sections.items():
        for key in set(_declared(cls)) & set(OVERRIDE_KEYS):
            value = _at(FULL, (section,))[key]
            got = resolve_config(None, {key: value})
            # The keyword sets its field, validated like the YAML, and nothing else.
            expected_section = dataclasses.replace(
                getattr(EffectiveConfig(), section), **{key: getattr(getattr(full, section), key)}
            )
            assert got == dataclasses.replace(EffectiveConfig(), **{section: expected_section})


@pytest.mark.parametrize("data", [FULL, CHAIN], ids=["full", "chain"])
def test_what_is_written_loads_back_equal(data: dict[str, object]) -> None:
    cfg = config_from_dict(data)
    assert cfg != EffectiveConfig()
    assert config_from_dict(yaml.safe_load(dump_config(cfg, redact=False))) == cfg
    assert config_from_dict(cfg.to_dict()) == cfg
