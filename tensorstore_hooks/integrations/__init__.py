"""Thin callbacks that switch offloading on inside the trainers people use.

* :mod:`tensorstore_hooks.integrations.transformers`: ``OffloadCallback`` for the
  Hugging Face ``Trainer`` (needs ``pip install transformers accelerate``).
* :mod:`tensorstore_hooks.integrations.lightning`: ``OffloadCallback`` for
  ``lightning.pytorch.Trainer`` (needs ``pip install lightning``).

Neither framework is a dependency of tensorstore-hooks: each module imports its
framework when it is imported itself, and says which package to install if the
import fails.
"""

from __future__ import annotations

__all__ = ["missing_framework"]


def missing_framework(module: str, pip: str, integration: str, error: ImportError) -> ImportError:
    """The ``ImportError`` to raise when ``module`` is missing: names the ``pip install``."""
    return ImportError(
        f"tensorstore_hooks.integrations.{integration} needs {module!r}, which is not "
        f"installed ({error}); pip install {pip}"
    )
