"""The daemon's config file goes through the library's loader (``_yaml_config``): the
same refusals (duplicate keys, unknown keys, bad values) with the same messages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tensorstore_hooks.server import load_config as load_daemon_config

from tensorstore_hooks import ConfigError
from tensorstore_hooks import load_config as load_library_config

DAEMON = "daemon config "


def _daemon_error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_daemon_config(path)
    message = str(info.value)
    assert message.startswith(DAEMON), message
    return message.removeprefix(DAEMON)


def _library_error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_library_config(path)
    return str(info.value)


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ("memory_quota: 1GiB\nmemory_quota: 2GiB\n", ":2:1", "duplicate key 'memory_quota'"),
        ("limits:\n  put_buffer: 1MiB\n  read_timeout: 1s\n  read_timeout: 2s\n", ":4:3",
         "duplicate key 'read_timeout'"),
        ("listen: [1\n", ":2:1", "YAML syntax error"),
    ],
)  # fmt: skip
def test_duplicate_keys_and_yaml_errors_refused_like_the_library(
    tmp_path: Path, text: str, where: str, what: str
) -> None:
    path = tmp_path / "server.yaml"
    path.write_text(text)
    daemon = _daemon_error(path)
    assert daemon.startswith(f"{path}{where}: ") and what in daemon, daemon
    # The library's loader says exactly the same about the same YAML.
    assert _library_error(path) == daemon


def test_unknown_keys_and_bad_values_read_like_the_library(tmp_path: Path) -> None:
    daemon_file = tmp_path / "server.yaml"
    daemon_file.write_text("listen: 127.0.0.1:0\nlimits:\n  max_conections: 3\n")
    library_file = tmp_path / "client.yaml"
    library_file.write_text("pipeline:\n  prefetchh: 3\n")
    shape = re.compile(r"^(.+):(\d+): ([\w.]+): unknown key '(\w+)'; allowed keys here: (.+)$")
    d = shape.match(_daemon_error(daemon_file))
    lib = shape.match(_library_error(library_file))
    assert d is not None and lib is not None
    assert d.groups()[:4] == (str(daemon_file), "3", "limits.max_conections", "max_conections")
    assert lib.groups()[:4] == (str(library_file), "2", "pipeline.prefetchh", "prefetchh")
    # The allowed keys are the names a config file uses (aliases, not attribute names).
    allowed = d.group(5).split(", ")
    assert "read_timeout" in allowed and "read_timeout_s" not in allowed

    daemon_file.write_text("memory_quota: lots\n")
    library_file.write_text("policy:\n  min_bytes: lots\n")
    value = re.compile(r"^(.+):(\d+): ([\w.]+): expected a whole number of bytes: .*; got 'lots'$")
    d, lib = value.match(_daemon_error(daemon_file)), value.match(_library_error(library_file))
    assert d is not None and lib is not None
    assert d.groups() == (str(daemon_file), "1", "memory_quota")
    assert lib.groups() == (str(library_file), "2", "policy.min_bytes")


def test_command_line_values_are_named_as_such(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text("listen: 127.0.0.1:0\n")
    with pytest.raises(ConfigError) as info:
        load_daemon_config(path, memory_quota="lots")
    assert str(info.value).startswith("daemon config command line: memory_quota: expected")
