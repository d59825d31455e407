"""The daemon hardened: TLS, fairness, the PUT payload budget and connection caps, the
Unix socket's directory and peer, the small items; and a daemon store that checks
its connection and token when opened (issue 13).

Every daemon is a real ``tensorstore-hooks serve`` process on loopback.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import StoreUnavailableError
from tensorstore_hooks.protocol import (
    is_valid_key,
    is_valid_session_id,
    message_head,
)
from tensorstore_hooks.storage.daemon._client import DaemonStore, fetch_stats
from tests.daemon_fixtures import (
    CLI,
    DaemonLauncher,
    daemons,
    free_port,
    raw_connect,
    raw_hello,
    recv_frame,
    send_frame,
    wait_until,
)

__all__ = ["daemons"]

trustme = pytest.importorskip("trustme")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


# -------------------------------------------------------------------------- TLS
class Certs:
    """A CA, the daemon's certificate (localhost, 127.0.0.1) and a client certificate."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        ca = trustme.CA()
        self.ca = str(d / "ca.pem")
        ca.cert_pem.write_to_path(self.ca)
        server = ca.issue_cert("localhost", "127.0.0.1")
        self.server = str(d / "server.pem")
        server.private_key_and_cert_chain_pem.write_to_path(self.server)
        client = ca.issue_cert("trainer@example.org")
        self.client = str(d / "client.pem")
        client.private_key_and_cert_chain_pem.write_to_path(self.client)
        other = trustme.CA()
        self.other_ca = str(d / "other-ca.pem")
        other.cert_pem.write_to_path(self.other_ca)
        self.other_client = str(d / "other-client.pem")
        other.issue_cert("mallory@example.org").private_key_and_cert_chain_pem.write_to_path(
            self.other_client
        )
        wrong_name = ca.issue_cert("db.example.org")
        self.wrong_name = str(d / "wrong-name.pem")
        wrong_name.private_key_and_cert_chain_pem.write_to_path(self.wrong_name)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return Certs(tmp_path_factory.mktemp("certs"))


def _tls_args(cert: str) -> list[str]:
    return ["--tls-cert", cert, "--tls-key", cert]


