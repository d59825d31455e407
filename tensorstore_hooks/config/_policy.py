"""Where a saved tensor goes: :class:`Policy`, its :class:`Rule` list, and the :class:`Decision`.

``Policy.decide`` runs once for every tensor autograd saves, on the training hot
path, so everything it needs (compiled globs, dtype sets, the ``Decision`` objects
it returns) is built once at construction; ``decide`` only compares and returns.

A rule is validated in one place: the ``rule_*`` field checks and
:func:`check_rule_conditions` below, which ``Rule.__init__`` runs. ``Rule``'s and
``Policy``'s fields are also the YAML keys of a rule and of the ``policy:`` section
(NOTE [ One declaration per setting ] in ``_schema.py``): their annotations carry the
same field checks, so YAML errors name the field path (``policy.rules[2].ndim``), and
each :class:`Rule` is built once, through ``Rule``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Literal, TypeVar, get_args

import torch
from pydantic import AfterValidator, BeforeValidator, PlainValidator

from tensorstore_hooks._units import MemoryShare, OptBudget, OptSize, Size, check_size
from tensorstore_hooks.config._schema import (
    budget_value,
    exact_size,
    is_none,
    opt_size,
    required,
    setting,
)
from tensorstore_hooks.config._select import compile_module_glob, path_matches
from tensorstore_hooks.errors import ConfigError

__all__ = [
    "ACTIONS",
    "Action",
    "Decision",
    "Policy",
    "Rule",
    "RuleAction",
    "RuleDtypes",
    "RuleError",
    "RuleModule",
    "RuleNdims",
    "check_rule_conditions",
    "compile_module_glob",
    "dtype_name",
    "exact_size",
    "parse_dtype",
    "rule_action",
    "rule_dtypes",
    "rule_module",
    "rule_ndims",
    "rule_size",
]

Action = Literal["keep", "host", "store"]
"""``keep``: leave the tensor where it is · ``host``: a (pinned) CPU copy, like
``save_on_cpu`` · ``store``: write it to the configured store."""

ACTIONS: tuple[Action, ...] = get_args(Action)

T = TypeVar("T")

_PATH_CACHE_LIMIT = 65536  # module paths remembered per rule (models have far fewer)

DTypeLike = torch.dtype | str
"""A ``torch.dtype`` or its name: ``"bool"``, ``"bfloat16"``, ``"torch.float16"``, ``"half"``."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What ``Policy.decide`` chose for one saved tensor."""

    action: Action
    """``keep``, ``host`` or ``store``."""
    label: str
    """Stats key naming why: ``"rules[0] module=*.lm_head"``, ``"parameter"``,
    ``"min_bytes"`` or ``"default"``."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bool"``, ``"float16"``, ``"torch.bfloat16"``, ``"half"`` or a ``torch.dtype`` -> dtype.

    Raises ``ValueError`` (not ConfigError: the config layer adds the field path).
    """
    if isinstance(name, torch.dtype):
        return name
    if isinstance(name, str):
        attr = name.strip().removeprefix("torch.")
        dtype = getattr(torch, attr, None) if attr.isidentifier() else None
        if isinstance(dtype, torch.dtype):
            return dtype
    raise ValueError(
        f"unknown dtype {name!r}; use a torch dtype name such as bool, float16, bfloat16, "
        "float32, int64, uint8, complex64, float8_e4m3fn"
    )


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling the YAML uses)."""
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------
# Rule validation: the one place. Each check raises ValueError with what is allowed
# (not the value: callers show it) and returns the normalised value.
# ---------------------------------------------------------------------------------------


def rule_action(value: object) -> Action:
    """``keep``, ``host`` or ``store``."""
    if isinstance(value, str):
        for action in ACTIONS:
            if value == action:
                return action
    raise ValueError("expected one of 'keep', 'host' or 'store'")


def rule_module(value: object) -> str | None:
    """A module glob (see :func:`compile_module_glob`), or ``None``."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError("expected an fnmatch glob string such as 'blocks.*' or '*.lm_head'")
    compile_module_glob(value)
    return value


def rule_dtypes(value: object) -> tuple[torch.dtype, ...] | None:
    """One dtype (name or ``torch.dtype``) or a non-empty list of them -> a tuple, or ``None``."""
    if value is None:
        return None
    if isinstance(value, str | torch.dtype):
        return (parse_dtype(value),)
    items = tuple(value) if isinstance(value, Iterable) and not isinstance(value, Mapping) else ()
    if not items:
        raise ValueError(
            "expected a dtype name or a non-empty list of them, e.g. bool or [float16]"
        )
    return tuple(parse_dtype(v) for v in items)


