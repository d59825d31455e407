"""The wire protocol's pure parts: framing, header limits, request validation."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorstore_hooks._codec import encode
from tensorstore_hooks.protocol import (
    MAGIC,
    MAX_FRAME_PAYLOAD,
    MAX_HEADER_BYTES,
    MAX_KEYS_PER_REQUEST,
    PREFIX,
    PREFIX_BYTES,
    PROTOCOL_VERSION,
    Bye,
    Delete,
    ErrorCode,
    Get,
    Hello,
    ListKeys,
    Ping,
    ProtocolError,
    Put,
    Stats,
    body_size,
    error_header,
    frame_chunks,
    is_valid_key,
    is_valid_session_id,
    message_head,
    pack_header,
    pack_prefix,
    parse_prefix,
    parse_request,
    raise_for_error,
    unpack_body,
    unpack_header,
)

META = encode(torch.arange(6, dtype=torch.float32).view(2, 3))[0]


def test_prefix_round_trip() -> None:
    assert PREFIX_BYTES == 16
    raw = pack_prefix(123, 456)
    assert raw[:4] == MAGIC and len(raw) == PREFIX_BYTES
    assert parse_prefix(raw) == (123, 456)


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (PREFIX.pack(b"HTTP", 1, 0), ErrorCode.BAD_REQUEST),
        (PREFIX.pack(MAGIC, MAX_HEADER_BYTES + 1, 0), ErrorCode.TOO_LARGE),
        (PREFIX.pack(MAGIC, 10, MAX_FRAME_PAYLOAD + 1), ErrorCode.TOO_LARGE),
        (PREFIX.pack(MAGIC, 10, 2**64 - 1), ErrorCode.TOO_LARGE),
    ],
)
def test_prefix_limits(raw: bytes, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_prefix(raw)
    assert info.value.code is code and info.value.fatal


def test_header_round_trip_and_limits() -> None:
    h = {"op": "ping", "id": 3}
    assert unpack_header(pack_header(h)) == h
    with pytest.raises(ProtocolError) as info:
        pack_header({"op": "x" * (MAX_HEADER_BYTES + 10)})
    assert info.value.code is ErrorCode.TOO_LARGE


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1, 2, 3]),  # not a map
        msgpack.packb({"op": b"bytes"}),  # bin is refused (max_bin_len=0)
        msgpack.packb({1: "int key"}),  # strict_map_key
        msgpack.packb({"a": msgpack.ExtType(1, b"x")}),  # ext is refused
        msgpack.packb({"op": "ping"}) + b"\x00",  # trailing bytes
        msgpack.packb({"k": list(range(MAX_KEYS_PER_REQUEST + 1))}),  # array too long
        msgpack.packb({str(i): i for i in range(100)}),  # map too long
        msgpack.packb({"s": "x" * 5000}),  # string too long
        b"\x91" * 5000 + b"\xc0",  # nesting far too deep
    ],
)
def test_unpack_header_refuses(raw: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        unpack_header(raw)
    assert info.value.code is ErrorCode.BAD_REQUEST and info.value.fatal


@given(st.binary(max_size=512))
@settings(max_examples=300, deadline=None)
def test_unpack_header_never_crashes(raw: bytes) -> None:
    try:
        header = unpack_header(raw)
    except ProtocolError:
        return
    assert isinstance(header, dict)


def test_body_size() -> None:
    assert body_size({}) == 0
    assert body_size({"size": 10}) == 10
    for bad in (-1, True, "10", 2**60, 1.5):
        with pytest.raises(ProtocolError):
            body_size({"size": bad})


def test_frame_chunks() -> None:
    assert list(frame_chunks(0)) == [(0, 0)]
    assert list(frame_chunks(5)) == [(0, 5)]
    m = MAX_FRAME_PAYLOAD
    assert list(frame_chunks(64 << 20)) == [(0, m), (m, 2 * m), (2 * m, 3 * m), (3 * m, 4 * m)]
    assert list(frame_chunks(m + 1)) == [(0, m), (m, m + 1)]


def test_message_head_layout() -> None:
    head = message_head({"op": "ping", "id": 1}, 7)
    header_len, payload_len = parse_prefix(head[:PREFIX_BYTES])
    assert payload_len == 7 and header_len == len(head) - PREFIX_BYTES
    assert unpack_header(head[PREFIX_BYTES:]) == {"op": "ping", "id": 1}


def test_keys_and_session_ids() -> None:
    assert is_valid_key("abc-DEF_123")
    for bad in ("", "a" * 65, "a/b", "a b", "../x", "é", 5, None, b"abc"):
        assert not is_valid_key(bad)
    assert is_valid_session_id("A" * 32)
    assert not is_valid_session_id("short")
    assert not is_valid_session_id("x" * 16 + "!")


def _req(**fields: Any) -> dict[str, Any]:
    return {"id": 1, **fields}


def test_parse_each_request() -> None:
    hello = parse_request(_req(op="hello", version=PROTOCOL_VERSION, token="t", session=None))
    assert isinstance(hello, Hello) and hello.open_session and hello.token == "t"
    put = parse_request(_req(op="put", meta=META.to_dict(), size=META.nbytes))
    assert isinstance(put, Put) and put.meta == META
    get = parse_request(_req(op="get", key="abc", head=True))
    assert isinstance(get, Get) and get.head
    delete = parse_request(_req(op="delete", keys=["a", "b"]))
    assert isinstance(delete, Delete) and delete.keys == ("a", "b")
    assert isinstance(parse_request(_req(op="list")), ListKeys)
    assert isinstance(parse_request(_req(op="ping")), Ping)
    assert isinstance(parse_request(_req(op="stats")), Stats)
    assert isinstance(parse_request(_req(op="bye")), Bye)


@pytest.mark.parametrize(
    "header",
    [
        {"op": "ping"},  # no id
        _req(op="nope"),
        _req(op=5),
        {"op": "ping", "id": True},  # bool is not an int here
        {"op": "ping", "id": -1},
        _req(op="hello"),  # no version
        _req(op="hello", version=1, token="x" * 2000),
        _req(op="hello", version=1, session="../../etc"),
        _req(op="hello", version=1, open_session="yes"),
        _req(op="put", meta=META.to_dict(), size=META.nbytes + 1),
        _req(op="put", meta={"dtype": "float32"}, size=4),
        _req(op="put", meta=[1, 2], size=4),
        _req(op="put", meta=META.to_dict()),
        _req(op="put", meta={**META.to_dict(), "dtype": "object"}, size=META.nbytes),
        _req(op="get"),
        _req(op="get", key="bad key"),
        _req(op="get", key=7),
        _req(op="get", key="k", head=1),
        _req(op="delete", keys="abc"),
        _req(op="delete", keys=["ok", "not ok"]),
        _req(op="delete", keys=["k"] * (MAX_KEYS_PER_REQUEST + 1)),
    ],
)
def test_parse_request_refuses(header: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(header)
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert not info.value.fatal  # the connection survives a bad request


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(
    st.fixed_dictionaries(
        {"op": st.sampled_from(["hello", "put", "get", "delete", "list", "ping", "bye", "x"])},
        optional={
            "id": _values | st.integers(),
            "key": _values,
            "keys": _values,
            "meta": _values,
            "size": _values,
            "version": _values,
            "token": _values,
            "session": _values,
            "head": _values,
        },
    )
)
@settings(max_examples=400, deadline=None)
def test_parse_request_only_raises_protocol_errors(header: dict[str, Any]) -> None:
    try:
        parse_request(header)
    except ProtocolError as e:
        assert e.code is ErrorCode.BAD_REQUEST


def test_error_frames() -> None:
    h = error_header(ErrorCode.QUOTA_EXCEEDED, "full" * 1000, req_id=4, fatal=False)
    assert len(h["message"]) <= 1024
    with pytest.raises(ProtocolError) as info:
        raise_for_error(h)
    assert info.value.code is ErrorCode.QUOTA_EXCEEDED and not info.value.fatal
    with pytest.raises(ProtocolError) as info:
        raise_for_error({"ok": False, "code": "SOMETHING_NEW", "message": 3})
    assert info.value.code is ErrorCode.INTERNAL
    raise_for_error({"ok": True})


def test_unpack_body() -> None:
    assert unpack_body(msgpack.packb(["a", "b"])) == ["a", "b"]
    with pytest.raises(ProtocolError):
        unpack_body(b"\xc1")
