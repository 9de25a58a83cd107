"""How an options dataclass declares its fields, and the words every config module shares.

A field declared with `option()` carries its flag group, its help text and its allowed values;
`Config` and the smaller options dataclasses (`kvflow generate`'s sampling flags) are made of
such fields, and the flags, the environment and the validation are all read off them.
"""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import field
from typing import Any

ENV_PREFIX = "KVFLOW_"


class ConfigError(ValueError):
    pass


def option(
    default: Any,
    group: str,
    doc: str,
    choices: tuple[str, ...] | None = None,
    secret: bool = False,
) -> Any:
    """A documented field: its flag's group, help text and allowed values. A `secret` one's
    value is never written where it could be read: the startup log shows it as ***."""
    metadata = {"group": group, "doc": doc, "choices": choices, "secret": secret}
    return field(default=default, metadata=metadata)


@functools.cache
def _type_hints(options: type) -> dict[str, Any]:
    """The class's resolved annotations, once: every process's parser asks for each field's,
    and resolving them all again for each took a second of its start."""
    return typing.get_type_hints(options)


def flag(name: str) -> str:
    """A field's command-line name without the dashes: max_num_seqs -> max-num-seqs."""
    return name.replace("_", "-")


def base_type(options: type, name: str) -> type:
    """The type a field's text parses as: `int | None` is int, `tuple[str, ...]` is tuple."""
    hint = _type_hints(options)[name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:  # several values
        return tuple
    return typing.cast(type, hint)
