"""The keys a program reads, each with its type, default and docstring: what
`rl <program> --help` lists after the usage (render_help), and docs/config.md."""

from __future__ import annotations

import textwrap
import types
from pathlib import Path
from typing import Annotated, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from rl.config import RunConfig
from rl.config.section import key_name
from rl.resolved_config import inline


# --- rl <program> --help ---------------------------------------------------------------------

_TYPE_NAMES = {int: "INT", float: "FLOAT", bool: "BOOL", str: "TEXT", Path: "PATH"}
_INDENT = "  "


def render_help(sections: tuple[str, ...], width: int = 100) -> str:
    """The top-level keys and those of the given tables ("trainer", or "trainer.lora" for one
    sub-table), each as `--table.key TYPE  (default ...)` over its docstring, table by table."""
    head = ("Config keys, set in the tables of '@ cfg.toml' files or as --table.key value "
            "(--dry-run prints the resolved config):")
    return "\n".join(["", *_wrap(head, width, ""), *_table_help(RunConfig, "", None, sections, width, {})]) + "\n"


def _table_help(cls: type[BaseModel], path: str, doc: str | None, sections: tuple[str, ...], width: int,
                seen: dict[type, str]) -> list[str]:
    """The lines of table `path` (model `cls`) and of the tables inside it that `sections` ask for."""
    lines: list[str] = []
    if _shown(path, sections):
        lines += ["", f"[{path}]" if path else "top-level keys", *_wrap(doc, width, _INDENT)]
        for name, field in cls.model_fields.items():
            if not table_models(field):
                key = key_name(name, field)
                lines += _key_help(f"--{path}.{key}" if path else f"--{key}", field, width)
        for name, field in cls.model_fields.items():
            if entry := _entries(field):
                lines += _entries_help(entry, f"{path}.{key_name(name, field)}", width, seen)
    for name, field in cls.model_fields.items():
        subs, sub_path = table_models(field), f"{path}.{key_name(name, field)}" if path else key_name(name, field)
        if len(subs) == 1 and _leads_to(sub_path, sections):
            lines += _table_help(subs[0], sub_path, field.description or subs[0].__doc__, sections, width, seen)
        elif subs and _shown(sub_path, sections):
            lines += _kinds_help(subs, sub_path, width)
    return lines


def _kinds_help(kinds: list[type[BaseModel]], path: str, width: int) -> list[str]:
    """A table that is one of several kinds (rl/config/delivery.py): each kind's keys apart."""
    lines: list[str] = []
    for cls in kinds:
        kind = cls.model_fields["kind"].default
        lines += ["", f'[{path}] kind = "{kind}"' + (" (the default)" if cls is kinds[0] else "")]
        fields = sorted(cls.model_fields.items(), key=lambda item: item[0] != "kind")  # kind first
        for name, field in fields:
            lines += _key_help(f"--{path}.{key_name(name, field)}", field, width)
    return lines


def _entries_help(cls: type[BaseModel], path: str, width: int, seen: dict[type, str]) -> list[str]:
    """The keys of each [[path]] entry (a TOML table, or an inline one in --path [{...}]), listed
    once per help; a second list of the same entries points at the first."""
    if cls in seen:
        return ["", f"[[{path}]]", *_wrap(f"Each entry takes the keys of [[{seen[cls]}]].", width, _INDENT)]
    seen[cls] = path
    lines = ["", f"[[{path}]]", *_wrap("Each entry takes:", width, _INDENT)]
    for name, field in cls.model_fields.items():
        subs = table_models(field)
        if subs:  # a table inside each entry (a dataset's own sampling): its keys, dotted
            lines += _wrap(f"{key_name(name, field)}: {field.description or ''}", width, _INDENT)
            lines += [line for sub, f in subs[0].model_fields.items()
                      for line in _key_help(f"{key_name(name, field)}.{key_name(sub, f)}", f, width)]
        else:
            lines += _key_help(key_name(name, field), field, width)
    return lines


def _key_help(key: str, field: FieldInfo, width: int) -> list[str]:
    return [f"{_INDENT}{key} {_type_name(field.annotation)}  ({_default(field)})",
            *_wrap(field.description, width, _INDENT * 3)]


def _shown(path: str, sections: tuple[str, ...]) -> bool:
    return not path or any(path == s or path.startswith(f"{s}.") for s in sections)


def _leads_to(path: str, sections: tuple[str, ...]) -> bool:
    """Shown itself, or holding a table that is (trainer, for trainer.lora)."""
    return _shown(path, sections) or any(s.startswith(f"{path}.") for s in sections)


def table_models(field: FieldInfo) -> list[type[BaseModel]]:
    """The model of a table key, or each kind's of a table that is one of several kinds (a
    discriminated union); none for a plain key."""
    a = field.annotation
    if isinstance(a, type) and issubclass(a, BaseModel):
        return [a]
    if get_origin(a) in (Union, types.UnionType) and field.discriminator:
        return [m for m in get_args(a) if isinstance(m, type) and issubclass(m, BaseModel)]
    return []


def _entries(field: FieldInfo) -> type[BaseModel] | None:
    """The entry model of a list-of-tables key (`[[orchestrator.datasets]]`)."""
    if get_origin(field.annotation) is list:
        (a,) = get_args(field.annotation)
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _type_name(annotation) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (Union, types.UnionType):  # X | None: unset is the default, not a value to type
        return "|".join(_type_name(a) for a in args if a is not type(None))
    if origin in (list, tuple):
        return "LIST"
    if origin is dict:
        return "TABLE"
    if origin is Annotated:  # a checked form (rl/addresses.py): the type it checks
        return _type_name(args[0])
    return _TYPE_NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)).upper())


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    return "default unset" if value is None else f"default {inline(_plain(value))}"


def _plain(value):
    """A default as TOML can write it (tomli_w knows neither paths nor tuples)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def _wrap(text: str | None, width: int, indent: str) -> list[str]:
    # No breaks at hyphens: flash_attention_2, tcp://*:5557 and file names stay whole.
    return textwrap.wrap(" ".join((text or "").split()), width, initial_indent=indent, subsequent_indent=indent,
                         break_on_hyphens=False, break_long_words=False)
