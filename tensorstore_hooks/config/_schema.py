"""How a setting is declared: once, as a field of its settings dataclass.

NOTE [ One declaration per setting ]
A setting is one field of a frozen settings dataclass (``StoreSettings``,
``TierSettings``, ``PipelineSettings``, ``Policy``, ``Rule``), declared with
:func:`setting` (or ``field(metadata=required())`` when it has no default), and a
section is a field declared with :func:`section`. Everything else is derived from
these fields, in ``_settings``:

1. The field's annotation is its YAML type: a pydantic type, usually an
   ``Annotated`` that carries the one validator of its value (``_units.Size``,
   ``Codec``, ...). mypy reads the plain type under it; the pydantic model of each
   section is built from the annotations (strict, unknown keys forbidden), so a
   YAML key exists exactly when the field does.
2. A field given ``items=Cls`` holds a tuple of ``Cls`` settings objects and reads a
   YAML list of ``Cls`` mappings (``store.tiers``, ``policy.rules``); its annotation
   is then only the Python type.
3. ``dump`` writes the value back as YAML (``dump_config``, ``to_dict``), ``omit``
   leaves the key out, ``secret`` masks a mapping's secret-looking values when printed.
4. ``keyword``: ``offload(**overrides)`` takes the setting by its name (only settings
   of the sections ``store``, ``pipeline`` and ``policy``; names are unique across them).
5. Checks across the fields of a section run once the section is built: in the
   class's own constructor (``Rule``), or as the ``check`` of its :func:`section`.

To add a setting: add the field, with its YAML type as annotation, its default
(``setting(default, dump=...)``) and a docstring, to its settings class, and a row
to ``docs/config.md``. Nothing else lists settings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar, overload

from tensorstore_hooks._units import MemoryShare

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "SETTING",
    "Section",
    "Setting",
    "budget_value",
    "exact_size",
    "is_empty",
    "is_none",
    "opt_size",
    "required",
    "seconds",
    "section",
    "setting",
]

T = TypeVar("T")
S = TypeVar("S", bound="DataclassInstance")

SETTING = "tensorstore_hooks.setting"
"""The ``dataclasses.field`` metadata key of a :class:`Setting` or a :class:`Section`."""


def _as_is(value: object) -> object:
    return value


@dataclass(frozen=True, slots=True)
class Setting(Generic[T]):
    """How one setting is written back and who may set it (NOTE [ One declaration per setting ])."""

    dump: Callable[[T], object]
    """The value as YAML writes it (``8388608`` -> ``"8MiB"``); plain data only."""
    omit: Callable[[T], bool] | None
    """Leave the key out of a dump when this says so (``None``: always written)."""
    keyword: bool
    """Whether ``offload(**overrides)`` takes it by its name."""
    secret: bool
    """A mapping whose values are masked, key by key, where the key looks secret, when
    the config is printed with ``redact``."""
    items: type[DataclassInstance] | None
    """A settings class: the field is a tuple of them, read from a YAML list of mappings."""


@dataclass(frozen=True, slots=True)
class Section(Generic[S]):
    """A field that holds a whole section (``store:``, ``pipeline:``, ``policy:``)."""

    cls: type[S]
    """The section's settings class; its settings are the section's keys."""
    check: Callable[[S, Set[str]], None] | None
    """Checks across the section's fields, given the keys the YAML named; raises
    ``ValueError`` with what is allowed (reported at the section)."""
    hide: Callable[[S], Set[str]] | None
    """Keys a dump of this section leaves out (one of two exclusive keys)."""


@overload
def setting(
    default: T,
    *,
    dump: Callable[[T], object] = ...,
    omit: Callable[[T], bool] | None = ...,
    keyword: bool = ...,
    secret: bool = ...,
    items: type[DataclassInstance] | None = ...,
) -> T: ...


@overload
def setting(
    *,
    factory: Callable[[], T],
    dump: Callable[[T], object] = ...,
    omit: Callable[[T], bool] | None = ...,
    keyword: bool = ...,
    secret: bool = ...,
    items: type[DataclassInstance] | None = ...,
) -> T: ...


def setting(
    default: T | None = None,
    *,
    factory: Callable[[], T] | None = None,
    dump: Callable[[T], object] = _as_is,
    omit: Callable[[T], bool] | None = None,
    keyword: bool = True,
    secret: bool = False,
    items: type[DataclassInstance] | None = None,
) -> T | None:
    """A settings field with its default (or ``factory``); see NOTE [ One declaration
    per setting ]. Its annotation is its YAML type; ``dump`` writes it back (default: as is)."""
    spec = {SETTING: Setting(dump, omit, keyword, secret, items)}
    if factory is not None:
        return field(default_factory=factory, metadata=spec)
    return field(default=default, metadata=spec)


def required(*, keyword: bool = True) -> Mapping[str, Setting[object]]:
    """The metadata of a setting without a default: ``field(metadata=required())``.

    (A plain ``field`` call, so that type checkers see that the field has no default.)
    """
    return {SETTING: Setting(_as_is, None, keyword, False, None)}


def section(
    cls: type[S],
    *,
    check: Callable[[S, Set[str]], None] | None = None,
    hide: Callable[[S], Set[str]] | None = None,
) -> S:
    """A field holding the section ``cls`` (default: ``cls()``); see :class:`Section`."""
    return field(default_factory=cls, metadata={SETTING: Section(cls, check, hide)})


# ---------------------------------------------------------------------------------------
# How values are written back (``dump``) and left out (``omit``)
# ---------------------------------------------------------------------------------------


def exact_size(n: int) -> int | str:
    """``8388608`` -> ``"8MiB"``: the largest binary unit that divides ``n`` exactly, else ``n``."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return n


def opt_size(n: int | None) -> int | str | None:
    """:func:`exact_size`, or ``None``."""
    return None if n is None else exact_size(n)


def budget_value(n: int | MemoryShare | None) -> int | str | None:
    """A budget as YAML writes it: a size, ``"auto"`` or ``"60%"`` (or ``None``)."""
    return str(n) if isinstance(n, MemoryShare) else opt_size(n)


def seconds(s: float) -> str:
    """A duration as YAML writes it: ``30.0`` -> ``"30s"``, ``0.5`` -> ``"0.5s"``."""
    return f"{int(s)}s" if float(s).is_integer() else f"{s}s"


def is_none(value: object) -> bool:
    """``omit`` for optional keys: left out when ``None``."""
    return value is None


def is_empty(value: tuple[object, ...]) -> bool:
    """``omit`` for lists written only when they hold something."""
    return not value