def rule_ndims(value: object) -> tuple[int, ...] | None:
    """One number of dimensions or a non-empty list of them -> a tuple, or ``None``."""
    if value is None:
        return None
    if isinstance(value, int):
        items: tuple[object, ...] = (value,)
    elif isinstance(value, Iterable) and not isinstance(value, str | Mapping):
        items = tuple(value)
    else:
        items = ()
    ndims = tuple(v for v in items if isinstance(v, int) and not isinstance(v, bool) and v >= 0)
    if not items or len(ndims) != len(items):
        raise ValueError(
            "expected a non-negative int or a non-empty list of them, e.g. 4 or [3, 4]"
        )
    return ndims


def rule_size(value: object) -> int | None:
    """A size (``_units``: whole bytes, int or ``"4MiB"``), or ``None``."""
    return None if value is None else check_size(value)


def check_rule_conditions(
    module: str | None,
    dtype: tuple[torch.dtype, ...] | None,
    min_bytes: int | None,
    max_bytes: int | None,
    ndim: tuple[int, ...] | None,
) -> None:
    """The checks across fields, on normalised values: at least one condition, and
    ``min_bytes <= max_bytes``. Raises ``ValueError``."""
    if (
        module is None
        and dtype is None
        and min_bytes is None
        and max_bytes is None
        and ndim is None
    ):
        raise ValueError(
            "a rule needs at least one condition (module, dtype, min_bytes, max_bytes, ndim); "
            "for tensors no rule matches, set the policy's default"
        )
    if min_bytes is not None and max_bytes is not None and min_bytes > max_bytes:
        raise ValueError(
            f"min_bytes ({min_bytes}) is larger than max_bytes ({max_bytes}): "
            "the rule could never match"
        )


class RuleError(ConfigError):
    """A :class:`Rule` that cannot be built: ``field`` (``None``: the rule as a whole)
    and ``reason`` (what is allowed) for callers that report the place themselves."""

    def __init__(self, field: str | None, reason: str, value: object = None) -> None:
        self.field = field
        self.reason = reason
        where = f"Rule: {field}: " if field is not None else "Rule: "
        got = f"; got {value!r}" if field is not None else ""
        super().__init__(f"{where}{reason}{got}")


RuleModule = Annotated[str | None, AfterValidator(rule_module)]
"""YAML type of ``module``: a glob (:func:`rule_module`)."""
RuleDtypes = Annotated[tuple[torch.dtype, ...] | None, PlainValidator(rule_dtypes)]
"""YAML type of ``dtype``: a dtype name or a list of them (:func:`rule_dtypes`)."""
RuleNdims = Annotated[tuple[int, ...] | None, PlainValidator(rule_ndims)]
"""YAML type of ``ndim``: an int or a list of them (:func:`rule_ndims`)."""
RuleAction = Annotated[Action, BeforeValidator(rule_action)]
"""YAML type of ``action`` (:func:`rule_action`)."""


def _dtype_names(dtypes: tuple[torch.dtype, ...] | None) -> str | list[str] | None:
    names = None if dtypes is None else [dtype_name(d) for d in dtypes]
    return names[0] if names is not None and len(names) == 1 else names


def _ndims(ndims: tuple[int, ...] | None) -> int | list[int] | None:
    return None if ndims is None else ndims[0] if len(ndims) == 1 else list(ndims)


def _checked(key: str, check: Callable[[object], T], value: object) -> T:
    """``check(value)``, its ``ValueError`` raised as the :class:`RuleError` of field ``key``."""
    try:
        return check(value)
    except ValueError as e:
        raise RuleError(key, str(e), value) from None


