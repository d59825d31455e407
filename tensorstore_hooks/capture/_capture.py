"""``tsh.capture``: stream a model's intermediates and gradients into the store.

Hooks on the chosen modules copy what they see into plain Zarr v3 arrays under
``ROOT/capture/`` (NOTE [ Capture layout ]) through the capture writer (NOTE [ Capture
writes ]): asynchronously, bounded by ``max_inflight``, off the device.

NOTE [ Capture hooks ]
1. ``input``: a forward pre-hook (with keyword arguments); ``output``: a forward hook.
2. ``grad_output``: the forward hook registers a tensor hook on each output leaf that
   requires grad; it fires with the gradient of that output, once, and records the
   step of the forward that made the output (gradient accumulation stays apart).
   Nothing is inserted into the model's graph.
3. ``grad_input``: a full backward hook (``register_full_backward_hook``); its blocks
   carry the step of the latest forward. On a module none of whose inputs requires
   grad there is no ``grad_input``, and torch warns that the hook fires anyway.
4. A forward that runs while backward runs is an activation checkpoint's
   recomputation: its values were captured by the first forward and are not taken
   again (and the step does not advance). Gradients flow once either way.
5. The step: a forward pre-hook on the model itself counts its forwards; blocks carry
   the number of forwards before theirs, or ``cap.step = n`` numbers the next one.
6. Hooks hold the capture weakly, and a copy of the model (``copy.deepcopy``,
   ``pickle``, ``torch.save``) gets hooks that do nothing. Tensor hooks of rule 2 that
   fire after the capture ended capture nothing (``stats.rows_dropped``): run backward
   inside the ``with`` block.

NOTE [ Capture names ]
Each tensor a hook sees is one *leaf*, named after the kind:

1. ``output``: the module's output; a tuple or list gives ``output.0``, ``output.1``,
   ...; a dict (or a ``ModelOutput``) gives ``output.<key>``; nested containers nest
   (``output.1.0``). Leaves that are not tensors (``None``, ints, ...) are skipped.
2. ``input``: the positional arguments: one gives ``input``, several give
   ``input.0``, ``input.1``, ...; keyword arguments give ``input.<name>``; containers
   inside them as in rule 1.
3. ``grad_output``: the gradient of each output leaf, named after it with ``grad_``
   in front (``grad_output``, ``grad_output.0``, ``grad_output.logits``).
   ``grad_input``: torch's tuple of gradients, one per tensor input: one gives
   ``grad_input``, several ``grad_input.0``, ...; ``None`` entries are skipped.
4. The array of a leaf is ``MODULE/LEAF`` (the model itself is ``root``). Rows of
   another shape or dtype than the first ones that array took (dynamic sequence
   lengths, a batch padded to another length) go to an array of their own,
   ``MODULE/LEAF@D1xD2_DTYPE`` (``layers.0/output@17x512_float32``): every array
   has one row shape, nothing is padded, and ``CaptureDataset(..., flatten=True)``
   reads a leaf with all its shapes as one stream of rows.
5. A capture into a root that already holds an array of the same name, row shape
   and dtype appends to it (its rows and blocks stay); one of another shape keeps
   the name, and the new rows take the ``@`` name of rule 4.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TypeAlias

import torch
import zarr
from torch.utils.hooks import RemovableHandle

from tensorstore_hooks._caller import names_caller
from tensorstore_hooks._codec import unsupported_reason
from tensorstore_hooks._warn import warn_user
from tensorstore_hooks.capture._layout import CAPTURE_DIR, row_bytes, stored_dtype_name
from tensorstore_hooks.capture._source import CaptureSource, StorageOptions, open_zarr_array
from tensorstore_hooks.capture._writer import (
    ArraySpec,
    CaptureStats,
    CaptureWriter,
    as_rows,
    chunk_rows_for,
)
from tensorstore_hooks.config import EffectiveConfig, check_globs, select_modules
from tensorstore_hooks.errors import ConfigError, TensorStoreError
from tensorstore_hooks.storage import DAEMON_SCHEMES, TensorStore, scheme_of
from tensorstore_hooks.storage.io import ChunkIO
from tensorstore_hooks.storage.zarr import ZarrStore, distributed_rank, make_io

__all__ = ["KINDS", "Capture", "capture"]

log = logging.getLogger("tensorstore_hooks")

KINDS: tuple[str, ...] = ("input", "output", "grad_input", "grad_output")
"""What ``capture(what=...)`` can name."""
DEFAULT_MAX_INFLIGHT = 256 << 20
"""Host-buffer bytes a capture may hold when ``max_inflight`` is not given."""
ROOT_NAME = "root"
"""The array folder of the model itself (``modules=None``)."""
_ConfigSource: TypeAlias = str | os.PathLike[str] | EffectiveConfig | Mapping[str, object] | None
"""What ``capture(config=...)`` takes, as ``offload(config=...)`` does."""
_OPTIONS = ("max_inflight", "writer_threads", "chunk_bytes", "storage_options", "read_deadline_s")
_DAEMON_HELP = (
    "the storage daemon keeps tensors by opaque key for the session that wrote them and "
    "frees them when it ends (BYE or lease expiry), so it cannot hold arrays that outlive "
    "the run and that plain zarr reads. Capture into a URL instead: the daemon host's disk "
    "(file:///path, e.g. beside its --root), an object store (s3://bucket/prefix), or any "
    "fsspec URL; offloading can keep using the daemon at the same time"
)


class _Detached:
    """What a copied or unpickled capture hook becomes: it does nothing."""

    def __call__(self, *args: object, **kwargs: object) -> None:
        return None


class _Hook:
    """A module hook of one capture. Holds the capture weakly; a copy of the model
    (``copy.deepcopy``, ``pickle``, ``torch.save``) gets a :class:`_Detached` instead."""

    __slots__ = ("_cap", "module", "role")

    def __init__(self, cap: Capture, module: str, role: str) -> None:
        self._cap = weakref.ref(cap)
        self.module = module
        self.role = role

    def __call__(self, *args: object) -> None:
        cap = self._cap()
        if cap is not None:
            cap._on_hook(self.module, self.role, args)

    def __reduce__(self) -> tuple[type[_Detached], tuple[()]]:
        return (_Detached, ())


class _GradHook:
    """A tensor hook on one output leaf: captures the gradient of that output, with
    the step of the forward that made it."""

    __slots__ = ("_cap", "leaf", "module", "step")

    def __init__(self, cap: Capture, module: str, leaf: str, step: int) -> None:
        self._cap = weakref.ref(cap)
        self.module = module
        self.leaf = leaf
        self.step = step

    def __call__(self, grad: torch.Tensor) -> None:
        cap = self._cap()
        if cap is not None and os.getpid() == cap._pid:
            cap._put(self.module, self.leaf, grad, self.step)
            cap._emit_warning()


class Capture(contextlib.AbstractContextManager["Capture"]):
    """What :func:`capture` returns: the hooks, the arrays they fill, and their stats.

    A context manager; leaving it (or :meth:`remove`) takes the hooks off and writes
    everything captured. ``cap.arrays`` maps each array name (``layers.0/output``) to
    a read-only ``zarr.Array``; ``cap.stats`` counts what was captured, written,
    dropped and waited for (:class:`~tensorstore_hooks.capture._writer.CaptureStats`).
    """

    def __init__(
        self,
        writer: CaptureWriter,
        *,
        kinds: frozenset[str],
        dtype: torch.dtype | None,
        rank: int | None,
        chunk_bytes: int,
        url: str,
        storage_options: StorageOptions | None,
        owns_io: bool,
    ) -> None:
        self._writer = writer
        self._kinds = kinds
        self._dtype = dtype
        self._rank = rank
        self._chunk_bytes = chunk_bytes
        self.url = url
        """The store root the arrays are under."""
        self._storage_options = storage_options
        self._handles: list[RemovableHandle] = []
        self._names: dict[tuple[str, str, tuple[int, ...], torch.dtype], str | None] = {}
        self._owners: dict[str, tuple[tuple[int, ...], str]] = {}
        self._lock = threading.Lock()
        self._step = 0
        self._forwards = 0
        self._step_set = False
        self._pid = os.getpid()
        # Collected or at exit without remove(): still write what was captured, once,
        # and only in this process (a forked child never writes its parent's arrays).
        self._finalizer = weakref.finalize(self, _finish, self._pid, writer, self._handles, owns_io)

    # ------------------------------------------------------------------ public
    @property
    def stats(self) -> CaptureStats:
        """Live counters (also after the capture ended)."""
        return self._writer.stats

    @property
    def io(self) -> ChunkIO:
        """The I/O layer of the store root (what :class:`CaptureDataset` can read from)."""
        return self._writer.io

    def capture_source(self, storage_options: StorageOptions | None = None) -> CaptureSource:
        """Where :class:`~tensorstore_hooks.CaptureDataset` reads this capture's arrays."""
        return CaptureSource.of_io(self.io, storage_options or self._storage_options, self.url)

    @property
    def step(self) -> int:
        """The step recorded with the next blocks: the number of forwards of the model
        before the current one. Setting it numbers the next forward (and counts on)."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"capture: step must be an int >= 0, got {value!r}")
        self._step = value
        self._step_set = True

    @property
    def names(self) -> list[str]:
        """The names of the arrays this capture writes (``layers.0/output``, ...)."""
        return sorted(s.name for s in self._writer.specs)

    @property
    def arrays(self) -> dict[str, zarr.Array]:
        """Each array this capture wrote, by name, as a read-only ``zarr.Array`` with the
        rows visible now (after the ``with`` block: all of them; during it, call
        :meth:`flush` first to see every row so far)."""
        out: dict[str, zarr.Array] = {}
        for spec in sorted(self._writer.specs, key=lambda s: s.name):
            arr = open_zarr_array(self.io, spec.path, self._storage_options)
            if arr is not None:
                out[spec.name] = arr
        return out

    def flush(self) -> None:
        """Block until every row captured so far is written and visible in its array."""
        self._writer.flush()
        self._emit_warning()

    def remove(self) -> None:
        """Take the hooks off, write everything captured (waits) and stop the I/O
        threads. Safe to call twice. A capture dropped without it does the same when
        it is collected (or at exit)."""
        self._finalizer()
        self._emit_warning()

    close = remove

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Capture({self.url!r}, arrays={self.names})"

    # ------------------------------------------------------------------ hooks
    def _on_hook(self, module: str, role: str, args: tuple[object, ...]) -> None:
        """``args``: what torch called the hook with (NOTE [ Capture hooks ] rules 1-3)."""
        if os.getpid() != self._pid:
            return  # a forked child (a DataLoader worker) running a copy of the model
        # Rule 4 of NOTE [ Capture hooks ]: a forward inside backward is a recomputation.
        in_backward = torch._C._current_graph_task_id() != -1
        step = self._step
        if role == "step":
            if not in_backward:
                self._on_forward()
        elif role == "input":
            if not in_backward:
                _, pos, kwargs = args
                for leaf, t in _input_leaves(pos, kwargs):
                    self._put(module, leaf, t, step)
        elif role == "output":
            leaves = list(_leaves("output", args[2]))
            if "output" in self._kinds and not in_backward:
                for leaf, t in leaves:
                    self._put(module, leaf, t, step)
            if "grad_output" in self._kinds:
                for leaf, t in leaves:
                    if t.requires_grad:
                        t.register_hook(_GradHook(self, module, "grad_" + leaf, step))
        else:  # "grad_input": (module, grad_input, grad_output)
            for leaf, t in _unwrapped("grad_input", args[1]):
                self._put(module, leaf, t, step)
        self._emit_warning()

    def _on_forward(self) -> None:
        if self._forwards and not self._step_set:
            self._step += 1
        self._step_set = False
        self._forwards += 1

    def _put(self, module: str, leaf: str, t: torch.Tensor, step: int) -> None:
        if unsupported_reason(t) is not None or stored_dtype_name(t.dtype) is None:
            self._writer.count(skipped=1)
            return
        stored = self._dtype if self._dtype is not None and t.is_floating_point() else t.dtype
        rows = as_rows(t.detach())
        key = (module, leaf, tuple(rows.shape[1:]), stored)
        name = self._names.get(key, "")
        if name == "":
            with self._lock:
                name = self._open(key, t.dtype)
        if name is None:  # its array could not be opened (counted, warned)
            self._writer.count(rows_dropped=rows.shape[0])
            return
        self._writer.append(name, rows, step)

    def _open(
        self, key: tuple[str, str, tuple[int, ...], torch.dtype], source: torch.dtype
    ) -> str | None:
        """The array name of a new (module, leaf, row shape, dtype): NOTE [ Capture names ]."""
        if key in self._names:
            return self._names[key]
        module, leaf, row_shape, stored = key
        dtype_name = str(stored).removeprefix("torch.")
        base = f"{module}/{leaf}"
        group = f"{CAPTURE_DIR}/rank{self._rank}" if self._rank is not None else CAPTURE_DIR
        writer = self._writer
        name: str | None = None
        try:
            owner = self._owners.get(base)
            if owner is None:
                found = writer.existing(f"{group}/{base}")
                owner = (found.row_shape, found.dtype) if found else (row_shape, dtype_name)
                self._owners[base] = owner
            name = (
                base if owner == (row_shape, dtype_name) else _variant(base, row_shape, dtype_name)
            )
            path = f"{group}/{name}"
            found = writer.existing(path)
            if found is not None and (found.row_shape, found.dtype) != (row_shape, dtype_name):
                raise ConfigError(f"{path} holds rows of {found.row_shape} {found.dtype}")
        except TensorStoreError as e:
            writer.failed(e, f"opening {group}/{base}", stopped=True)
            self._names[key] = None
            return None
        spec = ArraySpec(
            name=name,
            path=path,
            module=module,
            kind=leaf,
            row_shape=row_shape,
            dtype=stored,
            source_dtype=source,
            rank=self._rank,
            chunk_rows=(
                found.chunk_rows
                if found is not None
                else chunk_rows_for(row_bytes(row_shape, stored), self._chunk_bytes)
            ),
        )
        writer.open_array(spec, found)
        self._names[key] = name
        return name

    def _emit_warning(self) -> None:
        msg = self._writer.take_warning()
        if msg is not None:
            warn_user(msg)


def _finish(
    pid: int, writer: CaptureWriter, handles: list[RemovableHandle], owns_io: bool
) -> None:
    """Take the hooks off and write what was captured (``Capture.remove``, or its
    finalizer); nothing in a process other than the one that captured."""
    for handle in handles:
        handle.remove()
    handles.clear()
    if os.getpid() != pid:
        return
    try:
        writer.close()
    finally:
        if owns_io and not writer.io.is_private_memory:
            writer.io.close()


# ---------------------------------------------------------------------- leaves
def _leaves(name: str, value: object) -> Iterator[tuple[str, torch.Tensor]]:
    """Rule 1 of NOTE [ Capture names ]."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _leaves(f"{name}.{_part(k)}", v)
    elif isinstance(value, tuple | list):
        for i, v in enumerate(value):
            yield from _leaves(f"{name}.{i}", v)


