"""A config written back: the resolved TOML every run leaves in its output folder (options
with no effect commented out, so it loads again as a preset) and `train.py --help`."""

from __future__ import annotations

import dataclasses
from typing import Any

from job_config.loader import _describe, _fields, _type_hints
from job_config.schema import JobConfig, config_sections
from job_config.unused import ignored_options


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """The sections' values (the provenance is not an option)."""
    return {section: dataclasses.asdict(getattr(cfg, section)) for section in config_sections()}


def config_to_toml(cfg: JobConfig) -> str:
    """Serialises the resolved config as TOML. None values, and values that have no effect in
    this config (so that the file loads again as a preset), are written as comments."""
    lines, ignored = [], ignored_options(cfg)
    for section, values in config_to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                lines.append(f"# {key} = None")
            elif f"{section}.{key}" in ignored:
                lines.append(f"# {key} = {_toml_value(value)}  # no effect in this config")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def help_text() -> str:
    """Every option with its type, default and help, for `train.py --help`."""
    out = [
        "usage: train.py [--config NAME_OR_PATH] [--section.key VALUE ...]",
        "",
        "  --config NAME_OR_PATH   TOML preset; a bare name resolves inside configs/",
        "  A bare flag means true (--job.dry_run). Lists: --compile.components model,loss",
        "",
    ]
    cfg = JobConfig()
    for section in config_sections():
        sec_obj = getattr(cfg, section)
        hints = _type_hints(type(sec_obj))
        out.append(f"[{section}]")
        for key, f in _fields(sec_obj).items():
            default = getattr(sec_obj, key)
            out.append(f"  --{section}.{key} ({_describe(hints[key])}, default {default!r})")
            out.append(f"      {f.metadata['help']}")
        out.append("")
    return "\n".join(out)