@dataclass(frozen=True, slots=True, init=False)
class Rule:
    """One policy rule: every condition given must hold; ``action`` applies on a match.

    Conditions (``None`` = not checked; at least one must be given):

    * ``module``: fnmatch glob on the dotted path of the innermost module that was
      running when the tensor was saved (``"blocks.*.attn"``, ``"*.lm_head"``). The
      pattern is tried against the path and against ``"." + path``, so
      ``"*.lm_head"`` also matches a top-level child ``lm_head``. The root module's
      path is ``""``. Never matches when no module scope is known (no ``model=``).
    * ``dtype``: one dtype or several (names like ``"bool"`` or ``torch.dtype``).
    * ``min_bytes`` / ``max_bytes``: inclusive bounds on ``numel * element_size``.
    * ``ndim``: one number of dimensions or several.

    The fields are also a YAML rule's keys, in this order (NOTE [ One declaration per
    setting ] in ``_schema.py``).
    """

    name: str | None = setting(None, omit=is_none)
    """Optional label for stats (replaces the generated description)."""
    module: RuleModule = setting(None, omit=is_none)
    dtype: RuleDtypes = setting(None, dump=_dtype_names, omit=is_none)
    min_bytes: OptSize = setting(None, dump=opt_size, omit=is_none)
    max_bytes: OptSize = setting(None, dump=opt_size, omit=is_none)
    ndim: RuleNdims = setting(None, dump=_ndims, omit=is_none)
    # kw_only: a field without a default after fields with one (__init__ is Rule's own).
    action: RuleAction = field(kw_only=True, metadata=required())
    _glob: re.Pattern[str] | None = field(init=False, repr=False, compare=False)
    _dtypes: frozenset[torch.dtype] | None = field(init=False, repr=False, compare=False)
    _ndims: frozenset[int] | None = field(init=False, repr=False, compare=False)
    _seen: dict[str, bool] = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        action: Action,
        *,
        module: str | None = None,
        dtype: DTypeLike | Iterable[DTypeLike] | None = None,
        min_bytes: int | str | None = None,
        max_bytes: int | str | None = None,
        ndim: int | Iterable[int] | None = None,
        name: str | None = None,
    ) -> None:
        # Inputs are normalised here (one dtype -> a tuple, "4MiB" -> 4194304), so the
        # stored fields always have the narrow types above.
        checked_action = _checked("action", rule_action, action)
        checked_module = _checked("module", rule_module, module)
        dtypes = _checked("dtype", rule_dtypes, dtype)
        lo = _checked("min_bytes", rule_size, min_bytes)
        hi = _checked("max_bytes", rule_size, max_bytes)
        ndims = _checked("ndim", rule_ndims, ndim)
        try:
            check_rule_conditions(checked_module, dtypes, lo, hi, ndims)
        except ValueError as e:
            raise RuleError(None, str(e)) from None
        if name is not None and not isinstance(name, str):
            raise RuleError("name", "expected a string (the rule's label in the stats)", name)
        glob = None if checked_module is None else compile_module_glob(checked_module)
        values: dict[str, object] = {
            "action": checked_action,
            "module": checked_module,
            "dtype": dtypes,
            "min_bytes": lo,
            "max_bytes": hi,
            "ndim": ndims,
            "name": name,
            "_glob": glob,
            "_dtypes": None if dtypes is None else frozenset(dtypes),
            "_ndims": None if ndims is None else frozenset(ndims),
            "_seen": {},
        }
        for attr, normalised in values.items():
            object.__setattr__(self, attr, normalised)

    def describe(self) -> str:
        """The conditions as ``key=value`` words, e.g. ``"module=*.lm_head dtype=bool"``."""
        if self.name is not None:
            return self.name
        parts: list[str] = []
        if self.module is not None:
            parts.append(f"module={self.module}")
        if self.dtype is not None:
            parts.append("dtype=" + ",".join(dtype_name(d) for d in self.dtype))
        if self.min_bytes is not None:
            parts.append(f"min_bytes={exact_size(self.min_bytes)}")
        if self.max_bytes is not None:
            parts.append(f"max_bytes={exact_size(self.max_bytes)}")
        if self.ndim is not None:
            parts.append("ndim=" + ",".join(str(n) for n in self.ndim))
        return " ".join(parts)

    def matches(self, t: torch.Tensor, nbytes: int, module_path: str | None) -> bool:
        """Whether every given condition holds for ``t`` (``nbytes`` precomputed by the caller)."""
        if self._dtypes is not None and t.dtype not in self._dtypes:
            return False
        if self.min_bytes is not None and nbytes < self.min_bytes:
            return False
        if self.max_bytes is not None and nbytes > self.max_bytes:
            return False
        if self._ndims is not None and t.dim() not in self._ndims:
            return False
        if self._glob is not None:
            if module_path is None:
                return False
            hit = self._seen.get(module_path)
            if hit is None:
                hit = self._match_path(self._glob, module_path)
            if not hit:
                return False
        return True

    def _match_path(self, glob: re.Pattern[str], path: str) -> bool:
        hit = path_matches(glob, path)
        # A model has a fixed, small set of module paths: remember each answer. A
        # racing thread at worst computes the same bool twice (dict writes are atomic).
        if len(self._seen) < _PATH_CACHE_LIMIT:
            self._seen[path] = hit
        return hit


