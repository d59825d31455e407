"""Configuration: the YAML schema, its validation, and the effective settings.

A config file has three optional sections, ``store``, ``pipeline`` and ``policy``
(see ``docs/config.md`` and ``configs/``). It is parsed with a safe YAML loader,
validated by pydantic models (strict types, unknown keys forbidden), and turned
into plain frozen dataclasses (:class:`EffectiveConfig`) that the hooks read on the
hot path without pydantic. Every problem is a :class:`ConfigError` naming the
source (file and line, or the ``offload()`` keyword), the field path such as
``policy.rules[2].action``, the bad value and what is allowed. Validation happens
completely before anything is returned: nothing half-applies.

Each setting is declared once, as a field of its settings class (:class:`StoreSettings`,
:class:`TierSettings`, :class:`PipelineSettings`, ``Policy``, ``Rule``); the pydantic
models, the ``offload()`` keywords (:data:`OVERRIDE_KEYS`) and :meth:`EffectiveConfig.to_dict`
are derived from those fields (NOTE [ One declaration per setting ] in ``_schema.py``).
To add a setting, add its field (YAML type as annotation, ``setting(default, dump=...)``,
a docstring) to its class and a row to ``docs/config.md``; nothing else lists settings.

Precedence: ``offload()`` keywords > the file given as ``config=`` > the file named
by ``TSH_CONFIG`` (only when ``config=`` is not given) > built-in defaults.
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Callable, Mapping, Set
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Annotated, TypeVar, get_type_hints

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict
from pydantic import Field as SchemaField
from pydantic import ValidationError as _PydanticValidationError

from tensorstore_hooks._units import (
    DEFAULT_HEADROOM,
    Budget,
    Duration,
    Headroom,
    OptSize,
    Size,
    check_size,
)
from tensorstore_hooks.config._policy import Policy, Rule, RuleError
from tensorstore_hooks.config._schema import (
    SETTING,
    Section,
    Setting,
    budget_value,
    exact_size,
    is_empty,
    is_none,
    opt_size,
    required,
    seconds,
    section,
    setting,
)
from tensorstore_hooks.config._yaml import LineOf, format_validation_error, line_finder, read_yaml
from tensorstore_hooks.errors import ConfigError
from tensorstore_hooks.storage import BadURLError
from tensorstore_hooks.storage.zarr import (
    DEFAULT_CHUNK_BYTES,
    check_chunk_bytes,
    parse_codec,
    parse_direct_io,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "CONFIG_ENV",
    "OVERRIDE_KEYS",
    "ChunkBytes",
    "Codec",
    "DirectIO",
    "Duration",
    "EffectiveConfig",
    "MmapThreshold",
    "OptSize",
    "PipelineSettings",
    "Size",
    "StoreSettings",
    "StoreURL",
    "TierSettings",
    "TierURL",
    "WriterThreads",
    "config_from_dict",
    "dump_config",
    "format_validation_error",
    "load_config",
    "resolve_config",
]

CONFIG_ENV = "TSH_CONFIG"
"""Environment variable naming the config file used when ``offload()`` gets no ``config=``."""

S = TypeVar("S", bound="DataclassInstance")


# ---------------------------------------------------------------------------------------
# Field checks: each calls the one validator of its value (``_units``, ``storage.zarr``'s
# options, the store registry); ``Size``/``Duration`` live in ``_units``, the rule
# checks in ``_policy``.
# ---------------------------------------------------------------------------------------


def _mmap_threshold(value: object) -> int | None:
    n = None if value is None else check_size(value)
    if n is not None and not 0 < n <= 32 << 20:
        raise ValueError("expected a size from 1 byte to 32MiB (glibc's limit), or null")
    return n


def _codec(value: object) -> object:
    parse_codec(value)  # also refuses None and other non-strings, with the allowed forms
    return value


def _url(value: str | None) -> str | None:
    """Check a store URL with the store registry (no package is imported, no I/O)."""
    if value is None:
        return None
    from tensorstore_hooks.storage import check_url

    try:
        return check_url(value)
    except BadURLError as e:
        raise ValueError(e.reason) from None  # the error report shows the value itself


StoreURL = Annotated[str | None, AfterValidator(_url)]
"""YAML type of ``store.url``: checked by the store registry."""
TierURL = Annotated[str, AfterValidator(_url)]
"""YAML type of a tier's ``url``."""
Codec = Annotated[str, BeforeValidator(_codec)]
"""YAML type of ``store.codec`` (``storage.zarr.parse_codec``)."""
ChunkBytes = Annotated[int, BeforeValidator(check_chunk_bytes)]
"""YAML type of ``store.chunk_bytes``: a size, a power of two >= 4 KiB."""
DirectIO = Annotated[str, BeforeValidator(parse_direct_io)]
"""YAML type of ``store.direct_io``: ``auto``, ``on`` or ``off``."""
WriterThreads = Annotated[int, SchemaField(ge=1, le=64)]
"""YAML type of ``pipeline.writer_threads``."""
MmapThreshold = Annotated[int | None, BeforeValidator(_mmap_threshold)]
"""YAML type of ``pipeline.mmap_threshold``: 1 byte to 32 MiB, or null."""


