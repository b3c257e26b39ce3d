"""Typed job configuration: schema (dataclasses), loading (TOML + command line), checks."""

from job_config.checks import config_notes, validate
from job_config.loader import config_to_toml, help_text, parse_args
from job_config.problems import ConfigError
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
