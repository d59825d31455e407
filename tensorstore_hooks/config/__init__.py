"""Configuration: the settings of a session (store, pipeline, policy), the YAML
loader, and the policy rules that decide what each saved tensor gets.
"""

from __future__ import annotations

from tensorstore_hooks.config._policy import Decision, Policy, Rule
from tensorstore_hooks.config._schema import exact_size
from tensorstore_hooks.config._select import (
    check_globs,
    compile_module_glob,
    glob_matches,
    outermost,
    sample_names,
    select_modules,
)
from tensorstore_hooks.config._settings import (
    EffectiveConfig,
    PipelineSettings,
    StoreSettings,
    dump_config,
    load_config,
    resolve_config,
)
from tensorstore_hooks.config._yaml import LineOf, format_validation_error, line_finder, read_yaml

__all__ = [
    "Decision",
    "EffectiveConfig",
    "LineOf",
    "PipelineSettings",
    "Policy",
    "Rule",
    "StoreSettings",
    "check_globs",
    "compile_module_glob",
    "dump_config",
    "exact_size",
    "format_validation_error",
    "glob_matches",
    "line_finder",
    "load_config",
    "outermost",
    "read_yaml",
    "resolve_config",
    "sample_names",
    "select_modules",
]