def _options(options: Mapping[str, object] | None) -> dict[str, object] | None:
    return None if options is None else dict(options)


# ---------------------------------------------------------------------------------------
# Settings: what the rest of the library reads (plain dataclasses, no pydantic). Each
# field is one setting: NOTE [ One declaration per setting ] in _schema.py.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierSettings:
    """One entry of ``store.tiers``: a tier of a chain (NOTE [ Tier chain ], ``_chain_core``)."""

    url: TierURL = field(metadata=required(keyword=False))
    """The tier's store URL."""
    budget: OptSize = setting(None, dump=opt_size, omit=is_none)
    """Bytes the tier may hold; every tier but the last has one, the last none."""
    storage_options: dict[str, object] | None = setting(
        None, dump=_options, omit=is_none, secret=True
    )
    """This tier's fsspec options (``None``: the section's ``storage_options``)."""


@dataclass(frozen=True)
class StoreSettings:
    """The ``store:`` section: where offloaded tensors go."""

    url: StoreURL = setting(None, keyword=False)
    """Store URL (bare path, ``file://``, ``memory://``, ``s3://...``, ``tsh://HOST:PORT``);
    ``None``: a temporary local directory removed at exit. ``offload(store=...)`` replaces it."""
    storage_options: dict[str, object] = setting(factory=dict, dump=_options, secret=True)
    """Passed through to fsspec (credentials, endpoint_url, ...)."""
    codec: Codec = setting("none")
    """``none``, ``lz4``, ``zstd`` (level 3) or ``zstd:LEVEL``: 1..22 or -131072..-1
    (``storage.zarr``'s ``CODEC_HELP``; ``zstd:0`` is refused)."""
    chunk_bytes: ChunkBytes = setting(DEFAULT_CHUNK_BYTES, dump=exact_size)
    """Zarr chunk size in bytes: a power of two >= 4 KiB."""
    direct_io: DirectIO = setting("auto")
    """Local directories: ``auto`` (``O_DIRECT`` where the filesystem allows it), ``on``
    (required) or ``off`` (page cache). See NOTE [ Direct I/O ] in ``storage/io/_local.py``."""
    tiers: tuple[TierSettings, ...] = setting(
        (), items=TierSettings, omit=is_empty, keyword=False
    )
    """A tier chain instead of ``url`` (fastest first); empty: one store at ``url``."""


@dataclass(frozen=True)
class PipelineSettings:
    """The ``pipeline:`` section: background writing and read-ahead."""

    max_inflight: OptSize = setting(None, dump=opt_size)
    """Bytes written behind before pack blocks (0: every write finishes before pack returns;
    ``None``: derived from what the hooks saw, see NOTE [ Windows ] in ``pipeline/_budgets.py``)."""
    prefetch: OptSize = setting(None, dump=opt_size)
    """Bytes read ahead during backward (0: no read-ahead; ``None``: derived, as above)."""
    writer_threads: WriterThreads = setting(2)
    """Background writer threads (1..64)."""
    read_deadline_s: Duration = setting(30.0, dump=seconds)
    """How long a failing read is retried before its error is raised."""
    release_heap_every: Size = setting(128 << 20, dump=exact_size)
    """Bytes the I/O threads move between two hand-backs of freed heap memory to the OS
    (glibc ``malloc_trim``; 0: never). See NOTE [ Heap release ] in ``runtime/_heap.py``."""
    mmap_threshold: MmapThreshold = setting(1 << 20, dump=opt_size)
    """glibc ``M_MMAP_THRESHOLD`` set (process-wide) when a pipeline starts: freed buffers
    of at least this size leave RSS at once (``null``: leave glibc's dynamic threshold;
    at most 32 MiB). See NOTE [ Mmap threshold ] in ``runtime/_heap.py``."""
    host_budget: Budget = setting(0, dump=budget_value)
    """Pinned host memory that tensors leaving an accelerator may occupy before they
    spill to the store, oldest first (0: no host tier). See NOTE [ Host tier ]. Bytes,
    or a share of the memory there is (``"auto"``, ``"60%"``: NOTE [ Auto budgets ]
    in ``pipeline/_budgets.py``)."""
    memory_headroom: Headroom = setting(DEFAULT_HEADROOM, dump=budget_value)
    """What ``auto`` and percentage budgets leave unused: bytes, or a share of the
    memory limit (default 10%). NOTE [ Auto budgets ]."""


