"""Real S3-compatible servers for tests: moto (with injectable faults) and SeaweedFS.

Tests talk to them through s3fs over real HTTP, the path users take. Import the
fixtures into a test module with ``from .s3_fixtures import *``:

* ``s3_env`` (session): fake credentials in the environment, no AWS config files,
  no instance-metadata lookups (the network is closed).
* ``s3_server`` (session): one :class:`S3Server` shared by the session. Its
  ``faults`` plan is reset after every test that uses ``s3_faults``.
* ``s3_bucket``: a fresh, uniquely named bucket, emptied and removed afterwards.
* ``s3_url``: ``s3://<fresh bucket>/acts``; ``s3_options``: the ``storage_options``.
* ``s3_faults``: the shared server's :class:`FaultPlan`, cleared after the test.
* ``private_s3_server``: a server of the test's own (to stop mid-test).
* ``seaweedfs`` (session): one real SeaweedFS cluster (``tests/seaweedfs.py``: the S3
  gateway, master and filer in one ``weed server`` process, the volume server in
  another) with one bucket, :data:`SEAWEED_BUCKET`, shared by every test that asks.
* ``seaweed_url``: ``s3://tsh-weed/<fresh prefix>``, emptied afterwards;
  ``seaweed_options``: the ``storage_options``.
* ``seaweed_volume``: the session cluster for a test that stops its volume server;
  the volume server is running again after the test, whatever it did.

moto keeps buckets in process-global state, so servers in one process see the
same buckets; tests keep apart by bucket name. SeaweedFS tests keep apart by prefix
(a bucket is a SeaweedFS collection whose volumes take a second to create).
"""

from __future__ import annotations

import itertools
import random
import socket
import struct
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server

try:
    from moto.moto_server.werkzeug_app import MotoRequestHandler as _BaseHandler
except ImportError:  # moto >= 5.2 serves with werkzeug's own handler
    from werkzeug.serving import WSGIRequestHandler as _BaseHandler

from tests.seaweedfs import SeaweedFS

__all__ = [
    "SEAWEED_BUCKET",
    "FaultPlan",
    "S3Server",
    "private_s3_server",
    "s3_bucket",
    "s3_env",
    "s3_faults",
    "s3_options",
    "s3_server",
    "s3_url",
    "seaweed_options",
    "seaweed_url",
    "seaweed_volume",
    "seaweedfs",
]

SEAWEED_BUCKET = "tsh-weed"

CREDENTIALS = {"key": "testing", "secret": "testing"}

_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_ACCESS_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied</Message></Error>"
)
_INTERNAL = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error. Please try again.</Message></Error>"
)


@dataclass
class FaultPlan:
    """Which requests the server fails, and how. Thread-safe; seeded, so repeatable.

    Each request draws once: with probability ``slow_down`` the answer is a 503
    ``SlowDown``, with ``internal`` a 500 ``InternalError``, with ``reset`` the
    connection is reset (TCP RST) after the request has been read, with ``deny`` a
    403 ``AccessDenied`` (a permanent error), with ``hang`` the request is read and
    never answered: the connection stays open, silent, until :meth:`clear` (or
    ``hang_s``, so a forgotten hang still ends). At most
    ``max_faults`` faults are injected (then everything succeeds), so a test with
    faults always ends. ``injected`` counts what was done, by kind.
    """

    slow_down: float = 0.0
    internal: float = 0.0
    reset: float = 0.0
    deny: float = 0.0
    hang: float = 0.0
    max_faults: int = 0
    seed: int = 0
    hang_s: float = 60.0
    injected: Counter[str] = field(default_factory=Counter)
    requests: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(self.seed)
        self.released = threading.Event()
        """Set by :meth:`clear`: hung requests end (their connections are closed)."""

    def configure(
        self,
        *,
        slow_down: float = 0.0,
        internal: float = 0.0,
        reset: float = 0.0,
        deny: float = 0.0,
        hang: float = 0.0,
        max_faults: int = 50,
        seed: int = 0,
    ) -> FaultPlan:
        with self._lock:
            self.slow_down, self.internal, self.reset = slow_down, internal, reset
            self.deny, self.hang = deny, hang
            self.released.clear()
            self.max_faults = max_faults
            self._rng = random.Random(seed)
            self.injected.clear()
            self.requests = 0
        return self

    def clear(self) -> None:
        """Stop injecting faults and end the hung requests; the counters of what was
        injected stay readable."""
        with self._lock:
            self.max_faults = 0
        self.released.set()

    @property
    def total(self) -> int:
        return sum(self.injected.values())

    def draw(self) -> str | None:
        with self._lock:
            self.requests += 1
            if sum(self.injected.values()) >= self.max_faults:
                return None
            x = self._rng.random()
            for kind, p in (
                ("slow_down", self.slow_down),
                ("internal", self.internal),
                ("reset", self.reset),
                ("deny", self.deny),
                ("hang", self.hang),
            ):
                if x < p:
                    self.injected[kind] += 1
                    return kind
                x -= p
            return None


