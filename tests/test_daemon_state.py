"""The daemon's storage side, hardened: finished sessions, file permissions, journal
damage at restart, quotas (zero-byte tensors, what the directory holds, a lower quota
at restart, per-session quotas).

Every daemon here is a real ``tensorstore-hooks serve`` process (``daemon_fixtures``).
"""

from __future__ import annotations

import subprocess
import sys
import time

from tensorstore_hooks._daemon_client import fetch_stats

from .daemon_fixtures import DaemonLauncher, daemons, wait_until

__all__ = ["daemons"]  # the fixture, re-exported for pytest

KiB = 1 << 10
MiB = 1 << 20


# ------------------------------------------------------------ finished sessions
_FORGETFUL_CLIENT = """
import sys, torch, tensorstore_hooks as tsh
store = tsh.open_store(sys.argv[1])
store.put(torch.ones(1000))
model = torch.nn.Linear(64, 64)
with tsh.offload(sys.argv[1], min_bytes=0):
    loss = model(torch.randn(8, 64)).sum()
loss.backward()
print("done", flush=True)
# exits without closing either store
"""


def test_finished_client_leaves_stats_at_once(daemons: DaemonLauncher) -> None:
    d = daemons.start("--memory-quota", "16MiB", "--lease", "120")
    out = subprocess.run(
        [sys.executable, "-c", _FORGETFUL_CLIENT, d.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    t0 = time.monotonic()
    wait_until(
        lambda: fetch_stats(d.url)["sessions_total"] == 0,
        5,
        "the finished client's sessions to leave stats (lease is 120 s)",
    )
    snap = fetch_stats(d.url)
    assert snap["tiers"]["ram"]["used"] == 0 and snap["tiers"]["ram"]["tensors"] == 0
    assert snap["counters"]["sessions_expired"] == 0
    assert time.monotonic() - t0 < 5
    assert d.log().count("closed by the client") == 2
