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
   the name, and the new rows take the ``@`` name of rule 4. A document there that
   cannot be used is never written over (NOTE [ Capture documents ]): ``capture()``
   refuses the module, naming it and how to recover.
6. With ``mask=`` (NOTE [ Capture masks ] in ``capture/_mask.py``) a masked leaf's
   rows are its real tokens, and its array ``NAME`` has a companion ``NAME~tokens``
   of ``[step, sample, position]`` rows. Masked and unmasked rows never share an
   array: if the name is taken by the other kind, rule 4's ``@`` name ends in
   ``_masked`` for masked rows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TypeAlias

import torch
import zarr
from torch.utils.hooks import RemovableHandle

from tensorstore_hooks._caller import names_caller
from tensorstore_hooks._codec import unsupported_reason
from tensorstore_hooks._warn import warn_user
from tensorstore_hooks.capture._layout import (
    CAPTURE_DIR,
    ArrayInfo,
    kind_of,
    row_bytes,
    scan_arrays,
    stored_dtype_name,
)
from tensorstore_hooks.capture._locks import LOCK_DIR, ArrayLocks, lock_path
from tensorstore_hooks.capture._mask import TOKENS_SUFFIX, Mask, check_mask, mask_from_call
from tensorstore_hooks.capture._source import CaptureSource, StorageOptions, open_zarr_array
from tensorstore_hooks.capture._writer import (
    ArraySpec,
    CaptureStats,
    CaptureWriter,
    as_rows,
    chunk_rows_for,
)
from tensorstore_hooks.config import EffectiveConfig, check_globs, select_modules
from tensorstore_hooks.errors import ConfigError
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
_OPTIONS = (
    "max_inflight",
    "writer_threads",
    "chunk_bytes",
    "storage_options",
    "read_deadline_s",
    "direct_io",
)
_Key: TypeAlias = tuple[str, str, tuple[int, ...], torch.dtype, bool]
"""What decides a leaf's array: module, leaf, row shape, stored dtype, masked."""
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

    __slots__ = ("_cap", "leaf", "mask", "module", "step")

    def __init__(self, cap: Capture, module: str, leaf: str, step: int, mask: Mask | None) -> None:
        self._cap = weakref.ref(cap)
        self.module = module
        self.leaf = leaf
        self.step = step
        self.mask = mask

    def __call__(self, grad: torch.Tensor) -> None:
        cap = self._cap()
        if cap is not None and os.getpid() == cap._pid:
            cap._put(self.module, self.leaf, grad, self.step, self.mask)
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
        locks: ArrayLocks,
        mask: str | torch.Tensor | None,
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
        self._names: dict[_Key, str | None] = {}
        self._owners: dict[str, tuple[tuple[int, ...], str, bool]] = {}
        self._mask_key = mask if isinstance(mask, str) else None
        self._mask: Mask | None = Mask(mask) if isinstance(mask, torch.Tensor) else None
        """The mask of the latest forward (NOTE [ Capture masks ])."""
        self._lock = threading.Lock()
        self._step = 0
        self._forwards = 0
        self._step_set = False
        self._pid = os.getpid()
        # Collected or at exit without remove(): still write what was captured, once,
        # and only in this process (a forked child never writes its parent's arrays).
        self._finalizer = weakref.finalize(
            self, _finish, self._pid, writer, self._handles, owns_io, locks
        )

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
    def mask(self) -> torch.Tensor | str | None:
        """The mask (NOTE [ Capture masks ]): the key read at each forward, or the tensor
        used until it is set again. Set a ``(batch, seq)`` tensor before a forward to
        mask it (and the ones after)."""
        if self._mask_key is not None:
            return self._mask_key
        return None if self._mask is None else self._mask._mask

    @mask.setter
    def mask(self, value: torch.Tensor | None) -> None:
        self._mask_key = None
        self._mask = None if value is None else Mask(check_mask(value, "cap.mask"))

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
                self._on_forward(args[1], args[2])
        elif role == "input":
            if not in_backward:
                _, pos, kwargs = args
                for leaf, t in _input_leaves(pos, kwargs):
                    self._put(module, leaf, t, step, self._mask)
        elif role == "output":
            leaves = list(_leaves("output", args[2]))
            if "output" in self._kinds and not in_backward:
                for leaf, t in leaves:
                    self._put(module, leaf, t, step, self._mask)
            if "grad_output" in self._kinds:
                for leaf, t in leaves:
                    if t.requires_grad:
                        t.register_hook(_GradHook(self, module, "grad_" + leaf, step, self._mask))
        else:  # "grad_input": (module, grad_input, grad_output)
            for leaf, t in _unwrapped("grad_input", args[1]):
                self._put(module, leaf, t, step, self._mask)
        self._emit_warning()

    def _on_forward(self, args: object, kwargs: object) -> None:
        if self._mask_key is not None:  # NOTE [ Capture masks ] rule 1
            call = args if isinstance(args, tuple) else ()
            named = kwargs if isinstance(kwargs, Mapping) else {}
            self._mask = Mask(mask_from_call(self._mask_key, call, named))
        if self._forwards and not self._step_set:
            self._step += 1
        self._step_set = False
        self._forwards += 1

    def _put(self, module: str, leaf: str, t: torch.Tensor, step: int, mask: Mask | None) -> None:
        if unsupported_reason(t) is not None or stored_dtype_name(t.dtype) is None:
            self._writer.count(skipped=1)
            return
        stored = self._dtype if self._dtype is not None and t.is_floating_point() else t.dtype
        masked = mask is not None and mask.matches(t)
        rows = mask.select(t) if masked and mask is not None else as_rows(t.detach())
        key = (module, leaf, tuple(rows.shape[1:]), stored, masked)
        name = self._names.get(key, "")
        if name == "":
            with self._lock:
                name = self._open(key, t.dtype)
        if name is None:  # its array could not be opened (counted, warned)
            self._writer.count(rows_dropped=rows.shape[0])
            return
        self._writer.append(name, rows, step)
        if masked and mask is not None:
            self._writer.append(name + TOKENS_SUFFIX, mask.where(step), step)

    def _open(self, key: _Key, source: torch.dtype) -> str | None:
        """The array name of a new (module, leaf, row shape, dtype, masked): NOTE
        [ Capture names ]; a masked one opens its ``~tokens`` companion too."""
        if key in self._names:
            return self._names[key]
        module, leaf, row_shape, stored, masked = key
        group = f"{CAPTURE_DIR}/rank{self._rank}" if self._rank is not None else CAPTURE_DIR
        try:
            name, found = self._place(group, module, leaf, row_shape, stored, masked)
            companion = (
                self._writer.existing(f"{group}/{name}{TOKENS_SUFFIX}") if masked else None
            )
            have = (found.rows if found else 0, companion.rows if companion else 0)
            if masked and have[0] != have[1]:  # NOTE [ Capture masks ] rule 3
                raise ConfigError(
                    f"{group}/{name} holds {have[0]} rows but {group}/{name}{TOKENS_SUFFIX} "
                    f"{have[1]}: they no longer pair row for row, so no more are appended; "
                    "capture into another root (or move both arrays away)"
                )
        except Exception as e:  # a damaged document, a store error: never raise in a hook
            self._writer.failed(e, f"opening {group}/{module}/{leaf}", stopped=True)
            self._names[key] = None
            return None
        spec = self._spec(group, name, module, leaf, row_shape, stored, source, found)
        if masked:
            spec = replace(spec, tokens=name + TOKENS_SUFFIX)
        self._writer.open_array(spec, found)
        if masked:
            where = self._spec(
                group,
                name + TOKENS_SUFFIX,
                module,
                leaf + TOKENS_SUFFIX,
                (3,),
                torch.int64,
                torch.int64,
                companion,
            )
            self._writer.open_array(where, companion)
        self._names[key] = name
        return name

    def _place(
        self,
        group: str,
        module: str,
        leaf: str,
        row_shape: tuple[int, ...],
        stored: torch.dtype,
        masked: bool,
    ) -> tuple[str, ArrayInfo | None]:
        """Rules 4-6 of NOTE [ Capture names ]: the array's name, and what is stored
        there already. Raises for a document that cannot be used or a clash."""
        dtype_name = str(stored).removeprefix("torch.")
        base = f"{module}/{leaf}"
        owner = self._owners.get(base)
        if owner is None:
            found = self._writer.existing(f"{group}/{base}")
            owner = (
                (found.row_shape, found.dtype, found.masked)
                if found
                else (row_shape, dtype_name, masked)
            )
            self._owners[base] = owner
        mine = (row_shape, dtype_name, masked)
        name = base if owner == mine else _variant(base, row_shape, dtype_name, masked)
        path = f"{group}/{name}"
        found = self._writer.existing(path)
        if found is not None and (found.row_shape, found.dtype, found.masked) != mine:
            raise ConfigError(f"{path} holds rows of {found.row_shape} {found.dtype}")
        return name, found

    def _spec(
        self,
        group: str,
        name: str,
        module: str,
        kind: str,
        row_shape: tuple[int, ...],
        stored: torch.dtype,
        source: torch.dtype,
        found: ArrayInfo | None,
    ) -> ArraySpec:
        chunk_rows = (
            found.chunk_rows
            if found is not None
            else chunk_rows_for(row_bytes(row_shape, stored), self._chunk_bytes)
        )
        return ArraySpec(
            name=name,
            path=f"{group}/{name}",
            module=module,
            kind=kind,
            row_shape=row_shape,
            dtype=stored,
            source_dtype=source,
            rank=self._rank,
            chunk_rows=chunk_rows,
        )

    def _emit_warning(self) -> None:
        msg = self._writer.take_warning()
        if msg is not None:
            warn_user(msg)


