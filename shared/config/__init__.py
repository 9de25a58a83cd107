"""The one configuration object, its CLI flags and its environment variables.

Precedence: field defaults < config file (`--config`, JSON or TOML) < `KVFLOW_*` environment
< command-line flags. `--help` is generated from the field docs. Nothing else in kvflow reads
`os.environ`.

    options.py     option(): how a field is declared (group, doc, choices); ConfigError
    fields.py      Config: every field, documented, in --help order; what it derives
    validation.py  the checks Config runs when made, one function per flag group
    sources.py     the layers: --config file, KVFLOW_* environment, flags; OFFLINE_DEFAULTS
    cli.py         the flags, generated from the fields
    summary.py     what startup logs: the fields that differ from their defaults, secrets masked
"""

from shared.config.cli import add_config_flags
from shared.config.config import Config
from shared.config.fields import field_doc
from shared.config.options import ENV_PREFIX, ConfigError, option
from shared.config.sources import (
    OFFLINE_DEFAULTS,
    config_from_args,
    config_from_file,
    options_from_args,
)

__all__ = [
    "ENV_PREFIX",
    "OFFLINE_DEFAULTS",
    "Config",
    "ConfigError",
    "add_config_flags",
    "config_from_args",
    "config_from_file",
    "field_doc",
    "option",
    "options_from_args",
]
