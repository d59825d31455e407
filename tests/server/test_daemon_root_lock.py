"""A second daemon on a live root (NOTE [ One daemon per root ] in server/_root.py):
refused before it reads, sweeps, changes or removes anything under the root, saying
that the root is in use and by which pid. Real daemon processes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from tensorstore_hooks.storage.daemon._client import DaemonStore
from tests.daemon_fixtures import DaemonLauncher, daemons

__all__ = ["daemons"]  # the fixture, re-exported for pytest

KiB = 1 << 10
MiB = 1 << 20


def _tree(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file and directory under ``root``: mode, size and a digest of the bytes."""
    out: dict[str, tuple[int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            full = Path(dirpath, name)
            st = full.lstat()
            digest = hashlib.sha256(full.read_bytes()).hexdigest() if full.is_file() else ""
            out[str(full.relative_to(root))] = (st.st_mode, st.st_size, digest)
    return out


def test_second_daemon_touches_nothing_under_a_live_root(
    daemons: DaemonLauncher, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    d = daemons.start("--memory-quota", "0", "--root", str(root), "--disk-quota", "256MiB")
    with DaemonStore(d.url) as store:
        kept = {store.put(t): t for t in (torch.full((n,), float(n)) for n in (1, 4096, MiB))}
        # A PUT in flight on the live daemon: its chunk file is written, its index
        # record not yet. The old start-up sweep deleted exactly such files.
        segment = next((root / "daemon").glob("seg-*/c")).parent
        planted = segment / "c" / "99999"
        planted.write_bytes(b"\x5a" * (4 * KiB))
        root.chmod(0o750)  # a start would tighten this (NOTE [ Private root ], rule 2)
        before = _tree(root)

        for _ in range(3):  # a restart script that does not wait for the drain
            out = daemons.run(
                "--listen", "127.0.0.1:0", "--memory-quota", "0", "--root", str(root)
            )
            assert out.returncode == 2, out.stderr
            assert "in use by another daemon" in out.stderr, out.stderr
            assert f"pid {d.pid} " in out.stderr, out.stderr
            assert "cannot listen" not in out.stderr
        assert _tree(root) == before  # nothing read-modified, tightened or removed
        assert planted.read_bytes() == b"\x5a" * (4 * KiB)
        for key, t in kept.items():
            assert torch.equal(store.get(key), t)
    assert d.terminate() == 0
    # Once the first daemon is gone the root is free again (the kernel dropped its lock).
    d2 = daemons.start("--memory-quota", "0", "--root", str(root))
    assert d2.alive()
