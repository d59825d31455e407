"""Configuration: the YAML schema, its validation, and the effective settings.

A config file has three optional sections, ``store``, ``pipeline`` and ``policy``
(see ``docs/config.md`` and ``configs/``). It is parsed with a safe YAML loader,
validated by pydantic models (strict types, unknown keys forbidden), and turned
into plain frozen dataclasses (:class:`EffectiveConfig`) that the hooks read on the
hot path without pydantic. Every problem is a :class:`ConfigError` naming the
source (file and line, or the ``offload()`` keyword), the field path such as
``policy.rules[2].action``, the bad value and what is allowed. Validation happens
completely before anything is returned: nothing half-applies.

Precedence: ``offload()`` keywords > the file given as ``config=`` > the file named
by ``TSH_CONFIG`` (only when ``config=`` is not given) > built-in defaults.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    model_validator,
)
from pydantic import ValidationError as _PydanticValidationError

from tensorstore_hooks._units import (
    DEFAULT_HEADROOM,
    Budget,
    Duration,
    Headroom,
    MemoryShare,
    OptBudget,
    OptSize,
    Size,
    check_size,
)
from tensorstore_hooks.config._policy import (
    Action,
    Policy,
    Rule,
    RuleError,
    dtype_name,
    exact_size,
    rule_action,
    rule_dtypes,
    rule_module,
    rule_ndims,
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

__all__ = [
    "CONFIG_ENV",
    "OVERRIDE_KEYS",
    "Duration",
    "EffectiveConfig",
    "OptSize",
    "PipelineSettings",
    "Size",
    "StoreSettings",
    "TierSettings",
    "config_from_dict",
    "dump_config",
    "format_validation_error",
    "load_config",
    "resolve_config",
]

CONFIG_ENV = "TSH_CONFIG"
"""Environment variable naming the config file used when ``offload()`` gets no ``config=``."""


# ---------------------------------------------------------------------------------------
# Settings: what the rest of the library reads (plain dataclasses, no pydantic)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreSettings:
    """The ``store:`` section: where offloaded tensors go."""

    url: str | None = None
    """Store URL (bare path, ``file://``, ``memory://``, ``s3://...``, ``tsh://HOST:PORT``);
    ``None``: a temporary local directory removed at exit."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed through to fsspec (credentials, endpoint_url, ...)."""
    codec: str = "none"
    """``none``, ``lz4``, ``zstd`` (level 3) or ``zstd:LEVEL``: 1..22 or -131072..-1
    (``_zarr_options.CODEC_HELP``; ``zstd:0`` is refused)."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Zarr chunk size in bytes: a power of two >= 4 KiB."""
    direct_io: str = "auto"
    """Local directories: ``auto`` (``O_DIRECT`` where the filesystem allows it), ``on``
    (required) or ``off`` (page cache). See NOTE [ Direct I/O ] in ``storage/io/_local.py``."""
    tiers: tuple[TierSettings, ...] = ()
    """A tier chain instead of ``url`` (fastest first); empty: one store at ``url``."""


@dataclass(frozen=True)
class TierSettings:
    """One entry of ``store.tiers``: a tier of a chain (NOTE [ Tier chain ], ``_chain_core``)."""

    url: str
    """The tier's store URL."""
    budget: int | None = None
    """Bytes the tier may hold; every tier but the last has one, the last none."""
    storage_options: dict[str, Any] | None = None
    """This tier's fsspec options (``None``: the section's ``storage_options``)."""


@dataclass(frozen=True)
class PipelineSettings:
    """The ``pipeline:`` section: background writing and read-ahead."""

    max_inflight: int | None = None
    """Bytes written behind before pack blocks (0: every write finishes before pack returns;
    ``None``: derived from what the hooks saw, see NOTE [ Windows ] in ``pipeline/_budgets.py``)."""
    prefetch: int | None = None
    """Bytes read ahead during backward (0: no read-ahead; ``None``: derived, as above)."""
    writer_threads: int = 2
    """Background writer threads (1..64)."""
    read_deadline_s: float = 30.0
    """How long a failing read is retried before its error is raised."""
    release_heap_every: int = 128 << 20
    """Bytes the I/O threads move between two hand-backs of freed heap memory to the OS
    (glibc ``malloc_trim``; 0: never). See NOTE [ Heap release ] in ``runtime/_heap.py``."""
    mmap_threshold: int | None = 1 << 20
    """glibc ``M_MMAP_THRESHOLD`` set (process-wide) when a pipeline starts: freed buffers
    of at least this size leave RSS at once (``null``: leave glibc's dynamic threshold;
    at most 32 MiB). See NOTE [ Mmap threshold ] in ``runtime/_heap.py``."""
    host_budget: int | MemoryShare = 0
    """Pinned host memory that tensors leaving an accelerator may occupy before they
    spill to the store, oldest first (0: no host tier). See NOTE [ Host tier ]. Bytes,
    or a share of the memory there is (``"auto"``, ``"60%"``: NOTE [ Auto budgets ]
    in ``pipeline/_budgets.py``)."""
    memory_headroom: int | MemoryShare = DEFAULT_HEADROOM
    """What ``auto`` and percentage budgets leave unused: bytes, or a share of the
    memory limit (default 10%). NOTE [ Auto budgets ]."""


@dataclass(frozen=True)
class EffectiveConfig:
    """A validated configuration with every default filled in (``tsh.load_config`` returns one)."""

    store: StoreSettings = field(default_factory=StoreSettings)
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    policy: Policy = field(default_factory=Policy)
    source: str | None = None
    """The file it came from (``None``: defaults, a dict, or keywords only)."""

    def to_dict(self, *, redact: bool = False) -> dict[str, Any]:
        """The config as plain YAML-ready data, loadable again by ``config_from_dict``.

        Sizes are written with the largest exact binary unit (``"8MiB"``). With
        ``redact``, ``storage_options`` values whose key looks secret are masked.
        """
        def shown(options: Mapping[str, Any]) -> dict[str, Any]:
            if not redact:
                return dict(options)
            return {k: ("***" if _SECRET_KEY.search(str(k)) else v) for k, v in options.items()}

        store: dict[str, Any] = {
            "url": self.store.url,
            "storage_options": shown(self.store.storage_options),
            "codec": self.store.codec,
            "chunk_bytes": exact_size(self.store.chunk_bytes),
            "direct_io": self.store.direct_io,
        }
        if self.store.tiers:
            del store["url"]
            store["tiers"] = [_tier_to_dict(t, shown) for t in self.store.tiers]
        return {
            "store": store,
            "pipeline": {
                "max_inflight": _opt_exact(self.pipeline.max_inflight),
                "prefetch": _opt_exact(self.pipeline.prefetch),
                "writer_threads": self.pipeline.writer_threads,
                "read_deadline_s": _duration_str(self.pipeline.read_deadline_s),
                "release_heap_every": exact_size(self.pipeline.release_heap_every),
                "mmap_threshold": _opt_exact(self.pipeline.mmap_threshold),
                "host_budget": _budget_value(self.pipeline.host_budget),
                "memory_headroom": _budget_value(self.pipeline.memory_headroom),
            },
            "policy": {
                "min_bytes": exact_size(self.policy.min_bytes),
                "skip_parameters": self.policy.skip_parameters,
                "rules": [_rule_to_dict(r, sizes_as_str=True) for r in self.policy.rules],
                "default": self.policy.default,
                "device_budget": _budget_value(self.policy.device_budget),
            },
        }


_SECRET_KEY = re.compile(r"secret|token|password|passwd|credential|key", re.IGNORECASE)


def _tier_to_dict(tier: TierSettings, shown: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"url": tier.url}
    if tier.budget is not None:
        out["budget"] = exact_size(tier.budget)
    if tier.storage_options is not None:
        out["storage_options"] = shown(tier.storage_options)
    return out


def _opt_exact(n: int | None) -> int | str | None:
    return None if n is None else exact_size(n)


def _budget_value(n: int | MemoryShare | None) -> int | str | None:
    """A budget as YAML writes it: a size, ``"auto"`` or ``"60%"``."""
    return str(n) if isinstance(n, MemoryShare) else _opt_exact(n)


def _duration_str(s: float) -> str:
    return f"{int(s)}s" if float(s).is_integer() else f"{s}s"


def _rule_to_dict(rule: Rule, *, sizes_as_str: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rule.name is not None:
        out["name"] = rule.name
    if rule.module is not None:
        out["module"] = rule.module
    if rule.dtype is not None:
        names = [dtype_name(d) for d in rule.dtype]
        out["dtype"] = names[0] if len(names) == 1 else names
    for key in ("min_bytes", "max_bytes"):
        value = getattr(rule, key)
        if value is not None:
            out[key] = exact_size(value) if sizes_as_str else value
    if rule.ndim is not None:
        out["ndim"] = rule.ndim[0] if len(rule.ndim) == 1 else list(rule.ndim)
    out["action"] = rule.action
    return out


# ---------------------------------------------------------------------------------------
# Field checks: each calls the one validator of its value (``_units``, ``_zarr_options``,
# the store registry, ``_policy``'s rule checks); ``Size``/``Duration`` live in ``_units``.
# ---------------------------------------------------------------------------------------


def _mmap_threshold(value: Any) -> int | None:
    n = None if value is None else check_size(value)
    if n is not None and not 0 < n <= 32 << 20:
        raise ValueError("expected a size from 1 byte to 32MiB (glibc's limit), or null")
    return n


def _chunk_size(value: Any) -> int:
    return check_chunk_bytes(value)


def _direct_io(value: Any) -> str:
    return parse_direct_io(value)


def _codec(value: Any) -> Any:
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


# ---------------------------------------------------------------------------------------
# The schema (pydantic): strict types, unknown keys are errors
# ---------------------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _TierModel(_Model):
    url: Annotated[str, AfterValidator(_url)]
    budget: OptSize = None
    storage_options: dict[str, Any] | None = None


class _StoreModel(_Model):
    url: Annotated[str | None, AfterValidator(_url)] = None
    storage_options: dict[str, Any] = Field(default_factory=dict)
    codec: Annotated[str, BeforeValidator(_codec)] = "none"
    chunk_bytes: Annotated[int, BeforeValidator(_chunk_size)] = DEFAULT_CHUNK_BYTES
    direct_io: Annotated[str, BeforeValidator(_direct_io)] = "auto"
    tiers: list[_TierModel] = Field(default_factory=list)

    @model_validator(mode="after")
    def _chain(self) -> _StoreModel:
        # NOTE [ Tier chain ] in storage/chain/_core.py: a budget for every tier but the last.
        if "tiers" not in self.model_fields_set:
            return self
        if self.url is not None:
            raise ValueError(
                "url and tiers are exclusive: a chain names its URLs in tiers"
            )
        if len(self.tiers) < 2:
            raise ValueError(
                "tiers needs two or more tiers (fastest first); for one store use url"
            )
        for i, tier in enumerate(self.tiers[:-1]):
            if tier.budget is None:
                raise ValueError(
                    f"tiers[{i}].budget is missing: every tier but the last needs one "
                    "(the bytes it may hold, e.g. budget: 64GiB)"
                )
        if self.tiers[-1].budget is not None:
            raise ValueError(
                f"tiers[{len(self.tiers) - 1}] is the last tier and takes no budget: it "
                "holds what the tiers above cannot"
            )
        return self


class _PipelineModel(_Model):
    max_inflight: OptSize = PipelineSettings.max_inflight
    prefetch: OptSize = PipelineSettings.prefetch
    writer_threads: Annotated[int, Field(ge=1, le=64)] = PipelineSettings.writer_threads
    read_deadline_s: Duration = PipelineSettings.read_deadline_s
    release_heap_every: Size = PipelineSettings.release_heap_every
    mmap_threshold: Annotated[int | None, BeforeValidator(_mmap_threshold)] = (
        PipelineSettings.mmap_threshold
    )
    host_budget: Budget = PipelineSettings.host_budget
    memory_headroom: Headroom = PipelineSettings.memory_headroom


class _RuleModel(_Model):
    """A rule's keys and their types; the checks are ``_policy``'s (see its docstring)."""

    name: str | None = None
    module: Annotated[str | None, AfterValidator(rule_module)] = None
    dtype: Annotated[Any, BeforeValidator(rule_dtypes)] = None
    min_bytes: OptSize = None
    max_bytes: OptSize = None
    ndim: Annotated[Any, BeforeValidator(rule_ndims)] = None
    action: Annotated[Action, BeforeValidator(rule_action)]
    _rule: Rule = PrivateAttr()

    @model_validator(mode="after")
    def _build(self) -> _RuleModel:
        # The checks across fields run once, in Rule's constructor.
        try:
            self._rule = Rule(
                self.action,
                module=self.module,
                dtype=self.dtype,
                min_bytes=self.min_bytes,
                max_bytes=self.max_bytes,
                ndim=self.ndim,
                name=self.name,
            )
        except RuleError as e:
            raise ValueError(e.reason) from None
        return self

    def build(self) -> Rule:
        return self._rule


_DEFAULT_POLICY = Policy()  # slots dataclass: defaults are read from an instance


class _PolicyModel(_Model):
    min_bytes: Size = _DEFAULT_POLICY.min_bytes
    skip_parameters: bool = _DEFAULT_POLICY.skip_parameters
    rules: list[_RuleModel] = Field(default_factory=list)
    default: Action = _DEFAULT_POLICY.default
    device_budget: OptBudget = _DEFAULT_POLICY.device_budget


class _ConfigModel(_Model):
    store: _StoreModel = Field(default_factory=_StoreModel)
    pipeline: _PipelineModel = Field(default_factory=_PipelineModel)
    policy: _PolicyModel = Field(default_factory=_PolicyModel)

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        # "policy:" followed only by comments is null in YAML: read it as an empty section.
        if isinstance(data, dict):
            return {k: ({} if v is None and k in cls.model_fields else v) for k, v in data.items()}
        return data

    def build(self, source: str | None) -> EffectiveConfig:
        s, p, pol = self.store, self.pipeline, self.policy
        return EffectiveConfig(
            store=StoreSettings(
                url=s.url,
                storage_options=dict(s.storage_options),
                codec=s.codec,
                chunk_bytes=s.chunk_bytes,
                direct_io=s.direct_io,
                tiers=tuple(
                    TierSettings(
                        t.url,
                        t.budget,
                        None if t.storage_options is None else dict(t.storage_options),
                    )
                    for t in s.tiers
                ),
            ),
            pipeline=PipelineSettings(
                max_inflight=p.max_inflight,
                prefetch=p.prefetch,
                writer_threads=p.writer_threads,
                read_deadline_s=p.read_deadline_s,
                release_heap_every=p.release_heap_every,
                mmap_threshold=p.mmap_threshold,
                host_budget=p.host_budget,
                memory_headroom=p.memory_headroom,
            ),
            policy=Policy(
                min_bytes=pol.min_bytes,
                skip_parameters=pol.skip_parameters,
                rules=tuple(r.build() for r in pol.rules),
                default=pol.default,
                device_budget=pol.device_budget,
            ),
            source=source,
        )


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


def config_from_dict(data: Mapping[str, Any], *, source: str = "config") -> EffectiveConfig:
    """Validate an already-parsed config (the YAML structure as Python data)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected {_SECTIONS_HELP}, got {type(data).__name__}")
    return _validate(_plain(data), source=source, line_of=None, file=None)


def _validate(
    data: Any, *, source: str, line_of: LineOf | None, file: str | None
) -> EffectiveConfig:
    try:
        model = _ConfigModel.model_validate(data)
    except _PydanticValidationError as e:
        message = format_validation_error(e, source=source, root=_ConfigModel, line_of=line_of)
        raise ConfigError(message) from None
    try:
        return model.build(file)
    except ConfigError as e:  # the schema should have caught it: still name the source
        raise ConfigError(f"{source}: {e}") from e


def _plain(value: Any) -> Any:
    """Python containers -> the shapes YAML produces (strict models want lists and dicts)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, Rule):
        return _rule_to_dict(value)
    return value


# ---------------------------------------------------------------------------------------
# Effective config: file / env / defaults + keyword overrides
# ---------------------------------------------------------------------------------------

# offload() keyword -> section it overrides.
_OVERRIDES: dict[str, tuple[str, type[_Model]]] = {
    "min_bytes": ("policy", _PolicyModel),
    "skip_parameters": ("policy", _PolicyModel),
    "rules": ("policy", _PolicyModel),
    "default": ("policy", _PolicyModel),
    "device_budget": ("policy", _PolicyModel),
    "host_budget": ("pipeline", _PipelineModel),
    "memory_headroom": ("pipeline", _PipelineModel),
    "mmap_threshold": ("pipeline", _PipelineModel),
    "prefetch": ("pipeline", _PipelineModel),
    "max_inflight": ("pipeline", _PipelineModel),
    "writer_threads": ("pipeline", _PipelineModel),
    "read_deadline_s": ("pipeline", _PipelineModel),
    "release_heap_every": ("pipeline", _PipelineModel),
    "storage_options": ("store", _StoreModel),
    "codec": ("store", _StoreModel),
    "chunk_bytes": ("store", _StoreModel),
    "direct_io": ("store", _StoreModel),
}
OVERRIDE_KEYS: tuple[str, ...] = tuple(_OVERRIDES)
"""The keyword arguments of ``offload()`` that override config fields."""


def resolve_config(
    config: str | os.PathLike[str] | EffectiveConfig | Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
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
    unknown = sorted(k for k in overrides if k not in _OVERRIDES)
    if unknown:
        raise ConfigError(
            f"offload(): unknown keyword argument(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(OVERRIDE_KEYS)} (and store, config, model)"
        )
    problems: list[str] = []
    changes: dict[str, dict[str, Any]] = {"store": {}, "pipeline": {}, "policy": {}}
    for key, value in overrides.items():
        section, model_cls = _OVERRIDES[key]
        try:
            model = model_cls.model_validate({key: _plain(value)})
        except _PydanticValidationError as e:
            problems.append(
                format_validation_error(e, source=f"offload({key}=...)", root=model_cls)
            )
            continue
        validated = getattr(model, key)
        if key == "rules":
            validated = tuple(r.build() for r in validated)
        elif key == "storage_options":
            validated = dict(validated)
        changes[section][key] = validated
    if problems:
        raise ConfigError("\n".join(problems))
    return replace(
        base,
        store=replace(base.store, **changes["store"]),
        pipeline=replace(base.pipeline, **changes["pipeline"]),
        policy=replace(base.policy, **changes["policy"]),
    )


def _base_config(
    config: str | os.PathLike[str] | EffectiveConfig | Mapping[str, Any] | None,
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
