"""Opening the disk tier and re-adopting a previous run's sessions and tensors.

NOTE [ Journal damage ]
Both journals (the disk tier's index, ``ROOT/daemon/index``, and the session journal,
``ROOT/daemon/sessions``) are framed, checksummed records (NOTE [ Journal records ] in
``tensorstore_hooks/_index.py``): replay skips a damaged record and goes on. At
start the daemon:

1. quarantines intact disk-index records with unusable content (an unknown dtype,
   bad extents, metadata the daemon would not store: NOTE [ Storable metadata ] in
   ``_tensor_rules``): logged with the file, the record and the reason, then retired
   with a delete record, so the store opens and the daemon starts. Their tensors are
   lost.
2. logs every damaged region of either journal (file, record ordinal, byte offset)
   and, best effort, what the damaged records seem to have said (untrusted: never
   used to adopt anything);
3. restores every session named by an intact record. A session whose own record was
   lost but whose key records are intact is restored from them (its tensors are not
   lost because one record is), unless the journal says it ended;
4. adopts every key record whose disk-tier tensor exists; key records whose tensor
   the disk tier does not have (its index record was damaged or quarantined) are
   reported as lost, by session and key;
5. deletes disk-tier tensors that no intact key record owns: after a crash these
   are the normal orphans of NOTE [ Crash ordering ] (INFO); when the session journal
   was damaged they are the damaged records' tensors, and the WARNING says so;
6. deletes chunk files that no disk-index entry covers (left by damaged or
   quarantined index records), so the disk quota counts what the directory holds.

A damaged record thus costs exactly the tensors it described, and the daemon always
starts: nothing found in the files is fatal except an unreadable root.
"""

from __future__ import annotations

import logging
import os
import re
import time
import warnings
from collections.abc import Callable
from typing import TypeAlias, TypeGuard

from tensorstore_hooks._codec import TensorMeta
from tensorstore_hooks._units import format_bytes
from tensorstore_hooks.storage import split_url
from tensorstore_hooks.storage.io import LocalIO
from tensorstore_hooks.storage.zarr import IndexEntry, IndexLog, ZarrStore, scan_journal

from ._costs import DISK_NAMESPACE
from ._disk import DiskTier
from ._journal import StateJournal
from ._root import prepare_root
from ._sessions import SessionTable
from ._tensor_rules import meta_problem

__all__ = ["open_disk", "recover"]

Extents: TypeAlias = tuple[int, int, int]
"""The chunks a disk-index entry covers: (size class, first chunk, chunk count)."""

log = logging.getLogger("tensorstore_hooks.server")

_SEGMENT_RE = re.compile(r"seg-(\d+)")


def open_disk(
    root: str, max_tensor_bytes: int
) -> tuple[ZarrStore, StateJournal, Callable[[], None]]:
    """Prepare and lock the root (NOTE [ Private root ], NOTE [ One daemon per root ]),
    quarantine unusable disk-index records, open the disk tier and the session journal.
    Damage is logged, never fatal. Returns them and the function that releases the
    root's lock (call it after the store is closed)."""
    kind, location = split_url(root)
    unlock: Callable[[], None] = _nothing
    if kind == "local":
        unlock = prepare_root(location)  # the lock comes first: nothing is read before it
    try:
        if kind == "local":
            live = _quarantine_index(location, max_tensor_bytes)
            if live is not None:  # never sweep against an index that could not be read
                _sweep_stray_chunks(location, live)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            # No spare chunk files: the disk quota counts what the directory holds.
            disk = ZarrStore(root, namespace=DISK_NAMESPACE, spare_bytes=0)
        for w in caught:
            log.warning("disk tier: %s", w.message)
        return disk, StateJournal(root), unlock
    except BaseException:
        unlock()
        raise


def _nothing() -> None:
    pass


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _index_entry_extents(entry: IndexEntry, max_tensor_bytes: int) -> Extents | str:
    """The chunks this index entry covers, or why the disk tier could not use it."""
    try:
        seg, start, count = entry["seg"], entry["start"], entry["count"]
        meta = TensorMeta.from_dict(entry["meta"])
    except KeyError as e:
        return f"missing field {e.args[0]!r}"
    except Exception as e:
        return str(e)
    if not (_is_count(seg) and _is_count(start) and _is_count(count)):
        return f"bad extents {[seg, start, count]!r}"
    problem = meta_problem(meta, max_tensor_bytes)
    return problem[1] if problem is not None else (seg, start, count)


def _record_numbers(io: LocalIO, path: str) -> dict[str, int]:
    """Key -> ordinal of its last record in ``path`` (for messages)."""
    try:
        raw = bytes(io.read(path))
    except OSError:
        return {}
    return {key: i + 1 for i, (_, key, _) in enumerate(scan_journal(raw, path).records)}


