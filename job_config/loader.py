"""Loads a JobConfig from a TOML preset plus `--section.key value` command-line overrides.

Everything is checked before any process group, model or data work: unknown sections and
keys (with the closest valid name suggested), wrong types and out-of-range values here,
impossible combinations in `job_config/checks.py` (`validate`, run at the end of
`parse_args`); each raises one `ConfigError` naming the key, the value and what is allowed.
Writing a config back (TOML, `--help`) is `job_config/serialize.py`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from job_config.checks import validate
from job_config.problems import ConfigError
from job_config.schema import MOVED_OPTIONS, JobConfig, config_sections

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


def _suggest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else ""


def _fields(obj_or_cls: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj_or_cls)}


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """A section's field types (cached: evaluating the annotations is most of parsing's time)."""
    return typing.get_type_hints(cls)


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_describe(get_args(tp)[0])}"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _parse_cli_value(text: str, tp: Any) -> Any:
    """Turns a command-line string into a value of the annotated type (before validation)."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null", ""):
            return None
        return _parse_cli_value(text, next(a for a in get_args(tp) if a is not type(None)))
    if origin is list:
        inner = get_args(tp)[0]
        body = text.strip()
        if body.startswith("["):
            try:
                return tomllib.loads(f"v = {body}")["v"]
            except tomllib.TOMLDecodeError:
                body = body.strip("[]")
        items = [s.strip().strip("'\"") for s in body.split(",") if s.strip()]
        return [_parse_cli_value(s, inner) for s in items]
    if tp is bool:
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        return text
    if tp is int:
        try:
            return int(text)
        except ValueError:
            return text
    if tp is float:
        try:
            return float(text)
        except ValueError:
            return text
    return text


def _check_value(key: str, value: Any, tp: Any, meta: dict) -> Any:
    """Validates (and lightly coerces: int -> float) one value against its type and bounds."""
    origin = get_origin(tp)
    bad = ConfigError(f"{key} = {value!r} is invalid: expected {_describe(tp)}.")
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in get_args(tp):
                return None
            raise bad
        tp = next(a for a in get_args(tp) if a is not type(None))
        origin = get_origin(tp)
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(
                f"{key} = {value!r} is invalid: expected {_describe(tp)}."
                + (_suggest(value, list(get_args(tp))) if isinstance(value, str) else "")
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad
        inner = get_args(tp)[0]
        return [_check_value(f"{key}[{i}]", v, inner, {}) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        value = float(value)
    elif tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    for bound, ok, word in (
        ("ge", lambda v, b: v >= b, ">="),
        ("gt", lambda v, b: v > b, ">"),
        ("le", lambda v, b: v <= b, "<="),
    ):
        b = meta.get(bound)
        if b is not None and not ok(value, b):
            raise ConfigError(f"{key} = {value!r} is out of range: must be {word} {b}.")
    return value


def _set(cfg: JobConfig, section: str, key: str, value: Any, source: str) -> None:
    sections = config_sections()
    if section not in sections:
        raise ConfigError(
            f"Unknown config section [{section}] in {source}.{_suggest(section, list(sections))}"
            f" Valid sections: {', '.join(sections)}."
        )
    sec_obj = getattr(cfg, section)
    keys = _fields(sec_obj)
    if key not in keys:
        moved = MOVED_OPTIONS.get(f"{section}.{key}")
        if moved:
            raise ConfigError(
                f"Config key '{section}.{key}' in {source} has moved to '{moved}': write it "
                f"as --{moved} on the command line, or as [{moved.partition('.')[0]}] "
                f"{moved.partition('.')[2]} = ... in a preset."
            )
        full = [f"{section}.{k}" for k in keys]
        raise ConfigError(
            f"Unknown config key '{section}.{key}' in {source}."
            f"{_suggest(f'{section}.{key}', full)} Valid keys of [{section}]: {', '.join(keys)}."
        )
    tp = _type_hints(type(sec_obj))[key]
    setattr(sec_obj, key, _check_value(f"{section}.{key}", value, tp, keys[key].metadata))


def resolve_config_path(name: str) -> Path:
    """Finds a preset: a path as given, else `configs/NAME` with or without `.toml`."""
    candidates = [Path(name), CONFIGS_DIR / name, CONFIGS_DIR / f"{name}.toml"]
    for c in candidates:
        if c.is_file():
            return c
    presets = sorted(p.stem for p in CONFIGS_DIR.glob("*.toml"))
    raise ConfigError(
        f"Config '{name}' not found (looked at {', '.join(str(c) for c in candidates)}). "
        f"Presets in configs/: {', '.join(presets)}.{_suggest(Path(name).stem, presets)}"
    )


def _apply_toml(cfg: JobConfig, path: Path) -> None:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"{path}: top-level key '{section}' must be a [section] table; "
                f"options live inside sections, e.g. [training] steps = 10."
            )
        for key, value in values.items():
            _set(cfg, section, key, value, str(path))


def parse_args(argv: list[str], *, check: bool = True) -> JobConfig:
    """Builds the config from `--config NAME_OR_PATH` and `--section.key value` overrides;
    `check=False` leaves the cross-field checks to a later `validate` (only parse errors)."""
    cfg = JobConfig()
    config_name, overrides, cli_keys = None, [], set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(
                f"Unexpected argument '{arg}': options look like --section.key value."
            )
        name, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("--"):
                value = "true"  # a bare flag means true: --job.dry_run
            else:
                value, i = nxt, i + 1
        if name in ("config", "job.config_file"):
            config_name = value
        else:
            overrides.append((name, value))
        i += 1
    if config_name:
        path = resolve_config_path(config_name)
        _apply_toml(cfg, path)
        cfg.job.config_file = str(path)
    for name, text in overrides:
        section, dot, key = name.partition(".")
        if not dot:
            raise ConfigError(
                f"Option '--{name}' must name a section and a key, e.g. --training.steps 10."
            )
        sec_obj = getattr(cfg, section, None) if section in config_sections() else None
        tp = None
        if dataclasses.is_dataclass(sec_obj) and key in _fields(sec_obj):
            tp = _type_hints(type(sec_obj))[key]
        _set(cfg, section, key, _parse_cli_value(text, tp) if tp else text, "the command line")
        cli_keys.add(name)
    cfg.provenance.cli_keys = cli_keys  # see _given: who set a value decides if it was ignored
    if check:
        validate(cfg)
    return cfg
