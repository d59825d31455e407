"""YAML configs: schema, error messages, precedence, examples, and ``check-config``."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import tensorstore_hooks as tsh
from tensorstore_hooks import ConfigError, EffectiveConfig, Policy, Rule
from tensorstore_hooks.cli import check_config
from tensorstore_hooks.config._settings import (
    OVERRIDE_KEYS,
    PipelineSettings,
    StoreSettings,
    config_from_dict,
    dump_config,
    load_config,
    resolve_config,
)

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
EXAMPLES = [
    "local-disk.yaml",
    "memory.yaml",
    "s3.yaml",
    "daemon-client.yaml",
    "transformer.yaml",
    "auto-budgets.yaml",
]


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- examples


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_configs_load(name: str) -> None:
    cfg = tsh.load_config(CONFIGS / name)
    assert isinstance(cfg, EffectiveConfig)
    assert cfg.source == str(CONFIGS / name)
    # What check-config prints is itself a valid config, equal to the original.
    again = config_from_dict(yaml.safe_load(dump_config(cfg, redact=False)))
    assert again.to_dict() == cfg.to_dict()
    assert again.policy == cfg.policy


def test_example_values() -> None:
    s3 = load_config(CONFIGS / "s3.yaml")
    assert s3.store.url == "s3://my-training-bucket/activations"
    assert s3.store.chunk_bytes == 32 << 20
    assert s3.pipeline.read_deadline_s == 120.0
    assert s3.policy.min_bytes == 1 << 20
    daemon = load_config(CONFIGS / "daemon-client.yaml")
    assert daemon.store.url == "tsh://127.0.0.1:7077"
    tf = load_config(CONFIGS / "transformer.yaml")
    assert [r.action for r in tf.policy.rules] == ["keep", "host", "store"]
    assert tf.policy.rules[1].dtype == (torch.bool,)
    assert tf.policy.labels[1:4] == ("rules[0] last-layer", "rules[1] masks", "rules[2] layers")


def test_defaults_and_units(tmp_path: Path) -> None:
    cfg = load_config(
        _write(
            tmp_path,
            """
store:
  chunk_bytes: 1048576
pipeline:
  max_inflight: 1GiB
  prefetch: 500KB
  read_deadline_s: 500ms
policy:
  min_bytes: 512KiB
  rules:
    - {dtype: [bool, uint8], ndim: [2, 3], max_bytes: 1MiB, action: host}