def _check_chain(store: StoreSettings, given: Set[str]) -> None:
    """The ``store:`` section's checks across fields, once ``tiers`` is given."""
    # NOTE [ Tier chain ] in storage/chain/_core.py: a budget for every tier but the last.
    if "tiers" not in given:
        return
    if store.url is not None:
        raise ValueError("url and tiers are exclusive: a chain names its URLs in tiers")
    if len(store.tiers) < 2:
        raise ValueError("tiers needs two or more tiers (fastest first); for one store use url")
    for i, tier in enumerate(store.tiers[:-1]):
        if tier.budget is None:
            raise ValueError(
                f"tiers[{i}].budget is missing: every tier but the last needs one "
                "(the bytes it may hold, e.g. budget: 64GiB)"
            )
    if store.tiers[-1].budget is not None:
        raise ValueError(
            f"tiers[{len(store.tiers) - 1}] is the last tier and takes no budget: it "
            "holds what the tiers above cannot"
        )


def _chain_hides_url(store: StoreSettings) -> Set[str]:
    """A chain's dump writes ``tiers`` and no ``url`` (the two are exclusive)."""
    return {"url"} if store.tiers else set()


@dataclass(frozen=True)
class EffectiveConfig:
    """A validated configuration with every default filled in (``tsh.load_config`` returns one)."""

    store: StoreSettings = section(StoreSettings, check=_check_chain, hide=_chain_hides_url)
    pipeline: PipelineSettings = section(PipelineSettings)
    policy: Policy = section(Policy)
    source: str | None = None
    """The file it came from (``None``: defaults, a dict, or keywords only)."""

    def to_dict(self, *, redact: bool = False) -> dict[str, object]:
        """The config as plain YAML-ready data, loadable again by ``config_from_dict``.

        Sizes are written with the largest exact binary unit (``"8MiB"``). With
        ``redact``, ``storage_options`` values whose key looks secret are masked.
        """
        return _dump(self, redact=redact)


# ---------------------------------------------------------------------------------------
# Derived from the settings classes: the pydantic models (strict, unknown keys are
# errors) and the YAML a config is written as. NOTE [ One declaration per setting ].
# ---------------------------------------------------------------------------------------


class _Model(BaseModel):
    # arbitrary types: a rule's dtype is validated by its own check into torch.dtype.
    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, arbitrary_types_allowed=True
    )


def _annotated(tp: object, *metadata: object) -> object:
    """``Annotated[tp, *metadata]`` for a type made at run time."""
    return Annotated[(tp, *metadata)]


def _none_is_empty(value: object) -> object:
    # "policy:" followed only by comments is null in YAML: read it as an empty section.
    return {} if value is None else value


def _as_tuple(items: list[object]) -> tuple[object, ...]:
    return tuple(items)


def _builder(
    cls: type[S], check: Callable[[S, Set[str]], None] | None
) -> Callable[[BaseModel], S]:
    """The validator that turns a section's validated model into its settings object."""

    def build(model: BaseModel) -> S:
        values = {name: getattr(model, name) for name in type(model).model_fields}
        try:
            built = cls(**values)
        except RuleError as e:  # checks across a rule's fields: reported at the rule
            raise ValueError(e.reason) from None
        if check is not None:
            check(built, model.model_fields_set)
        return built

    return build


