"""Loads a JobConfig from a TOML preset plus `--section.key value` command-line overrides.

Everything is checked here, before any process group, model or data work: unknown sections
and keys (with the closest valid name suggested), wrong types, out-of-range values and
impossible combinations each raise one `ConfigError` naming the key, the value and what is
allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from config.schema import JobConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A config problem, reported to the user as one message before any expensive work."""


def _suggest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else ""


def _fields(obj_or_cls: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj_or_cls)}


def _type_hints(cls: type) -> dict[str, Any]:
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
    sections = _fields(cfg)
    if section not in sections:
        raise ConfigError(
            f"Unknown config section [{section}] in {source}.{_suggest(section, list(sections))}"
            f" Valid sections: {', '.join(sections)}."
        )
    sec_obj = getattr(cfg, section)
    keys = _fields(sec_obj)
    if key not in keys:
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


def parse_args(argv: list[str]) -> JobConfig:
    """Builds the config from `--config NAME_OR_PATH` and `--section.key value` overrides."""
    cfg = JobConfig()
    config_name, overrides = None, []
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
        sec_obj = getattr(cfg, section, None)
        tp = None
        if dataclasses.is_dataclass(sec_obj) and key in _fields(sec_obj):
            tp = _type_hints(type(sec_obj))[key]
        _set(cfg, section, key, _parse_cli_value(text, tp) if tp else text, "the command line")
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Cross-field checks that need no process group (world-size checks live in parallel_dims)."""
    t = cfg.training
    if t.global_batch_size == 0:
        raise ConfigError(
            "training.global_batch_size = 0: use -1 (local_batch_size x DP degree) or a "
            "positive multiple of local_batch_size x DP degree."
        )
    if cfg.parallelism.pipeline_parallel_layers_per_stage == 0:
        raise ConfigError(
            "parallelism.pipeline_parallel_layers_per_stage = 0: use -1 (split the layers "
            "evenly) or a positive number of layers per stage."
        )
    if t.global_batch_size != -1 and t.global_batch_size % t.local_batch_size:
        raise ConfigError(
            f"training.global_batch_size = {t.global_batch_size} must be a multiple of "
            f"training.local_batch_size = {t.local_batch_size} (or -1)."
        )
    if t.dataset != "sample" and not t.dataset_path:
        raise ConfigError(
            f"training.dataset = '{t.dataset}' needs training.dataset_path (a file, glob or "
            "folder, or the Hugging Face dataset name); or use dataset = 'sample'."
        )
    v = cfg.validation
    if v.enable and (v.dataset or t.dataset) in ("text", "jsonl", "parquet") and not v.dataset_path:
        raise ConfigError(
            f"validation.enable with {v.dataset or t.dataset} files needs "
            "validation.dataset_path: local files have no held-out split, so validating on "
            "training.dataset_path would measure the training data. Point it at held-out "
            "files, or set validation.enable = false."
        )
    ck = cfg.checkpoint
    if not ck.enable:
        loads = {
            "initial_load_path": ck.initial_load_path != "",
            "load_step": ck.load_step != -1,
            "exclude_from_loading": bool(ck.exclude_from_loading),
        }
        if any(loads.values()):
            names = ", ".join(f"checkpoint.{k}" for k, on in loads.items() if on)
            raise ConfigError(
                f"{names} set but checkpoint.enable = false, so nothing would be loaded: "
                "set checkpoint.enable = true (or drop the option)."
            )
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        if not ac.selective_ac_option.isdigit() or int(ac.selective_ac_option) < 1:
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option = '{ac.selective_ac_option}' is "
                "invalid: expected 'op' or a positive integer N (checkpoint every N-th block)."
            )
    for comp in cfg.compile.components:
        if comp not in ("model", "loss"):
            raise ConfigError(
                f"compile.components contains '{comp}': allowed entries are 'model' and 'loss'."
            )
    if cfg.parallelism.context_parallel_degree != 1:
        raise ConfigError(
            f"parallelism.context_parallel_degree = {cfg.parallelism.context_parallel_degree}: "
            "context parallelism is reserved and not supported yet; set it to 1."
        )
    prof = cfg.profiling
    if prof.enable_profiling and prof.profiler_warmup + prof.profiler_active > prof.profile_freq:
        raise ConfigError(
            f"profiling.profiler_warmup ({prof.profiler_warmup}) + profiler_active "
            f"({prof.profiler_active}) must not exceed profiling.profile_freq "
            f"({prof.profile_freq}): each window ends at a multiple of profile_freq."
        )


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def config_to_toml(cfg: JobConfig) -> str:
    """Serialises the resolved config as TOML (None values are written as comments)."""
    lines = []
    for section, values in config_to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                lines.append(f"# {key} = None")
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
    for section in _fields(cfg):
        sec_obj = getattr(cfg, section)
        hints = _type_hints(type(sec_obj))
        out.append(f"[{section}]")
        for key, f in _fields(sec_obj).items():
            default = getattr(sec_obj, key)
            out.append(f"  --{section}.{key} ({_describe(hints[key])}, default {default!r})")
            out.append(f"      {f.metadata['help']}")
        out.append("")
    return "\n".join(out)