""",
        )
    )
    assert cfg.store == StoreSettings(chunk_bytes=1 << 20)
    assert cfg.pipeline == PipelineSettings(
        max_inflight=1 << 30, prefetch=500_000, read_deadline_s=0.5
    )
    assert cfg.policy == Policy(
        min_bytes=512 << 10,
        rules=(Rule("host", dtype=(torch.bool, torch.uint8), ndim=(2, 3), max_bytes=1 << 20),),
    )


def test_empty_sections_are_defaults(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "store:\n# nothing yet\npolicy:\n"))
    assert cfg == EffectiveConfig(source=cfg.source)


# --------------------------------------------------------------------------- bad configs

BAD_CONFIGS = [
    # (id, yaml, field path in the message, what is allowed / why)
    ("wrong-type-int", "pipeline:\n  writer_threads: two\n", "pipeline.writer_threads", "integer"),
    ("bool-for-int", "pipeline:\n  writer_threads: true\n", "pipeline.writer_threads", "integer"),
    (
        "threads-zero",
        "pipeline:\n  writer_threads: 0\n",
        "pipeline.writer_threads",
        "greater than or equal to 1",
    ),
    ("unknown-section", "stor:\n  url: x\n", "stor", "store, pipeline, policy"),
    ("unknown-key", "store:\n  uri: /tmp/x\n", "store.uri", "url, storage_options, codec"),
    (
        "unknown-rule-key",
        "policy:\n  rules:\n    - {module: a, acton: keep, action: keep}\n",
        "policy.rules[0].acton",
        "module, dtype, min_bytes, max_bytes, ndim, action",
    ),
    ("bad-size", "policy:\n  min_bytes: 12 parsecs\n", "policy.min_bytes", '"512KiB", "8MiB"'),
    ("negative-size", "pipeline:\n  prefetch: -1\n", "pipeline.prefetch", "non-negative"),
    ("float-size", "pipeline:\n  max_inflight: 1.5\n", "pipeline.max_inflight", '"8MiB"'),
    (
        "bad-action",
        "policy:\n  rules:\n    - {ndim: 1, action: keep}\n    - {ndim: 2, action: host}\n"
        "    - {ndim: 3, action: stash}\n",
        "policy.rules[2].action",
        "'keep', 'host' or 'store'",
    ),
    ("bad-default", "policy:\n  default: offload\n", "policy.default", "'keep', 'host' or 'store'"),
    (
        "bad-glob",
        "policy:\n  rules:\n    - {module: 'blocks.[0-', action: keep}\n",
        "policy.rules[0].module",
        "unclosed '['",
    ),
    (
        "glob-whitespace",
        "policy:\n  rules:\n    - {module: 'blocks 0', action: keep}\n",
        "policy.rules[0].module",
        "whitespace",
    ),
    (
        "bad-dtype",
        "policy:\n  rules:\n    - {dtype: [bool, float33], action: host}\n",
        "policy.rules[0].dtype",
        "unknown dtype 'float33'",
    ),
    (
        "rule-without-condition",
        "policy:\n  rules:\n    - {action: keep}\n",
        "policy.rules[0]",
        "at least one condition",
    ),
    (
        "rule-min-above-max",
        "policy:\n  rules:\n    - {min_bytes: 2MiB, max_bytes: 1MiB, action: keep}\n",
        "policy.rules[0]",
        "never match",
    ),
    (
        "rule-missing-action",
        "policy:\n  rules:\n    - {module: '*.lm_head'}\n",
        "policy.rules[0].action",
        "required",
    ),
    (
        "bad-ndim",
        "policy:\n  rules:\n    - {ndim: two, action: keep}\n",
        "policy.rules[0].ndim",
        "int",
    ),
    ("rules-not-list", "policy:\n  rules: {action: keep}\n", "policy.rules", "list"),
    ("section-not-mapping", "policy: [1, 2]\n", "policy", "mapping"),
    ("bad-bool", "policy:\n  skip_parameters: maybe\n", "policy.skip_parameters", "boolean"),
    ("bad-url-scheme", "store:\n  url: foo://bucket/x\n", "store.url", "unknown URL scheme 'foo'"),
    (
        "bad-chained-scheme",
        "store:\n  url: nocache::s3://bucket/x\n",
        "store.url",
        "unknown URL scheme 'nocache'",
    ),
    ("daemon-url-no-port", "store:\n  url: tsh://localhost\n", "store.url", "tsh://HOST:PORT"),
    ("empty-url", "store:\n  url: ''\n", "store.url", "temporary directory"),
    ("bad-codec", "store:\n  codec: gzip\n", "store.codec", "'zstd:LEVEL'"),
    ("bad-zstd-level", "store:\n  codec: zstd:99\n", "store.codec", "1..22 (higher"),
    ("chunk-not-pow2", "store:\n  chunk_bytes: 3MiB\n", "store.chunk_bytes", "power of two"),
    (
        "options-not-mapping",
        "store:\n  storage_options: anon\n",
        "store.storage_options",
        "mapping",
    ),
    ("bad-duration", "pipeline:\n  read_deadline_s: soon\n", "pipeline.read_deadline_s", '"30s"'),
]


@pytest.mark.parametrize(
    ("text", "path", "allowed"),
    [case[1:] for case in BAD_CONFIGS],
    ids=[case[0] for case in BAD_CONFIGS],
)
def test_bad_configs(tmp_path: Path, text: str, path: str, allowed: str) -> None:
    file = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(file)
    message = str(info.value)
    assert str(file) in message
    assert f": {path}: " in message
    assert allowed in message
    assert isinstance(info.value, ValueError)  # ConfigError is also a ValueError


def test_error_names_line_and_value(tmp_path: Path) -> None:
    file = _write(
        tmp_path,
        """\
policy:
  min_bytes: 1MiB
  rules:
    - {module: "*.lm_head", action: keep}
    - dtype: bool
      action: stash