def _default(f: Field[object]) -> object:
    """The pydantic default of a settings field: its value, its factory, or required."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return SchemaField(default_factory=f.default_factory)
    return SchemaField()


def _schema_of(f: Field[object], spec: object, hints: Mapping[str, object]) -> object | None:
    """The pydantic type of one settings field (``None``: not a setting)."""
    if isinstance(spec, Section):
        build = _builder(spec.cls, spec.check)
        return _annotated(
            _model(spec.cls), BeforeValidator(_none_is_empty), AfterValidator(build)
        )
    if not isinstance(spec, Setting):
        return None
    if spec.items is None:
        return hints[f.name]
    item = _annotated(_model(spec.items), AfterValidator(_builder(spec.items, None)))
    return _annotated(types.GenericAlias(list, (item,)), AfterValidator(_as_tuple))


_MODELS: dict[type[DataclassInstance], type[_Model]] = {}


def _model(cls: type[DataclassInstance]) -> type[_Model]:
    """The pydantic model of the YAML mapping that ``cls`` (a settings class) is read from
    (made once per class)."""
    if cls in _MODELS:
        return _MODELS[cls]
    hints = get_type_hints(cls, include_extras=True)
    namespace: dict[str, object] = {"__module__": __name__, "__doc__": cls.__doc__}
    annotations: dict[str, object] = {}
    for f in fields(cls):
        tp = _schema_of(f, f.metadata.get(SETTING), hints)
        if tp is not None:
            annotations[f.name] = tp
            namespace[f.name] = _default(f)
    namespace["__annotations__"] = annotations
    model = types.new_class(
        f"{cls.__name__}Schema", (_Model,), exec_body=lambda ns: ns.update(namespace)
    )
    if not issubclass(model, _Model):
        raise TypeError(f"{model!r} is not a pydantic model")
    _MODELS[cls] = model
    return model


def _keywords() -> dict[str, tuple[str, type[_Model]]]:
    """``offload()`` keyword -> (the section it sets, that section's model)."""
    out: dict[str, tuple[str, type[_Model]]] = {}
    for f in fields(EffectiveConfig):
        spec = f.metadata.get(SETTING)
        if not isinstance(spec, Section):
            continue
        for g in fields(spec.cls):
            setting_spec = g.metadata.get(SETTING)
            if isinstance(setting_spec, Setting) and setting_spec.keyword:
                if g.name in out:
                    raise TypeError(f"offload() keyword {g.name!r} is declared twice")
                out[g.name] = (f.name, _model(spec.cls))
    return out


_SECRET_KEY = re.compile(r"secret|token|password|passwd|credential|key", re.IGNORECASE)


def _masked(options: object) -> object:
    if not isinstance(options, dict):
        return options
    return {k: ("***" if _SECRET_KEY.search(str(k)) else v) for k, v in options.items()}


def _dump(
    settings: DataclassInstance, *, redact: bool, hidden: Set[str] = frozenset()
) -> dict[str, object]:
    """A settings object as plain YAML data, key by key as its settings declare."""
    out: dict[str, object] = {}
    for f in fields(settings):
        spec = f.metadata.get(SETTING)
        if f.name in hidden or not isinstance(spec, Section | Setting):
            continue
        value = getattr(settings, f.name)
        if isinstance(spec, Section):
            hide = spec.hide(value) if spec.hide is not None else frozenset()
            out[f.name] = _dump(value, redact=redact, hidden=hide)
        elif spec.omit is not None and spec.omit(value):
            continue
        elif spec.items is not None:
            out[f.name] = [_dump(item, redact=redact) for item in value]
        else:
            dumped = spec.dump(value)
            out[f.name] = _masked(dumped) if redact and spec.secret else dumped
    return out


_CONFIG_MODEL = _model(EffectiveConfig)
_build_config = _builder(EffectiveConfig, None)

_SECTIONS_HELP = "a mapping with the optional sections store, pipeline, policy"


def load_config(path: str | os.PathLike[str]) -> EffectiveConfig:
    """Read and validate a YAML config file; return it with defaults filled in.

    Raises :class:`ConfigError` (file and line, field path, bad value, what is
    allowed) for a missing/unreadable file, YAML syntax errors, an empty file,
    unknown keys, wrong types and bad values. Public as ``tsh.load_config``.
    """
    if not isinstance(path, str | os.PathLike):
        raise ConfigError(f"load_config: expected a file path, got {type(path).__name__}")
    source = os.fspath(path)
    data, node = read_yaml(source)
    if data is None:
        raise ConfigError(f"{source}: config file is empty; expected {_SECTIONS_HELP}")
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}:1: top level must be {_SECTIONS_HELP}, got a {type(data).__name__}"
        )
    return _validate(data, source=source, line_of=line_finder(node), file=source)


