"""The conformance suite for :class:`~tensorstore_hooks.storage.io.ChunkIO`, the
object I/O under ``ZarrStore`` (one backend per module in ``storage/io/``).

The zarr-python ``testing/store.py`` pattern: a generic test class that each backend
subclasses with its fixture and two raw helpers that reach the backend *around* the
object under test, so a write is checked by what really landed and a read by what
was really there::

    import pytest
    from tensorstore_hooks.testing import ChunkIOConformance

    class TestMyIO(ChunkIOConformance):
        @pytest.fixture
        def io(self, tmp_path):
            io = MyIO(...)   # an empty root
            yield io
            io.close()

        def set_raw(self, io, path, data): ...   # put bytes at ``path`` directly
        def get_raw(self, io, path): ...         # bytes at ``path``, or None

Optional capabilities are declared by the backend's class attributes and each test
follows them: ``supports_append`` (``open_append``/``truncate``; without it
``open_append`` raises ``NotImplementedError``), locks (``lock`` returns ``None``
where there are none) and direct I/O (``configure_direct_io`` answers off, with a
reason, where it cannot be had).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tensorstore_hooks import ConfigError
from tensorstore_hooks.storage.io import Buffer, ChunkIO

__all__ = ["ChunkIOConformance"]


class ChunkIOConformance:
    """What every :class:`~tensorstore_hooks.storage.io.ChunkIO` backend promises.

    A subclass provides an ``io`` fixture (a backend on an empty root) and the two raw
    helpers below. The tests check writes (any buffer type, replace, sized writes),
    reads (``read``, ``read_many``, ``readinto``; a missing object is
    ``FileNotFoundError``), the inventory (``exists``, ``listdir``), removal
    (``delete``, ``remove_tree``, ``replace``), the optional capabilities, and writes
    and reads from several threads.
    """

    def set_raw(self, io: ChunkIO, path: str, data: bytes) -> None:
        """Put ``data`` at ``path`` under ``io``'s root without going through ``io``."""
        raise NotImplementedError

    def get_raw(self, io: ChunkIO, path: str) -> bytes | None:
        """The bytes at ``path`` under ``io``'s root, read without ``io``; ``None`` if absent."""
        raise NotImplementedError

    # ------------------------------------------------------------------ write
    def test_write_joins_parts_of_any_buffer_type(self, io: ChunkIO) -> None:
        """``write`` joins bytes, bytearray, memoryview and numpy parts, byte for byte."""
        parts: list[Buffer] = [
            b"ab",
            bytearray(b"cd"),
            memoryview(b"ef"),
            np.frombuffer(b"gh", dtype=np.uint8),
            np.array([0x6A6A6969], dtype="<u4"),  # a multi-byte element type
        ]
        io.write("a/b/obj", parts)
        assert self.get_raw(io, "a/b/obj") == b"abcdefghiijj"

    def test_write_replaces_a_longer_object(self, io: ChunkIO) -> None:
        """``write`` replaces an object whole: no tail of a longer one is left."""
        io.write("x", [b"0123456789"])
        io.write("x", [b"abc"])
        assert self.get_raw(io, "x") == b"abc"

    def test_write_many(self, io: ChunkIO) -> None:
        """``write_many`` writes every object it is given."""
        io.write_many([(f"d/{i}", [bytes([i]) * (i + 1)]) for i in range(5)])
        for i in range(5):
            assert self.get_raw(io, f"d/{i}") == bytes([i]) * (i + 1)

    def test_write_sized_pads_a_new_object_with_zeros(self, io: ChunkIO) -> None:
        """``write_sized`` makes a new object of ``size`` bytes, zeros after the parts."""
        io.write_sized("z/new", [b"abc", memoryview(b"de")], 12)
        assert self.get_raw(io, "z/new") == b"abcde" + bytes(7)

    def test_write_sized_sets_the_size_of_an_existing_object(self, io: ChunkIO) -> None:
        """``write_sized`` shrinks or grows an existing object to ``size`` bytes."""
        self.set_raw(io, "z/long", b"x" * 100)
        io.write_sized("z/long", [b"ab"], 10)
        got = self.get_raw(io, "z/long")
        assert got is not None and len(got) == 10 and got.startswith(b"ab")
        self.set_raw(io, "z/short", b"y")
        io.write_sized("z/short", [b"cd"], 9)
        got = self.get_raw(io, "z/short")
        assert got is not None and len(got) == 9 and got.startswith(b"cd")

    def test_direct_io_status_and_refusal(self, io: ChunkIO) -> None:
        """NOTE [ Direct I/O ]: every backend answers ``configure_direct_io``; one that
        cannot do it says why under ``auto`` and refuses ``on`` with a ConfigError."""
        status = io.configure_direct_io("auto", "ns/direct-probe")
        assert status.mode == "auto" and io.direct_io is status
        assert io.uses_direct_io is status.enabled
        if status.enabled:
            assert status.reason == "" and status.describe() == "on"
        else:
            assert status.reason and status.describe().startswith("off (")
            with pytest.raises(ConfigError, match="direct_io='on'"):
                io.configure_direct_io("on", "ns/direct-probe")
        assert self.get_raw(io, "ns/direct-probe") is None  # the probe leaves nothing

    # ------------------------------------------------------------------- read
    def test_read_what_is_there(self, io: ChunkIO) -> None:
        """``read`` returns the object's bytes."""
        self.set_raw(io, "r/obj", b"hello")
        assert bytes(io.read("r/obj")) == b"hello"

    def test_read_missing_is_file_not_found(self, io: ChunkIO) -> None:
        """``read`` and ``read_many`` of a missing object raise ``FileNotFoundError``."""
        with pytest.raises(FileNotFoundError):
            io.read("nope")
        with pytest.raises(FileNotFoundError):
            io.read_many(["nope", "also-nope"])

    def test_read_many_keeps_order(self, io: ChunkIO) -> None:
        """``read_many`` answers in the order of the paths asked."""
        for i in range(6):
            self.set_raw(io, f"m/{i}", str(i).encode() * 3)
        got = io.read_many([f"m/{i}" for i in (5, 0, 3)])
        assert [bytes(g) for g in got] == [b"555", b"000", b"333"]

    def test_readinto_fills_views_in_order(self, io: ChunkIO) -> None:
        """``readinto`` fills the views in order, reports each one filled, returns the size."""
        self.set_raw(io, "v", bytes(range(10)))
        a, b, c = bytearray(3), bytearray(4), bytearray(3)
        done: list[int] = []
        size = io.readinto("v", [memoryview(a), memoryview(b), memoryview(c)], done.append)
        assert size == 10
        assert bytes(a) + bytes(b) + bytes(c) == bytes(range(10))
        assert done == [0, 1, 2]

    def test_readinto_a_short_object_reports_its_size(self, io: ChunkIO) -> None:
        """``readinto`` of an object shorter than the views fills what it has and says so."""
        self.set_raw(io, "short", b"abcde")
        a, b = bytearray(4), bytearray(4)
        done: list[int] = []
        assert io.readinto("short", [memoryview(a), memoryview(b)], done.append) == 5
        assert bytes(a) == b"abcd" and bytes(b)[:1] == b"e"
        assert done == [0]  # the second view was not completed

    def test_readinto_missing_is_file_not_found(self, io: ChunkIO) -> None:
        """``readinto`` of a missing object raises ``FileNotFoundError``."""
        with pytest.raises(FileNotFoundError):
            io.readinto("nope", [memoryview(bytearray(4))])

    # -------------------------------------------------------------- inventory
    def test_exists_objects_and_prefixes(self, io: ChunkIO) -> None:
        """``exists`` is True for an object and for each folder above it, False otherwise."""
        self.set_raw(io, "e/f/g", b"1")
        assert io.exists("e/f/g")
        assert io.exists("e/f") and io.exists("e")
        assert not io.exists("e/f/h") and not io.exists("x")

    def test_listdir_names_one_level(self, io: ChunkIO) -> None:
        """``listdir`` names the entries one level down, sorted; ``[]`` for a missing folder."""
        for p in ("l/a", "l/b/c", "l/b/d", "other"):
            self.set_raw(io, p, b"1")
        assert io.listdir("l") == ["a", "b"]
        assert io.listdir("l/b") == ["c", "d"]
        assert io.listdir("missing") == []

    # ---------------------------------------------------------------- removal
    def test_delete_ignores_missing(self, io: ChunkIO) -> None:
        """``delete`` removes what exists, skips what does not, touches nothing else."""
        self.set_raw(io, "del/a", b"1")
        self.set_raw(io, "del/b", b"2")
        io.delete(["del/a", "del/missing"])
        assert self.get_raw(io, "del/a") is None
        assert self.get_raw(io, "del/b") == b"2"
        io.delete([])

    def test_remove_tree_leaves_siblings(self, io: ChunkIO) -> None:
        """``remove_tree`` removes a folder, not a sibling that shares its name's prefix."""
        for p in ("t/x/1", "t/x/y/2", "t/xy", "t/z"):
            self.set_raw(io, p, b"1")
        io.remove_tree("t/x")
        assert self.get_raw(io, "t/x/1") is None and self.get_raw(io, "t/x/y/2") is None
        assert self.get_raw(io, "t/xy") == b"1" and self.get_raw(io, "t/z") == b"1"
        io.remove_tree("t/absent")

    def test_replace_moves_over(self, io: ChunkIO) -> None:
        """``replace`` moves an object over another, which it replaces."""
        self.set_raw(io, "s", b"new")
        self.set_raw(io, "d", b"old-and-longer")
        io.replace("s", "d")
        assert self.get_raw(io, "d") == b"new"
        assert self.get_raw(io, "s") is None

    # ---------------------------------------------------------- capabilities
    def test_append_and_truncate_where_supported(self, io: ChunkIO) -> None:
        """With ``supports_append``: appends land in order, ``truncate`` cuts; without it
        ``open_append`` raises ``NotImplementedError``."""
        if not io.supports_append:
            with pytest.raises(NotImplementedError):
                io.open_append("j/journal")
            return
        f = io.open_append("j/journal")
        try:
            f.write(b"one")
            f.write(b"two")
            assert self.get_raw(io, "j/journal") == b"onetwo"
            f.truncate(3)
            f.write(b"!")
            assert self.get_raw(io, "j/journal") == b"one!"
        finally:
            f.close()
        io.truncate("j/journal")
        assert self.get_raw(io, "j/journal") == b""

    def test_lock_excludes_a_second_holder_where_supported(self, io: ChunkIO) -> None:
        """A held lock refuses a second holder with ``BlockingIOError``; releasing is
        idempotent; a backend without locks answers ``None``, never an error."""
        release = io.lock("ns/lock")
        if release is None:
            assert io.lock("ns/lock") is None  # no locks: documented, never an error
            return
        try:
            with pytest.raises(BlockingIOError, match="held by pid"):
                io.lock("ns/lock")
        finally:
            release()
        release()  # idempotent
        again = io.lock("ns/lock")
        assert again is not None
        again()

    def test_concurrent_writes_and_reads(self, io: ChunkIO) -> None:
        """Four threads write and read their own objects at once; each reads what it wrote."""
        errors: list[BaseException] = []

        def work(n: int) -> None:
            try:
                for i in range(20):
                    path = f"c/{n}/{i}"
                    io.write(path, [bytes([n]) * 100, bytes([i])])
                    assert bytes(io.read(path)) == bytes([n]) * 100 + bytes([i])
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:1]
