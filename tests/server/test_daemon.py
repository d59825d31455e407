"""The storage daemon end to end: training through it, sessions, security, CLI, limits.

Every daemon here is a real process started through ``tensorstore-hooks serve`` (see
``daemon_fixtures``); quota/spill behaviour is in ``test_daemon_quota.py``, crash and
restart in ``test_daemon_restart.py``, malformed input in ``test_daemon_fuzz.py``.
"""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from torch import nn

import tensorstore_hooks as tsh
from tensorstore_hooks import ConfigError, KeyNotFoundError, StoreUnavailableError
from tensorstore_hooks.protocol import message_head
from tensorstore_hooks.storage.daemon._client import DaemonStore, fetch_stats
from tests.daemon_fixtures import (
    CLI,
    Daemon,
    DaemonLauncher,
    daemons,
    free_port,
    raw_connect,
    raw_hello,
    recv_frame,
    shared_daemon,
    wait_until,
)

__all__ = ["daemons", "shared_daemon"]  # fixtures, re-exported for pytest

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


# --------------------------------------------------------------------- training
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 256), nn.Tanh()
        )
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h * h.sigmoid())


def _grads(model: nn.Module, x: torch.Tensor, url: str | None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if url is None:
        loss = model(x).logsumexp(-1).sum()
    else:
        with tsh.offload(url, min_bytes=0) as hooks:
            loss = model(x).logsumexp(-1).sum()
        assert hooks.stats.tensors_offloaded > 0
    loss.backward()
    if url is not None:
        assert hooks.stats.fallbacks == 0
        hooks.close()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_training_through_daemon_identical_grads(shared_daemon: Daemon) -> None:
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(32, 64)
    ref = _grads(model, x, None)
    got = _grads(model, x, shared_daemon.url)
    assert len(got) == len(ref) == len(list(model.parameters()))
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r)
    # The hooks closed their store: the session is gone from the daemon.
    snap = fetch_stats(shared_daemon.url)
    assert all(s["tensors"] == 0 for s in snap["sessions"])


# --------------------------------------------------------------------- sessions
def test_session_isolation(shared_daemon: Daemon) -> None:
    with DaemonStore(shared_daemon.url) as a, DaemonStore(shared_daemon.url) as b:
        t = torch.randn(100, 100)
        key = a.put(t)
        assert key in a and key not in b
        assert len(b) == 0 and list(b.keys()) == [] and b.nbytes == 0
        with pytest.raises(KeyNotFoundError):
            b.get(key)
        with pytest.raises(KeyNotFoundError):
            b.delete(key)
        b.delete_many([key])  # silently ignored: not b's key
        assert torch.equal(a.get(key), t)  # untouched by b
        assert a.session_id != b.session_id


def test_close_frees_the_session_at_once(shared_daemon: Daemon) -> None:
    store = DaemonStore(shared_daemon.url)
    for _ in range(4):
        store.put(torch.randn(256, 1024))
    sid = store.session_id
    assert sid is not None
    labels = {s["id"] for s in fetch_stats(shared_daemon.url)["sessions"]}
    assert sid[:8] in labels
    store.close()
    store.close()
    labels = {s["id"] for s in fetch_stats(shared_daemon.url)["sessions"]}
    assert sid[:8] not in labels
    with pytest.raises(StoreUnavailableError):
        store.put(torch.ones(1))


def test_threads_share_one_session(shared_daemon: Daemon) -> None:
    import threading

    with DaemonStore(shared_daemon.url, connections=3) as store:
        keys: list[str] = []
        lock = threading.Lock()

        def work(i: int) -> None:
            for j in range(10):
                k = store.put(torch.full((1000,), float(i * 100 + j)))
                with lock:
                    keys.append(k)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        assert len(store) == 60 == len(set(keys))
        mine = [s for s in fetch_stats(shared_daemon.url)["sessions"] if s["tensors"] == 60]
        assert len(mine) == 1 and mine[0]["connections"] <= 3


