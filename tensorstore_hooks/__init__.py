"""tensorstore-hooks: offload the tensors PyTorch autograd saves for backward.

During forward, saved activations go to a chunked Zarr store (local disk, memory,
any fsspec backend such as S3, or the storage daemon); in backward they are
prefetched and rehydrated onto their original device, bit-identically::

    import tensorstore_hooks as tsh

    with tsh.offload() as hooks:
        loss = model(batch).sum()
    loss.backward()
    print(hooks.stats)

Module map (a saved tensor's path, in order: ``docs/life-of-a-saved-tensor.md``):

* ``_hooks.py`` / ``paddle/`` - ``offload()`` and ``OffloadHooks``: pack and unpack
  wired to the pipeline's router (``HooksBase``: what both give a caller).
* ``_pipeline.py`` - ``Pipeline``: builds and wires the units below, and closes them.
* ``_router.py`` - ``Router``: keep / host / store for each saved tensor, and unpack.
* ``_records.py`` - the record table: every change to a record (intent methods, the
  lifecycle), pack order, dedup, finalizers.
* ``_writebehind.py`` - bytes into the store on I/O threads, backpressure, fallback.
* ``_device.py``, ``_staging.py``, ``_host_tier.py`` - staging: accelerator tensors
  through pinned host buffers, and the host tier.
* ``_prefetch.py`` - reads ahead of backward, newest first.
* ``_iopool.py``, ``_heap.py`` - the shared I/O threads; freed heap back to the OS.
* ``_retry.py`` - the one retry loop, with each layer's failure classifier;
  ``_signals.py`` - Ctrl-C kept out of the finalizers that free saved tensors.
* ``_store.py``, ``_zarr_store.py``, ``_chunkio.py``, ``_daemon_client.py``,
  ``_registry.py`` - the stores and ``open_store`` (one registry entry per URL
  scheme); ``_chain.py`` - ``TierChain``, several stores as one, fastest first;
  ``_urls.py`` the only store URL parser; ``_zarr_options.py`` chunk size
  and codec checks.
* ``_codec.py``, ``_adapters.py``, ``_paddle_bridge.py`` - tensor <-> bytes; other
  frameworks' tensors through adapters.
* ``_config.py``, ``_policy.py``, ``_scope.py``, ``_units.py`` - settings and rules.
* ``_report.py`` - ``hooks.report()`` (per module path: what was saved, the action and
  the rule; the device-budget curve) and the figures the trainer callbacks log;
  ``_caller.py`` - errors that name the public function the user called.
* ``_capture.py`` - ``capture()``: module hooks streaming intermediates and gradients
  into plain Zarr arrays under ``ROOT/capture/`` (``_capture_writer.py`` appends them on
  I/O threads, ``_capture_layout.py`` is their layout); ``_capture_dataset.py`` -
  ``CaptureDataset`` reads them back (``_capture_source.py``: from a URL or an object).
"""

from __future__ import annotations

from ._capture import Capture, capture
from ._capture_dataset import CaptureDataset
from ._capture_writer import CaptureStats
from ._chain import TierChain
from ._chain_stats import ChainStats, TierStats
from ._codec import TensorMeta
from ._config import EffectiveConfig, load_config
from ._hooks import OffloadHooks, offload
from ._policy import Decision, Policy, Rule
from ._registry import open_store, register_store
from ._router import Router
from ._stats import OffloadStats, RouteStats
from ._store import BlobStore, TensorStore
from ._wrap import unwrap, wrap
from ._zarr_store import ZarrStore
from .errors import (
    ConfigError,
    IntegrityError,
    KeyNotFoundError,
    QuotaExceededError,
    StoreClosedError,
    StoreUnavailableError,
    TensorStoreError,
    UnsupportedTensorError,
)

__version__ = "0.1.0"

__all__ = [
    "BlobStore",
    "Capture",
    "CaptureDataset",
    "CaptureStats",
    "ChainStats",
    "ConfigError",
    "Decision",
    "EffectiveConfig",
    "IntegrityError",
    "KeyNotFoundError",
    "OffloadHooks",
    "OffloadStats",
    "Policy",
    "QuotaExceededError",
    "RouteStats",
    "Router",
    "Rule",
    "StoreClosedError",
    "StoreUnavailableError",
    "TensorMeta",
    "TensorStore",
    "TensorStoreError",
    "TierChain",
    "TierStats",
    "UnsupportedTensorError",
    "ZarrStore",
    "__version__",
    "capture",
    "load_config",
    "offload",
    "open_store",
    "register_store",
    "unwrap",
    "wrap",
]
