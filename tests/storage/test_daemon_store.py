"""The store conformance suite on DaemonStore, against a real daemon process.

One daemon serves the whole module; each test gets a fresh DaemonStore, i.e. its own
session, so tests cannot see each other's keys (which is itself under test here).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import tensorstore_hooks as tsh
from tensorstore_hooks import TensorStore
from tensorstore_hooks.storage.daemon._client import DaemonStore
from tensorstore_hooks.testing import StoreConformance
from tests.daemon_fixtures import Daemon, shared_daemon

__all__ = ["shared_daemon"]  # the fixture, re-exported for pytest


class TestDaemonStore(StoreConformance):
    large_nbytes = 40 << 20  # several 16 MiB frames each way

    @pytest.fixture
    def store(self, shared_daemon: Daemon) -> Iterator[TensorStore]:
        s = tsh.open_store(shared_daemon.url)
        assert isinstance(s, DaemonStore)
        yield s
        s.close()
