"""The error hierarchy of tensorstore-hooks.

One shallow tree rooted at :class:`TensorStoreError`. Each error also inherits the
builtin exception callers already catch (``KeyError``, ``ValueError``, ...), so code
written against plain Python keeps working. Messages name the component, the
key/path/field that was wrong, and what to do about it; wrapped causes are chained
with ``raise ... from e``.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "IntegrityError",
    "KeyNotFoundError",
    "QuotaExceededError",
    "StoreClosedError",
    "StoreUnavailableError",
    "TensorStoreError",
    "UnsupportedTensorError",
]


class TensorStoreError(Exception):
    """Base class of every error raised by tensorstore-hooks."""


class ConfigError(TensorStoreError, ValueError):
    """A configuration value (keyword, YAML field, URL, size) is invalid.

    The message names the source (file or keyword), the field path such as
    ``policy.rules[2].action``, the bad value and what is allowed.
    """


class KeyNotFoundError(TensorStoreError, KeyError):
    """A key is not in the store (never written, already deleted, or another session's)."""

    def __str__(self) -> str:
        # KeyError.__str__ repr()s its argument, which would quote the whole message.
        return str(self.args[0]) if self.args else ""


class IntegrityError(TensorStoreError):
    """Stored bytes failed verification: checksum mismatch, truncated chunk, bad metadata."""


class QuotaExceededError(TensorStoreError):
    """The store refused a write because its memory and disk quotas are full."""


class StoreUnavailableError(TensorStoreError, ConnectionError):
    """The store cannot be reached or used (closed, server gone, bucket missing, denied)."""


class UnsupportedTensorError(TensorStoreError, TypeError):
    """The tensor kind cannot be stored (sparse, quantized, nested, meta, subclass)."""


class StoreClosedError(StoreUnavailableError):
    """The store object was closed by its owner; no retry can help: open a new one."""
