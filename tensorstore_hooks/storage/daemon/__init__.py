"""The storage daemon's client: ``tsh://`` and ``tsh+tls://`` stores.

Imported only when such a URL is opened (the registry loads it lazily).
"""

from __future__ import annotations

from tensorstore_hooks.storage.daemon._client import fetch_stats

__all__ = [
    "fetch_stats",
]
