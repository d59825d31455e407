"""What a connection and its request handlers may use: the daemon's parts, passed down.

The :class:`~._app.Daemon` builds them and hands one :class:`Services` to every
connection; connections and handlers never see the daemon itself (so nothing below
``_app`` imports it), and each part keeps its own state.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass

from tensorstore_hooks.protocol import Msgpack

from ._config import LimitsConfig, ServerConfig
from ._conns import ConnRegistry
from ._payload import AnswerBudget, PayloadBudget
from ._sessions import SessionTable
from ._stats import DaemonStats
from ._tiers import Tiers

__all__ = ["Services"]


@dataclass(frozen=True, eq=False)
class Services:
    """The daemon's parts, as a connection sees them."""

    config: ServerConfig
    token: str | None
    """The secret HELLO must carry, or None."""
    tls: ssl.SSLContext | None
    stats: DaemonStats
    conns: ConnRegistry
    sessions: SessionTable
    tiers: Tiers
    puts: PayloadBudget
    """Disk-bound PUT payloads (NOTE [ Payload bytes as they arrive ])."""
    answers: AnswerBudget
    """GET answers read from disk (NOTE [ Answers read from disk ])."""
    snapshot: Callable[[], dict[str, Msgpack]]
    """The whole ``stats`` snapshot (the STATS request)."""

    @property
    def limits(self) -> LimitsConfig:
        return self.config.limits
