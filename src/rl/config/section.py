"""The base of every config table: a key it does not know is refused (a typo must not pass
silently), and each field's docstring is that key's documentation (`--help`, `--dry-run`).

A key that is a Python keyword is a field with an alias (`class_: str = Field("", alias="class")`):
the alias is its only name in TOML, flags, errors, dumps and docs (key_name), the field's name
the one code reads."""

from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True,
                              serialize_by_alias=True)


def key_name(name: str, field: FieldInfo) -> str:
    """The config key of a field: its alias where it has one (`class` for `class_`)."""
    return field.alias or name
