"""tensorstore-hooks: offload the tensors PyTorch autograd saves for backward.

During forward, saved activations go to a chunked Zarr store (local disk, memory,
any fsspec backend such as S3, or the storage daemon); in backward they are
prefetched and rehydrated onto their original device, bit-identically::

    import tensorstore_hooks as tsh

    with tsh.offload() as hooks:
        loss = model(batch).sum()
    loss.backward()
    print(hooks.stats)

Module map: subpackages by layer, top first; an import never points up (a layers
contract in CI: docs/architecture.md). A saved tensor's path through them is
``docs/life-of-a-saved-tensor.md``.

* ``cli/`` - the ``tensorstore-hooks`` command (demo, plan, inspect, clean, serve,
  stats, check-config); ``testing/`` - the store and ChunkIO conformance suites, for
  users' own stores.
* ``integrations/`` - the HF Trainer and Lightning callbacks; ``paddle/`` - the same
  hooks under PaddlePaddle.
* ``hooks/`` - ``offload()``/``OffloadHooks``, ``wrap()``/``unwrap()``, composition
  with checkpointing and ``torch.compile``, the module scope, ``hooks.report()``;
  ``capture/`` - ``capture()`` into plain Zarr arrays and ``CaptureDataset``.
* ``pipeline/`` - what one hooks object runs: the router, the record table,
  write-behind, prefetch, the I/O pool, device staging and the host tier, budgets,
  stats, the decision ledger and the timeline.
* ``config/`` - settings, the YAML loader, the policy, and the one module-glob
  selector (NOTE [ Module globs ]).
* ``storage/`` - the ``TensorStore`` API with its declared capabilities, the registry
  behind ``open_store``, URLs and the one retry loop; ``storage/zarr/`` the Zarr
  store, ``storage/io/`` one module per backend (local with direct I/O, memory,
  fsspec), ``storage/chain/`` tier chains, ``storage/daemon/`` the daemon's client.
* ``runtime/`` - process-wide effects (only while a pipeline lives), the memory there
  is, fork safety, frames dynamo must not compile.
* Beside them, at the bottom: ``errors`` (public), ``protocol`` (the daemon's wire
  format), ``_codec``/``_adapters`` (tensor <-> bytes, other frameworks), ``_units``,
  ``_warn``, ``_caller``.

The daemon (``server/`` in the source tree) installs as ``tensorstore_hooks.server``;
the library never imports it (the CLI's ``serve`` does, when it runs).
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
