"""Malformed input never disturbs anyone else: hypothesis throws bad frames at a daemon
(truncated, oversized, not msgpack, wrongly typed, out of order) while a good client
keeps storing and reading tensors on the same daemon."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorstore_hooks.protocol import (
    MAGIC,
    MAX_FRAME_PAYLOAD,
    MAX_HEADER_BYTES,
    PREFIX,
    PROTOCOL_VERSION,
    message_head,
)
from tensorstore_hooks.storage.daemon._client import DaemonStore, fetch_stats
from tests.daemon_fixtures import Daemon, raw_connect, recv_frame, shared_daemon

__all__ = ["shared_daemon"]  # the fixture, re-exported for pytest

META = {
    "dtype": "float32",
    "shape": [4],
    "stride": [1],
    "storage_offset": 0,
    "compact": False,
    "device": "cpu",
    "requires_grad": False,
    "nbytes": 16,
}
HELLO = message_head({"op": "hello", "id": 1, "version": PROTOCOL_VERSION}, 0)

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=30)
    | st.binary(max_size=30)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=15,
)
_ops = st.sampled_from(["hello", "put", "get", "delete", "list", "ping", "stats", "bye", "zap"])


_VALID = {
    "hello": {"op": "hello", "id": 1, "version": PROTOCOL_VERSION},
    "put": {"op": "put", "id": 2, "meta": META, "size": 16},
    "get": {"op": "get", "id": 3, "key": "abc", "head": False},
    "delete": {"op": "delete", "id": 4, "keys": ["abc", "def"]},
    "list": {"op": "list", "id": 5},
    "ping": {"op": "ping", "id": 6},
    "stats": {"op": "stats", "id": 7},
    "bye": {"op": "bye", "id": 8},
}


@st.composite
def _typed_header(draw: st.DrawFn) -> dict[str, Any]:
    """A valid request with one to three fields (or meta fields) replaced or dropped."""
    header: dict[str, Any] = dict(_VALID[draw(st.sampled_from(sorted(_VALID)))])
    names = ["op", "id", "key", "keys", "meta", "size", "version", "token", "session", "head"]
    for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=3)):
        if draw(st.booleans()):
            header[name] = draw(_values)
        else:
            header.pop(name, None)
    if draw(st.booleans()):
        header["meta"] = {**META, draw(st.sampled_from(sorted(META))): draw(_values)}
    return header


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@st.composite
def _frames(draw: st.DrawFn) -> bytes:
    """One malformed conversation, as the bytes a client sends."""
    kind = draw(st.sampled_from(
        ["garbage", "bad_header", "typed", "typed_after_hello", "oversized", "truncated",
         "payload_mismatch", "continuation_first"]
    ))  # fmt: skip
    if kind == "garbage":
        return draw(st.binary(max_size=300))
    if kind == "bad_header":
        raw = draw(st.binary(min_size=1, max_size=200) | st.builds(_pack, _values))
        return PREFIX.pack(MAGIC, len(raw), 0) + raw
    if kind in ("typed", "typed_after_hello"):
        header = draw(_typed_header())
        raw = _pack(header)
        size = header.get("size")
        choice = draw(st.sampled_from(["announced", "none", "random"]))
        if choice == "announced" and isinstance(size, int) and 0 <= size <= 64:
            payload = b"p" * size  # the payload the header announces
        elif choice == "random":
            payload = draw(st.binary(max_size=64))
        else:
            payload = b""
        frame = PREFIX.pack(MAGIC, len(raw), len(payload)) + raw + payload
        return (HELLO + frame) if kind == "typed_after_hello" else frame
    if kind == "oversized":
        header_len = draw(st.sampled_from([MAX_HEADER_BYTES + 1, 2**32 - 1, 5]))
        payload_len = draw(st.sampled_from([MAX_FRAME_PAYLOAD + 1, 2**64 - 1, 0]))
        return HELLO + PREFIX.pack(MAGIC, header_len, payload_len) + b"\x80" * 5
    if kind == "truncated":
        whole = (
            HELLO + message_head({"op": "put", "id": 2, "meta": META, "size": 16}, 16) + b"x" * 16
        )
        return whole[: draw(st.integers(0, len(whole) - 1))]
    if kind == "payload_mismatch":
        size = draw(st.integers(0, 64))
        sent = draw(st.integers(0, 80))
        head = {"op": "put", "id": 2, "meta": META, "size": size}
        return HELLO + message_head(head, sent) + b"y" * sent
    # A continuation frame where a message must start.
    return HELLO + struct.pack("<4sIQ", MAGIC, 0, 8) + b"z" * 8


@pytest.fixture(scope="module")
def good_client(shared_daemon: Daemon) -> Iterator[DaemonStore]:
    with DaemonStore(shared_daemon.url) as store:
        yield store


def _converse(url: str, data: bytes) -> list[dict[str, Any]]:
    """Send ``data``, half-close, and collect every frame until the daemon hangs up."""
    answers: list[dict[str, Any]] = []
    with raw_connect(url, timeout_s=20) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return answers  # the daemon already hung up on us: fine
        while True:
            got = recv_frame(sock)  # any frame it sends must itself be well formed
            if got is None:
                return answers
            answers.append(got[0])


@given(data=_frames())
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_malformed_frames_disturb_nobody(
    shared_daemon: Daemon, good_client: DaemonStore, data: bytes
) -> None:
    answers = _converse(shared_daemon.url, data)
    for a in answers:
        assert isinstance(a.get("ok"), bool)
        if not a["ok"]:
            assert a["code"] in {
                "BAD_REQUEST", "UNAUTHORIZED", "NOT_FOUND", "QUOTA_EXCEEDED", "TOO_LARGE",
                "BUSY", "INTERNAL",
            }  # fmt: skip
            assert a["code"] != "INTERNAL", a  # bad input is never a daemon bug
    # Meanwhile, on its own long-lived connection, the good client is unaffected.
    t = torch.randn(64, 64)
    key = good_client.put(t)
    assert torch.equal(good_client.get(key), t)
    good_client.delete(key)


def test_daemon_survived_the_fuzzing(shared_daemon: Daemon, good_client: DaemonStore) -> None:
    assert shared_daemon.alive()
    snap = fetch_stats(shared_daemon.url)
    assert snap["counters"]["errors"] > 0
    assert snap["connections"] <= 3  # the good client (and this stats call), nothing leaked
    x = torch.randn(2, 1024, 1024)
    assert torch.equal(good_client.get(good_client.put(x)), x)


# ------------------------------------------------------------ planted metadata
def _meta(**changes: Any) -> dict[str, Any]:
    return {**META, **changes}


_PLANTED = [
    # (metadata, expected code): what a client could plant that a later GET, inspect,
    # stats or a restart would choke on (NOTE [ Storable metadata ]).
    (_meta(device="cpu\n"), "BAD_REQUEST"),
    (_meta(device="nosuchdevice"), "BAD_REQUEST"),
    (_meta(shape=[1, 4], stride=[2**63, 1]), "BAD_REQUEST"),
    (_meta(storage_offset=2**48), "TOO_LARGE"),
    # 64 dimensions whose strides span 2**40 elements: 16 bytes of payload, a 4 TiB rebuild
    (_meta(shape=[1] * 63 + [2], stride=[1] * 63 + [2**40], compact=True, nbytes=8), "TOO_LARGE"),
]


@pytest.mark.parametrize(("meta", "code"), _PLANTED, ids=lambda v: str(v)[:40])
def test_planted_metadata_is_refused(
    shared_daemon: Daemon, meta: dict[str, Any], code: str
) -> None:
    payload = b"\x01" * meta["nbytes"]
    with raw_connect(shared_daemon.url) as sock:
        sock.sendall(HELLO)
        welcome = recv_frame(sock)
        assert welcome is not None and welcome[0]["ok"] is True
        sock.sendall(
            message_head({"op": "put", "id": 2, "meta": meta, "size": len(payload)}, len(payload))
            + payload
        )
        answer = recv_frame(sock)
        assert answer is not None
        header = answer[0]
        assert header["ok"] is False and header["code"] == code, header
        assert "tensor metadata" in header["message"] and header["fatal"] is False
        # The payload was read and dropped: the connection is in step and usable, and
        # nothing was stored.
        sock.sendall(message_head({"op": "list", "id": 3}, 0))
        listed = recv_frame(sock)
        assert listed is not None and listed[0]["ok"] is True
        assert msgpack.unpackb(listed[1]) == []
        ok_put = message_head({"op": "put", "id": 4, "meta": META, "size": 16}, 16)
        sock.sendall(ok_put + b"\x02" * 16)
        stored = recv_frame(sock)
        assert stored is not None and stored[0]["ok"] is True, stored
