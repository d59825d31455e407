"""Every byte the daemon holds for a client is counted in a named budget that ``stats``
shows and that bounds its memory, and no session holds more than its share of one
(issue 36, findings 3-7): RAM answers to clients that never read, disk pieces
between reads, the bookkeeping of disk-tier tensors, discard buffers, the PUT and
GET budgets under clients that stall. Real daemon processes; raw sockets for the
clients that misbehave."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tensorstore_hooks as tsh
from tensorstore_hooks import QuotaExceededError
from tensorstore_hooks.protocol import message_head
from tensorstore_hooks.storage.daemon._client import DaemonStore, fetch_stats
from tensorstore_hooks.storage.zarr._store import DEFAULT_BUFFER_POOL_BYTES
from tests.daemon_fixtures import (
    DaemonLauncher,
    daemons,
    raw_connect,
    raw_hello,
    recv_frame,
    rss,
    send_frame,
    wait_until,
)

__all__ = ["daemons"]  # the fixture, re-exported for pytest

KiB = 1 << 10
MiB = 1 << 20


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "server.yaml"
    path.write_text("listen: 127.0.0.1:0\n" + text)
    return str(path)


@contextlib.contextmanager
def _unread_gets(
    url: str, session: str, keys: list[str], rcvbuf: int | None = 64 * KiB
) -> Iterator[list[socket.socket]]:
    """One connection per key of ``session`` that asks for it and reads nothing (a
    receive buffer of ``rcvbuf`` bytes, None: the system's)."""
    socks: list[socket.socket] = []
    try:
        for i, key in enumerate(keys):
            s = raw_connect(url)
            if rcvbuf is not None:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            socks.append(s)
            assert raw_hello(s, session=session)["ok"] is True
            send_frame(s, {"op": "get", "id": 2 + i, "key": key, "head": False})
        yield socks
    finally:
        for s in socks:
            s.close()


def _read_first_frame(sock: socket.socket) -> None:
    """Read the first frame of an answer (its header and payload) and no more."""
    from tensorstore_hooks.protocol import PREFIX_BYTES, parse_prefix

    prefix = bytearray(PREFIX_BYTES)
    view = memoryview(prefix)
    while view:
        view = view[sock.recv_into(view) :]
    header_len, payload_len = parse_prefix(prefix)
    left = header_len + payload_len
    sink = bytearray(1 << 20)
    while left:
        got = sock.recv_into(sink, min(left, len(sink)))
        assert got, "EOF inside the first frame"
        left -= got


def _peak_rss(pid: int, seconds: float) -> int:
    peak = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        peak = max(peak, rss(pid))
        time.sleep(0.02)
    return peak


# -------------------------------------------------- finding 3: RAM answers in flight
def test_ram_answers_stay_counted_until_sent(daemons: DaemonLauncher, tmp_path: Path) -> None:
    cfg = _config(tmp_path, "memory_quota: 64MiB\nlimits:\n  read_timeout: 60s\n")
    d = daemons.start("--config", cfg)
    big = torch.ones(4 * MiB)  # 16 MiB
    with DaemonStore(d.url) as store:
        sid = store.session_id
        assert sid is not None
        warm = store.put(big)  # warm the daemon's heap up
        store.get(warm)
        store.delete(warm)
        time.sleep(0.3)
        before = rss(d.pid)
        refused = 0
        with contextlib.ExitStack() as stack:
            for _ in range(8):  # the old daemon grew by 16 MiB each round, counting 0
                try:
                    key = store.put(big)
                except QuotaExceededError as e:
                    assert "no room" in str(e)
                    refused += 1
                    continue
                stack.enter_context(_unread_gets(d.url, sid, [key]))
                time.sleep(0.2)  # the answer has started: its buffer is in flight
                store.delete(key)
            grown = _peak_rss(d.pid, 1.0) - before
            assert grown < 64 * MiB + 32 * MiB, f"RSS grew by {grown / MiB:.0f} MiB"
            assert refused >= 4  # no room while three answers hold the RAM quota
            ram = fetch_stats(d.url)["tiers"]["ram"]
            # The deleted tensors' buffers are still being sent: RAM says so.
            assert ram["answers"] >= 3 * 16 * MiB and ram["used"] >= ram["answers"], ram
            assert ram["used"] <= 64 * MiB
        # The readers went away: the RAM comes back.
        wait_until(
            lambda: fetch_stats(d.url)["tiers"]["ram"]["used"] == 0, 30, "the answers to end"
        )
        assert torch.equal(store.get(store.put(big)), big)
    assert "Traceback" not in d.log()


# ------------------------------------------------- finding 4: pieces between reads
def test_a_connection_waiting_for_its_next_piece_holds_none(
    daemons: DaemonLauncher, tmp_path: Path
) -> None:
    cfg = _config(
        tmp_path,
        f"memory_quota: 0\nroot: {tmp_path / 'root'}\ndisk_quota: 1GiB\n"
        "limits:\n  read_timeout: 60s\n",
    )
    d = daemons.start("--config", cfg)
    big = torch.arange(8 * MiB, dtype=torch.float32)  # 32 MiB: 4 pieces of 8 MiB
    with DaemonStore(d.url) as store:
        key = store.put(big)
        assert torch.equal(store.get(key), big)
        sid = store.session_id
        assert sid is not None
        time.sleep(0.3)
        before = rss(d.pid)
        with _unread_gets(d.url, sid, [key] * 40, rcvbuf=None) as socks:
            # 40 connections of one session each read the first piece of their answer,
            # then stop: all but a few wait for budget for their next piece.
            for sock in socks:
                _read_first_frame(sock)
            grown = _peak_rss(d.pid, 3.0) - before
            snap = fetch_stats(d.url)
        held = snap["buffers"]["get"]
        # What the budget holds, plus the store's pool of idle read buffers (a named
        # budget too): the old daemon kept a piece per waiting connection, +390 MiB.
        pool = DEFAULT_BUFFER_POOL_BYTES
        assert grown < held["session_limit"] + pool + 32 * MiB, f"RSS grew {grown / MiB:.0f} MiB"
        assert held["used"] <= held["session_limit"], held
        assert snap["buffers"]["store_pool"]["idle_limit"] == pool


# ------------------------------------------- finding 5: disk-tier bookkeeping
def test_disk_tier_bookkeeping_is_charged_to_a_budget(
    daemons: DaemonLauncher, tmp_path: Path
) -> None:
    cfg = _config(
        tmp_path,
        f"memory_quota: 0\nroot: {tmp_path / 'root'}\nlimits:\n  disk_bookkeeping: 1MiB\n",
    )
    d = daemons.start("--config", cfg)
    meta = tsh.TensorMeta("float32", (0,), (1,), 0, False, "cpu", False, 0).to_dict()
    n = 1200
    answers = []
    with raw_connect(d.url) as sock:
        assert raw_hello(sock)["ok"] is True
        for start in range(0, n, 200):
            for i in range(start, start + 200):
                send_frame(sock, {"op": "put", "id": 10 + i, "meta": meta, "size": 0})
            for _ in range(200):
                got = recv_frame(sock)
                assert got is not None
                answers.append(got[0])
    stored = [a for a in answers if a["ok"]]
    refused = [a for a in answers if not a["ok"]]
    per_tensor = 1024
    assert len(stored) == MiB // per_tensor and len(refused) == n - len(stored)
    assert {a["code"] for a in refused} == {"QUOTA_EXCEEDED"}
    assert "disk_bookkeeping" in refused[0]["message"]
    book = fetch_stats(d.url)["buffers"]["bookkeeping"]
    assert book == {"used": MiB, "limit": MiB, "per_tensor": per_tensor}


# ----------------------------------------------------- finding 6: discard buffers
def test_refused_payloads_share_one_discard_buffer(daemons: DaemonLauncher) -> None:
    d = daemons.start("--memory-quota", "64MiB", "--session-quota", "1MiB")
    meta = tsh.TensorMeta("uint8", (2 * MiB,), (1,), 0, False, "cpu", False, 2 * MiB)
    payload = bytes(2 * MiB)
    with DaemonStore(d.url) as warm:
        warm.put(torch.ones(16))
    time.sleep(0.3)
    before = rss(d.pid)
    socks = []
    try:
        for _ in range(100):  # each PUT is refused (session quota), its payload discarded
            s = raw_connect(d.url)
            socks.append(s)
            assert raw_hello(s)["ok"] is True
            send_frame(s, {"op": "put", "id": 2, "meta": meta.to_dict()}, payload)
            got = recv_frame(s)
            assert got is not None and got[0]["code"] == "QUOTA_EXCEEDED"
        grown = rss(d.pid) - before
        snap = fetch_stats(d.url)
    finally:
        for s in socks:
            s.close()
    assert grown < 24 * MiB, f"RSS grew by {grown / MiB:.0f} MiB"  # was 1 MiB a connection
    assert snap["buffers"]["discard"] == {"used": MiB, "limit": MiB}


# ------------------------------------------------ finding 7: fair shares of budgets
def test_one_sessions_stalled_puts_do_not_hold_up_another(
    daemons: DaemonLauncher, tmp_path: Path
) -> None:
    cfg = _config(
        tmp_path,
        f"memory_quota: 0\nroot: {tmp_path / 'root'}\ndisk_quota: 1GiB\n"
        "limits:\n  put_buffer: 64MiB\n  read_timeout: 60s\n",
    )
    d = daemons.start("--config", cfg)
    size = 16 * MiB
    meta = tsh.TensorMeta("uint8", (size,), (1,), 0, False, "cpu", False, size).to_dict()
    head = message_head({"op": "put", "id": 2, "meta": meta, "size": size}, size)
    writers: list[socket.socket] = []
    threads: list[threading.Thread] = []

    def half_send(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.sendall(head + bytes(size // 2))  # blocks while the daemon does not read

    sid = None
    try:
        for _ in range(16):  # one session, 16 PUTs: each sends half and stops
            s = raw_connect(d.url)
            writers.append(s)
            welcome = raw_hello(s, session=sid)
            assert welcome["ok"] is True
            sid = welcome["session"]
            threads.append(threading.Thread(target=half_send, args=(s,), daemon=True))
            threads[-1].start()
        wait_until(
            lambda: fetch_stats(d.url)["buffers"]["put"]["used"] >= 24 * MiB,
            20,
            "the stalled PUTs to take budget",
        )
        time.sleep(0.5)
        # The victim's PUTs go to disk through the same budget: they must not wait for
        # the stalled ones' read timeout (60 s; the old daemon made them wait it out).
        x = torch.randn(MiB)  # 4 MiB
        with DaemonStore(d.url, io_timeout_s=10, reconnect_deadline_s=0.5) as victim:
            for _ in range(5):
                assert torch.equal(victim.get(victim.put(x)), x)
        put = fetch_stats(d.url)["buffers"]["put"]
        assert put["used"] <= put["limit"], put
    finally:
        for s in writers:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(timeout=30)
        for s in writers:
            s.close()


def test_stalled_puts_of_many_sessions_are_dropped_for_another(
    daemons: DaemonLauncher, tmp_path: Path
) -> None:
    # Eight sessions, two half-sent PUTs each: shares alone cannot keep room for a
    # newcomer, so PUTs stalled past PUT_STALL_S are dropped when it needs the room.
    cfg = _config(
        tmp_path,
        f"memory_quota: 0\nroot: {tmp_path / 'root'}\ndisk_quota: 1GiB\n"
        "limits:\n  put_buffer: 32MiB\n  read_timeout: 60s\n",
    )
    d = daemons.start("--config", cfg)
    size = 16 * MiB
    meta = tsh.TensorMeta("uint8", (size,), (1,), 0, False, "cpu", False, size).to_dict()
    head = message_head({"op": "put", "id": 2, "meta": meta, "size": size}, size)
    writers: list[socket.socket] = []
    threads: list[threading.Thread] = []
    dropped: list[dict[str, object]] = []

    def half_send(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.sendall(head + bytes(size // 2))
            s.settimeout(30)
            got = recv_frame(s)
            if got is not None:
                dropped.append(got[0])

    try:
        for i in range(16):
            s = raw_connect(d.url)
            writers.append(s)
            sid = None if i % 2 == 0 else sid  # noqa: F821 - set on the even turn
            welcome = raw_hello(s, session=sid)
            sid = welcome["session"]
            threads.append(threading.Thread(target=half_send, args=(s,), daemon=True))
            threads[-1].start()
        wait_until(
            lambda: fetch_stats(d.url)["buffers"]["put"]["used"] >= 28 * MiB,
            20,
            "the stalled PUTs to fill the budget",
        )
        x = torch.randn(MiB)  # 4 MiB
        with DaemonStore(d.url, io_timeout_s=10, reconnect_deadline_s=0.5) as victim:
            for _ in range(3):
                assert torch.equal(victim.get(victim.put(x)), x)
        snap = fetch_stats(d.url)
        assert snap["counters"]["put_preemptions"] > 0
        assert snap["buffers"]["put"]["used"] <= 32 * MiB + 8 * MiB  # + the oldest's rest
        wait_until(lambda: dropped, 10, "a dropped writer to be told why")
        assert dropped[0]["code"] == "BUSY" and "stalled" in str(dropped[0]["message"])
    finally:
        for s in writers:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(timeout=30)
        for s in writers:
            s.close()


def test_stalled_readers_do_not_hold_up_another_session(
    daemons: DaemonLauncher, tmp_path: Path
) -> None:
    cfg = _config(
        tmp_path,
        f"memory_quota: 0\nroot: {tmp_path / 'root'}\ndisk_quota: 2GiB\n"
        "limits:\n  get_buffer: 64MiB\n  session_get_buffer: 32MiB\n  read_timeout: 60s\n",
    )
    d = daemons.start("--config", cfg)
    big = torch.arange(8 * MiB, dtype=torch.float32)  # 32 MiB
    stores = [DaemonStore(d.url) for _ in range(4)]  # four sessions of one client
    try:
        with contextlib.ExitStack() as stack:
            for st in stores:
                key = st.put(big)
                assert st.session_id is not None
                stack.enter_context(_unread_gets(d.url, st.session_id, [key] * 4))
            time.sleep(1.0)  # the unread answers fill the GET budget (or, preempted, wait)
            x = torch.randn(2 * MiB)  # 8 MiB, read from disk in one piece
            with DaemonStore(d.url, io_timeout_s=10, reconnect_deadline_s=0.5) as victim:
                for _ in range(5):
                    assert torch.equal(victim.get(victim.put(x)), x)
            snap = fetch_stats(d.url)
            assert snap["counters"]["get_preemptions"] > 0
            assert snap["buffers"]["get"]["used"] <= 64 * MiB
    finally:
        for st in stores:
            st.close()
    assert "Traceback" not in d.log()


def _read_answer(sock: socket.socket) -> tuple[dict[str, object], bytearray]:
    """One whole answer (continuation frames joined) into a preallocated buffer."""
    from tensorstore_hooks.protocol import PREFIX_BYTES, parse_prefix, unpack_header

    def exact(view: memoryview) -> None:
        while view:
            n = sock.recv_into(view)
            assert n, "EOF inside an answer"
            view = view[n:]

    prefix = bytearray(PREFIX_BYTES)
    exact(memoryview(prefix))
    header_len, first = parse_prefix(prefix)
    raw = bytearray(header_len)
    exact(memoryview(raw))
    header = unpack_header(raw)
    body = bytearray(int(header.get("size", 0)))
    exact(memoryview(body)[:first])
    pos = first
    while pos < len(body):
        exact(memoryview(prefix))
        hl, pl = parse_prefix(prefix)
        assert hl == 0, "an error frame cut the answer off"
        exact(memoryview(body)[pos : pos + pl])
        pos += pl
    return header, body


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_preempted_answers_come_back_whole(
    daemons: DaemonLauncher, tmp_path: Path, tls: bool
) -> None:
    # Readers that pause long enough to be preempted (their pieces read again from
    # disk, the interrupted TLS write repeated as it was) still get every byte.
    extra = ""
    ctx = None
    if tls:
        trustme = pytest.importorskip("trustme")
        ca = trustme.CA()
        ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
        pem = tmp_path / "server.pem"
        ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
        extra = f"tls_cert: {pem}\ntls_key: {pem}\n"
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    cfg = _config(
        tmp_path,
        f"memory_quota: 0\nroot: {tmp_path / 'root'}\ndisk_quota: 2GiB\n{extra}"
        "limits:\n  get_buffer: 16MiB\n  session_get_buffer: 16MiB\n",
    )
    d = daemons.start("--config", cfg)
    tensors = [torch.randint(0, 1 << 30, (6 * MiB,), dtype=torch.int32) for _ in range(3)]
    opts = {"tls_ca": str(tmp_path / "ca.pem")} if tls else {}
    with DaemonStore(d.url, **opts) as store:
        keys = [store.put(t) for t in tensors]
        sid = store.session_id
        assert sid is not None
        socks: list[socket.socket] = []
        try:
            for i, key in enumerate(keys * 2):  # 6 answers of 24 MiB, 16 MiB of budget
                s = socket.create_connection(("127.0.0.1", d.port), timeout=60)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)
                if ctx is not None:
                    s = ctx.wrap_socket(s, server_hostname="127.0.0.1")
                socks.append(s)
                assert raw_hello(s, session=sid)["ok"] is True
                send_frame(s, {"op": "get", "id": 100 + i, "key": key})
            time.sleep(0.5)
            for i, s in enumerate(socks):  # read them one after the other
                header, body = _read_answer(s)
                assert header["ok"] is True, header
                assert bytes(body) == tensors[i % 3].numpy().tobytes()
        finally:
            for s in socks:
                s.close()
        assert store.stats()["counters"]["get_preemptions"] > 0
    assert "Traceback" not in d.log()
