"""Typed job configuration: schema (dataclasses) and loading (TOML + command line)."""

from job_config.loader import (
    ConfigError,
    config_notes,
    config_to_toml,
    help_text,
    parse_args,
    validate,
)
from job_config.schema import JobConfig

__all__ = [
    "ConfigError",
    "JobConfig",
    "config_notes",
    "config_to_toml",
    "help_text",
    "parse_args",
    "validate",
]