def _finish(
    pid: int,
    writer: CaptureWriter,
    handles: list[RemovableHandle],
    owns_io: bool,
    locks: ArrayLocks,
) -> None:
    """Take the hooks off, write what was captured and let the arrays go (``Capture.remove``,
    or its finalizer); nothing in a process other than the one that captured."""
    for handle in handles:
        handle.remove()
    handles.clear()
    if os.getpid() != pid:
        return
    try:
        writer.close()
    finally:
        locks.release()  # after the last write: NOTE [ One writer per array ]
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


def _variant(base: str, row_shape: tuple[int, ...], dtype: str, masked: bool) -> str:
    dims = "x".join(str(d) for d in row_shape) or "scalar"
    return f"{base}@{dims}_{dtype}" + ("_masked" if masked else "")


# ---------------------------------------------------------------------- capture()
@names_caller("tsh.capture")
def capture(
    model: torch.nn.Module,
    store: str | os.PathLike[str] | TensorStore,
    *,
    modules: str | Sequence[str] | None,
    what: str | Sequence[str],
    dtype: torch.dtype | str | None = None,
    mask: str | torch.Tensor | None = None,
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
    ``mask``: padded batches keep only their real tokens: a ``(batch, seq)`` attention
    mask, or the name of the model's keyword argument that carries it
    (``"attention_mask"``); NOTE [ Capture masks ].
    ``pipeline`` keywords: ``max_inflight`` (host-buffer bytes in use before a hook
    waits; default 256 MiB), ``writer_threads``, ``chunk_bytes`` (chunk object size,
    default 8 MiB), ``storage_options`` (fsspec), ``read_deadline_s`` (how long
    object-store requests retry), ``direct_io`` (``auto``: chunks go to a local disk
    with ``O_DIRECT`` where it allows it); ``config`` as for
    :func:`~tensorstore_hooks.offload`.

    Use it as a context manager, or call ``remove()``. Hooks: NOTE [ Capture hooks ];
    array names, containers and dynamic shapes: NOTE [ Capture names ]; the layout:
    NOTE [ Capture layout ]; writes and failures: NOTE [ Capture writes ]. Raises
    :class:`ConfigError` for a glob that matches nothing, an unknown kind or keyword,
    a bad mask, a daemon URL (``tsh://``: it cannot hold arrays) or a store that is
    not a Zarr root; :class:`~tensorstore_hooks.StoreUnavailableError` when another
    capture writes the same arrays (NOTE [ One writer per array ]); and
    :class:`~tensorstore_hooks.IntegrityError` when one of them has a document that
    cannot be used (NOTE [ Capture documents ]). Nothing is hooked then.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"capture: expected a torch.nn.Module, got {type(model).__name__}")
    kinds = _check_what(what)
    stored = _check_dtype(dtype)
    if mask is not None and not isinstance(mask, str):
        check_mask(mask, "mask=")
    names = dict(model.named_modules())
    selected = _select(names, modules)
    cfg = _settings(config, pipeline)
    io, url, owns_io, options = _open_io(store, cfg)
    rank = distributed_rank()
    group = f"{CAPTURE_DIR}/rank{rank}" if rank is not None else CAPTURE_DIR
    labels = sorted(name or ROOT_NAME for name in selected)
    locks = _claim(io, owns_io, group, labels, kinds)
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
        locks=locks,
        mask=mask,
    )
    _hook(cap, model, {name: names[name] for name in selected}, kinds)
    direct = " (chunks with O_DIRECT)" if io.uses_direct_io else ""
    log.info("capture: %s of %s into %s/%s%s", "+".join(sorted(kinds)), labels, url, group, direct)
    return cap