class _Handler(_BaseHandler):
    """moto's request handler, quiet, sending one ``Server`` header, failing on plan.

    werkzeug sends ``Server: Werkzeug/...`` and moto adds ``server: amazon.com``;
    aiohttp >= 3.13.4 rejects a response with two (getmoto/moto#9930), so the
    second one is dropped here.
    """

    faults: FaultPlan  # set on the per-server subclass

    def send_response(self, code: int, message: str | None = None) -> None:
        self._sent_server = False
        super().send_response(code, message)

    def send_header(self, keyword: str, value: str) -> None:
        if keyword.lower() == "server":
            if getattr(self, "_sent_server", False):
                return
            self._sent_server = True
        super().send_header(keyword, value)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # one line per request would bury test output

    def run_wsgi(self) -> None:
        fault = self.faults.draw()
        if fault is None:
            super().run_wsgi()
            return
        self._drain_body()
        self.close_connection = True
        if fault == "hang":
            # Read, never answered: what a wedged gateway or a black-holed route does.
            self.faults.released.wait(self.faults.hang_s)
            self.connection.close()
            return
        if fault == "reset":
            # SO_LINGER 0: close() sends RST, what a crashed or overloaded proxy does.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            return
        status, body = {
            "slow_down": (503, _SLOW_DOWN),
            "internal": (500, _INTERNAL),
            "deny": (403, _ACCESS_DENIED),
        }[fault]
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":  # a HEAD answer has headers only
            self.wfile.write(body)

    def _drain_body(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        while length > 0:
            chunk = self.rfile.read(min(length, 1 << 20))
            if not chunk:
                break
            length -= len(chunk)


class S3Server(ThreadedMotoServer):
    """moto's threaded server on 127.0.0.1 (free port) with a :class:`FaultPlan`.

    ``stop()`` also closes the listening socket (moto's own stop leaves it open,
    so new connections would hang in the backlog instead of being refused).
    """

    def __init__(self) -> None:
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self.faults = FaultPlan()

    def _server_entry(self) -> None:
        handler = type("Handler", (_Handler,), {"faults": self.faults})
        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server(self._ip_address, self._port, app, True, request_handler=handler)
        self._server_ready_event.set()
        self._server.serve_forever()

    @property
    def endpoint_url(self) -> str:
        host, port = self.get_host_and_port()
        return f"http://{host}:{port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """What ``tsh.offload``/``open_store`` need as ``storage_options``."""
        return {"endpoint_url": self.endpoint_url, **CREDENTIALS}

    def stop(self) -> None:
        server = self._server
        super().stop()
        if server is not None:
            server.server_close()

    def client(self) -> Any:
        """A boto3 S3 client for setup and checks (close it: ``client.close()``)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=CREDENTIALS["key"],
            aws_secret_access_key=CREDENTIALS["secret"],
            region_name="us-east-1",
        )

    def create_bucket(self, name: str) -> None:
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        finally:
            client.close()

    def remove_bucket(self, name: str) -> None:
        """Delete every object of ``name``, then the bucket (absent is fine)."""
        client = self.client()
        try:
            paginator = client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=name):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=name, Delete={"Objects": keys})
            client.delete_bucket(Bucket=name)
        except client.exceptions.NoSuchBucket:
            pass
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


_bucket_ids = itertools.count()


@pytest.fixture(scope="session")
def s3_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fake credentials; no AWS config files or metadata service can leak in."""
    missing = tmp_path_factory.mktemp("aws") / "none"
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SECURITY_TOKEN": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": str(missing),
            "AWS_SHARED_CREDENTIALS_FILE": str(missing),
            "AWS_EC2_METADATA_DISABLED": "true",
        }.items():
            mp.setenv(name, value)
        mp.delenv("AWS_PROFILE", raising=False)
        mp.delenv("AWS_ENDPOINT_URL", raising=False)
        yield


@pytest.fixture(scope="session")
def s3_server(s3_env: None) -> Iterator[S3Server]:
    server = S3Server()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def private_s3_server(s3_env: None) -> Iterator[S3Server]:
    """A server for one test (which may stop it; stopping twice is harmless)."""
    server = S3Server()
    server.start()
    try:
        yield server
    finally:
        if server._server_ready_event.is_set():
            server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    name = f"tsh-test-{next(_bucket_ids)}-{random.getrandbits(32):08x}"
    s3_server.create_bucket(name)
    try:
        yield name
    finally:
        s3_server.faults.clear()
        s3_server.remove_bucket(name)


@pytest.fixture
def s3_url(s3_bucket: str) -> str:
    return f"s3://{s3_bucket}/acts"


@pytest.fixture
def s3_options(s3_server: S3Server) -> dict[str, Any]:
    return s3_server.storage_options


@pytest.fixture
def s3_faults(s3_server: S3Server) -> Iterator[FaultPlan]:
    s3_server.faults.configure(max_faults=0)
    try:
        yield s3_server.faults
    finally:
        s3_server.faults.clear()


# ------------------------------------------------------------------- SeaweedFS
_prefix_ids = itertools.count()


@pytest.fixture(scope="session")
def seaweedfs(s3_env: None) -> Iterator[SeaweedFS]:
    """One SeaweedFS cluster for the session (a few seconds to start, two to stop: its
    data is thrown away, so SIGKILL follows SIGTERM soon)."""
    server = SeaweedFS(split_volume=True)
    server.start(bucket=SEAWEED_BUCKET)
    try:
        yield server
    finally:
        server.stop(timeout_s=2.0)


@pytest.fixture
def seaweed_url(seaweedfs: SeaweedFS) -> Iterator[str]:
    prefix = f"t{next(_prefix_ids)}-{random.getrandbits(32):08x}"
    try:
        yield f"s3://{SEAWEED_BUCKET}/{prefix}"
    finally:
        seaweedfs.start_volume(bucket=SEAWEED_BUCKET)  # a failed fault test may have left it off
        seaweedfs.remove_prefix(SEAWEED_BUCKET, prefix + "/")


@pytest.fixture
def seaweed_options(seaweedfs: SeaweedFS) -> dict[str, Any]:
    return seaweedfs.storage_options


@pytest.fixture
def seaweed_volume(seaweedfs: SeaweedFS) -> Iterator[SeaweedFS]:
    """The session cluster, for a test that stops and starts its volume server."""
    try:
        yield seaweedfs
    finally:
        seaweedfs.start_volume(bucket=SEAWEED_BUCKET)