def _quarantine_index(location: str, max_tensor_bytes: int) -> dict[str, Extents] | None:
    """Retire disk-index records the store would refuse; returns the extents of the
    usable entries (None if the index cannot be read: the store's own open then says why)."""
    io = LocalIO(location)
    directory = f"{DISK_NAMESPACE}/index"
    index = IndexLog(io, directory, warn=False)  # the store reports damage when it opens
    try:
        entries = index.load()
    except Exception as e:  # the store's own open reports it properly
        log.debug("pre-reading the disk-tier index failed: %r", e)
        return None
    usable: dict[str, Extents] = {}
    bad: dict[str, str] = {}
    for k, entry in entries.items():
        found = _index_entry_extents(entry, max_tensor_bytes)
        if isinstance(found, str):
            bad[k] = found
        else:
            usable[k] = found
    if bad:
        numbers = _record_numbers(io, f"{directory}/journal")
        for key, why in bad.items():
            where = (
                f"{location}/{directory}/journal record {numbers[key]}"
                if key in numbers
                else f"{location}/{directory}/snapshot"
            )
            log.warning(
                "disk-tier index %s (key %s) quarantined: %s; the record is skipped and "
                "its tensor lost",
                where,
                key,
                why,
            )
            index.record_delete(key)
    index.close()
    return usable


def _sweep_stray_chunks(location: str, live: dict[str, Extents]) -> None:
    """Delete chunk files no live disk-index entry covers (NOTE [ Journal damage ] 6)."""
    covered: set[tuple[int, int]] = set()
    for seg, start, count in live.values():
        covered.update((seg, start + i) for i in range(count))
    ns_dir = os.path.join(location, DISK_NAMESPACE)
    stray = 0
    nbytes = 0
    try:
        segments = [m for name in os.listdir(ns_dir) if (m := _SEGMENT_RE.fullmatch(name))]
    except FileNotFoundError:
        return
    for m in segments:
        chunk = int(m.group(1))
        cdir = os.path.join(ns_dir, m.group(0), "c")
        try:
            names = os.listdir(cdir)
        except FileNotFoundError:
            continue
        for name in names:
            if not name.isdigit() or (chunk, int(name)) in covered:
                continue
            path = os.path.join(cdir, name)
            try:
                nbytes += os.path.getsize(path)
                os.unlink(path)
                stray += 1
            except OSError as e:
                log.warning("cannot delete stray chunk file %s: %s", path, e)
    if stray:
        log.warning(
            "deleted %d chunk files (%s) that no disk-tier index entry covers (left by "
            "damaged or quarantined index records, or a crash mid-write)",
            stray,
            format_bytes(nbytes),
        )


def recover(table: SessionTable, tier: DiskTier, journal: StateJournal) -> None:
    """Re-adopt the previous run's sessions and disk-tier tensors (NOTE [ Journal damage ])."""
    replay = journal.load()
    for q in replay.quarantined:
        log.warning("session journal: %s; skipped", q)
    for d in replay.damage:
        log.warning("session journal damaged: %s", d)
    if replay.readings:
        log.warning(
            "the damaged session-journal records seem to have said (unchecked): %s",
            "; ".join(replay.readings),
        )
    disk = tier.store
    for sid, created in replay.sessions.items():
        table.restore(sid, created)
    implied: dict[str, int] = {}
    for rec in replay.keys.values():
        if rec.session not in replay.sessions and rec.session not in replay.ended:
            implied[rec.session] = implied.get(rec.session, 0) + 1
    for sid, n in implied.items():
        s = table.restore(sid, time.time())
        log.warning(
            "session %s: its own journal record is missing or damaged; restored from its "
            "%d intact key records",
            s.label,
            n,
        )
    on_disk = set(disk.keys())
    adopted: set[str] = set()
    lost: dict[str, list[str]] = {}
    for key, rec in replay.keys.items():
        owner = table.get(rec.session)
        if owner is None or rec.disk_key in adopted:
            continue  # its session ended: an orphan (collected below)
        if rec.disk_key not in on_disk:
            lost.setdefault(owner.label, []).append(key)
            continue
        table.restore_key(key, owner, disk.meta(rec.disk_key), rec)
        adopted.add(rec.disk_key)
    if lost:
        log.warning(
            "%d acknowledged tensors are lost: the disk tier has no data for them (their "
            "disk-index records were damaged or quarantined, see above): %s",
            sum(len(v) for v in lost.values()),
            "; ".join(f"session {sid}: keys {', '.join(keys)}" for sid, keys in lost.items()),
        )
    orphans = sorted(on_disk - adopted)
    orphan_bytes = sum(disk.meta(k).nbytes for k in orphans)
    if orphans:
        disk.delete_many(orphans)
        if replay.damage:
            log.warning(
                "deleted %d disk-tier tensors (%s) that no intact session-journal record "
                "owns: the damaged records above described them (or crashed writes)",
                len(orphans),
                format_bytes(orphan_bytes),
            )
    table.compact_journal()
    tier.measure_docs()
    held = tier.held()
    if held > tier.quota:
        log.warning(
            "the disk tier holds %s, more than its quota of %s: no tensor goes to disk "
            "until its sessions free %s (stored tensors are kept)",
            format_bytes(held),
            format_bytes(tier.quota),
            format_bytes(held - tier.quota),
        )
    if replay.sessions or implied or on_disk:
        log.info(
            "recovered %d sessions and %d disk-tier tensors (%d bytes); collected %d orphans",
            len(replay.sessions) + len(implied),
            len(adopted),
            tier.files,
            len(orphans),
        )