class _Relay:
    """A loopback TCP relay that records every byte the client sends."""

    def __init__(self, target_port: int) -> None:
        self.sent = bytearray()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._target = target_port
        self._threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self._listener.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self._target))
            for src, dst, rec in ((a, b, True), (b, a, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, rec), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if record:
                    self.sent += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()


def test_tls_round_trip_and_nothing_in_clear(
    daemons: DaemonLauncher, certs: Certs, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("tls-secret-token-1234\n")
    token_file.chmod(0o600)
    d = daemons.start(*_tls_args(certs.server), "--token-file", str(token_file))
    assert d.url.startswith("tsh+tls://127.0.0.1:")
    relay = _Relay(d.port)
    try:
        url = f"tsh+tls://127.0.0.1:{relay.port}"
        x = torch.full((64, 1024), 7.25)
        with tsh.open_store(url, token="tls-secret-token-1234", tls_ca=certs.ca) as store:
            key = store.put(x)
            assert torch.equal(store.get(key), x)
            assert store.session_id is not None
            sid = store.session_id
        assert len(relay.sent) > x.numel() * 4  # the tensor went through the relay...
        assert b"tls-secret-token-1234" not in relay.sent  # ...but not the token
        assert sid.encode() not in relay.sent
        assert b"TSH1" not in relay.sent and x.numpy().tobytes()[:64] not in relay.sent
    finally:
        relay.close()
    # The same keys work in storage_options (the YAML path) and for offload().
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    inp = torch.randn(8, 16)
    model(inp).sum().backward()
    ref = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    opts = {"tls_ca": certs.ca, "token": "tls-secret-token-1234"}
    with tsh.offload(d.url, storage_options=opts, min_bytes=0) as hooks:
        loss = model(inp).sum()
    loss.backward()
    assert hooks.stats.tensors_offloaded > 0
    got = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    hooks.close()


def test_plaintext_and_tls_mismatch_fail_at_once(daemons: DaemonLauncher, certs: Certs) -> None:
    tls = daemons.start(*_tls_args(certs.server))
    plain = daemons.start("--memory-quota", "16MiB")
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=r"tsh\+tls://") as info:
        DaemonStore(tls.url.replace("tsh+tls://", "tsh://"))
    assert "only speaks TLS" in str(info.value)
    with pytest.raises(StoreUnavailableError, match="plaintext"):
        DaemonStore(plain.url.replace("tsh://", "tsh+tls://"), tls_ca=certs.ca)
    assert time.monotonic() - t0 < 10  # no 30 s of retries, no hang
    # A raw plaintext peer gets a readable error frame, not silence.
    with raw_connect(tls.url.replace("tsh+tls://", "tsh://")) as sock:
        got = raw_hello(sock)
        assert got["code"] == "UNAUTHORIZED" and "TLS" in got["message"]


def test_tls_verifies_certificate_and_host_name(daemons: DaemonLauncher, certs: Certs) -> None:
    d = daemons.start(*_tls_args(certs.server))
    with pytest.raises(StoreUnavailableError, match="did not verify"):
        DaemonStore(d.url)  # the system CAs do not know trustme's CA
    with pytest.raises(StoreUnavailableError, match="did not verify"):
        DaemonStore(d.url, tls_ca=certs.other_ca)
    wrong = daemons.start(*_tls_args(certs.wrong_name))
    with pytest.raises(StoreUnavailableError, match="did not verify"):
        DaemonStore(wrong.url, tls_ca=certs.ca)  # signed by the CA, for another host
    with pytest.raises(tsh.ConfigError, match=r"tsh\+tls"):
        DaemonStore(d.url.replace("tsh+tls://", "tsh://"), tls_ca=certs.ca, check=False)


def test_tls_client_certificates(daemons: DaemonLauncher, certs: Certs) -> None:
    d = daemons.start(*_tls_args(certs.server), "--tls-client-ca", certs.ca)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="tls_cert"):
        DaemonStore(d.url, tls_ca=certs.ca)
    with pytest.raises(StoreUnavailableError):
        DaemonStore(d.url, tls_ca=certs.ca, tls_cert=certs.other_client)
    assert time.monotonic() - t0 < 15
    with DaemonStore(d.url, tls_ca=certs.ca, tls_cert=certs.client) as store:
        x = torch.arange(1000.0)
        assert torch.equal(store.get(store.put(x)), x)
    snap = fetch_stats(d.url, tls_ca=certs.ca, tls_cert=certs.client)
    assert snap["url"] == d.url