def _hook(
    cap: Capture, model: torch.nn.Module, chosen: dict[str, torch.nn.Module], kinds: frozenset[str]
) -> None:
    """Register the hooks of NOTE [ Capture hooks ] (their handles go to ``cap``)."""
    handles = cap._handles
    handles.append(
        model.register_forward_pre_hook(_Hook(cap, "", "step"), prepend=True, with_kwargs=True)
    )
    for name, sub in sorted(chosen.items()):
        label = name or ROOT_NAME
        if "input" in kinds:
            handles.append(
                sub.register_forward_pre_hook(_Hook(cap, label, "input"), with_kwargs=True)
            )
        if kinds & {"output", "grad_output"}:
            handles.append(sub.register_forward_hook(_Hook(cap, label, "output")))
        if "grad_input" in kinds:
            handles.append(sub.register_full_backward_hook(_Hook(cap, label, "grad_input")))


def _claim(
    io: ChunkIO, owns_io: bool, group: str, labels: list[str], kinds: frozenset[str]
) -> ArrayLocks:
    """The locks of every array this capture may write (NOTE [ One writer per array ]),
    once none of them has a damaged document; on failure ``io`` is closed if owned."""
    locks = ArrayLocks(io)
    try:
        _refuse_damaged(io, group, labels, kinds)
        locks.take(lock_path(group, label, kind) for label in labels for kind in sorted(kinds))
    except BaseException:
        if owns_io and not io.is_private_memory:
            io.close()
        raise
    return locks


def _refuse_damaged(io: ChunkIO, group: str, labels: list[str], kinds: frozenset[str]) -> None:
    """Raise the :class:`DamagedDocument` of an array this capture would write into
    (rule 5 of NOTE [ Capture names ]): it is never written over."""
    for label in labels:
        for damaged in scan_arrays(io, f"{group}/{label}").damaged:
            leaf = damaged.path.rsplit("/", 1)[-1]
            if kind_of(leaf) in kinds:
                raise damaged


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
    try:
        # NOTE [ Capture writes ] rule 2; probed once per root (a ZarrStore's io already was).
        io.configure_direct_io(cfg.store.direct_io, f"{LOCK_DIR}/direct-probe")
    except ConfigError as e:
        io.close()
        raise ConfigError(f"capture: {e}") from None
    return io, io.url, True, options
