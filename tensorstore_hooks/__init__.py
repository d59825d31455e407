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

* ``hooks/_offload.py`` / ``paddle/`` - ``offload()`` and ``OffloadHooks``: pack and unpack
  wired to the pipeline's router (``HooksBase``: what both give a caller).
* ``pipeline/_pipeline.py`` - ``Pipeline``: builds and wires the units below, and closes them.
* ``pipeline/_router.py`` - ``Router``: keep / host / store for each saved tensor, and unpack.
* ``pipeline/_records.py`` - the record table: every change to a record (intent methods, the
  lifecycle), pack order, dedup, finalizers.
* ``pipeline/_writebehind.py`` - bytes into the store on I/O threads, backpressure, fallback.
* ``pipeline/_device.py``, ``pipeline/_staging.py``, ``pipeline/_host_tier.py`` - staging: accelerator tensors
  through pinned host buffers, and the host tier.
* ``pipeline/_prefetch.py`` - reads ahead of backward, newest first.
* ``pipeline/_iopool.py``, ``runtime/_heap.py`` - the shared I/O threads; freed heap back to the OS.
* ``storage/_retry.py`` - the one retry loop, with each layer's failure classifier;
  ``runtime/_signals.py`` - Ctrl-C kept out of the finalizers that free saved tensors.
* ``storage/_store.py``, ``storage/zarr/_store.py``, ``storage/io/_local.py``, ``storage/daemon/_client.py``,
  ``storage/_registry.py`` - the stores and ``open_store`` (one registry entry per URL
  scheme); ``storage/chain/_chain.py`` - ``TierChain``, several stores as one, fastest first;
  ``storage/_urls.py`` the only store URL parser; ``storage/zarr/_options.py`` chunk size
  and codec checks.
* ``_codec.py``, ``_adapters.py``, ``paddle/_bridge.py`` - tensor <-> bytes; other
  frameworks' tensors through adapters.
* ``config/_settings.py``, ``config/_policy.py``, ``hooks/_scope.py``, ``_units.py`` - settings and rules.
* ``hooks/_report.py`` - ``hooks.report()`` (per module path: what was saved, the action and
  the rule; the device-budget curve) and the figures the trainer callbacks log;
  ``_caller.py`` - errors that name the public function the user called.
* ``capture/_capture.py`` - ``capture()``: module hooks streaming intermediates and gradients
  into plain Zarr arrays under ``ROOT/capture/`` (``capture/_writer.py`` appends them on
  I/O threads, ``capture/_layout.py`` is their layout); ``capture/_dataset.py`` -
  ``CaptureDataset`` reads them back (``capture/_source.py``: from a URL or an object).
"""

from __future__ import annotations

from tensorstore_hooks._codec import TensorMeta
from tensorstore_hooks.capture import Capture, CaptureDataset, CaptureStats, capture
from tensorstore_hooks.config import Decision, EffectiveConfig, Policy, Rule, load_config
from tensorstore_hooks.errors import (
    ConfigError,
    IntegrityError,
    KeyNotFoundError,
    QuotaExceededError,
    StoreClosedError,
    StoreUnavailableError,
    TensorStoreError,
    UnsupportedTensorError,
)
from tensorstore_hooks.hooks import OffloadHooks, offload, unwrap, wrap
from tensorstore_hooks.pipeline import OffloadStats, Router, RouteStats
from tensorstore_hooks.storage import BlobStore, TensorStore, open_store, register_store
from tensorstore_hooks.storage.chain import ChainStats, TierChain, TierStats
from tensorstore_hooks.storage.zarr import ZarrStore

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