def _unwrapped(name: str, values: object) -> Iterator[tuple[str, torch.Tensor]]:
    """Rules 2 and 3: a tuple of one is its element."""
    if isinstance(values, tuple | list) and len(values) == 1:
        return _leaves(name, values[0])
    return _leaves(name, values)


def _input_leaves(args: object, kwargs: object) -> Iterator[tuple[str, torch.Tensor]]:
    """Rule 2: ``args`` and ``kwargs`` as a forward pre-hook with keywords gets them."""
    yield from _unwrapped("input", args)
    if isinstance(kwargs, Mapping):
        for k, v in kwargs.items():
            yield from _leaves(f"input.{_part(k)}", v)


def _part(key: object) -> str:
    """A dict key as one path segment (``/`` would start a new folder)."""
    return str(key).replace("/", "_")


def _variant(base: str, row_shape: tuple[int, ...], dtype: str) -> str:
    dims = "x".join(str(d) for d in row_shape) or "scalar"
    return f"{base}@{dims}_{dtype}"


# ---------------------------------------------------------------------- capture()
@names_caller("tsh.capture")
def capture(
    model: torch.nn.Module,
    store: str | os.PathLike[str] | TensorStore,
    *,
    modules: str | Sequence[str] | None,
    what: str | Sequence[str],
    dtype: torch.dtype | str | None = None,
    config: _ConfigSource = None,
    **pipeline: object,
) -> Capture:
    """Stream what chosen modules see into plain Zarr v3 arrays under ``ROOT/capture/``.

    ``store``: a store root URL (``file:///data/acts``, a path, ``s3://bucket/prefix``,
    any fsspec URL) or a :class:`ZarrStore` (its root is used; it may offload at the
    same time). ``modules``: fnmatch globs over ``model.named_modules()`` names, as in
    :func:`~tensorstore_hooks.wrap` (``None``: the model itself): each glob takes the
    outermost modules it matches (``blocks.*``: the blocks, not their layers); give a
    nested module a glob of its own to capture it too. ``what``: ``"input"``,
    ``"output"``, ``"grad_input"``, ``"grad_output"`` or several. ``dtype``: store
    floating-point tensors in this dtype (``"bfloat16"``), exactly as ``.to(dtype)``
    rounds; ``None`` keeps each tensor's own; other tensors always keep theirs.
    ``pipeline`` keywords: ``max_inflight`` (host-buffer bytes in use before a hook
    waits; default 256 MiB), ``writer_threads``, ``chunk_bytes`` (chunk object size,
    default 8 MiB), ``storage_options`` (fsspec), ``read_deadline_s`` (how long
    object-store requests retry); ``config`` as for :func:`~tensorstore_hooks.offload`.

    Use it as a context manager, or call ``remove()``. Hooks: NOTE [ Capture hooks ];
    array names, containers and dynamic shapes: NOTE [ Capture names ]; the layout:
    NOTE [ Capture layout ]; writes and failures: NOTE [ Capture writes ]. Raises
    :class:`ConfigError` for a glob that matches nothing, an unknown kind or keyword,
    a daemon URL (``tsh://``: it cannot hold arrays) or a store that is not a Zarr
    root; nothing is hooked then.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"capture: expected a torch.nn.Module, got {type(model).__name__}")
    kinds = _check_what(what)
    stored = _check_dtype(dtype)
    names = dict(model.named_modules())
    selected = _select(names, modules)
    cfg = _settings(config, pipeline)
    io, url, owns_io, options = _open_io(store, cfg)
    rank = distributed_rank()
    max_inflight = cfg.pipeline.max_inflight
    writer = CaptureWriter(
        io,
        max_inflight=DEFAULT_MAX_INFLIGHT if max_inflight is None else max_inflight,
        threads=cfg.pipeline.writer_threads,
        stats=CaptureStats(),
    )
    cap = Capture(
        writer,
        kinds=kinds,
        dtype=stored,
        rank=rank,
        chunk_bytes=cfg.store.chunk_bytes,
        url=url,
        storage_options=options,
        owns_io=owns_io,
    )
    handles = cap._handles
    handles.append(model.register_forward_pre_hook(_Hook(cap, "", "step"), prepend=True))
    for name in sorted(selected):
        sub = names[name]
        label = name or ROOT_NAME
        if "input" in kinds:
            handles.append(
                sub.register_forward_pre_hook(_Hook(cap, label, "input"), with_kwargs=True)
            )
        if kinds & {"output", "grad_output"}:
            handles.append(sub.register_forward_hook(_Hook(cap, label, "output")))
        if "grad_input" in kinds:
            handles.append(sub.register_full_backward_hook(_Hook(cap, label, "grad_input")))
    log.info(
        "capture: %d module(s), %s, into %s/%s",
        len(selected),
        ", ".join(sorted(kinds)),
        url,
        CAPTURE_DIR,
    )
    return cap


def _check_what(what: str | Sequence[str]) -> frozenset[str]:
    items = [what] if isinstance(what, str) else list(what) if isinstance(what, Sequence) else []
    bad = [w for w in items if w not in KINDS]
    if not items or bad:
        raise ConfigError(
            f"capture: what={what!r}: expected one or more of {', '.join(KINDS)}"
            + (f" (unknown: {', '.join(map(repr, bad))})" if bad else "")
        )
    return frozenset(items)


def _check_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    value = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError(
            f"capture: dtype={dtype!r}: expected a floating-point torch dtype such as "
            "'bfloat16', 'float16' or torch.float32 (or None to keep each tensor's own)"
        )
    if stored_dtype_name(value) is None:
        raise ConfigError(f"capture: dtype={dtype!r} cannot be stored in a Zarr array")
    return value


def _select(names: dict[str, torch.nn.Module], modules: str | Sequence[str] | None) -> set[str]:
    """The modules ``modules`` selects (NOTE [ Module globs ] rule 2), each of which
    can name an array folder."""
    chosen = select_modules(names, check_globs(modules, "capture"), "capture")
    bad = sorted(n for n in chosen if "/" in n or n == ROOT_NAME)
    if bad:
        raise ConfigError(
            f"capture: module name(s) {bad} cannot name an array folder ('/' starts a new "
            f"folder; {ROOT_NAME!r} is the model's own); rename the submodule"
        )
    return chosen


def _settings(config: _ConfigSource, pipeline: Mapping[str, object]) -> EffectiveConfig:
    from tensorstore_hooks.config import resolve_config

    unknown = sorted(k for k in pipeline if k not in _OPTIONS)
    if unknown:
        raise ConfigError(
            f"capture(): unknown keyword argument(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(_OPTIONS)} (policy keywords such as min_bytes belong to offload())"
        )
    try:
        return resolve_config(config, pipeline)
    except ConfigError as e:
        # The config layer names offload(); these keywords were given to capture().
        raise ConfigError(str(e).replace("offload(", "capture(")) from None


def _open_io(
    store: str | os.PathLike[str] | TensorStore, cfg: EffectiveConfig
) -> tuple[ChunkIO, str, bool, StorageOptions | None]:
    """``(io, url, owned, storage_options)`` of the store root capture writes under."""
    if isinstance(store, ZarrStore):
        if store.temporary:
            raise ConfigError(
                f"capture: {store.url} is a temporary store, deleted when it closes; "
                "capture into a URL (file:///data/acts, s3://bucket/prefix) instead"
            )
        io: ChunkIO = store._io  # its root, shared with the store (thread-safe)
        return io, store.url, False, None
    if isinstance(store, TensorStore):
        raise ConfigError(
            f"capture: cannot capture into a {type(store).__name__} ({store.url}): "
            + (_DAEMON_HELP if scheme_of(store.url) in DAEMON_SCHEMES else "it is not a Zarr root")
        )
    if store is None or not isinstance(store, str | os.PathLike):
        raise ConfigError(
            "capture: store must be a store root URL (file:///data/acts, a path, "
            f"s3://bucket/prefix) or a ZarrStore; got {store!r}"
        )
    url = os.fspath(store)
    if scheme_of(url) in DAEMON_SCHEMES:
        raise ConfigError(f"capture: {url}: {_DAEMON_HELP}")
    options = dict(cfg.store.storage_options) or None
    io = make_io(url, options, retry_deadline_s=cfg.pipeline.read_deadline_s)
    return io, io.url, True, options
