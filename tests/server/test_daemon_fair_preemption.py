"""A request of a session under its fair share waits about one piece's time for
holders of sessions over theirs that do not move their bytes, not ``PUT_STALL_S``
per piece (issue 36, finding 7; NOTE [ Fair preemption ] in ``server/_payload.py``).
Real daemon processes; raw sockets for the clients that stall."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import tensorstore_hooks as tsh
from tensorstore_hooks.protocol import message_head
from tensorstore_hooks.storage.daemon._client import DaemonStore, fetch_stats
from tests.daemon_fixtures import DaemonLauncher, daemons, raw_connect, raw_hello, wait_until

__all__ = ["daemons"]  # the fixture, re-exported for pytest

MiB = 1 << 20
PUT_STALL_S = 0.5  # server/_payload.py: what the old daemon made a victim wait per drop
PIECE = MiB  # server/_payload.py PIECE_BYTES


@contextlib.contextmanager
def _trickling_puts(url: str, sessions: int, per_session: int, size: int) -> Iterator[list[int]]:
    """``sessions`` sessions, each with ``per_session`` writers that send almost half
    of a PUT of ``size`` bytes (16 MiB: 7.5 MiB) and then 4 KiB every 100 ms (never
    blocked for PUT_STALL_S, never done: the rest of the piece takes minutes), and
    when the daemon drops them come back at once and do it again. Yields the count of
    their drops."""
    meta = tsh.TensorMeta("uint8", (size,), (1,), 0, False, "cpu", False, size).to_dict()
    head = message_head({"op": "put", "id": 2, "meta": meta, "size": size}, size)
    half = head + bytes(size // 2 - size // 32)  # a quarter piece short of 8 pieces
    trickle = bytes(4 << 10)
    stop = threading.Event()
    drops = [0]
    live: set[socket.socket] = set()
    lock = threading.Lock()

    def writer(sid: str) -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError), raw_connect(url, timeout_s=60) as s:
                with lock:
                    live.add(s)
                try:
                    assert raw_hello(s, session=sid)["ok"] is True
                    s.sendall(half)  # blocks while the daemon does not read
                    while not stop.wait(0.1):  # then a trickle, until it is dropped
                        s.sendall(trickle)
                finally:
                    with lock:
                        live.discard(s)
            with lock:
                drops[0] += 1

    sids = []
    for _ in range(sessions):
        with raw_connect(url) as s:
            sids.append(str(raw_hello(s)["session"]))
    threads = [
        threading.Thread(target=writer, args=(sid,), daemon=True)
        for sid in sids
        for _ in range(per_session)
    ]
    for t in threads:
        t.start()
    try:
        yield drops
    finally:
        stop.set()
        with lock:
            for s in live:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(timeout=30)


def test_a_put_under_its_share_waits_about_a_piece_for_stalled_over_share_puts(
    daemons: DaemonLauncher, tmp_path: Path
) -> None:
    # Three sessions, three trickling writers each, hold the whole 64 MiB budget: about
    # 21 MiB a session, over its share once a fourth session asks (64 MiB // 5). Their peers are
    # never blocked for PUT_STALL_S (a trickle every 100 ms), so the old daemon never
    # dropped them: a victim session's PUT waited for their read timeout. Now a holder
    # of a session over its share blocked for FAIR_STALL_S gives way to a session under
    # its share, and the room up to the victim's share stays its own while its PUT is
    # in flight: each piece waits about one FAIR_STALL_S at most.
    path = tmp_path / "server.yaml"
    path.write_text(
        f"listen: 127.0.0.1:0\nmemory_quota: 0\nroot: {tmp_path / 'root'}\n"
        "disk_quota: 2GiB\nlimits:\n  put_buffer: 64MiB\n  read_timeout: 120s\n"
    )
    d = daemons.start("--config", str(path))
    x = torch.randn(2 * MiB)  # 8 MiB: 8 pieces, within the victim's share
    puts = 4
    with _trickling_puts(d.url, sessions=3, per_session=3, size=16 * MiB) as drops:
        wait_until(
            lambda: fetch_stats(d.url)["buffers"]["put"]["used"] >= 60 * MiB,
            30,
            "the trickling PUTs to fill the budget",
        )
        with DaemonStore(d.url, io_timeout_s=15, reconnect_deadline_s=1) as victim:
            victim.put(torch.zeros(1))  # the session and its connection, made untimed
            start = time.monotonic()
            keys = [victim.put(x) for _ in range(puts)]
            took = time.monotonic() - start
            for key in keys:
                assert torch.equal(victim.get(key), x)
        snap = fetch_stats(d.url)
    # The bound, generous for a loaded machine: PUT_STALL_S per PUT (8 pieces, each
    # waiting a FAIR_STALL_S or so); the old daemon made the first piece wait the
    # writers' read timeout (the victim's io_timeout_s, 15 s, ran out first).
    pieces = puts * x.numel() * 4 // PIECE
    assert took <= PUT_STALL_S * pieces / 8, (took, drops[0], snap["buffers"]["put"])
    assert snap["counters"]["put_preemptions"] > 0
    assert snap["buffers"]["put"]["used"] <= 64 * MiB + 8 * MiB  # + the oldest's rest
    assert "Traceback" not in d.log()
