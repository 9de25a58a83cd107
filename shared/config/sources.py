"""Where config values come from, layered: field defaults < a --config file (JSON or TOML) <
`KVFLOW_*` environment < command-line flags. The only reader of `os.environ` in kvflow."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from shared.config.config import Config
from shared.config.options import ENV_PREFIX, ConfigError, base_type

# Offline generation (the `LLM` class, `kvflow generate`, `kvflow bench`) trades step latency
# for throughput, as vLLM's LLM class does: larger steps. Layered above the field defaults and
# below everything a user sets. Offline 256 x 512/256 on an H100 (docs/benchmarks.md): 8,946
# output tok/s at 16384 and 8,900 at 8192 in one run; 8,683 at 2048 in an earlier one.
OFFLINE_DEFAULTS: dict[str, Any] = {"max_num_batched_tokens": 16384}

T = TypeVar("T")


def config_from_args(
    args: argparse.Namespace, defaults: dict[str, Any] | None = None, **overrides: Any
) -> Config:
    """Layer field defaults < `defaults` (e.g. OFFLINE_DEFAULTS) < --config file < KVFLOW_* env
    < flags < explicit overrides."""
    values: dict[str, Any] = dict(defaults or {})
    if getattr(args, "config", None):
        values.update(_read_file(Path(args.config)))
    values.update(_env_and_flags(Config, args))
    values.update(overrides)
    return Config(**values)


def config_from_file(path: Path) -> Config:
    """The config a file holds, alone (what a process started with a resolved config reads)."""
    return Config(**_read_file(path))


def options_from_args(options: type[T], args: argparse.Namespace) -> T:
    """Another options dataclass, layered defaults < KVFLOW_* env < flags."""
    return options(**_env_and_flags(options, args))


def _env_and_flags(options: type, args: argparse.Namespace) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(options):
        env = os.environ.get(ENV_PREFIX + f.name.upper())
        if env is not None:
            values[f.name] = _parse_value(options, f.name, env)
        flag = getattr(args, f.name, None)
        if flag is not None:
            if isinstance(flag, bool):
                values[f.name] = flag
            elif isinstance(flag, list):
                values[f.name] = tuple(flag)
            else:
                values[f.name] = _parse_value(options, f.name, str(flag))
    return values


def _parse_value(options: type, name: str, text: str) -> Any:
    kind = base_type(options, name)
    if kind is tuple:  # a JSON list, or values split on whitespace
        return tuple(json.loads(text)) if text.lstrip().startswith("[") else tuple(text.split())
    if text.lower() in ("", "none", "null") and kind is not str:
        return None
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}: not a boolean: {text!r}")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{name}: expected {kind.__name__}, got {text!r}") from None


def _read_file(path: Path) -> dict[str, Any]:
    text = path.read_text()
    data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown config keys {unknown}")
    return {k.replace("-", "_"): tuple(v) if isinstance(v, list) else v for k, v in data.items()}