def config_from_dict(data: Mapping[str, object], *, source: str = "config") -> EffectiveConfig:
    """Validate an already-parsed config (the YAML structure as Python data)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected {_SECTIONS_HELP}, got {type(data).__name__}")
    return _validate(_plain(data), source=source, line_of=None, file=None)


def _validate(
    data: object, *, source: str, line_of: LineOf | None, file: str | None
) -> EffectiveConfig:
    try:
        model = _CONFIG_MODEL.model_validate(data)
    except _PydanticValidationError as e:
        message = format_validation_error(
            e, source=source, root=_CONFIG_MODEL, line_of=line_of
        )
        raise ConfigError(message) from None
    return replace(_build_config(model), source=file)


def _plain(value: object) -> object:
    """Python containers -> the shapes YAML produces (strict models want lists and dicts)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, Rule):
        return _dump(value, redact=False)
    return value


# ---------------------------------------------------------------------------------------
# Effective config: file / env / defaults + keyword overrides
# ---------------------------------------------------------------------------------------

_KEYWORDS = _keywords()
OVERRIDE_KEYS: tuple[str, ...] = tuple(_KEYWORDS)
"""The keyword arguments of ``offload()`` that override config fields: every setting of
the ``store``, ``pipeline`` and ``policy`` sections but ``store.url`` and ``store.tiers``."""


def resolve_config(
    config: str | os.PathLike[str] | EffectiveConfig | Mapping[str, object] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> EffectiveConfig:
    """The effective config for ``offload(config=..., **overrides)``.

    ``config``: a YAML path, an :class:`EffectiveConfig`, a dict shaped like the
    YAML, or ``None`` (then the file named by ``$TSH_CONFIG`` if set, else the
    defaults). Each override is validated exactly like its YAML field and replaces
    it (``rules=`` replaces the whole list). Raises :class:`ConfigError` naming the
    keyword (``offload(min_bytes=...)``) or the file; unknown keywords list the
    allowed ones. All overrides are checked before any is applied.
    """
    base = _base_config(config)
    if not overrides:
        return base
    unknown = sorted(k for k in overrides if k not in _KEYWORDS)
    if unknown:
        raise ConfigError(
            f"offload(): unknown keyword argument(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(OVERRIDE_KEYS)} (and store, config, model)"
        )
    problems: list[str] = []
    changes: dict[str, dict[str, object]] = {}
    for key, value in overrides.items():
        section_name, model_cls = _KEYWORDS[key]
        try:
            model = model_cls.model_validate({key: _plain(value)})
        except _PydanticValidationError as e:
            problems.append(
                format_validation_error(e, source=f"offload({key}=...)", root=model_cls)
            )
            continue
        changes.setdefault(section_name, {})[key] = getattr(model, key)
    if problems:
        raise ConfigError("\n".join(problems))
    return replace(
        base,
        **{name: replace(getattr(base, name), **values) for name, values in changes.items()},
    )


def _base_config(
    config: str | os.PathLike[str] | EffectiveConfig | Mapping[str, object] | None,
) -> EffectiveConfig:
    if isinstance(config, EffectiveConfig):
        return config
    if isinstance(config, str | os.PathLike):
        return load_config(config)
    if isinstance(config, Mapping):
        return config_from_dict(config, source="offload(config={...})")
    if config is not None:
        raise ConfigError(
            "offload(config=...): expected a YAML file path, a dict, an EffectiveConfig or None, "
            f"got {type(config).__name__}"
        )
    env = os.environ.get(CONFIG_ENV, "").strip()
    if not env:
        return EffectiveConfig()
    try:
        return load_config(env)
    except ConfigError as e:
        raise ConfigError(f"{e}\n(the file named by the environment variable {CONFIG_ENV})") from e


def dump_config(config: EffectiveConfig, *, redact: bool = True) -> str:
    """The effective config as YAML text (what ``check-config`` prints); loadable again."""
    header = f"# effective config from {config.source}\n" if config.source else ""
    labels = "".join(f"#   {label}\n" for label in config.policy.labels)
    body = yaml.safe_dump(config.to_dict(redact=redact), sort_keys=False, default_flow_style=False)
    return f"{header}# defaults filled in; stats labels:\n{labels}{body}"
