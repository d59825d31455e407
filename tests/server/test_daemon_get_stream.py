"""GET answers read from disk are streamed piece by piece under a budget per session
and in total (NOTE [ Answers read from disk ] in server/_payload.py): clients that do
not read their answers cost the daemon a bounded amount of memory and stall only
their own session. Real daemon processes, raw sockets for the clients that stall."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import psutil
import pytest
import torch

from tensorstore_hooks import StoreUnavailableError
from tensorstore_hooks.storage.daemon._client import DaemonStore, fetch_stats
from tests.daemon_fixtures import DaemonLauncher, daemons, raw_connect, raw_hello, send_frame

__all__ = ["daemons"]  # the fixture, re-exported for pytest

MiB = 1 << 20


def _rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def test_unread_answers_hold_bounded_memory(daemons: DaemonLauncher, tmp_path: Path) -> None:
    cfg = tmp_path / "server.yaml"
    cfg.write_text(
        f"listen: 127.0.0.1:0\nmemory_quota: 0\nroot: {tmp_path / 'root'}\ndisk_quota: 1GiB\n"
        "limits:\n  session_get_buffer: 16MiB\n  get_buffer: 64MiB\n  read_timeout: 20s\n"
    )
    d = daemons.start("--config", str(cfg))
    big = torch.arange(8 * MiB, dtype=torch.float32)  # 32 MiB, on disk (memory_quota 0)
    with DaemonStore(d.url) as stalled, DaemonStore(d.url) as other:
        key = stalled.put(big)
        assert torch.equal(stalled.get(key), big)  # warm the daemon's heap up
        sid = stalled.session_id
        assert sid is not None
        time.sleep(0.3)
        before = _rss(d.pid)

        socks: list[socket.socket] = []
        try:
            for i in range(8):  # 8 GETs of 32 MiB that nobody reads
                s = raw_connect(d.url)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
                socks.append(s)
                assert raw_hello(s, session=sid)["ok"] is True
                send_frame(s, {"op": "get", "id": 2 + i, "key": key, "head": False})
            peak = before
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                peak = max(peak, _rss(d.pid))
                time.sleep(0.02)
            # On the old daemon each GET read its whole tensor: 8 x 32 MiB.
            assert peak - before < 40 * MiB, f"RSS grew by {(peak - before) / MiB:.0f} MiB"
            snap = fetch_stats(d.url)
            held = snap["buffers"]["get"]
            assert 0 < held["used"] <= 16 * MiB and held["waits"] > 0, held

            # Another session is not held up by them.
            t = torch.randn(2 * MiB)  # 8 MiB, on disk too
            t0 = time.monotonic()
            assert torch.equal(other.get(other.put(t)), t)
            assert time.monotonic() - t0 < 5.0
        finally:
            for s in socks:
                s.close()
        # The stalled session gets its share back once those connections are gone.
        t0 = time.monotonic()
        assert torch.equal(stalled.get(key), big)
        assert time.monotonic() - t0 < 10.0
    assert "Traceback" not in d.log()


def test_streamed_answers_are_exact(daemons: DaemonLauncher, tmp_path: Path) -> None:
    d = daemons.start("--memory-quota", "0", "--root", str(tmp_path / "root"))
    tensors = [
        torch.randint(0, 255, (20 * MiB + 3,), dtype=torch.uint8),  # 3 pieces and a tail
        torch.randn(300, 101)[:, 1:],  # a gapped view (compact), a small chunk class
        torch.empty(0, 5),  # nothing to stream
        torch.randn(40000, dtype=torch.float64)[::3],  # strided, a 320 KiB span
    ]
    with DaemonStore(d.url) as store:
        for t in tensors:
            got = store.get(store.put(t))
            assert torch.equal(got, t) and got.stride() == t.stride() and got.dtype == t.dtype


def test_read_failure_mid_answer_is_reported(daemons: DaemonLauncher, tmp_path: Path) -> None:
    root = tmp_path / "root"
    d = daemons.start("--memory-quota", "0", "--root", str(root))
    t = torch.arange(6 * MiB, dtype=torch.float32)  # 24 MiB: 3 chunks of 8 MiB
    with DaemonStore(d.url) as store:
        key = store.put(t)
        small = store.put(torch.ones(10))
        chunks = sorted((root / "daemon").glob("seg-8388608/c/*"), key=lambda p: int(p.name))
        assert len(chunks) == 3
        # Damage the middle chunk: the first piece (8 MiB; with a rotated stream, chunk
        # 0 and the stream's tail in chunk 2) is sent before the second needs chunk 1.
        with open(chunks[1], "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(StoreUnavailableError, match=r"crc32c differs.*cut off"):
            store.get(key)
        assert torch.equal(store.get(small), torch.ones(10))  # the session goes on
    assert "GET answer cut off" in d.log()
