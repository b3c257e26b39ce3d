"""Typed job configuration: schema (dataclasses), loading (TOML + command line), checks.

The names below are imported on first use (PEP 562), so importing one submodule, such as
`job_config.problems` from the parallelisms, loads neither the loader nor the checks."""

import importlib

_HOMES = {
    "ConfigError": "job_config.problems",
    "JobConfig": "job_config.schema",
    "config_notes": "job_config.checks",
    "validate": "job_config.checks",
    "config_to_toml": "job_config.serialize",
    "help_text": "job_config.serialize",
    "parse_args": "job_config.loader",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'job_config' has no attribute '{name}'")
    return getattr(importlib.import_module(_HOMES[name]), name)