@dataclass(frozen=True, slots=True)
class Policy:
    """Decides, for each tensor autograd saves, whether to keep, host or store it.

    Immutable and thread-safe. ``decide`` checks, in order: parameters (with
    ``skip_parameters``), then ``rules`` (first match wins), then ``min_bytes``
    (smaller tensors are kept), then ``default``. Rules therefore see small tensors
    too: a rule can send a 1 KiB bool mask to ``host`` even below ``min_bytes``.

    The public fields are the ``policy:`` section's keys (NOTE [ One declaration per
    setting ] in ``_schema.py``).
    """

    min_bytes: Size = setting(65536, dump=exact_size)
    """Tensors smaller than this (payload bytes) stay where they are, unless a rule matches."""
    skip_parameters: bool = setting(True)
    """Keep ``nn.Parameter`` s and views of them: they live on anyway, storing them only costs."""
    recompute_casts: bool = setting(True)
    """A parameter's cast the rules would move (autocast's weight casts, ``.to(dtype)``
    of a parameter) is recomputed at unpack instead, version-checked; ``False``: such
    casts go through the rules like any tensor. NOTE [ Parameter casts ] in
    ``pipeline/_recompute.py``."""
    rules: tuple[Rule, ...] = setting((), items=Rule)
    """Checked in order; the first that matches decides."""
    default: Action = setting("store")
    """The action for tensors no rule matched (and at least ``min_bytes`` large)."""
    device_budget: OptBudget = setting(None, dump=budget_value)
    """Bytes of saved tensors the rules would move that may stay where they were made,
    per forward, newest first (``None``: no plan), or a share of the memory there is
    (``MemoryShare``: ``"auto"``, ``"60%"``). NOTE [ Device budget plan ] and NOTE
    [ Auto budgets ] in ``pipeline/_budgets.py``."""
    _table: tuple[tuple[Rule, Decision], ...] = field(
        default=(), init=False, repr=False, compare=False
    )
    _param: Decision = field(
        default=Decision("keep", "parameter"), init=False, repr=False, compare=False
    )
    _small: Decision = field(
        default=Decision("keep", "min_bytes"), init=False, repr=False, compare=False
    )
    _default: Decision = field(
        default=Decision("store", "default"), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.default not in ACTIONS:
            raise ConfigError(
                f"Policy: default {self.default!r} is not one of {', '.join(ACTIONS)}"
            )
        if (
            isinstance(self.min_bytes, bool)
            or not isinstance(self.min_bytes, int)
            or self.min_bytes < 0
        ):
            raise ConfigError(
                f"Policy: min_bytes must be a non-negative int, got {self.min_bytes!r}"
            )
        budget = self.device_budget
        if (
            budget is not None
            and not isinstance(budget, MemoryShare)
            and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0)
        ):
            raise ConfigError(
                "Policy: device_budget must be a non-negative int, a MemoryShare "
                '(tsh.offload(device_budget="auto") or "60%" makes one) or None, '
                f"got {budget!r}"
            )
        rules = tuple(self.rules)
        for i, r in enumerate(rules):
            if not isinstance(r, Rule):
                raise ConfigError(f"Policy: rules[{i}] is a {type(r).__name__}, expected a Rule")
        object.__setattr__(self, "rules", rules)
        # Decisions are built once: decide() returns shared immutable objects.
        object.__setattr__(
            self,
            "_table",
            tuple(
                (r, Decision(r.action, f"rules[{i}] {r.describe()}")) for i, r in enumerate(rules)
            ),
        )
        object.__setattr__(self, "_default", Decision(self.default, "default"))

    @property
    def labels(self) -> tuple[str, ...]:
        """Every label ``decide`` can return, in rule order (for stats tables)."""
        return ("parameter", *(d.label for _, d in self._table), "min_bytes", "default")

    def decide(
        self, t: torch.Tensor, module_path: str | None, *, parameter: bool | None = None
    ) -> Decision:
        """Route one saved tensor. ``module_path`` is ``ModuleScope.current()`` (or None).

        ``parameter``: whether ``t`` is a parameter (or a view of one); ``None`` tests
        for ``nn.Parameter``. Other frameworks say it themselves (Paddle: ``persistable``).
        Cheap and allocation-free apart from the glob match on module rules.
        """
        if self.skip_parameters and (
            parameter
            if parameter is not None
            else isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
        ):
            return self._param
        nbytes = t.numel() * t.element_size()
        for rule, decision in self._table:
            if rule.matches(t, nbytes, module_path):
                return decision
        if nbytes < self.min_bytes:
            return self._small
        return self._default
