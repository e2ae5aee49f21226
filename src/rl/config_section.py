"""The base of every config table: a key it does not know is refused (a typo must not pass
silently), and each field's docstring is that key's documentation (`--help`, `--dry-run`)."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)
