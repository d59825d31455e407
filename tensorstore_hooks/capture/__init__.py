"""Capture: module hooks that stream chosen intermediates and gradients into plain
Zarr arrays under ``ROOT/capture/``, and :class:`CaptureDataset`, which reads them back.
"""

from __future__ import annotations

from tensorstore_hooks.capture._capture import Capture, capture
from tensorstore_hooks.capture._dataset import CaptureDataset
from tensorstore_hooks.capture._layout import DamagedDocument, list_arrays, scan_arrays
from tensorstore_hooks.capture._repair import repair_array
from tensorstore_hooks.capture._writer import CaptureStats

__all__ = [
    "Capture",
    "CaptureDataset",
    "CaptureStats",
    "DamagedDocument",
    "capture",
    "list_arrays",
    "repair_array",
    "scan_arrays",
]