# ------------------------------------------------------------------------- CLI
def test_stats_cli(shared_daemon: Daemon, capsys: pytest.CaptureFixture[str]) -> None:
    from tensorstore_hooks.cli import main

    with DaemonStore(shared_daemon.url) as store:
        store.put(torch.randn(1024, 256))
        # The real console entry point once, in a process of its own ...
        out = subprocess.run(
            [*CLI, "stats", shared_daemon.url], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        text = out.stdout
        for needle in (
            "daemon tsh://127.0.0.1:", "tier", "ram", "disk", "quota", "spills",
            "requests/s", "put", "sessions (", "buffers      put 0 B of 256.00 MiB",
            "32.00 MiB per session",
        ):  # fmt: skip
            assert needle in text, text
        assert store.session_id is not None and store.session_id[:8] in text
        assert "1.00 MiB" in text  # the session's RAM bytes
        # ... and the same code in-process for the variants (importing torch is slow).
        assert main(["stats", "--json", shared_daemon.url]) == 0
        snap = json.loads(capsys.readouterr().out)
        assert snap["tiers"]["ram"]["quota"] == 256 << 20
        assert snap["counters"]["put"] >= 1
        assert snap["buffers"]["get"]["session_limit"] == 32 << 20
        assert snap["tiers"]["disk"]["writable"] is True
        assert "takes no writes" not in text
    assert main(["stats", f"tsh://127.0.0.1:{free_port()}"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_listening_line_is_the_only_stdout(daemons: DaemonLauncher) -> None:
    d = daemons.start()
    assert d.url.startswith("tsh://127.0.0.1:") and d.port > 0
    with DaemonStore(d.url) as store:
        store.put(torch.ones(3))
    assert d.terminate() == 0  # SIGTERM drains and exits 0
    assert d.stdout_rest() == b""
    assert "stopped" in d.log()


def test_sigterm_lets_the_request_in_flight_finish(daemons: DaemonLauncher) -> None:
    d = daemons.start("--memory-quota", "64MiB")
    n = 1 << 20
    meta = tsh.TensorMeta("uint8", (n,), (1,), 0, False, "cpu", False, n)
    payload = bytes(range(256)) * (n // 256)
    with raw_connect(d.url) as busy, raw_connect(d.url) as idle:
        raw_hello(busy)
        raw_hello(idle)
        busy.sendall(message_head({"op": "put", "id": 2, "meta": meta.to_dict(), "size": n}, n))
        busy.sendall(payload[:1000])
        time.sleep(0.3)  # the daemon is receiving this PUT now
        d.proc.send_signal(signal.SIGTERM)
        assert recv_frame(idle) is None  # idle connections are closed at once
        busy.sendall(payload[1000:])
        got = recv_frame(busy)
        assert got is not None and got[0]["ok"] is True and "key" in got[0]
        assert recv_frame(busy) is None  # then the busy one is closed too
    assert d.proc.wait(timeout=30) == 0


def test_unix_socket(daemons: DaemonLauncher, tmp_path: Path) -> None:
    path = tmp_path / "tsh.sock"
    d = daemons.start("--unix", str(path))
    assert d.url == f"tsh+unix://{path}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with tsh.open_store(d.url) as store:
        t = torch.randn(3, 4, 5)
        assert torch.equal(store.get(store.put(t)), t)
    # A second daemon on the same path refuses to steal the live socket.
    out = daemons.run("--unix", str(path))
    assert out.returncode == 1 and "another daemon is listening" in out.stderr
    assert d.terminate() == 0
    assert not path.exists()


# -------------------------------------------------------------------- security
def test_token_enforced(
    daemons: DaemonLauncher,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(0o600)
    d = daemons.start("--token-file", str(token_file))
    monkeypatch.delenv("TSH_TOKEN", raising=False)
    for token in (None, "wrong", "s3cret-token-but-longer"):
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="token") as info:
            DaemonStore(d.url, token=token)  # refused when opened, not at the first write
        assert d.url in str(info.value) and time.monotonic() - t0 < 5
    with DaemonStore(d.url, token="s3cret-token") as store:
        assert torch.equal(store.get(store.put(torch.ones(2))), torch.ones(2))
    monkeypatch.setenv("TSH_TOKEN", "s3cret-token")
    with tsh.open_store(d.url) as env_store:  # token from the environment
        env_store.put(torch.ones(2))
    with DaemonStore(d.url, token_file=token_file) as store:
        store.put(torch.ones(2))
    # A raw client that skips the token is refused and disconnected.
    with raw_connect(d.url) as sock:
        answer = raw_hello(sock, token=None)
        assert answer["code"] == "UNAUTHORIZED" and answer["fatal"] is True
        assert recv_frame(sock) is None
    monkeypatch.delenv("TSH_TOKEN")
    from tensorstore_hooks.cli import main

    assert main(["stats", d.url]) == 1
    assert "token" in capsys.readouterr().err
    assert main(["stats", "--token-file", str(token_file), d.url]) == 0
    assert "sessions (" in capsys.readouterr().out


def test_non_loopback_without_token_refused(daemons: DaemonLauncher) -> None:
    # Refused before binding anything: nothing listens on a public address here.
    out = daemons.run("--listen", "0.0.0.0:0")
    assert out.returncode == 2
    assert "non-loopback" in out.stderr and "--token-file" in out.stderr
    assert out.stdout == ""


# ---------------------------------------------------------------------- config
def test_shipped_server_config_works(daemons: DaemonLauncher, tmp_path: Path) -> None:
    from tensorstore_hooks.server import load_config

    cfg = load_config(CONFIGS / "server.yaml")
    assert cfg.listen == "127.0.0.1:7077" and cfg.memory_quota_bytes == 4 << 30
    assert cfg.limits.max_tensor_bytes == 4 << 30
    d = daemons.start(
        "--config",
        str(CONFIGS / "server.yaml"),
        "--listen",
        "127.0.0.1:0",
        "--root",
        str(tmp_path / "root"),
    )
    with DaemonStore(d.url) as store:
        store.put(torch.ones(8))
        assert store.stats()["tiers"]["disk"]["quota"] == 64 << 30


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("listen: 127.0.0.1:1\nbogus: 1\n", "bogus"),
        ("memory_quota: lots\n", "memory_quota"),
        ("limits:\n  idle_timeout: forever\n", "limits.idle_timeout"),
        ("limits:\n  max_connections: 0\n", "limits.max_connections"),
        ("listen: nohostport\n", "listen"),
        ("- a list\n", "mapping"),
    ],
)
def test_config_errors_name_file_and_field(tmp_path: Path, text: str, field: str) -> None:
    from tensorstore_hooks.server import load_config

    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and field in str(info.value)


def test_bad_config_file_cli_exit_code(daemons: DaemonLauncher, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("disk_quota: -5\n")
    out = daemons.run("--config", str(path))
    assert out.returncode == 2 and "disk_quota" in out.stderr and str(path) in out.stderr


# ---------------------------------------------------------------------- limits
def test_idle_connections_cost_nothing(daemons: DaemonLauncher, tmp_path: Path) -> None:
    cfg = tmp_path / "limits.yaml"
    cfg.write_text(
        "memory_quota: 256MiB\n"
        "limits:\n  max_connections: 64\n  handshake_timeout: 2s\n  read_timeout: 1s\n"
    )
    d = daemons.start("--config", str(cfg), "--listen", "127.0.0.1:0")
    silent = [raw_connect(d.url) for _ in range(50)]  # connect, never speak
    try:
        slow = raw_connect(d.url)
        head = message_head({"op": "hello", "id": 1, "version": 1}, 0)
        slow.sendall(head[:1])  # one byte, then nothing for a while
        x = torch.randn(2, 1024, 1024)  # 8 MiB
        t0 = time.monotonic()
        with DaemonStore(d.url) as store:
            for _ in range(5):
                assert torch.equal(store.get(store.put(x)), x)
        assert time.monotonic() - t0 < 10
        # The slow talker is cut off by the read timeout, the silent ones by the
        # handshake timeout; both see an error frame, then EOF.
        slow.settimeout(10)
        got = recv_frame(slow)
        assert got is not None and got[0]["ok"] is False and got[0]["fatal"] is True
        slow.close()
        for sock in silent:
            sock.settimeout(10)
            got = recv_frame(sock)
            assert got is not None and "timed out" in got[0]["message"]
        snap = fetch_stats(d.url)
        assert snap["connections"] <= 1
    finally:
        for sock in silent:
            sock.close()


def test_connection_cap(daemons: DaemonLauncher, tmp_path: Path) -> None:
    cfg = tmp_path / "cap.yaml"
    cfg.write_text("memory_quota: 16MiB\nlimits:\n  max_connections: 4\n  handshake_timeout: 30s\n")
    d = daemons.start("--config", str(cfg), "--listen", "127.0.0.1:0")
    socks = [raw_connect(d.url) for _ in range(4)]
    try:
        for sock in socks:  # authenticated connections count against the cap
            assert raw_hello(sock)["ok"] is True
        assert fetch_stats_or_none(d.url) is None
        with raw_connect(d.url) as extra:
            got = raw_hello(extra)
            assert got["code"] == "BUSY" and "connection cap" in got["message"]
        with pytest.raises(StoreUnavailableError, match="connection cap"):
            DaemonStore(d.url, reconnect_deadline_s=0.5)
    finally:
        for s in socks:
            s.close()
    with DaemonStore(d.url) as store:  # room again once they left
        wait_until(lambda: _put_ok(store), 10, "a free connection slot")


def fetch_stats_or_none(url: str) -> dict[str, object] | None:
    try:
        return fetch_stats(url, timeout_s=2)
    except StoreUnavailableError:
        return None


def _put_ok(store: DaemonStore) -> bool:
    try:
        store.put(torch.ones(1))
    except StoreUnavailableError:
        return False
    return True


def test_oversized_tensor_refused_up_front(daemons: DaemonLauncher, tmp_path: Path) -> None:
    cfg = tmp_path / "small.yaml"
    cfg.write_text("memory_quota: 64MiB\nlimits:\n  max_tensor: 1MiB\n")
    d = daemons.start("--config", str(cfg), "--listen", "127.0.0.1:0")
    with DaemonStore(d.url) as store:
        store.put(torch.ones(1000))
        with pytest.raises(tsh.QuotaExceededError, match="max_tensor"):
            store.put(torch.ones(1 << 20))  # 4 MiB
    # A raw client that lies about its size is disconnected before sending it.
    with raw_connect(d.url) as sock:
        raw_hello(sock)
        meta = tsh.TensorMeta("uint8", (8 << 20,), (1,), 0, False, "cpu", False, 8 << 20)
        sock.sendall(
            message_head({"op": "put", "id": 2, "meta": meta.to_dict(), "size": 8 << 20}, 0)
        )
        got = recv_frame(sock)
        assert got is not None and got[0]["code"] == "TOO_LARGE"
        assert recv_frame(sock) is None


# --------------------------------------------------------------------- metrics
def test_metrics_endpoint(daemons: DaemonLauncher) -> None:
    pytest.importorskip("prometheus_client")
    port = free_port()
    d = daemons.start("--memory-quota", "32MiB", "--metrics", f"127.0.0.1:{port}")
    with DaemonStore(d.url) as store:
        store.put(torch.ones(1024, 256))
        time.sleep(0.6)  # the metrics read a snapshot refreshed every 0.25 s

        def scrape() -> dict[str, float]:
            url = f"http://127.0.0.1:{port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
            samples = {}
            for line in text.splitlines():
                if line and not line.startswith("#"):
                    name, value = line.rsplit(" ", 1)
                    samples[name] = float(value)
            return samples

        m = wait_until(
            # 1 MiB + the per-tensor overhead (NOTE [ What a tensor costs ])
            lambda: (
                (s := scrape()).get('tsh_tier_used_bytes{tier="ram"}') == (1 << 20) + 2048 and s
            ),
            10,
            "the RAM gauge to show the tensor",
        )
    assert m['tsh_tier_quota_bytes{tier="ram"}'] == 32 << 20
    assert m['tsh_requests_total{op="put"}'] == 1
    assert m["tsh_sessions"] == 1
    assert m["tsh_received_bytes_total"] >= 1 << 20
    assert m['tsh_buffer_bytes{kind="get"}'] == 0 and m['tsh_buffer_bytes{kind="put"}'] == 0
    assert m["tsh_disk_writable"] == 0  # no disk tier
    assert m["tsh_disk_write_failures_total"] == 0
    assert d.terminate() == 0


def test_library_never_imports_the_daemon() -> None:
    code = (
        "import sys, torch, tensorstore_hooks as tsh, tensorstore_hooks.storage.daemon._client; "
        "print('tensorstore_hooks.server' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
