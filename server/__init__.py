"""The tensorstore-hooks storage daemon (installed as ``tensorstore_hooks.server``).

Run it with ``tensorstore-hooks serve`` (see ``docs/daemon.md``); embed it with::

    from tensorstore_hooks.server import load_config, serve
    serve(load_config("configs/server.yaml", listen="127.0.0.1:0"), on_ready=print)

The library never imports this package; it imports the library (codec, stores,
protocol). Modules, lowest first (an import never points up; ``tests/test_daemon_layout``
checks there is no cycle): ``_config`` (settings), ``_costs`` (what a tensor costs,
what the disk root holds), ``_payload`` (memory for payloads in flight), ``_wire``
(framed socket I/O), ``_model`` (session and tensor values), ``_tensor_rules`` (which
metadata is stored), ``_disk`` (the disk tier, its failures), ``_tiers`` (RAM/disk
placement, quotas, spills), ``_journal`` (what survives a crash), ``_sessions``
(ownership, per-session accounting, leases; the only journal writer), ``_root``
(the root's permissions), ``_recovery`` (opening the disk tier, replay at restart),
``_conns`` (the connection registry), ``_stats`` (counters, the snapshot),
``_services`` (the parts a connection uses), ``_answers`` (sending a tensor),
``_handlers`` (the handler table), ``_connection`` (handshake, request loop),
``_listen`` (binding), ``_checks`` (``--check``), ``_metrics`` (Prometheus),
``_app`` (lifecycle, housekeeping).
"""

from __future__ import annotations

from ._app import Daemon, serve
from ._checks import check_config
from ._config import LimitsConfig, ServerConfig, load_config

__all__ = ["Daemon", "LimitsConfig", "ServerConfig", "check_config", "load_config", "serve"]
