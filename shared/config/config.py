"""`Config`: the fields (fields.py), checked when one is built (validation.py) and told in
startup's log line (summary.py)."""

from __future__ import annotations

from shared.config.fields import ConfigFields
from shared.config.summary import non_default_summary
from shared.config.validation import canonical_spellings, validate


class Config(ConfigFields):
    """Everything one kvflow process is configured by, checked: a bad value is a ConfigError
    that names its flag."""

    def __post_init__(self) -> None:
        for name, value in canonical_spellings(self).items():  # one name each past this point
            object.__setattr__(self, name, value)
        validate(self)

    def non_default_summary(self) -> str:
        """The fields that differ from their defaults, secrets masked: what startup logs."""
        return non_default_summary(self)
