"""Real daemon processes for the tests, started through the CLI.

Every daemon is ``python -m tensorstore_hooks.cli serve ...`` bound to loopback with
``--listen 127.0.0.1:0`` unless told otherwise; its stderr goes to a log file under
the test's ``tmp_path`` (a pipe nobody reads could fill and stall it). Each process
is killed (SIGKILL if SIGTERM is not enough) in the fixture's finalizer.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests._mounts import tmpfs

__all__ = [
    "CLI",
    "SERVE",
    "Daemon",
    "DaemonLauncher",
    "daemons",
    "free_port",
    "raw_connect",
    "raw_heads",
    "raw_hello",
    "recv_frame",
    "send_frame",
    "rss",
    "shared_daemon",
    "tmpfs",  # re-exported from tests._mounts for the daemon tests that mount one
    "wait_until",
]

CLI = [sys.executable, "-m", "tensorstore_hooks.cli"]
SERVE = [*CLI, "serve"]
START_TIMEOUT_S = 60.0


def rss(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes."""
    import psutil

    return int(psutil.Process(pid).memory_info().rss)


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(pred: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.05) -> Any:
    """Poll ``pred`` until it returns a truthy value; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)


class Daemon:
    """A running daemon process."""

    def __init__(
        self, proc: subprocess.Popen[bytes], url: str, log_path: Path, args: Sequence[str]
    ):
        self.proc = proc
        self.url = url
        self.log_path = log_path
        self.args = list(args)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        """SIGKILL (no drain, no cleanup) and reap."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait(timeout=30)

    def stdout_rest(self) -> bytes:
        """What the daemon printed after the listening line (read once it exited)."""
        assert self.proc.stdout is not None
        return self.proc.stdout.read()


class DaemonLauncher:
    """Starts daemons for one test (or module) and kills them all at the end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._procs: list[subprocess.Popen[bytes]] = []
        self._count = 0

    def _log_path(self) -> Path:
        self._count += 1
        return self.workdir / f"daemon-{self._count}.log"

    def start(
        self, *args: str, env: dict[str, str] | None = None, timeout_s: float = START_TIMEOUT_S
    ) -> Daemon:
        """Run ``serve *args`` (adding ``--listen 127.0.0.1:0`` if no address is given)
        and wait for its ``listening on URL`` line."""
        argv = list(args)
        if not any(a in argv for a in ("--listen", "--unix", "--config")):
            argv = ["--listen", "127.0.0.1:0", *argv]
        log_path = self._log_path()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [*SERVE, *argv],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                env={**os.environ, **(env or {})},
            )
        self._procs.append(proc)
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, left))
            if not ready:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"daemon did not start in {timeout_s}s:\n{log_path.read_text()}")
            chunk = proc.stdout.readline()
            if not chunk:
                proc.wait()
                raise RuntimeError(
                    f"daemon exited ({proc.returncode}) before listening:\n{log_path.read_text()}"
                )
            line += chunk
        text = line.decode().strip()
        assert text.startswith("listening on "), text
        return Daemon(proc, text.removeprefix("listening on "), log_path, argv)

    def run(self, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``serve *args`` expecting it to exit by itself (a refused config)."""
        return subprocess.run(
            [*SERVE, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            if proc.stdout is not None:
                proc.stdout.close()
        self._procs.clear()


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[DaemonLauncher]:
    """Start daemons with ``daemons.start("--memory-quota", "1MiB", ...)``."""
    launcher = DaemonLauncher(tmp_path)
    yield launcher
    launcher.close()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for a whole module: 256 MiB RAM, 512 MiB disk, 30 s lease.

    Tests sharing it stay independent by each using their own DaemonStore (session).
    """
    workdir = tmp_path_factory.mktemp("shared-daemon")
    launcher = DaemonLauncher(workdir)
    try:
        yield launcher.start(
            "--memory-quota",
            "256MiB",
            "--root",
            f"file://{workdir / 'root'}",
            "--disk-quota",
            "512MiB",
            "--lease",
            "30",
        )
    finally:
        launcher.close()


# ------------------------------------------------------------ raw protocol helpers
def raw_connect(url: str, timeout_s: float = 10.0) -> Any:
    """A plain socket to a ``tsh://`` or ``tsh+unix://`` daemon (no HELLO sent)."""
    import socket

    from tensorstore_hooks.storage.daemon._client import parse_daemon_url

    addr = parse_daemon_url(url)
    if addr.path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        sock.connect(addr.path)
        return sock
    return socket.create_connection((addr.host, addr.port), timeout=timeout_s)


def send_frame(sock: Any, header: dict[str, Any], payload: bytes = b"") -> None:
    from tensorstore_hooks.protocol import message_head

    if payload:
        header = {**header, "size": len(payload)}
    sock.sendall(message_head(header, len(payload)) + payload)


def recv_frame(sock: Any) -> tuple[dict[str, Any], bytes] | None:
    """One whole message (continuations joined), or None at EOF/reset."""
    from tensorstore_hooks.protocol import PREFIX_BYTES, parse_prefix, unpack_header

    def exact(n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            try:
                chunk = sock.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            buf += chunk
        return buf

    prefix = exact(PREFIX_BYTES)
    if prefix is None:
        return None
    header_len, payload_len = parse_prefix(prefix)
    raw = exact(header_len)
    assert raw is not None, "EOF inside a header sent by the daemon"
    header = unpack_header(raw)
    payload = exact(payload_len) if payload_len else b""
    assert payload is not None
    size = int(header.get("size", 0))
    while len(payload) < size:
        cont = exact(PREFIX_BYTES)
        assert cont is not None
        hl, pl = parse_prefix(cont)
        assert hl == 0
        more = exact(pl)
        assert more is not None
        payload += more
    return header, payload


def raw_hello(sock: Any, token: str | None = None, **extra: Any) -> dict[str, Any]:
    from tensorstore_hooks.protocol import PROTOCOL_VERSION

    send_frame(sock, {"op": "hello", "id": 1, "version": PROTOCOL_VERSION, "token": token, **extra})
    got = recv_frame(sock)
    assert got is not None, "daemon closed the connection during HELLO"
    return got[0]


def raw_heads(url: str, session: str, keys: list[str]) -> dict[str, str | None]:
    """Where the daemon says each key of ``session`` is: ``"ram"``, ``"disk"``, or
    None (NOT_FOUND). Joins the session on a connection of its own (HEAD requests)."""
    with raw_connect(url) as sock:
        welcome = raw_hello(sock, session=session)
        assert welcome.get("ok") is True, welcome
        out: dict[str, str | None] = {}
        for i, key in enumerate(keys):
            send_frame(sock, {"op": "get", "id": 10 + i, "key": key, "head": True})
            got = recv_frame(sock)
            assert got is not None, "daemon closed the connection during HEAD"
            header = got[0]
            if header.get("ok") is True:
                out[key] = header["tier"]
            else:
                assert header.get("code") == "NOT_FOUND", header
                out[key] = None
        return out