""",
    )
    with pytest.raises(ConfigError) as info:
        load_config(file)
    assert str(info.value) == (
        f"{file}:6: policy.rules[1].action: expected one of 'keep', 'host' or 'store'; got 'stash'"
    )


def test_every_problem_is_reported(tmp_path: Path) -> None:
    file = _write(tmp_path, "store:\n  codec: gzip\npolicy:\n  default: x\n  min_bytes: lots\n")
    with pytest.raises(ConfigError) as info:
        load_config(file)
    message = str(info.value)
    assert message.startswith(f"3 problems in {file}:")
    for fragment in (":2: store.codec", ":4: policy.default", ":5: policy.min_bytes"):
        assert fragment in message


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("policy:\n  min_bytes: [1MiB\n", ["YAML syntax error", ":3:"]),
        ("policy:\n\tmin_bytes: 1\n", ["YAML syntax error", ":2:"]),
        ("store: {url: x\n", ["YAML syntax error", ":2:"]),
        ("policy:\n  min_bytes: 1\n  min_bytes: 2\n", ["duplicate key 'min_bytes'", ":3:"]),
        ("store: !!python/object:os.system {}\n", ["YAML syntax error", ":1:"]),
        ("", ["config file is empty", "store, pipeline, policy"]),
        ("# only a comment\n", ["config file is empty"]),
        ("- store\n- policy\n", ["top level must be a mapping", "got a list"]),
        ("just a string\n", ["top level must be a mapping", "got a str"]),
    ],
    ids=[
        "unclosed-bracket",
        "tab-indent",
        "unclosed-brace",
        "duplicate-key",
        "python-tag",
        "empty-file",
        "only-comments",
        "top-level-list",
        "top-level-scalar",
    ],
)
def test_unparsable_files(tmp_path: Path, text: str, fragments: list[str]) -> None:
    file = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(file)
    assert str(file) in str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_missing_file_directory_and_binary(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found") as info:
        load_config(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(info.value)
    assert isinstance(info.value.__cause__, FileNotFoundError)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(binary)
    with pytest.raises(ConfigError, match="expected a file path"):
        load_config(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "url",
    [
        "/var/tmp/acts",
        "relative/dir",
        "file:///var/tmp/acts",
        "memory://",
        "tsh://127.0.0.1:7077",
        "tsh://[::1]:7077",
        "tsh+unix:///run/tsh.sock",
        "s3://bucket/prefix",
        "gs://bucket/prefix",
        "simplecache::s3://bucket/prefix",
        "S3://bucket/upper-case-scheme",
    ],
)
def test_good_urls(url: str) -> None:
    assert config_from_dict({"store": {"url": url}}).store.url == url


@pytest.mark.parametrize(
    "url", ["nosuch://x", "tsh://host", "tsh://host:99999", "tsh+unix://", "simplecache::tsh://h:1"]
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(ConfigError, match=r"store\.url"):
        config_from_dict({"store": {"url": url}})


def test_secrets_are_masked_when_printed() -> None:
    cfg = config_from_dict(
        {"store": {"url": "s3://b/p", "storage_options": {"key": "AKIA", "secret": "s", "anon": 0}}}
    )
    shown = yaml.safe_load(dump_config(cfg))["store"]["storage_options"]
    assert shown == {"key": "***", "secret": "***", "anon": 0}
    assert cfg.store.storage_options["secret"] == "s"  # only the printout is masked


# --------------------------------------------------------------------------- precedence


def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    file = _write(
        tmp_path, "policy:\n  min_bytes: 1MiB\n  default: host\npipeline:\n  prefetch: 1\n"
    )
    cfg = resolve_config(
        file,
        {
            "min_bytes": "4MiB",
            "prefetch": 2048,
            "codec": "lz4",
            "rules": [{"module": "*.lm_head", "action": "keep"}],
        },
    )
    assert cfg.policy.min_bytes == 4 << 20
    assert cfg.policy.default == "host"  # not overridden: still the file's
    assert cfg.policy.rules == (Rule("keep", module="*.lm_head"),)
    assert cfg.pipeline.prefetch == 2048
    assert cfg.store.codec == "lz4"
    assert cfg.source == str(file)


def test_rules_override_accepts_rule_objects_and_tuples() -> None:
    rules = (Rule("host", dtype=torch.bool), {"ndim": (3, 4), "action": "store"})
    cfg = resolve_config(None, {"rules": rules})
    assert cfg.policy.rules == (Rule("host", dtype="bool"), Rule("store", ndim=(3, 4)))


def test_env_var_names_the_default_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_file = _write(tmp_path, "policy:\n  min_bytes: 3KiB\n", "env.yaml")
    monkeypatch.setenv("TSH_CONFIG", str(env_file))
    assert resolve_config(None, {}).policy.min_bytes == 3 << 10
    assert resolve_config(None, {"min_bytes": 5}).policy.min_bytes == 5
    # An explicit config= wins over the environment.
    other = _write(tmp_path, "policy:\n  min_bytes: 7\n", "other.yaml")
    assert resolve_config(other, {}).policy.min_bytes == 7
    monkeypatch.setenv("TSH_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="TSH_CONFIG"):
        resolve_config(None, {})
    monkeypatch.setenv("TSH_CONFIG", "")
    assert resolve_config(None, {}) == EffectiveConfig()


def test_no_config_no_env_gives_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TSH_CONFIG", raising=False)
    assert resolve_config(None, {}) == EffectiveConfig()


def test_effective_config_and_dict_inputs() -> None:
    base = config_from_dict({"policy": {"min_bytes": "2KiB"}})
    assert resolve_config(base, {}) is base
    assert resolve_config({"policy": {"min_bytes": "2KiB"}}, {}) == base
    with pytest.raises(ConfigError, match=r"offload\(config=\{\.\.\.\}\): policy\.min_bytes"):
        resolve_config({"policy": {"min_bytes": "lots"}}, {})
    with pytest.raises(ConfigError, match="expected a YAML file path"):
        resolve_config(3.5, {})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"min_bytes": "1 MiBs"}, "offload(min_bytes=...): min_bytes: expected"),
        ({"prefetch": -5}, "offload(prefetch=...): prefetch:"),
        ({"max_inflight": "lots"}, "offload(max_inflight=...): max_inflight:"),
        ({"writer_threads": 2.0}, "offload(writer_threads=...): writer_threads:"),
        ({"skip_parameters": "no"}, "offload(skip_parameters=...): skip_parameters:"),
        ({"default": "drop"}, "offload(default=...): default: expected one of"),
        ({"codec": "brotli"}, "offload(codec=...): codec:"),
        ({"chunk_bytes": 1000}, "offload(chunk_bytes=...): chunk_bytes: expected a power of two"),
        ({"storage_options": ["anon"]}, "offload(storage_options=...): storage_options:"),
        ({"rules": [{"module": "a", "action": "nah"}]}, "offload(rules=...): rules[0].action:"),
        ({"rules": {"action": "keep"}}, "offload(rules=...): rules:"),
        ({"read_deadline_s": "forever"}, "offload(read_deadline_s=...): read_deadline_s:"),
    ],
)
def test_bad_overrides_name_the_keyword(overrides: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config(None, overrides)
    assert fragment in str(info.value)


def test_unknown_keyword_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config(None, {"min_byte": 1, "prefetch": 1})
    message = str(info.value)
    assert "min_byte" in message
    for key in OVERRIDE_KEYS:
        assert key in message


def test_nothing_half_applies(tmp_path: Path) -> None:
    base = load_config(_write(tmp_path, "policy:\n  min_bytes: 1KiB\n"))
    snapshot = base.to_dict()
    with pytest.raises(ConfigError) as info:
        resolve_config(base, {"min_bytes": 5, "prefetch": "bad", "default": "worse"})
    assert "prefetch" in str(info.value) and "default" in str(info.value)  # all reported
    assert base.to_dict() == snapshot


# --------------------------------------------------------------------------- check-config


def _run_check_config(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="tensorstore-hooks")
    check_config.register(parser.add_subparsers())
    args = parser.parse_args(["check-config", str(path)])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_check_config_prints_effective_config(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run_check_config(CONFIGS / "transformer.yaml", capsys)
    assert (code, err) == (0, "")
    printed = yaml.safe_load(out)
    assert printed["policy"]["rules"][0] == {
        "name": "last-layer",
        "module": "layers.7*",
        "action": "keep",
    }
    assert printed["pipeline"]["prefetch"] is None  # default: derived (NOTE [ Windows ])
    assert printed["pipeline"]["host_budget"] == 0  # defaults filled in
    assert "rules[1] masks" in out  # the stats labels, as comments


def test_check_config_broken_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = _write(tmp_path, "policy:\n  rules:\n    - {module: x, action: stash}\n")
    code, out, err = _run_check_config(file, capsys)
    assert code == 1
    assert out == ""
    assert f"{file}:3: policy.rules[0].action" in err


def _console_script() -> list[str]:
    exe = shutil.which("tensorstore-hooks", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "tensorstore_hooks.cli"]


def test_console_script_check_config(tmp_path: Path) -> None:
    """The installed ``tensorstore-hooks check-config`` end to end (exit codes, streams)."""
    ok = subprocess.run(
        [*_console_script(), "check-config", str(CONFIGS / "transformer.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["policy"]["rules"][2]["module"] == "layers.*"
    bad = _write(tmp_path, "pipeline:\n  prefetch: 12 parsecs\n")
    broken = subprocess.run(
        [*_console_script(), "check-config", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert broken.returncode == 1
    assert "pipeline.prefetch" in broken.stderr and str(bad) in broken.stderr
    assert broken.stdout == ""
