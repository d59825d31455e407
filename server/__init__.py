"""The tensorstore-hooks storage daemon (installed as ``tensorstore_hooks.server``).

Run it with ``tensorstore-hooks serve`` (see ``docs/daemon.md``); embed it with::

    from tensorstore_hooks.server import load_config, serve
    serve(load_config("configs/server.yaml", listen="127.0.0.1:0"), on_ready=print)

The library never imports this package; it imports the library (codec, stores,
protocol). Modules: ``_config`` (settings), ``_wire`` (framed socket I/O), ``_model``
(session and tensor values), ``_tiers`` (RAM/disk placement and quotas; reports
spills by callback), ``_sessions`` (ownership, per-session accounting, leases; the
only journal writer, drives the tiers), ``_costs`` (what a tensor counts against a
quota), ``_journal`` (what survives a crash), ``_recovery`` (opening the disk tier,
replay and damage at restart), ``_root`` (the root's permissions), ``_app``
(lifecycle, leases), ``_listen`` (binding), ``_connection`` (handshake,
request loop), ``_handlers`` (the handler table), ``_stats`` (counters, snapshot),
``_metrics`` (Prometheus).
"""

from __future__ import annotations

from ._app import Daemon, serve
from ._checks import check_config
from ._config import LimitsConfig, ServerConfig, load_config

__all__ = ["Daemon", "LimitsConfig", "ServerConfig", "check_config", "load_config", "serve"]
