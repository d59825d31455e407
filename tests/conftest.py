"""Shared fixtures: seeds, the fake accelerator's stream-rule check, temporary store
URLs, and the ``cuda`` marker.

Keep this small. Store-specific fixtures live next to the tests that use them
(``store`` for :class:`tensorstore_hooks.testing.StoreConformance` is defined by each
subclass's module).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

# Real daemon processes: tests/daemon_fixtures.py, imported by the modules that
# start one (most tests never do, so its fixtures are not loaded for every module).

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
"""Use together with ``@pytest.mark.cuda``; see :func:`pytest_collection_modifyitems`."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test marked ``cuda`` is skipped, visibly, where no device exists, even if its
    # author forgot ``requires_cuda``: never a silent pass on CPU.
    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(requires_cuda)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same RNG state (equivalence tests seed again)."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


@pytest.fixture(autouse=True)
def _fresh_fakes() -> Iterator[None]:
    """No test breaks a rule of NOTE [ Stream ordering ] on the fake accelerator
    (``tests/fake_accelerator.py``) unnoticed: after the test body, every fake made
    during the test must have recorded no violation. A test that breaks the rules on
    purpose checks what it expected and clears it (``ops.violations.clear()``)."""
    from tests.fake_accelerator import broken_rules

    broken_rules()  # forget fakes made before this test (at import, by other tests)
    yield
    broken = broken_rules()
    if broken:
        shown = "\n  ".join(broken[:5])
        more = f"\n  ... and {len(broken) - 5} more" if len(broken) > 5 else ""
        pytest.fail(
            f"the fake accelerator recorded {len(broken)} stream-rule violation(s) "
            f"(NOTE [ Stream ordering ], tests/fake_cuda.py) that the test did not "
            f"expect and clear:\n  {shown}{more}",
            pytrace=False,
        )


@pytest.fixture
def file_url(tmp_path: Path) -> str:
    """A ``file://`` URL of an empty directory, removed by pytest."""
    return f"file://{tmp_path / 'store'}"


@pytest.fixture(params=["file", "memory"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A store URL: a temporary directory, then ``memory://``."""
    if request.param == "file":
        yield f"file://{tmp_path / 'store'}"
    else:
        yield "memory://"
