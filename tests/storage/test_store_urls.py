"""Store URLs and store kinds: one rule set, so the config, ``open_store`` and
``offload`` accept and refuse the same URLs (NOTE [ Store URL rules ] in ``_urls``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import ConfigError, TensorStore
from tensorstore_hooks.config._settings import config_from_dict
from tensorstore_hooks.storage._registry import store_kinds

# ------------------------------------------------------------- the three entry points


def _via_config(url: object) -> None:
    config_from_dict({"store": {"url": url}})


def _via_open_store(url: object) -> None:
    tsh.open_store(url).close()  # type: ignore[arg-type]


def _via_offload(url: object) -> None:
    tsh.offload(url).close()  # type: ignore[arg-type]


ENTRY_POINTS: list[Callable[[object], None]] = [_via_config, _via_open_store, _via_offload]
ENTRY_IDS = ["config", "open_store", "offload"]


@pytest.fixture
def in_empty_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current directory is an empty one, so a URL taken as a local path shows."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


# (url, fragment of the fix the message must show)
REFUSED = [
    ("tsh://127.0.0.1", "tsh://127.0.0.1:7077"),
    ("tsh://localhost", "tsh://HOST:PORT"),
    ("tsh://[::1]", "tsh://[::1]:7077"),
    ("tsh://127.0.0.1:0", "1..65535"),
    ("tsh://127.0.0.1:99999", "1..65535"),
    ("tsh://127.0.0.1:7077/path", "no path"),
    ("tsh+unix://relative.sock", "tsh+unix:///absolute/path"),
    ("simplecache::tsh://127.0.0.1:7077", "cannot be chained"),
    ("tsh:/127.0.0.1:7077", "'tsh://127.0.0.1:7077'"),
    ("tsh:127.0.0.1:7077", "'tsh://127.0.0.1:7077'"),
    ("tsh:/[::1]:7077", "'tsh://[::1]:7077'"),
    ("file:/scratch/acts", "'file:///scratch/acts'"),
    ("memory:/", "'memory://'"),
    ("s3:/bucket/prefix", "'s3://bucket/prefix'"),
    ("", "temporary directory"),
    ("   ", "temporary directory"),
    ("file://", "file:///scratch/acts"),
    ("nosuchscheme://x", "unknown URL scheme 'nosuchscheme'"),
]


@pytest.mark.parametrize("enter", ENTRY_POINTS, ids=ENTRY_IDS)
@pytest.mark.parametrize(("url", "fix"), REFUSED, ids=[u or "empty" for u, _ in REFUSED])
def test_every_entry_point_refuses_the_same_urls(
    in_empty_dir: Path, enter: Callable[[object], None], url: str, fix: str
) -> None:
    with pytest.raises(ConfigError) as info:
        enter(url)
    assert fix in str(info.value)
    if enter is _via_config:
        assert "store.url" in str(info.value)
    assert list(in_empty_dir.iterdir()) == []  # never silently a local directory


ACCEPTED = [
    "tsh://127.0.0.1:7077",
    "tsh://[::1]:7077",
    "tsh+tls://daemon.example:7443",
    "tsh+unix:///run/tsh.sock",
    "memory://",
    "file:///var/tmp/acts",
    "relative/dir",
    "./name:with-colon",
    "run:3",  # not a known scheme and no slash: a directory name
    "simplecache::s3://bucket/prefix",
]


@pytest.mark.parametrize("url", ACCEPTED)
def test_config_accepts_what_the_registry_opens(url: str) -> None:
    assert config_from_dict({"store": {"url": url}}).store.url == url


def test_daemon_url_needs_its_port_everywhere() -> None:
    """``open_store('tsh://127.0.0.1')`` fills in no port: a daemon URL names its own."""
    with pytest.raises(ConfigError, match="port is missing") as info:
        tsh.open_store("tsh://127.0.0.1")
    assert "tsh://127.0.0.1:7077" in str(info.value)
    with pytest.raises(ConfigError, match="port is missing"):
        config_from_dict({"store": {"url": "tsh://127.0.0.1"}})


def test_one_slash_never_makes_a_local_directory(in_empty_dir: Path) -> None:
    with pytest.raises(ConfigError) as info, tsh.offload("tsh:/127.0.0.1:7077", min_bytes=0):
        torch.ones(4, requires_grad=True).exp().sum().backward()
    assert "did you mean 'tsh://127.0.0.1:7077'" in str(info.value)
    assert not (in_empty_dir / "tsh:").exists()


@pytest.mark.parametrize("url", ["", "file://"])
def test_offload_never_uses_the_current_directory(in_empty_dir: Path, url: str) -> None:
    with pytest.raises(ConfigError, match="store URL"):
        tsh.offload(url)
    assert list(in_empty_dir.iterdir()) == []


@pytest.mark.parametrize("bad", [42, 1.5, b"/tmp/x", ["memory://"]])
@pytest.mark.parametrize("enter", [tsh.open_store, tsh.offload], ids=["open_store", "offload"])
def test_non_url_store_argument_is_a_config_error(enter: Callable[..., Any], bad: object) -> None:
    with pytest.raises(ConfigError, match=type(bad).__name__):
        enter(bad)


# ------------------------------------------------------------------------- registry


class _Recorder(TensorStore):
    """A factory that records what it was called with (and stores nothing)."""

    calls: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def __init__(self, url: str, **options: Any) -> None:
        _Recorder.calls.append((url, options))

    def put(self, tensor: torch.Tensor) -> str:
        raise NotImplementedError

    def get(self, key: str, *, device: Any = None) -> torch.Tensor:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def keys(self) -> Any:
        return iter(())

    def __contains__(self, key: object) -> bool:
        return False

    def __len__(self) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


def _other_factory(url: str, **options: Any) -> TensorStore:
    return _Recorder(url, **options)


def test_register_store_refuses_silent_overwrite() -> None:
    tsh.register_store("test-noclobber", _Recorder)
    tsh.register_store("test-noclobber", _Recorder)  # the same factory again: fine
    with pytest.raises(ConfigError, match="clobber=True"):
        tsh.register_store("test-noclobber", _other_factory)
    assert store_kinds()["test-noclobber"].factory is _Recorder
    with pytest.raises(ConfigError, match="already registered"):
        tsh.register_store("file", _Recorder)  # built-in kinds are protected too
    tsh.register_store("test-noclobber", _other_factory, clobber=True)
    assert store_kinds()["test-noclobber"].factory is _other_factory


def test_registry_view_is_read_only() -> None:
    kinds = store_kinds()
    assert {"file", "memory", "tsh", "tsh+tls", "tsh+unix"} <= set(kinds)
    with pytest.raises(TypeError):
        kinds["file"] = kinds["memory"]  # type: ignore[index]
    assert kinds["file"].scheme == "file"


def test_registered_kind_is_used_by_config_open_store_and_offload() -> None:
    def parse(url: str) -> None:
        if url.endswith("/bad"):
            raise ConfigError(f"{url}: the bucket must not be called 'bad'")

    tsh.register_store("test-kind", _Recorder, parse_url=parse, option_keys={"region"})
    # The config validator asks the kind's own URL parser (no store is opened).
    with pytest.raises(ConfigError, match=r"store\.url: .*must not be called 'bad'"):
        config_from_dict({"store": {"url": "test-kind://x/bad"}})
    with pytest.raises(ConfigError, match="must not be called 'bad'"):
        tsh.open_store("test-kind://x/bad")
    # Declared option keys: anything else is a ConfigError listing them.
    with pytest.raises(ConfigError, match="allowed: region"):
        tsh.open_store("test-kind://x/ok", colour="red")
    # offload() passes the kind's options from store.storage_options, not Zarr's codec.
    _Recorder.calls.clear()
    hooks = tsh.offload(
        "test-kind://x/ok", storage_options={"region": "eu"}, codec="lz4", chunk_bytes="1MiB"
    )
    hooks.close()
    assert _Recorder.calls == [("test-kind://x/ok", {"region": "eu"})]


def test_zarr_store_options_are_checked_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown option.*chunk_size.*allowed:.*chunk_bytes"):
        tsh.open_store(str(tmp_path / "x"), chunk_size="1MiB")
    assert not (tmp_path / "x").exists()
