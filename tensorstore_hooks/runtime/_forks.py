"""Which process opened a store or a pipeline, so a forked child leaves them alone.

NOTE [ Fork safety ]
A child made by ``fork()`` (DataLoader workers, ``multiprocessing`` with fork, a
bare ``os.fork()``) inherits every store, pipeline, finalizer, lock and atexit
handler of its parent, but none of its threads. Acting on the parent's store from
there destroys what the parent still needs: a child that frees its copy of a graph
deletes the keys, closing the store unlinks chunk files and releases the parent's
namespace lock (``flock`` locks belong to the open file both processes share), a
temporary store's finalizer removes the whole directory at the child's exit, and a
wrapped module running in the child writes into the parent's namespace over chunks
the parent allocates next. So, with :func:`foreign` (the pid recorded at open is
not this process's):

1. A store opened by another process is read-only here: ``put``/``delete`` raise
   :class:`~tensorstore_hooks.StoreUnavailableError` naming the fix (open a store
   of your own); ``close()``, finalizers and the namespace lock do nothing to it.
2. A pipeline made by another process keeps every tensor packed here in memory
   (``Router``), and its handles' finalizers free nothing here (``_records``).
3. I/O pools made by another process are not used here (their threads do not
   exist); one made here is this process's own.

A child may open and use stores of its own: they record its pid (and a default
namespace is named by it). Checks read ``os.getpid()`` when they run rather than
registering at-fork handlers: nothing process-wide is installed for this.
"""

from __future__ import annotations

import os

__all__ = ["foreign"]


def foreign(pid: int) -> bool:
    """Whether this process is not ``pid`` (the one that opened the thing that recorded it)."""
    return os.getpid() != pid
