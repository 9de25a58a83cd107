"""The command-line flags, one per field, their --help text generated from the field docs."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from shared.config.config import Config
from shared.config.options import ENV_PREFIX, base_type, flag


def add_config_flags(
    parser: argparse.ArgumentParser, groups: tuple[str, ...], options: type = Config
) -> None:
    """Add one flag per field of the given groups; defaults stay unset (None).

    `options` is Config or another dataclass whose fields are declared with `option()`.
    """
    if options is Config:
        parser.add_argument("--config", help="JSON or TOML file of config values.")
    by_group: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(options):
        group = f.metadata["group"]
        if group not in groups or f.name == "model":  # the model is positional
            continue
        if group not in by_group:
            by_group[group] = parser.add_argument_group(f"{group} options")
        _add_flag(by_group[group], f, base_type(options, f.name))


def _add_flag(group: argparse._ArgumentGroup, f: dataclasses.Field[Any], kind: type) -> None:
    """The field's flag: --name/--no-name for a boolean, several values for a tuple."""
    name = f"--{flag(f.name)}"
    doc = f"{f.metadata['doc']} [env {ENV_PREFIX}{f.name.upper()}; default: {f.default}]"
    if kind is bool:
        group.add_argument(name, action=argparse.BooleanOptionalAction, default=None, help=doc)
    elif kind is tuple:
        group.add_argument(name, nargs="+", default=None, help=doc, metavar="VALUE")
    else:
        choices = f.metadata.get("choices")
        group.add_argument(
            name,
            type=str,
            default=None,
            choices=choices,
            help=doc,
            metavar=None if choices else kind.__name__.upper(),
        )