def test_cleartext_listener_warns(daemons: DaemonLauncher, certs: Certs, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("t0ken")
    token_file.chmod(0o600)
    cfg = tmp_path / "public.yaml"
    cfg.write_text(f"listen: 0.0.0.0:{free_port()}\ntoken_file: {token_file}\n")
    out = daemons.run("--config", str(cfg), "--check")  # --check binds nothing
    assert out.returncode == 0, out.stderr
    assert "in clear" in out.stderr and "--tls-cert" in out.stderr
    out = daemons.run("--config", str(cfg), "--check", *_tls_args(certs.server))
    assert out.returncode == 0 and "in clear" not in out.stderr


# --------------------------------------------------------------------- fairness
class _Flooder:
    """A token holder pipelining PINGs as fast as it can, reading every answer."""

    def __init__(self, url: str) -> None:
        self.sock = raw_connect(url)
        assert raw_hello(self.sock)["ok"] is True
        self.stop = threading.Event()
        batch = b"".join(message_head({"op": "ping", "id": i + 2}, 0) for i in range(2000))
        self._batch = batch
        self.sent = 0
        self._threads = [
            threading.Thread(target=self._send, daemon=True),
            threading.Thread(target=self._drain, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _send(self) -> None:
        try:
            while not self.stop.is_set():
                self.sock.sendall(self._batch)
                self.sent += 2000
        except OSError:
            pass

    def _drain(self) -> None:
        try:
            while not self.stop.is_set() and self.sock.recv(1 << 20):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self.stop.set()
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for t in self._threads:
            t.join(timeout=10)


def test_one_client_cannot_starve_others(daemons: DaemonLauncher) -> None:
    d = daemons.start("--memory-quota", "64MiB", "--lease", "1.5")
    with DaemonStore(d.url, keepalive=False) as store:
        x = torch.randn(256, 1024)  # 1 MiB
        kept = store.put(x)
        flood = _Flooder(d.url)
        try:
            wait_until(lambda: flood.sent >= 20000, 30, "the flood to start")
            worst = 0.0
            end = time.monotonic() + 4.0  # well past the 1.5 s lease
            while time.monotonic() < end:
                t0 = time.monotonic()
                key = store.put(x)
                assert torch.equal(store.get(key), x)
                worst = max(worst, time.monotonic() - t0)
                store.delete(key)  # a fast machine makes many rounds: stay within the quota
                time.sleep(0.05)
            assert torch.equal(store.get(kept), x)  # the session never expired
        finally:
            flood.close()
        assert worst < 1.0, f"a put+get took {worst:.2f}s while another client flooded"
        assert store.sessions_lost == 0
    assert fetch_stats(d.url)["counters"]["sessions_expired"] == 0


# ---------------------------------------------- PUT payload budget and connection caps
def test_half_sent_put_holds_only_what_it_sent(daemons: DaemonLauncher, tmp_path: Path) -> None:
    cfg = tmp_path / "disk.yaml"
    cfg.write_text(
        f"memory_quota: 0\nroot: {tmp_path / 'root'}\ndisk_quota: 1GiB\n"
        "limits:\n  put_buffer: 64MiB\n  read_timeout: 20s\n"
    )
    d = daemons.start("--config", str(cfg), "--listen", "127.0.0.1:0")
    meta = tsh.TensorMeta("uint8", (256 << 20,), (1,), 0, False, "cpu", False, 256 << 20)
    with raw_connect(d.url) as slow, DaemonStore(d.url) as store:
        raw_hello(slow)
        first = 8 << 20
        slow.sendall(
            message_head({"op": "put", "id": 2, "meta": meta.to_dict(), "size": 256 << 20}, first)
        )
        slow.sendall(b"\0" * first)  # 8 MiB of 256 MiB, then nothing
        time.sleep(0.5)
        small = torch.arange(1024, dtype=torch.float32)  # 4 KiB
        for _ in range(3):
            t0 = time.monotonic()
            assert torch.equal(store.get(store.put(small)), small)
            assert time.monotonic() - t0 < 3.0
        staged = fetch_stats(d.url)["buffers"]["put"]["used"]
        assert staged <= first + (1 << 20)  # what the slow peer sent, plus one piece


def test_silent_connections_cannot_fill_the_cap(daemons: DaemonLauncher, tmp_path: Path) -> None:
    cfg = tmp_path / "cap.yaml"
    cfg.write_text("memory_quota: 16MiB\nlimits:\n  max_connections: 8\n  handshake_timeout: 30s\n")
    d = daemons.start("--config", str(cfg), "--listen", "127.0.0.1:0")
    silent = [raw_connect(d.url) for _ in range(70)]  # connect, never say HELLO
    try:
        t0 = time.monotonic()
        with DaemonStore(d.url) as store:
            store.put(torch.ones(10))
        snap = fetch_stats(d.url)
        assert time.monotonic() - t0 < 5
        assert snap["unauthenticated"] <= 64  # limits.max_unauthenticated
        assert snap["counters"]["evicted_unauthenticated"] >= 6
        # The oldest silent ones were told why before being dropped.
        silent[0].settimeout(10)
        got = recv_frame(silent[0])
        assert got is not None and got[0]["code"] == "BUSY" and "HELLO" in got[0]["message"]
    finally:
        for s in silent:
            s.close()


# ------------------------------------------------------------------- Unix socket
def test_unix_socket_directory_checked(daemons: DaemonLauncher, tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    out = daemons.run("--unix", str(open_dir / "d.sock"), "--memory-quota", "1MiB")
    assert out.returncode == 2, out.stderr
    assert "writable by other users" in out.stderr and "private directory" in out.stderr
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    d = daemons.start("--unix", str(sticky / "d.sock"), "--memory-quota", "1MiB")
    wait_until(lambda: "shared directory" in d.log(), 10, "the shared-directory warning")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    d2 = daemons.start("--unix", str(private / "d.sock"), "--memory-quota", "1MiB")
    assert "shared directory" not in d2.log()


def test_unix_client_checks_the_peer_uid(daemons: DaemonLauncher, tmp_path: Path) -> None:
    private = tmp_path / "run"
    private.mkdir(mode=0o700)
    d = daemons.start("--unix", str(private / "d.sock"), "--memory-quota", "4MiB")
    with DaemonStore(d.url) as store:  # our own daemon: accepted
        store.put(torch.ones(4))
    # A store told to trust only another uid refuses before sending its token.
    with pytest.raises(StoreUnavailableError, match="refusing to send it the token"):
        DaemonStore(d.url, token="secret", peer_uid=os.getuid() + 12345)
    assert fetch_stats(d.url)["counters"]["hello"] == 2  # the refused one never said HELLO


# ------------------------------------------------------------------- small items
def test_keys_and_session_ids_refuse_a_trailing_newline(daemons: DaemonLauncher) -> None:
    assert not is_valid_key("abc\n") and is_valid_key("abc")
    assert not is_valid_session_id("a" * 20 + "\n") and is_valid_session_id("a" * 20)
    d = daemons.start("--memory-quota", "1MiB")
    with raw_connect(d.url) as sock:
        assert raw_hello(sock)["ok"] is True
        send_frame(sock, {"op": "get", "id": 2, "key": "abc\n"})
        got = recv_frame(sock)
        assert got is not None and got[0]["code"] == "BAD_REQUEST"
        assert "invalid key" in got[0]["message"]


def test_put_before_hello_is_unauthorized(daemons: DaemonLauncher) -> None:
    d = daemons.start("--memory-quota", "1MiB")
    meta = tsh.TensorMeta("uint8", (16,), (1,), 0, False, "cpu", False, 16)
    with raw_connect(d.url) as sock:
        send_frame(sock, {"op": "put", "id": 1, "meta": meta.to_dict()}, b"x" * 16)
        got = recv_frame(sock)
        assert got is not None and got[0]["code"] == "UNAUTHORIZED" and got[0]["fatal"] is True


def test_token_hygiene(
    daemons: DaemonLauncher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("hygiene-token\n")
    token_file.chmod(0o644)
    d = daemons.start("--token-file", str(token_file), "--memory-quota", "1MiB")
    wait_until(lambda: "readable by other users" in d.log(), 10, "the daemon's token warning")
    monkeypatch.setenv("TSH_TOKEN", "hygiene-token\n")  # as `export TSH_TOKEN=$(cat f)` can
    with DaemonStore(d.url) as store:
        store.put(torch.ones(2))
    monkeypatch.delenv("TSH_TOKEN")
    with pytest.warns(UserWarning, match="readable by other users"):
        store = DaemonStore(d.url, token_file=token_file)
    store.close()
    token_file.chmod(0o600)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DaemonStore(d.url, token_file=token_file).close()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def test_check_config_and_serve_check_know_daemon_configs(tmp_path: Path) -> None:
    out = _cli("check-config", str(CONFIGS / "server.yaml"))
    assert out.returncode == 0, out.stderr
    assert "daemon config" in out.stdout and "unknown key" not in out.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: 127.0.0.1:0\nmemory_quota: 1GiB\nlimits:\n  max_conections: 3\n")
    for args in (("check-config", str(bad)), ("serve", "--config", str(bad), "--check")):
        out = _cli(*args)
        assert out.returncode != 0
        assert f"{bad}:4" in out.stderr and "max_conections" in out.stderr
        assert "allowed keys here:" in out.stderr and "max_connections" in out.stderr
    port = free_port()
    good = tmp_path / "good.yaml"
    good.write_text(f"listen: 127.0.0.1:{port}\nmemory_quota: 1GiB\n")
    out = _cli("serve", "--config", str(good), "--check")
    assert out.returncode == 0 and "daemon config OK" in out.stdout, out.stderr
    with socket.socket() as s:  # --check bound nothing: the port is still free
        s.bind(("127.0.0.1", port))


# ------------------------------------------------------ issue 13: checked at open
def test_unreachable_daemon_fails_at_open() -> None:
    url = f"tsh://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=url.replace(".", r"\.")):
        tsh.open_store(url)
    with pytest.raises(StoreUnavailableError, match="cannot reach the daemon"):
        tsh.offload(url)
    assert time.monotonic() - t0 < 15
