"""Reading a YAML config file and reporting what pydantic finds wrong with it.

The one loader of the library's config (``_settings``) and the daemon's
(``server/_config``), so both refuse the same things with the same messages:

* :func:`read_yaml`: a safe YAML load that refuses duplicate keys (PyYAML keeps the
  last one silently) and non-scalar keys, and names the file, line and column of a
  syntax error; missing, unreadable and non-UTF-8 files are named too.
* :func:`line_finder`: maps a pydantic error location to the 1-based line of the
  YAML node it points at.
* :func:`format_validation_error`: one line per problem,
  ``SOURCE[:LINE]: FIELD.PATH: what is wrong; got VALUE``; an unknown key lists the
  keys allowed at that place (by their YAML names: a field's alias if it has one).

Every problem is a :class:`~tensorstore_hooks.errors.ConfigError`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from typing import Annotated, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic import ValidationError as _PydanticValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from tensorstore_hooks.errors import ConfigError

__all__ = ["LineOf", "format_validation_error", "line_finder", "read_yaml"]

Loc = tuple[int | str, ...]
LineOf = Callable[[Loc], "int | None"]
"""``loc -> 1-based line`` of the YAML node at a pydantic error location (or None)."""


# ---------------------------------------------------------------------------------------
# YAML
# ---------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML keeps the last one silently)."""

    def construct_mapping(
        self, node: yaml.MappingNode, deep: bool = False
    ) -> dict[Hashable, object]:
        seen: dict[Hashable, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, list | dict):
                raise yaml.constructor.ConstructorError(
                    None, None, "a mapping key must be a scalar", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str) -> tuple[object, yaml.Node | None]:
    """Parse the YAML file ``path``; returns ``(data, root node)`` (``None`` data when empty).

    Raises :class:`ConfigError` naming the file (and line:column for YAML errors) for a
    missing, unreadable or non-UTF-8 file, a syntax error, or a duplicate key.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as e:
        raise ConfigError(
            f"{path}: config file not found (cwd {os.getcwd()}); check the path"
        ) from e
    except IsADirectoryError as e:
        raise ConfigError(f"{path}: is a directory, expected a YAML config file") from e
    except PermissionError as e:
        raise ConfigError(f"{path}: cannot read config file: permission denied") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: config file is not UTF-8 text ({e.reason})") from e
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e}") from e
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        data = None if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        problem = " ".join(p for p in (e.context, e.problem) if p)
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: YAML error: {e}") from e
    finally:
        loader.dispose()
    return data, node


def line_finder(root: yaml.Node | None) -> LineOf:
    """``loc -> 1-based line`` of the deepest YAML node along the pydantic location."""

    def line_of(loc: Loc) -> int | None:
        node = root
        if node is None:
            return None
        for i, part in enumerate(loc):
            nxt: yaml.Node | None = None
            if isinstance(node, yaml.MappingNode):
                for key_node, value_node in node.value:
                    if getattr(key_node, "value", None) == part:
                        # The field itself is reported at its key; containers at their value.
                        nxt = key_node if i == len(loc) - 1 else value_node
                        break
            elif (
                isinstance(node, yaml.SequenceNode)
                and isinstance(part, int)
                and 0 <= part < len(node.value)
            ):
                nxt = node.value[part]
            if nxt is None:
                break
            node = nxt
        return int(node.start_mark.line) + 1

    return line_of


# ---------------------------------------------------------------------------------------
# pydantic errors
# ---------------------------------------------------------------------------------------


def _path(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """A model's fields by the name a config file uses: the alias if any."""
    return {info.alias or name: info for name, info in model.model_fields.items()}


def _model_at(root: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    """The pydantic model class that holds the field at ``loc`` (for 'allowed keys' hints)."""
    model: type[BaseModel] | None = root
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int):
            continue
        fields = _fields(model)
        info = fields.get(part) or model.model_fields.get(part)
        if info is None:
            return None
        ann = info.annotation
        candidates = [_bare(c) for c in (ann, *get_args(ann))]
        model = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
    return model


def _bare(tp: object) -> object:
    """``Annotated[T, ...]`` -> ``T`` (a list of rules is ``list[Annotated[Model, ...]]``)."""
    return get_args(tp)[0] if get_origin(tp) is Annotated else tp


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(err: ErrorDetails, root: type[BaseModel]) -> str:
    kind, loc, msg = err["type"], tuple(err["loc"]), str(err["msg"])
    if kind == "extra_forbidden":
        parent = _model_at(root, loc[:-1])
        allowed = ", ".join(_fields(parent)) if parent is not None else "?"
        return f"unknown key {loc[-1]!r}; allowed keys here: {allowed}"
    if kind == "missing":
        return "required field is missing"
    if kind == "value_error":
        msg = str(err.get("ctx", {}).get("error", msg))
    elif kind in ("model_type", "dict_type"):
        msg = "expected a mapping of key: value"
    elif kind == "literal_error":
        msg = f"expected one of {err.get('ctx', {}).get('expected', msg)}"
    elif msg.startswith("Input should be "):
        rest = msg.removeprefix("Input should be ")
        # "greater than or equal to 1" reads as a value bound, not a type.
        msg = f"expected {'a value ' if rest.startswith(('greater', 'less')) else ''}{rest}"
    else:
        msg = msg[0].lower() + msg[1:] if msg else msg
    return f"{msg}; got {_short(err.get('input'))}"


def format_validation_error(
    error: _PydanticValidationError,
    *,
    source: str,
    root: type[BaseModel],
    prefix: Loc = (),
    line_of: LineOf | None = None,
    source_of: Callable[[Loc], str | None] | None = None,
) -> str:
    """One line per problem, in file order: ``SOURCE[:LINE]: FIELD.PATH: what is wrong;
    got VALUE``.

    ``line_of(loc)`` maps a field location to a 1-based YAML line; ``source_of(loc)``,
    if given and not None for a location, names another source for that field (the
    daemon's command-line flags override its file) and then no line is shown.
    """
    found: list[tuple[int, str]] = []
    for err in error.errors(include_url=False):
        loc = tuple(err["loc"])
        where = source
        line = None
        other = source_of(loc) if source_of is not None else None
        if other is not None:
            where = other
        else:
            line = line_of(loc) if line_of is not None else None
            if line is not None:
                where = f"{source}:{line}"
        path = _path(prefix + loc) or "(top level)"
        found.append((line or 0, f"{where}: {path}: {_describe(err, root)}"))
    # In file order (pydantic reports in its own order); problems without a line first.
    lines = [text for _, text in sorted(found, key=lambda item: item[0])]
    if len(lines) == 1:
        return lines[0]
    return f"{len(lines)} problems in {source}:\n  " + "\n  ".join(lines)
