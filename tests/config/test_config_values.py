"""Values checked once: sizes (whole bytes), the codec spec, and rules, whichever way
they come in (YAML, ``offload()`` keywords, ``open_store`` options, ``Rule(...)``,
the daemon's config)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import ConfigError, Rule
from tensorstore_hooks.config._settings import config_from_dict

# ---------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("value", "exact"),
    [("0.3KiB", "307.2"), ("1.5", "1.5"), ("0.1B", "0.1"), ("1.0000001KB", "1000.0001")],
)
def test_fractional_sizes_are_refused_naming_the_field(value: str, exact: str) -> None:
    """Sizes are exact: ``min_bytes='1.5'`` is not 1, nor ``'0.3KiB'`` 307."""
    with pytest.raises(ConfigError) as info:
        tsh.offload(min_bytes=value)
    message = str(info.value)
    assert "min_bytes" in message and repr(value) in message
    assert f"{exact} bytes, not a whole number" in message
    with pytest.raises(ConfigError, match=r"pipeline\.prefetch: .*not a whole number"):
        config_from_dict({"pipeline": {"prefetch": value}})
    with pytest.raises(ConfigError, match=r"Rule: min_bytes: .*not a whole number"):
        Rule("keep", min_bytes=value)


@pytest.mark.parametrize(
    ("value", "n"),
    [("1.5MiB", 1536 << 10), ("0.5KB", 500), ("2.25GiB", 9 << 28), ("1.0", 1), ("8 mib", 8 << 20)],
)
def test_fractions_that_make_whole_bytes_are_exact(value: str, n: int) -> None:
    cfg = config_from_dict({"policy": {"min_bytes": value}, "pipeline": {"prefetch": value}})
    assert cfg.policy.min_bytes == n and cfg.pipeline.prefetch == n


@pytest.mark.parametrize("value", [1.5, 1024.0, float("nan"), -1, True, "1e3", "5 parsecs"])
def test_non_sizes_are_refused(value: object) -> None:
    with pytest.raises(ConfigError, match=r"policy\.min_bytes: expected a whole number of bytes"):
        config_from_dict({"policy": {"min_bytes": value}})


def test_daemon_config_uses_the_same_sizes() -> None:
    from tensorstore_hooks.server import load_config

    assert load_config(memory_quota="1.5MiB").memory_quota_bytes == 1536 << 10
    with pytest.raises(ConfigError, match="memory_quota"):
        load_config(memory_quota="0.3KiB")


# ---------------------------------------------------------------------- codec

_ACCEPTED_LEVELS = ["zstd:1", "zstd:22", "zstd:-1", "zstd:-131072", "zstd"]
_REFUSED_CODECS: list[Any] = ["zstd:0", "zstd:23", "zstd:-131073", "zstd:", "zstd:+3", "ZSTD", None]


@pytest.mark.parametrize("codec", _REFUSED_CODECS)
def test_config_and_store_refuse_the_same_codecs(tmp_path: Path, codec: Any) -> None:
    with pytest.raises(ConfigError, match=r"store\.codec: expected 'none', 'lz4', 'zstd'"):
        config_from_dict({"store": {"codec": codec}})
    with pytest.raises(ConfigError, match="ZarrStore: codec: expected 'none'") as info:
        tsh.open_store(str(tmp_path / "s"), codec=codec)
    message = str(info.value)
    # The message states exactly the accepted range (and why 0 is refused).
    assert "1..22" in message and "-131072..-1" in message and "zstd:0 is refused" in message
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("codec", _ACCEPTED_LEVELS)
def test_every_level_the_message_promises_round_trips(tmp_path: Path, codec: str) -> None:
    assert config_from_dict({"store": {"codec": codec}}).store.codec == codec
    t = torch.arange(1 << 14, dtype=torch.float32).reshape(64, -1) % 7
    with tsh.open_store(str(tmp_path / "s"), codec=codec, chunk_bytes="16KiB") as store:
        assert torch.equal(store.get(store.put(t)), t)


def test_zstd_level_is_written_as_asked(tmp_path: Path) -> None:
    """``zstd:0`` was written as level 3; now a level is stored exactly as given."""
    import zarr

    root = tmp_path / "s"
    with tsh.open_store(str(root), codec="zstd:-5", chunk_bytes="16KiB", namespace="ns") as store:
        store.put(torch.zeros(4096))
        attrs = zarr.open_group(str(root / "ns"), mode="r").attrs["tensorstore_hooks"]
        assert attrs["codec"] == "zstd:-5"  # type: ignore[index,call-overload]
        segment = zarr.open_array(str(root / "ns" / "seg-16384"), mode="r")
        codecs = segment.metadata.to_dict()["codecs"]
        assert isinstance(codecs, list | tuple)
        assert {"name": "zstd", "configuration": {"level": -5, "checksum": False}} in codecs
        np.testing.assert_array_equal(segment[:16], np.zeros(16, np.uint8))


# ---------------------------------------------------------------------- rules

BAD_RULES: list[dict[str, Any]] = [
    {"action": "stash", "ndim": 1},
    {"action": "keep"},
    {"action": "keep", "dtype": []},
    {"action": "keep", "dtype": "float33"},
    {"action": "keep", "ndim": []},
    {"action": "keep", "ndim": [True]},
    {"action": "keep", "module": "blocks.[0"},
    {"action": "keep", "module": ""},
    {"action": "keep", "min_bytes": "0.3KiB"},
    {"action": "keep", "min_bytes": "2MiB", "max_bytes": "1MiB"},
]


def _reason(message: str) -> str:
    """What ``Rule`` says is wrong, without its ``Rule: FIELD:`` prefix and the value."""
    message = re.sub(r"^Rule: ((action|module|dtype|min_bytes|max_bytes|ndim): )?", "", message)
    return message.split("; got ")[0]


@pytest.mark.parametrize("rule", BAD_RULES, ids=[str(r) for r in BAD_RULES])
def test_rule_is_validated_by_one_validator(rule: dict[str, Any]) -> None:
    """``Rule(...)`` and the YAML schema give the same verdict and the same reason."""
    with pytest.raises(ConfigError) as direct:
        Rule(**rule)
    with pytest.raises(ConfigError) as from_yaml:
        config_from_dict({"policy": {"rules": [rule]}})
    yaml_message = str(from_yaml.value)
    assert "policy.rules[0]" in yaml_message
    assert _reason(str(direct.value)) in yaml_message
