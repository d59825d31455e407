"""The daemon's values: sessions, stored tensors and journaled ownership.

Shared by ``_sessions`` (who owns what, accounting, journaling) and ``_tiers``
(where the bytes live); the dependency runs one way: ``_sessions`` -> ``_tiers`` ->
``_model`` (-> ``_costs``). A session's connections are the connection registry's
(``_conns``), not part of the session.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tensorstore_hooks._codec import TensorMeta

from ._costs import RAM_OVERHEAD_BYTES

__all__ = ["Entry", "KeyRecord", "Session"]


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """The journal's record of one disk-tier tensor's owner."""

    session: str
    """The owning session's id."""
    disk_key: str
    """The tensor's key in the disk tier (a ZarrStore namespace)."""
    nbytes: int
    """Payload bytes (as acknowledged to the client)."""


@dataclass(eq=False, slots=True)
class Session:
    """One client's namespace of keys. Event-loop thread only.

    Its byte counts are kept by :class:`~._sessions.SessionTable` (never by the tiers).
    """

    id: str
    """Secret: whoever knows it (and the token) can resume the session. Never logged whole."""
    created: float
    """Wall-clock time of creation (survives restarts through the journal)."""
    last_seen: float
    """``time.monotonic()`` of the last request on any of its connections."""
    entries: dict[str, Entry] = field(default_factory=dict)
    ram_bytes: int = 0
    """Payload bytes of its tensors held in RAM (also while they are being spilled)."""
    disk_bytes: int = 0
    """Payload bytes of its tensors on the disk tier."""
    reserved_bytes: int = 0
    """Session-quota bytes held by its PUTs in flight."""
    persisted: bool = False
    """True once the journal knows this session (it has had a tensor on disk)."""
    ended: bool = False
    requests: int = 0

    @property
    def label(self) -> str:
        """A loggable prefix of the id."""
        return self.id[:8]

    @property
    def nbytes(self) -> int:
        """Payload bytes the session holds, RAM + disk."""
        return self.ram_bytes + self.disk_bytes

    @property
    def charged_bytes(self) -> int:
        """What counts against ``--session-quota``: payload + per-tensor overhead of its
        tensors, and its PUTs in flight."""
        return self.nbytes + len(self.entries) * RAM_OVERHEAD_BYTES + self.reserved_bytes


@dataclass(eq=False, slots=True)
class Entry:
    """One stored tensor. In RAM while ``buf`` is set (also while spilling), else on disk."""

    key: str
    owner: Session
    meta: TensorMeta
    buf: np.ndarray | None
    disk_key: str | None = None
    """Its key in the disk tier, set once its bytes are there *and* journaled."""
    spilling: bool = False
    freed: bool = False
    readers: int = 0
    """GET answers streaming it from disk; its chunks are deleted after the last one."""
    answers: int = 0
    """GET answers sending its RAM buffer; the buffer stays counted in RAM until the
    last one ends, even once the tensor is deleted or spilled (NOTE [ Quota accounting ])."""
    answer_charge: int = 0
    """RAM still counted for those answers after the tensor left RAM (0 otherwise)."""

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes

    @property
    def tier(self) -> str:
        return "ram" if self.buf is not None else "disk"
