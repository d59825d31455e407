"""Module globs: the one selector behind ``wrap(modules=)``, ``capture(modules=)`` and
the ``module`` condition of policy rules.

NOTE [ Module globs ]
1. A glob is an ``fnmatch`` pattern over the dotted paths of ``model.named_modules()``
   (``"layers.3.mlp"``; the model itself is ``""``), case-sensitive; ``*`` also crosses
   dots. It matches a path ``p`` when it matches ``p`` or ``"." + p``, so
   ``"*.lm_head"`` also takes a top-level ``lm_head``. An empty glob, whitespace or an
   unclosed ``[`` is refused (fnmatch would take it literally and never match).
2. Selecting modules (``wrap``, ``capture``): each glob takes its *outermost* matches
   (``"layers.*"`` takes the blocks, not their sublayers); the globs' choices add up,
   so a glob of its own can take a module nested in another glob's choice. A glob that
   matches no module is a :class:`~tensorstore_hooks.ConfigError` naming it and some
   names that exist. ``None`` selects the model itself.
3. What a selection means is the caller's: ``capture`` writes one array per selected
   module; ``wrap`` offloads inside each selected module's forward, where a selected
   module nested in another selected one adds nothing (the outer block already covers
   it: :func:`outermost`).
4. A policy rule's ``module`` condition holds for a tensor saved while the innermost
   running module's path matches (rule 1).
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Iterable, Sequence

from tensorstore_hooks.errors import ConfigError

__all__ = [
    "check_globs",
    "compile_module_glob",
    "glob_matches",
    "outermost",
    "path_matches",
    "sample_names",
    "select_modules",
]


def compile_module_glob(pattern: str) -> re.Pattern[str]:
    """Compile an fnmatch pattern on dotted module paths (rule 1).

    Raises ``ValueError`` for an empty pattern, whitespace, or an unclosed ``[``
    (which fnmatch would silently take literally, so the glob would never match).
    """
    if not pattern:
        raise ValueError("empty module pattern; use e.g. 'blocks.*' or '*.lm_head'")
    if any(c.isspace() for c in pattern):
        raise ValueError(f"module pattern {pattern!r} contains whitespace; module paths never do")
    if _unclosed_set(pattern):
        raise ValueError(
            f"module pattern {pattern!r} has an unclosed '['; fnmatch sets look like "
            "'blocks.[0-3].*' (use '[[]' for a literal '[')"
        )
    try:
        return re.compile(fnmatch.translate(pattern))
    except re.error as e:  # e.g. a reversed range "[z-a]"
        raise ValueError(f"module pattern {pattern!r} is not a valid fnmatch glob: {e}") from e


def _unclosed_set(pattern: str) -> bool:
    i = 0
    while i < len(pattern):
        if pattern[i] == "[":
            # fnmatch: "]" right after "[" or "[!" is a literal member of the set.
            j = i + 1
            if j < len(pattern) and pattern[j] == "!":
                j += 1
            if j < len(pattern) and pattern[j] == "]":
                j += 1
            close = pattern.find("]", j)
            if close < 0:
                return True
            i = close
        i += 1
    return False


def path_matches(glob: re.Pattern[str], path: str) -> bool:
    """Whether compiled ``glob`` matches module ``path`` (rule 1: ``path`` or ``"." + path``)."""
    return glob.match(path) is not None or glob.match("." + path) is not None


@functools.lru_cache(maxsize=256)
def _compiled(glob: str) -> re.Pattern[str]:
    return compile_module_glob(glob)


def glob_matches(glob: str, path: str) -> bool:
    """Whether ``glob`` (checked, rule 1) matches module ``path``."""
    return path_matches(_compiled(glob), path)


def sample_names(paths: Iterable[str], limit: int = 12) -> str:
    """Up to ``limit`` module paths, quoted, shallowest first, for an error or warning."""
    names = sorted(paths, key=lambda p: (p.count("."), p))
    shown = ", ".join(repr(p) for p in names[:limit])
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return shown + more if names else "(none)"


def check_globs(modules: str | Sequence[str] | None, caller: str) -> list[str] | None:
    """``modules`` as a list of checked globs (``None`` stays ``None``: the model itself).

    Raises :class:`ConfigError` naming ``caller`` (``"wrap"``, ``"capture"``) for a value
    that is not a glob or a non-empty list of globs, or a glob rule 1 refuses.
    """
    if modules is None:
        return None
    globs = [modules] if isinstance(modules, str) else list(modules)
    if not globs or not all(isinstance(g, str) for g in globs):
        raise ConfigError(
            f"{caller}: modules must be a glob or a non-empty list of globs (fnmatch over the "
            f"names of model.named_modules()), or None for the model itself; got {modules!r}"
        )
    for glob in globs:
        try:
            _compiled(glob)
        except ValueError as e:
            raise ConfigError(f"{caller}: modules: {e}") from e
    return globs


def select_modules(names: Iterable[str], globs: list[str] | None, caller: str) -> set[str]:
    """The module paths ``globs`` select among ``names`` (rule 2): each glob's outermost
    matches, added up; ``{""}`` (the model itself) for ``None``.

    Raises :class:`ConfigError` naming ``caller`` for a glob that matches no module.
    """
    if globs is None:
        return {""}
    candidates = [n for n in names if n]
    chosen: set[str] = set()
    for glob in globs:
        hits = {n for n in candidates if glob_matches(glob, n)}
        if not hits:
            raise ConfigError(
                f"{caller}: modules glob {glob!r} matches no module of the model. Some names "
                f"that exist: {sample_names(candidates)}"
            )
        chosen |= outermost(hits)
    return chosen


def outermost(paths: set[str]) -> set[str]:
    """The paths of ``paths`` that are not inside another one of them (rule 3)."""

    def nested(path: str) -> bool:
        parts = path.split(".")
        return any(".".join(parts[:i]) in paths for i in range(1, len(parts)))

    return {p for p in paths if not nested(p)}
