"""What startup logs of the config: only the fields whose values differ from their defaults, as
vLLM's "non-default args" line, and a secret field's value (option(secret=True)) as ***."""

from __future__ import annotations

import dataclasses
from typing import Any

from shared.config.fields import ConfigFields

MASK = "***"


def non_default_values(config: ConfigFields) -> dict[str, Any]:
    """Each field whose value is not its default, by name in field order; secrets masked."""
    return {
        f.name: MASK if f.metadata["secret"] else getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != _default(f)
    }


def non_default_summary(config: ConfigFields) -> str:
    """`{'model': 'Qwen/Qwen3-8B', 'port': 8001, 'api_key': '***'}`; `{}` for the defaults."""
    return repr(non_default_values(config))


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default
